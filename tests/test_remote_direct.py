"""Fetches that read straight into host blocks (``RedisStore.readinto``, the default).

The reply reader on a socket pair, byte by byte where it matters: values split over many
reads, missing keys (RESP2 and RESP3), error replies, values longer or shorter than their
memory, a broken reply; then on a real server: a longer value than a block is a miss and
the connection stays in step, a cancelled restore waits for its read and holds nothing, a
client library's error is a miss, a run broken for want of room stops the fetch."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import anyio
import pytest

from asyncpin.testing import FakeBackend
from asyncpin.tier import RedisStore
from asyncpin.tier.remote import HEADER_BYTES, _Wire
from tests.redis_servers import RedisServer
from tests.test_remote_tier import (
    BLOCKS,
    TIMEOUT_S,
    host_of,
    make_layout,
    nothing_held,
    remote_tier,
    same,
    stored_and_forgotten,
)

pytestmark = [pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis-py's client is asyncio's


# -- the reply reader ------------------------------------------------------------------------


def _replies(wire_bytes: bytes, sinks: list[list[memoryview]], *, chunk: int = 7) -> list[Any]:
    """What ``_Wire`` reads of ``wire_bytes``, sent ``chunk`` bytes at a time."""
    a, b = socket.socketpair()
    a.settimeout(5)

    def send() -> None:
        with b:
            for i in range(0, len(wire_bytes), chunk):
                b.sendall(wire_bytes[i : i + chunk])

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wire = _Wire(a, float("inf"), lambda: None)
        return [wire.value_into(s) for s in sinks]
    finally:
        sender.join()
        a.close()


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _sinks(*sizes: int) -> list[memoryview]:
    return [memoryview(bytearray(n)) for n in sizes]


def test_values_split_over_many_reads_land_in_their_sinks() -> None:
    one, two = bytes(range(200)), bytes(range(100, 250)) * 3
    sinks = [_sinks(10, 190), _sinks(50, 400)]
    got = _replies(_bulk(one) + _bulk(two), sinks, chunk=3)
    assert got == [200, 450]
    assert bytes(sinks[0][0]) + bytes(sinks[0][1]) == one
    assert bytes(sinks[1][0]) + bytes(sinks[1][1]) == two


@pytest.mark.parametrize("nil", [b"$-1\r\n", b"_\r\n"])
def test_a_missing_key_and_an_error_reply_keep_the_reader_in_step(nil: bytes) -> None:
    sinks = [_sinks(4), _sinks(4), _sinks(4)]
    got = _replies(nil + b"-MOVED 3999 127.0.0.1:7002\r\n" + _bulk(b"abcd"), sinks)
    assert got == [None, b"MOVED 3999 127.0.0.1:7002", 4]
    assert bytes(sinks[2][0]) == b"abcd"


def test_a_value_longer_than_its_sinks_is_read_through_and_its_length_said() -> None:
    long = bytes(range(256)) * 400  # 102400 bytes: more than the drop buffer
    sinks = [_sinks(8, 8), _sinks(3)]
    got = _replies(_bulk(long) + _bulk(b"xyz"), sinks, chunk=4093)
    assert got == [len(long), 3]
    assert bytes(sinks[0][0]) + bytes(sinks[0][1]) == long[:16]
    assert bytes(sinks[1][0]) == b"xyz"  # the next reply is read where it starts


def test_a_shorter_value_fills_what_it_has() -> None:
    sinks = [_sinks(4, 100)]
    assert _replies(_bulk(b"abcdef"), sinks) == [6]
    assert bytes(sinks[0][0]) == b"abcd" and bytes(sinks[0][1][:2]) == b"ef"


@pytest.mark.parametrize(
    ("wire_bytes", "words"),
    [
        (b"+OK\r\n", "not a reply to GET"),
        (b"$4\r\nabcdXY", "without its CRLF"),
        (b"$10\r\nabc", "closed the connection"),
    ],
)
def test_a_broken_reply_is_an_error(wire_bytes: bytes, words: str) -> None:
    with pytest.raises(ConnectionError, match=words):
        _replies(wire_bytes, [_sinks(16)])


class _Stop(Exception):
    pass


def test_the_deadline_the_quiet_limit_and_the_cancel_check_stop_a_read() -> None:
    """A server that says nothing more: each stops the read, within a poll or two."""
    checks: list[int] = []

    def cancelled_at_the_third_look() -> None:
        checks.append(1)
        if len(checks) == 3:
            raise _Stop

    a, b = socket.socketpair()
    with a, b:
        a.settimeout(_Wire.POLL_S)
        b.sendall(b"$100\r\n")
        with pytest.raises(TimeoutError, match="4 times the timeout"):
            _Wire(a, time.monotonic() + 0.1, lambda: None).value_into(_sinks(100))
        with pytest.raises(TimeoutError, match=r"no byte from the server for 0\.1 s"):
            _Wire(a, float("inf"), lambda: None, quiet_s=0.1).value_into(_sinks(100))
        with pytest.raises(_Stop):
            _Wire(a, float("inf"), cancelled_at_the_third_look).value_into(_sinks(100))


# -- on a real server ------------------------------------------------------------------------


@pytest.mark.redis
async def test_a_longer_value_is_a_miss_and_the_next_fetch_reads_right(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """A value longer than header and block (another writer's) is read through on the
    socket: a miss counted (``truncated``: its size is not the header's); the same
    connection then reads the next values where they start."""
    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(redis_server.url, redis_keyspace, host_blocks=BLOCKS) as (
            tier,
            layout,
        ):
            hashes = list(range(300, 304))
            kept = await stored_and_forgotten(tier, layout, hashes)
            link = tier.remote
            assert link is not None
            key = link.key_of(hashes[1])
            value = redis_server.command("GET", key)
            assert isinstance(value, bytes) and len(value) == HEADER_BYTES + link.nbytes
            redis_server.command("SET", key, value + b"x" * 70000)
            assert await tier.restore(hashes, [0, 1, 2, 3]) == 1
            remote = tier.stats().remote
            assert remote is not None and remote.invalid_by_reason == {"truncated": 1}
            redis_server.command("SET", key, value)
            tier.clear()
            assert await tier.restore(hashes, [0, 1, 2, 3]) == 4
            assert same(layout, [0, 1, 2, 3], kept)
            await nothing_held(tier)


@pytest.mark.redis
async def test_a_cancelled_restore_waits_for_its_read_and_holds_nothing(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """Cancelled while a part is read into host blocks (the server paused mid-fetch): the
    cancellation waits for the read, which stops at its next socket read; the reserved
    blocks are freed, nothing is loadable that was not read whole, the connection is not
    reused, and a later restore reads everything."""
    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(
            redis_server.url, redis_keyspace, host_blocks=BLOCKS, timeout_s=5.0
        ) as (tier, layout):
            hashes = list(range(700, 716))
            kept = await stored_and_forgotten(tier, layout, hashes)
            store = tier.remote.store if tier.remote is not None else None
            assert isinstance(store, RedisStore)
            # A connection in the pool first (making one waits on redis-py's own timeout).
            assert await tier.restore(hashes[:1], [0]) == 1
            tier.clear()
            reading = threading.Event()
            real = store.readinto

            def paused_read(keys: Any, sinks: Any, **kwargs: Any) -> list[int | None]:
                redis_server.pause()
                reading.set()
                return real(keys, sinks, **kwargs)

            store.readinto = paused_read  # type: ignore[method-assign]
            try:
                with anyio.move_on_after(0.3) as scope:
                    await tier.restore(hashes, list(range(16)))
                assert scope.cancelled_caught and reading.is_set()
            finally:
                redis_server.resume()
            store.readinto = real  # type: ignore[method-assign]
            assert tier.lookup(hashes) == 0
            await nothing_held(tier)
            tier.clear()
            assert await tier.restore(hashes, list(range(16))) == 16
            assert same(layout, list(range(16)), kept)


@pytest.mark.redis
async def test_a_client_library_error_in_a_direct_fetch_is_a_miss(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    class Broken:
        def get_connection(self) -> Any:
            raise AttributeError("'NoneType' object has no attribute 'recv_into'")

    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(redis_server.url, redis_keyspace) as (tier, _):
            store = tier.remote.store if tier.remote is not None else None
            assert isinstance(store, RedisStore)
            store._blocking = type("Client", (), {"connection_pool": Broken()})()
            assert await tier.restore([1, 2], [0, 1]) == 0
            remote = tier.stats().remote
            assert remote is not None and remote.missed_blocks == 2 and remote.degraded
            assert remote.errors == 1


@pytest.mark.redis
async def test_a_run_broken_for_want_of_room_stops_the_direct_fetch(
    redis_server: RedisServer, redis_keyspace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the copying fetch's test in test_remote_tier.py: the second part finds no room
    (another load holds the rest of the host), room comes back before the third part: the
    run has a gap, so the third part is not fetched, and nothing is evicted for it."""
    from asyncpin.tier import _FetchSink

    dev = 64
    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(
            redis_server.url, redis_keyspace, layout=host_of(dev), host_blocks=dev
        ) as (tier, layout):
            hashes = list(range(400, 448))
            await stored_and_forgotten(tier, layout, hashes)
            others = list(range(900, 948))  # another request's prefix, held by its load
            await tier.store(others, list(range(48))).transfer
            await tier.remote_written()
            held = tier.index.begin_load(others)
            commits: list[tuple[int, bool]] = []
            commit = _FetchSink.commit

            def counted(sink: _FetchSink, part: Any, valid: int) -> bool:
                go_on = commit(sink, part, valid)
                commits.append((valid, go_on))
                if len(commits) == 2:
                    tier.index.end_load(others, held)  # that load is over: room again
                return go_on

            monkeypatch.setattr(_FetchSink, "commit", counted)
            assert await tier.restore(hashes, list(range(48))) == 16
            assert commits == [(16, True), (16, False)]
            assert all(h in tier.index for h in others)  # none evicted for the gap's sake
            await nothing_held(tier)


def test_the_fake_backend_is_what_these_tests_use() -> None:
    """(The layouts above are host tensors: FakeBackend moves them.)"""
    assert make_layout().device.type == "cpu" and FakeBackend().name == "fake"
