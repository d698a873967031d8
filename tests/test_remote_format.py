"""The remote tier's value format, without a server: a value is data only when every
field of its header matches what the reader expects; anything else is a miss with a
reason, never data."""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import pytest

from asyncpin.tier.remote import HEADER_BYTES, decode, encode_header, fingerprint, hash_digest

PRINT = fingerprint("model-a", {"num_arrays": 2, "host_block_bytes": 64}, (0, 1))
PAYLOAD = bytes(range(64))


def value(payload: bytes = PAYLOAD, block_hash: int | bytes = 7, print_: bytes = PRINT) -> bytes:
    return encode_header(payload, print_, hash_digest(block_hash)) + payload


def read(raw: bytes, block_hash: int | bytes = 7) -> memoryview | str:
    return decode(raw, nbytes=len(PAYLOAD), print_=PRINT, digest=hash_digest(block_hash))


def test_a_value_round_trips() -> None:
    got = read(value())
    assert isinstance(got, memoryview) and bytes(got) == PAYLOAD
    assert HEADER_BYTES == 64


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (value()[: HEADER_BYTES - 1], "truncated"),
        (value()[:-1], "truncated"),
        (value() + b"x", "truncated"),
        (b"XXXX" + value()[4:], "magic"),
        (value()[:4] + b"\x09" + value()[5:], "version"),
        (value(payload=PAYLOAD + b"\x00" * 8), "length"),
        (value(print_=fingerprint("model-b", {"num_arrays": 2}, (0, 1))), "foreign"),
        (value(block_hash=8), "stale"),
        (value()[:-1] + bytes([value()[-1] ^ 1]), "checksum"),
    ],
    ids=[
        "header-cut",
        "payload-cut",
        "too-long",
        "magic",
        "version",
        "length",
        "foreign",
        "stale",
        "checksum",
    ],
)
def test_anything_else_is_a_miss_with_its_reason(raw: bytes, reason: str) -> None:
    assert read(raw) == reason


def test_the_fingerprint_names_model_layout_and_rank() -> None:
    layout = {"num_arrays": 2, "host_block_bytes": 64}
    base = fingerprint("m", layout, (0, 1))
    assert len(base) == 16 and base == fingerprint("m", dict(layout), (0, 1))
    assert base != fingerprint("n", layout, (0, 1))
    assert base != fingerprint("m", {**layout, "host_block_bytes": 128}, (0, 1))
    assert base != fingerprint("m", layout, (1, 2))


def test_int_and_bytes_hashes_never_share_a_digest() -> None:
    assert hash_digest(1) != hash_digest(b"1") and hash_digest(1) != hash_digest(b"i1")


def test_an_int_hash_of_any_size_has_a_digest() -> None:
    """Past the interpreter's limit on ints written in decimal (a hostile trial: 10**5000
    raised ValueError from inside the write-behind and reads, and marked the tier
    degraded against a healthy server); distinct ints keep distinct digests."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)  # the lowest a process may set
    try:
        big = [10**5000, 10**5000 + 1, -(10**5000), 2**2048, 2**2048 - 1, -(2**2048)]
        digests = [hash_digest(h) for h in [*big, 2**64, 1, 0, -1]]
        assert len(set(digests)) == len(digests) and all(len(d) == 16 for d in digests)
    finally:
        sys.set_int_max_str_digits(limit)


@pytest.mark.parametrize(
    "h",
    [2**64, -(2**255), 2**2048 - 1, 2**2048, -(2**2048), 10**617, 10**4300 - 1, -(10**4300 - 1)],
    ids=["2**64", "-2**255", "2**2048-1", "2**2048", "-2**2048", "10**617", "4300 9s", "-4300 9s"],
)
def test_an_int_up_to_4300_digits_keeps_the_name_it_always_had(h: int) -> None:
    """The names of the values a server already holds (written in decimal, under the
    interpreter's default limit of 4300 digits) do not change, whatever the limit now
    (a review: ints past 2048 bits were renamed in hex)."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # no limit: the name as it was written
    try:
        before = hashlib.blake2b(b"i%d" % h, digest_size=16).digest()
        sys.set_int_max_str_digits(640)
        assert hash_digest(h) == before
    finally:
        sys.set_int_max_str_digits(limit)


def test_a_wrong_type_reply_is_told_from_an_error_that_names_the_key() -> None:
    """A reply's own error must start with WRONGTYPE; redis-py's reworded pipeline error
    (the command, with its key, first) is only a hint to re-run the pipeline (review: a
    key holding " WRONGTYPE " in its namespace made another error an empty value)."""
    from redis.exceptions import ResponseError

    from asyncpin.tier.remote import _wrong_type

    reply = b"WRONGTYPE Operation against a key holding the wrong kind of value"
    assert _wrong_type(reply) and _wrong_type(ResponseError(reply.decode()))
    other = b"ERR unknown command 'GET', with args beginning with: 'ns WRONGTYPE x:k' "
    assert not _wrong_type(other) and not _wrong_type(ResponseError(other.decode()))
    reworded = ResponseError(
        f"Command # 2 (GET ns:k) of pipeline caused error: ('{reply.decode()}',)"
    )
    assert _wrong_type(reworded, reworded=True) and not _wrong_type(reworded)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_get_reply_that_is_no_string_reads_as_an_empty_value(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hostile or odd server answers GET with a number, a double, a boolean or an
    array (RESP3): the store gives an empty value (counted invalid by the reader), never
    the object (an attacker's trial: restore raised TypeError from len())."""
    from redis.exceptions import ResponseError

    from asyncpin.tier.remote import RedisStore

    store = RedisStore("redis://127.0.0.1:1", direct_reads=False)
    replies: list[Any] = [1088, 1.5, True, [b"a"], ResponseError("WRONGTYPE x"), None, b"v"]

    async def run(what: str, build: Any) -> list[Any]:
        return replies

    monkeypatch.setattr(store, "_run", run)
    got = await store.get([f"k{i}" for i in range(len(replies))])
    assert got == [b"", b"", b"", b"", b"", None, b"v"]
    await store.aclose()
