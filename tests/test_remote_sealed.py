"""``KVTier(remote_secret=...)``: values sealed with a keyed BLAKE2b. A writer to the store
without the secret (another local user of a server with no password, say) can compute
every field of an unkeyed value from public facts; with a secret, what it plants is a
miss, never data. Against a real server."""

from __future__ import annotations

import anyio
import pytest
import structlog
import torch

from asyncpin import ConfigError
from asyncpin.tier import KVTier, RedisStore
from asyncpin.tier.remote import HEADER_BYTES, KEYED_VERSION, encode_header, hash_digest
from tests.redis_servers import RedisServer
from tests.test_remote_tier import (
    TIMEOUT_S,
    blocks_of,
    make_layout,
    remote_tier,
    same,
    stored_and_forgotten,
)

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

SECRET = b"shared-by-the-servers-of-one-store"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis-py's client is asyncio's


def plant(server: RedisServer, tier: KVTier, block_hash: int, payload: bytes, value: bytes) -> None:
    """What a writer to the store puts under the tier's key for ``block_hash``."""
    assert tier.remote is not None
    server.command("SET", tier.remote.key_of(block_hash), value + payload)


@pytest.mark.parametrize("direct_reads", [True, False])
async def test_sealed_values_round_trip_and_forged_ones_are_misses(
    direct_reads: bool, redis_server: RedisServer, redis_keyspace: str
) -> None:
    with anyio.fail_after(TIMEOUT_S), structlog.testing.capture_logs() as events:
        async with remote_tier(
            redis_server.url, redis_keyspace, direct_reads=direct_reads, remote_secret=SECRET
        ) as (tier, layout):
            assert tier.remote is not None
            kept = await stored_and_forgotten(tier, layout, [1, 2])
            raw = redis_server.command("GET", tier.remote.key_of(1))
            assert isinstance(raw, bytes) and raw[4] == KEYED_VERSION
            assert await tier.restore([1, 2], [10, 11]) == 2
            assert same(layout, [10, 11], kept)

            # Forged by a writer without the secret, with the library's public functions:
            # an unkeyed value (version 2), the same with its version byte made 3 (an
            # XXH3 checksum where the seal goes), then one sealed with another secret.
            nbytes = layout.host_block_bytes
            print_ = tier.remote.print_
            forged: list[tuple[int, bytes | None, bool, str]] = [
                (3, None, False, "version"),
                (5, None, True, "checksum"),
                (4, b"x" * 16, False, "checksum"),
            ]
            for block_hash, secret, as_keyed, reason in forged:
                payload = bytes([0x41]) * nbytes
                header = bytearray(encode_header(payload, print_, hash_digest(block_hash), secret))
                if as_keyed:
                    header[4] = KEYED_VERSION
                plant(redis_server, tier, block_hash, payload, bytes(header))
                before = blocks_of(layout, [12])
                assert await tier.restore([block_hash], [12]) == 0
                assert same(layout, [12], before)  # nothing of it reached the device
                stats = tier.stats().remote
                assert stats is not None and stats.invalid_by_reason.get(reason, 0) >= 1
            assert SECRET.decode() not in repr(tier.stats()) + repr(tier.remote.store)
    assert SECRET.decode() not in repr(events)  # the key is never logged


async def test_an_unkeyed_tier_reads_no_sealed_value(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    layout = make_layout()
    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(
            redis_server.url, redis_keyspace, layout=layout, remote_secret=SECRET
        ) as (sealed, _):
            await stored_and_forgotten(sealed, layout, [7])
        async with remote_tier(redis_server.url, redis_keyspace, layout=layout) as (plain, _):
            assert await plain.restore([7], [3]) == 0
            stats = plain.stats().remote
            assert stats is not None and stats.invalid_by_reason == {"version": 1}


@pytest.mark.parametrize("secret", [b"short", b"x" * 65, "a str of the right length"])
async def test_a_secret_is_16_to_64_bytes(secret: object) -> None:
    layout = make_layout()
    from asyncpin import OffloadManager
    from asyncpin.testing import FakeBackend

    async with OffloadManager.for_kv(layout, 4, backend=FakeBackend()) as mgr:
        store = RedisStore("redis://127.0.0.1:1/0")
        with pytest.raises(ConfigError, match="remote_secret must be 16 to 64 bytes"):
            KVTier(mgr, remote=store, remote_secret=secret)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="give remote= too"):
            KVTier(mgr, remote_secret=SECRET)
        await store.aclose()


def test_the_seal_is_over_the_fingerprint_the_hash_and_the_payload() -> None:
    payload = torch.arange(256, dtype=torch.uint8).numpy().tobytes()
    base = encode_header(payload, b"p" * 16, b"d" * 16, SECRET)
    for other in (
        encode_header(payload, b"q" * 16, b"d" * 16, SECRET),
        encode_header(payload, b"p" * 16, b"e" * 16, SECRET),
        encode_header(payload[:-1] + b"\x00", b"p" * 16, b"d" * 16, SECRET),
        encode_header(payload, b"p" * 16, b"d" * 16, SECRET[:-1] + b"!"),
    ):
        assert other[16:24] != base[16:24]  # the seal differs
    assert len(base) == HEADER_BYTES
