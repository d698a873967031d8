"""Fetches that read straight into host blocks (``RedisStore.readinto``, the default).

The reply reader on a socket pair, byte by byte where it matters: values split over many
reads, missing keys (RESP2 and RESP3), error replies, values longer or shorter than their
memory, a broken reply; then on a real server: a longer value than a block is a miss and
the connection stays in step, a cancelled restore waits for its read and holds nothing, a
client library's error is a miss, a run broken for want of room stops the fetch."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
import torch

from asyncpin import KVLayout
from asyncpin.testing import FakeBackend
from asyncpin.tier import KVTier, RedisStore, RemoteError
from asyncpin.tier.remote import HEADER_BYTES, RemoteLink, _Wire
from tests.helpers import wait_thread_event
from tests.redis_servers import RedisServer
from tests.test_remote_tier import (
    BLOCKS,
    TIMEOUT_S,
    a_run_behind_a_held_host,
    blocks_of,
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


Shape = tuple[int, int]  # a value's head buffer and body buffer sizes


def _replies(
    wire_bytes: bytes, shapes: list[Shape], *, chunk: int = 7
) -> tuple[list[Any], list[bytes]]:
    """What ``_Wire`` reads of ``wire_bytes`` (sent ``chunk`` bytes at a time) into a head
    and a body buffer of each shape; returns the replies and each value's bytes kept
    (head, then body)."""
    a, b = socket.socketpair()
    a.settimeout(5)

    def send() -> None:
        with b, contextlib.suppress(OSError):  # the reader gave up and closed its end
            for i in range(0, len(wire_bytes), chunk):
                b.sendall(wire_bytes[i : i + chunk])

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wire = _Wire(a, float("inf"), lambda: None)
        replies, kept = [], []
        for head_size, body_size in shapes:
            head, body = memoryview(bytearray(head_size)), memoryview(bytearray(body_size))
            asked: list[int] = []

            def body_for(
                size: int, body: memoryview = body, asked: list[int] = asked
            ) -> memoryview | None:
                asked.append(size)
                return body if len(body) else None

            reply = wire.value_into(head, body_for)
            replies.append(reply)
            if isinstance(reply, int):
                kept.append(bytes(head[: min(head_size, reply)]) + (bytes(body) if asked else b""))
            else:
                kept.append(b"")
        return replies, kept
    finally:
        # Closed before the join: a reader that raised stops reading, and the sender's
        # small sends fill the socket's buffer (each costs far more than its bytes).
        a.close()
        sender.join()


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def test_values_split_over_many_reads_land_in_their_buffers() -> None:
    one, two = bytes(range(200)), bytes(range(100, 250)) * 3
    replies, kept = _replies(_bulk(one) + _bulk(two), [(10, 190), (50, 400)], chunk=3)
    assert replies == [200, 450]
    assert kept == [one, two]


@pytest.mark.parametrize("nil", [b"$-1\r\n", b"_\r\n"])
def test_a_missing_key_and_an_error_reply_keep_the_reader_in_step(nil: bytes) -> None:
    wire_bytes = nil + b"-MOVED 3999 127.0.0.1:7002\r\n" + _bulk(b"abcdef")
    replies, kept = _replies(wire_bytes, [(4, 2), (4, 2), (4, 2)])
    assert replies == [None, b"MOVED 3999 127.0.0.1:7002", 6]
    assert kept[2] == b"abcdef"


def test_a_value_longer_than_its_buffers_is_read_through_and_its_size_said() -> None:
    long = bytes(range(256)) * 400  # 102400 bytes: more than the drop buffer
    replies, kept = _replies(_bulk(long) + _bulk(b"xyz"), [(8, 8), (3, 0)], chunk=4093)
    assert replies == [len(long), 3]
    assert kept == [long[:16], b"xyz"]  # the next reply is read where it starts


def test_a_value_no_longer_than_its_head_never_asks_for_a_body() -> None:
    replies, kept = _replies(_bulk(b"abcd") + _bulk(b"abcdef"), [(4, 100), (4, 100)])
    assert replies == [4, 6]
    assert kept[0] == b"abcd"  # no body asked: the head held it all
    assert kept[1][:6] == b"abcdef"


@pytest.mark.parametrize(
    ("wire_bytes", "words"),
    [
        (b"+OK\r\n", "not a reply to GET"),
        (b"$4\r\nabcdXY", "without its CRLF"),
        (b"$10\r\nabc", "closed the connection"),
        (b"$" + b"9" * 5000, "longer than 1024 bytes"),
        (b"$-5\r\n", "not a reply to GET"),
    ],
)
def test_a_broken_reply_is_an_error(wire_bytes: bytes, words: str) -> None:
    with pytest.raises(ConnectionError, match=words):
        _replies(wire_bytes, [(4, 12)])


class _Stop(BaseException):
    """What ``check_cancelled`` raises (as a cancellation does: not an Exception)."""


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
        head = memoryview(bytearray(100))
        with pytest.raises(TimeoutError, match="4 times the timeout"):
            _Wire(a, time.monotonic() + 0.1, lambda: None).value_into(head, lambda _: None)
        with pytest.raises(TimeoutError, match=r"no byte from the server for 0\.1 s"):
            _Wire(a, float("inf"), lambda: None, quiet_s=0.1).value_into(head, lambda _: None)
        with pytest.raises(_Stop):
            _Wire(a, float("inf"), cancelled_at_the_third_look).value_into(head, lambda _: None)


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

            def paused_read(keys: Any, into: Any, **kwargs: Any) -> list[int | None]:
                redis_server.pause()
                reading.set()
                return real(keys, into, **kwargs)

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
        _sock = None

        def connect(self) -> None:
            raise AttributeError("'NoneType' object has no attribute 'recv_into'")

        def disconnect(self) -> None:
            pass

    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(redis_server.url, redis_keyspace) as (tier, _):
            store = tier.remote.store if tier.remote is not None else None
            assert isinstance(store, RedisStore)
            store._idle = [Broken()]
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

    with anyio.fail_after(TIMEOUT_S):
        async with a_run_behind_a_held_host(redis_server.url, redis_keyspace) as (
            tier,
            _layout,
            hashes,
            others,
            held,
        ):
            commits: list[tuple[int, bool]] = []
            commit = _FetchSink.commit

            def counted(sink: _FetchSink, k: int, part: Any, valid: int) -> bool:
                go_on = commit(sink, k, part, valid)
                commits.append((valid, go_on))
                if len(commits) == 2:
                    tier.index.end_load(others, held)  # that load is over: room again
                return go_on

            monkeypatch.setattr(_FetchSink, "commit", counted)
            assert await tier.restore(hashes, list(range(48))) == 16
            # The second part found no room: its values are read and checked in spares
            # (16 valid, counted as hits as the copying fetch counts them), none is on
            # the host, and the run ends there: the third part, read ahead, is dropped
            # (committed with none valid, not counted as looked up).
            assert commits == [(16, True), (16, False), (0, False)]
            remote = tier.stats().remote
            assert remote is not None
            assert (remote.lookups, remote.hit_blocks, remote.missed_blocks) == (32, 32, 0)
            assert all(h in tier.index for h in others)  # none evicted for the gap's sake
            await nothing_held(tier)


def test_the_fake_backend_is_what_these_tests_use() -> None:
    """(The layouts above are host tensors: FakeBackend moves them.)"""
    assert make_layout().device.type == "cpu" and FakeBackend().name == "fake"


# -- review findings (each failed before its fix) --------------------------------------------


@pytest.mark.redis
async def test_asyncios_own_cancel_frees_no_block_while_the_read_writes_it(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """``asyncio.wait_for`` cancels a restore whose read waits on a paused server: the
    restore returns only once the read has stopped, so the blocks it frees, stored into
    by another request right after, are never written by the read. (Before: ``run_sync``
    returned at once on asyncio's own cancellation, the blocks were freed and reused,
    and when the server resumed the read wrote the first request's bytes over all 16 of
    the second's.)"""
    import asyncio

    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(redis_server.url, redis_keyspace, host_blocks=16, timeout_s=5.0) as (
            tier,
            layout,
        ):
            a = list(range(700, 716))
            await stored_and_forgotten(tier, layout, a)
            store = tier.remote.store if tier.remote is not None else None
            assert isinstance(store, RedisStore)
            assert await tier.restore(a[:1], [0]) == 1  # a pooled connection
            tier.clear()
            done = threading.Event()
            real = store.readinto

            def paused_read(keys: Any, into: Any, **kwargs: Any) -> list[int | None]:
                redis_server.pause()
                try:
                    return real(keys, into, **kwargs)
                finally:
                    done.set()

            store.readinto = paused_read  # type: ignore[method-assign]
            try:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(tier.restore(a, list(range(16))), 0.3)
                assert done.is_set()  # the read was over when the restore returned
                b = list(range(900, 916))
                kept_b = blocks_of(layout, list(range(16, 32)))
                await tier.store(b, list(range(16, 32))).transfer  # into the freed blocks
                assert tier.lookup(b) == 16
            finally:
                redis_server.resume()
            store.readinto = real  # type: ignore[method-assign]
            await tier.load(b, list(range(16)))
            assert same(layout, list(range(16)), kept_b)


@pytest.mark.redis
@pytest.mark.parametrize("server", ["missing", "killed"])
@pytest.mark.parametrize("direct_reads", [True, False])
async def test_a_remote_miss_evicts_nothing(
    server: str, direct_reads: bool, redis_server: RedisServer, redis_keyspace: str
) -> None:
    """The host is full of other requests' blocks; a restore of blocks the server lacks
    (or of any block, the server down) evicts none of them. (Before: the direct fetch
    reserved a whole part's blocks before reading, and evicted 16.)"""
    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(
            redis_server.url,
            redis_keyspace,
            direct_reads=direct_reads,
            host_blocks=16,
            timeout_s=0.5,
        ) as (tier, _):
            others = list(range(100, 116))
            await tier.store(others, list(range(16))).transfer
            await tier.remote_written()
            if server == "killed":
                redis_server.kill()
            assert await tier.restore(list(range(500, 516)), list(range(16, 32))) == 0
            assert tier.lookup(others) == 16
            assert tier.index.stats().evicted_blocks == 0


def test_options_the_direct_reads_cannot_use_are_refused() -> None:
    """An object of redis-py's asyncio client (a ``Retry`` of ``redis.asyncio``) would
    break every direct read (review: AttributeError on each fetch, the tier degraded
    for good), on a single node and on a cluster."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from asyncpin import ConfigError

    url = "redis://127.0.0.1:1/0"
    with pytest.raises(ConfigError, match="retry= is an object of redis-py's asyncio"):
        RedisStore(url, retry=Retry(NoBackoff(), 1))
    with pytest.raises(ConfigError, match="cannot use: pass direct_writes=False"):
        RedisStore(url, retry=Retry(NoBackoff(), 1), direct_reads=False, direct_writes=True)
    store = RedisStore(url, retry=Retry(NoBackoff(), 1), direct_reads=False)
    assert not store.direct_reads and not store.direct_writes  # writes follow reads
    for flag in ("direct_reads", "direct_writes"):
        with pytest.raises(ConfigError, match=f"{flag} must be a bool"):
            RedisStore(url, **{flag: cast(Any, 1)})
    # A cluster reads and writes straight from the host blocks too, node by node.
    cluster = RedisStore(url, cluster=True)
    assert cluster.direct_reads and cluster.direct_writes
    copying = RedisStore(url, cluster=True, direct_reads=False)
    assert not copying.direct_reads and not copying.direct_writes
    with pytest.raises(ConfigError, match="retry= is an object of redis-py's asyncio"):
        RedisStore(url, cluster=True, retry=Retry(NoBackoff(), 1), direct_reads=True)
    # A cluster given no choice takes the copying path where its options need it.
    fallen_back = RedisStore(url, cluster=True, retry=Retry(NoBackoff(), 1))
    assert not fallen_back.direct_reads and not fallen_back.direct_writes
    assert RedisStore(url).direct_reads and RedisStore(url).direct_writes
    reads_only = RedisStore(url, direct_writes=False)
    assert reads_only.direct_reads and not reads_only.direct_writes
    # An option of the asyncio client alone (review: every direct read failed on it).
    with warnings.catch_warnings():  # redis-py deprecates the option it tests
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError, match="direct path's blocking client refuses"):
            RedisStore(url, auto_close_connection_pool=True)
        RedisStore(url, auto_close_connection_pool=True, direct_reads=False)


@pytest.mark.redis
async def test_a_closed_store_reads_nothing(redis_server: RedisServer) -> None:
    """(Review: a read after ``aclose`` made a new client that nobody closed.)"""
    store = RedisStore(redis_server.url, timeout_s=1.0)
    await store.aclose()
    with pytest.raises(RemoteError, match="closed"):
        await anyio.to_thread.run_sync(lambda: store.readinto(["k"], lambda *_: None, head_bytes=4))
    assert store._blocking is None


async def test_a_thread_run_to_the_end_outlasts_asyncios_own_cancel() -> None:
    """``_thread_to_the_end`` (the copies into and out of host blocks, the direct reads)
    returns only once its thread has, and the thread sees the cancellation."""
    import asyncio

    from asyncpin.tier.remote import _thread_to_the_end

    saw_cancel = threading.Event()
    finished = threading.Event()

    def work() -> None:
        try:
            for _ in range(500):
                anyio.from_thread.check_cancelled()
                time.sleep(0.01)
        except BaseException:
            saw_cancel.set()
            raise
        finally:
            finished.set()

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(_thread_to_the_end(work, anyio.CapacityLimiter(1)), 0.05)
    assert finished.is_set() and saw_cancel.is_set()
    with pytest.raises(ValueError, match="raised as itself"):
        await _thread_to_the_end(
            lambda: (_ for _ in ()).throw(ValueError("raised as itself")),
            anyio.CapacityLimiter(1),
        )


class _DrippingServer:
    """A TCP server that answers whatever it is sent with a reply line that never ends,
    one byte every 20 ms, until the client goes (what a hostile process on the port, or
    a broken proxy, can do to a client's handshake)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        self._listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._drip, args=(client,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _drip(self, client: socket.socket) -> None:
        with client:
            try:
                client.recv(4096)
                client.sendall(b"+")
                while not self._stop.wait(0.02):
                    client.sendall(b"O")
            except OSError:
                pass  # the client shut the connection

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()


@pytest.mark.parametrize("stop_by", ["deadline", "cancel"])
async def test_a_handshake_that_never_ends_is_bounded(stop_by: str) -> None:
    """redis-py's connect and handshake, which no deadline of ours reached, against a
    server that drips a reply line without end: the read stops at 4 times the timeout,
    or at once when cancelled. (Review: it hung without end, cancellation ignored.)"""
    server = _DrippingServer()
    store = RedisStore(f"redis://127.0.0.1:{server.port}", timeout_s=0.3)
    try:
        stop_at = time.monotonic() + (0.2 if stop_by == "cancel" else 1e9)

        def check_cancelled() -> None:
            if time.monotonic() > stop_at:
                raise _Stop

        def read() -> Any:
            return store.readinto(
                ["k"], lambda *_: None, head_bytes=4, check_cancelled=check_cancelled
            )

        with anyio.fail_after(10):  # before: no end
            if stop_by == "cancel":
                with pytest.raises(_Stop):
                    await anyio.to_thread.run_sync(read)
            else:
                with pytest.raises(RemoteError, match="outlived 4 times the timeout"):
                    await anyio.to_thread.run_sync(read)
    finally:
        await store.aclose()
        server.close()


@contextlib.contextmanager
def unmapped_at_close() -> Iterator[None]:
    """With the cycle collector off, the managers closed in the block unmap their regions
    at once: no reference cycle keeps a view of host memory alive (``region.kept_by_views``
    not logged)."""
    import gc

    import structlog

    gc.collect()
    gc.disable()
    try:
        with structlog.testing.capture_logs() as events:
            yield
    finally:
        gc.enable()
    names = [event["event"] for event in events]
    assert "manager.closed" in names
    assert "region.kept_by_views" not in names, names


async def cancelled_while_reading(
    tier: KVTier, how: str, hashes: list[int], device_blocks: list[int]
) -> None:
    """A restore of ``hashes`` cancelled once its direct read has begun: by an anyio
    scope (``cancelled``) or by asyncio's own ``Task.cancel`` (``asyncio-cancel``)."""
    store = tier.remote.store if tier.remote is not None else None
    assert isinstance(store, RedisStore)
    reading = threading.Event()
    real = store.readinto

    def read(keys: Any, into: Any, **kwargs: Any) -> list[int | None]:
        reading.set()
        return real(keys, into, **kwargs)

    store.readinto = read  # type: ignore[method-assign]
    try:
        if how == "cancelled":
            async with anyio.create_task_group() as tg:
                tg.start_soon(tier.restore, hashes, device_blocks)
                await wait_thread_event(reading)
                tg.cancel_scope.cancel()
        else:
            task = asyncio.ensure_future(tier.restore(hashes, device_blocks))
            await wait_thread_event(reading)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        store.readinto = real  # type: ignore[method-assign]


@pytest.mark.redis
@pytest.mark.parametrize("fault", ["killed", "paused", "cancelled", "asyncio-cancel"])
async def test_a_failed_direct_read_keeps_no_host_memory_alive(
    fault: str, redis_server: RedisServer, redis_keyspace: str
) -> None:
    """The server dies, or stops answering mid-read, or the restore is cancelled (by an
    anyio scope, or asyncio's own ``Task.cancel``) while a read waits on it; with the
    cycle collector off, leaving the manager unmaps its region at once (review: the
    error's traceback and anyio's future formed cycles that kept the host blocks' views
    alive: ``region.kept_by_views``; a newcomer's trial: the cancellation's too)."""
    with unmapped_at_close(), anyio.fail_after(TIMEOUT_S):
        async with remote_tier(redis_server.url, redis_keyspace, timeout_s=0.5) as (
            tier,
            layout,
        ):
            await stored_and_forgotten(tier, layout, [1, 2, 3])
            if fault == "killed":
                redis_server.kill()
            else:  # mid-read: the pool has a connection, the server stops answering
                assert await tier.restore([1], [0]) == 1
                tier.clear()
                redis_server.pause()
            try:
                if fault in ("cancelled", "asyncio-cancel"):
                    await cancelled_while_reading(tier, fault, [1, 2, 3], [0, 1, 2])
                else:
                    assert await tier.restore([1, 2, 3], [0, 1, 2]) == 0
            finally:
                redis_server.reset()
            remote = tier.stats().remote
            assert remote is not None and remote.degraded == (fault in ("killed", "paused"))


@pytest.mark.redis
@pytest.mark.parametrize("how", ["cancelled", "asyncio-cancel"])
async def test_a_cancelled_copying_restore_keeps_no_host_memory_alive(
    how: str, redis_server: RedisServer, redis_keyspace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copying fetch (``direct_reads=False``, every cluster's) cancelled while a part
    is copied into host blocks, by an anyio scope or asyncio's own ``Task.cancel``: with
    the cycle collector off, leaving the manager unmaps its region at once (review: the
    copy's frame kept the host rows alive in asyncio's cancellation cycles)."""
    import numpy as np

    copying, go = threading.Event(), threading.Event()
    real_copyto = np.copyto

    def held_copy(dst: Any, src: Any, *args: Any, **kwargs: Any) -> None:
        copying.set()
        go.wait(TIMEOUT_S)
        real_copyto(dst, src, *args, **kwargs)

    with unmapped_at_close(), anyio.fail_after(TIMEOUT_S):
        async with remote_tier(
            redis_server.url, redis_keyspace, host_blocks=BLOCKS, direct_reads=False
        ) as (tier, layout):
            await stored_and_forgotten(tier, layout, [1, 2, 3])
            monkeypatch.setattr(np, "copyto", held_copy)
            try:
                if how == "cancelled":
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(tier.restore, [1, 2, 3], [0, 1, 2])
                        await wait_thread_event(copying)
                        tg.cancel_scope.cancel()
                        go.set()
                else:
                    task = asyncio.ensure_future(tier.restore([1, 2, 3], [0, 1, 2]))
                    await wait_thread_event(copying)
                    task.cancel()
                    go.set()
                    with pytest.raises(asyncio.CancelledError):
                        await task
            finally:
                go.set()
                monkeypatch.setattr(np, "copyto", real_copyto)
            await nothing_held(tier)


@pytest.mark.redis
@pytest.mark.parametrize("direct_reads", [True, False])
async def test_two_restores_of_one_run_both_get_it(
    direct_reads: bool, redis_server: RedisServer, redis_keyspace: str
) -> None:
    """Two restores of the same 48 blocks at once: a block the other is storing is read
    and checked, not taken as the end of the run. (Review: the direct fetch took it for
    "no room" and the second restore got 16 of 48; the copying fetch got 48. Then the
    second could lose a part to the race with the first's commit: no more, the block
    the first is fetching is waited for.)"""
    dev = 128
    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(
            redis_server.url,
            redis_keyspace,
            layout=host_of(dev),
            host_blocks=dev,
            direct_reads=direct_reads,
        ) as (tier, layout):
            hashes = list(range(1000, 1048))
            kept = await stored_and_forgotten(tier, layout, hashes)
            got: dict[str, int] = {}

            async def one(name: str, gpu: list[int]) -> None:
                got[name] = await tier.restore(hashes, gpu)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, "A", list(range(0, 48)))
                tg.start_soon(one, "B", list(range(64, 112)))
            assert got == {"A": 48, "B": 48}, got
            assert same(layout, list(range(48)), kept)
            assert same(layout, list(range(64, 112)), kept)
            remote = tier.stats().remote
            assert remote is not None and remote.invalid_blocks == 0
            await nothing_held(tier)


@pytest.mark.redis
@pytest.mark.parametrize("direct_reads", [True, False])
@pytest.mark.parametrize("depth", [1, 4, 64])
async def test_restores_of_one_run_at_once_never_cut_each_other_short(
    depth: int, direct_reads: bool, redis_server: RedisServer, redis_keyspace: str
) -> None:
    """Four restores of the same 64 blocks at once, in parts of 4, the host with room for
    all: each gets all 64, the host keeps one copy, and no block is stored and freed for
    nothing. (A hostile trial: a block another restore was fetching was read into a
    spare and taken for the end of the run; the restore then freed the blocks it had
    read ahead, which the others needed: at depth 64 they returned 4-16 of 128, 114
    blocks freed.)"""
    dev = 320
    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(
            redis_server.url,
            redis_keyspace,
            layout=host_of(dev),
            host_blocks=128,
            direct_reads=direct_reads,
            remote_read_depth=depth,
        ) as (tier, layout):
            assert tier.remote is not None
            tier.remote.batch = 4
            hashes = list(range(2000, 2064))
            kept = await stored_and_forgotten(tier, layout, hashes)
            before = tier.index.stats()
            got: list[int] = []

            async def one(j: int) -> None:
                got.append(await tier.restore(hashes, list(range(64 * (j + 1), 64 * (j + 2)))))

            async with anyio.create_task_group() as tg:
                for j in range(4):
                    tg.start_soon(one, j)
            assert got == [64] * 4, got
            for j in range(4):
                assert same(layout, list(range(64 * (j + 1), 64 * (j + 2))), kept), j
            after = tier.index.stats()
            assert after.failed_blocks == before.failed_blocks
            assert after.stored_blocks - before.stored_blocks == 64
            assert tier.lookup(hashes) == 64 and not tier._fetching
            await nothing_held(tier)


@pytest.mark.redis
async def test_one_reads_failed_connect_leaves_another_read_alone(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """Two reads on one store (two tiers may share it): B is cancelled while it connects,
    A reads on, unharmed. (Review: B's clean-up shut every connection of the pool in
    use, A's too: "Bad file descriptor".)"""
    store = RedisStore(redis_server.url, timeout_s=5.0)
    keys = [f"{redis_keyspace}{i}" for i in range(8)]
    for key in keys:
        redis_server.command("SET", key, b"v" * (1 << 16))
    buffers = [memoryview(bytearray(1 << 16)) for _ in keys]
    b_connecting, b_shut, release = threading.Event(), threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}
    made = store._new_connection

    def slow_connection(at: Any = None) -> Any:  # B's: it waits in its handshake until released
        conn = made(at)
        connect, disconnect = conn.connect, conn.disconnect

        def slow_connect() -> None:
            b_connecting.set()
            release.wait(10)
            connect()

        def noted_disconnect(*args: Any) -> None:
            b_shut.set()
            disconnect(*args)

        conn.connect, conn.disconnect = slow_connect, noted_disconnect
        return conn

    def read_b() -> None:
        def cancelled() -> None:
            raise _Stop

        try:
            store.readinto(keys[:1], lambda *_: None, head_bytes=4, check_cancelled=cancelled)
        except BaseException as exc:
            outcome["b"] = exc

    reader_b = threading.Thread(target=read_b)
    looks = 0

    def a_looks() -> None:  # at A's first look, B starts, connects, is cancelled, shuts
        nonlocal looks
        looks += 1
        if looks == 1:
            store._new_connection = slow_connection  # type: ignore[method-assign]
            reader_b.start()
            assert b_connecting.wait(10) and b_shut.wait(10)
            release.set()

    def read_a() -> list[int | None]:
        return store.readinto(
            keys, lambda i, _, __: buffers[i], head_bytes=0, check_cancelled=a_looks
        )

    try:
        with anyio.fail_after(TIMEOUT_S):
            assert await anyio.to_thread.run_sync(read_a) == [1 << 16] * len(keys)
            await anyio.to_thread.run_sync(reader_b.join)
        assert isinstance(outcome["b"], _Stop)
        assert all(bytes(b) == b"v" * (1 << 16) for b in buffers)
    finally:
        release.set()
        await store.aclose()


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_redis_tier_on_trio_is_refused(anyio_backend: str) -> None:
    """redis-py's client is asyncio's: on trio the tier said nothing and its writes and
    lookups failed, counted, for ever (review). Now entering it says so."""
    from asyncpin import ConfigError, OffloadManager
    from asyncpin.tier import KVTier

    async with OffloadManager.for_kv(make_layout(), 4, backend=FakeBackend()) as mgr:
        store = RedisStore("redis://127.0.0.1:1/0")
        with pytest.raises(ConfigError, match="needs asyncio"):
            async with KVTier(mgr, remote=store):
                pass
        await store.aclose()


# -- parts read at once (``read_depth``) -----------------------------------------------------


@asynccontextmanager
async def _in_parts_of_4(
    url: str, keyspace: str, **kwargs: Any
) -> AsyncIterator[tuple[KVTier, KVLayout, RemoteLink]]:
    """``remote_tier`` (a host of ``BLOCKS``) whose fetches read parts of 4 blocks."""
    async with remote_tier(url, keyspace, host_blocks=BLOCKS, **kwargs) as (tier, layout):
        link = tier.remote
        assert link is not None and isinstance(link.store, RedisStore)
        link.batch = 4
        yield tier, layout, link


def _second_part_first(store: Any, first_key: str, second_key: str) -> threading.Event:
    """``store.readinto`` made to read the part starting at ``second_key`` before the one
    starting at ``first_key`` is read (the first waits for it, as long as a test may
    run: 5 s was not always enough on a loaded 2-core machine, and the parts were then
    read one after the other, on one connection): returns the event set once the
    second part's read is over. Parts read one at a time never set it in time, and the
    test's own time limit fails them."""
    real: Callable[..., list[int | None]] = store.readinto
    second_read = threading.Event()

    def ordered(keys: Any, into: Any, **kwargs: Any) -> list[int | None]:
        if keys[0] == first_key:
            second_read.wait(TIMEOUT_S)
        try:
            return real(keys, into, **kwargs)
        finally:
            if keys[0] == second_key:
                second_read.set()

    store.readinto = ordered
    return second_read


@pytest.mark.redis
async def test_parts_are_read_at_once_and_committed_in_order(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """Parts of 4 blocks, two read at once: the second part's read ends before the
    first's starts, and the restore still brings the whole run back, in order, every
    byte right, on two connections. (Before: one part at a time, the first part's read
    waited for a second part that was never read alongside it.)"""
    with anyio.fail_after(TIMEOUT_S):
        async with _in_parts_of_4(redis_server.url, redis_keyspace) as (tier, layout, link):
            hashes = list(range(1200, 1216))
            kept = await stored_and_forgotten(tier, layout, hashes)
            second_read = _second_part_first(
                link.store, link.key_of(hashes[0]), link.key_of(hashes[4])
            )
            assert await tier.restore(hashes, list(range(16))) == 16
            assert second_read.is_set()
            assert same(layout, list(range(16)), kept)
            remote = tier.stats().remote
            assert remote is not None
            assert (remote.lookups, remote.hit_blocks, remote.missed_blocks) == (16, 16, 0)
            # A connection each read under way at once: part 0 waits for part 1's read
            # to end; parts 2 and 3 overlap only if their threads do.
            assert 1 <= len(cast(RedisStore, link.store)._idle) <= link.read_depth
            await nothing_held(tier)


@pytest.mark.redis
async def test_a_part_read_ahead_of_the_runs_end_is_dropped(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """The second value of the first part is corrupt, and the second part has been read
    ahead (whole, into host blocks) by then: the restore brings back the one block
    before the fault; the second part's blocks are freed, not indexed, and not counted
    as looked up."""
    with anyio.fail_after(TIMEOUT_S):
        async with _in_parts_of_4(redis_server.url, redis_keyspace) as (tier, layout, link):
            hashes = list(range(1300, 1316))
            kept = await stored_and_forgotten(tier, layout, hashes)
            key = link.key_of(hashes[1])
            value = redis_server.command("GET", key)
            assert isinstance(value, bytes)
            redis_server.command("SET", key, value[:-1] + bytes([value[-1] ^ 1]))
            second_read = _second_part_first(
                link.store, link.key_of(hashes[0]), link.key_of(hashes[4])
            )
            assert await tier.restore(hashes, list(range(16))) == 1
            assert second_read.is_set()
            assert same(layout, [0], [k[:1] for k in kept])
            assert tier.lookup(hashes) == 1
            assert not any(h in tier.index for h in hashes[4:])
            remote = tier.stats().remote
            assert remote is not None and remote.invalid_by_reason == {"checksum": 1}
            assert (remote.lookups, remote.hit_blocks, remote.fetched_blocks) == (4, 1, 1)
            await nothing_held(tier)


@pytest.mark.redis
async def test_a_part_read_ahead_takes_no_room_an_earlier_part_needs(
    redis_server: RedisServer, redis_keyspace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 blocks of room (another load holds the other 48): the second part, read
    while the first waits, may not take the room the first needs; it is read again in
    its turn, by when the other load is over, and the whole run comes back. (Before:
    the second part took the 16 free blocks, the first found none, and the restore
    brought back nothing.)"""
    from asyncpin.tier import _FetchSink

    with anyio.fail_after(TIMEOUT_S):
        async with a_run_behind_a_held_host(redis_server.url, redis_keyspace) as (
            tier,
            layout,
            hashes,
            others,
            held,
        ):
            kept = blocks_of(layout, list(range(48)))
            link = tier.remote
            assert link is not None and isinstance(link.store, RedisStore)
            reads: list[str] = []
            real = link.store.readinto

            def counted_read(keys: Any, into: Any, **kwargs: Any) -> list[int | None]:
                reads.append(keys[0])
                return real(keys, into, **kwargs)

            link.store.readinto = counted_read  # type: ignore[method-assign]
            second_read = _second_part_first(
                link.store, link.key_of(hashes[0]), link.key_of(hashes[16])
            )
            commit = _FetchSink.commit

            def first_frees_room(sink: _FetchSink, k: int, part: Any, valid: int) -> bool:
                go_on = commit(sink, k, part, valid)
                if k == 0:
                    tier.index.end_load(others, held)  # that load is over: room again
                return go_on

            monkeypatch.setattr(_FetchSink, "commit", first_frees_room)
            for raw in layout.byte_arrays():
                raw.zero_()
            assert await tier.restore(hashes, list(range(48))) == 48
            assert second_read.is_set()
            assert reads.count(link.key_of(hashes[16])) == 2  # read ahead, then in turn
            assert same(layout, list(range(48)), kept)
            await nothing_held(tier)


@pytest.mark.parametrize("depth", [0, -1, True, 1.5, "2", 65])
def test_a_read_depth_that_is_not_a_count_is_refused(depth: Any) -> None:
    from asyncpin.errors import ConfigError
    from asyncpin.tier.remote import RemoteLink

    store = RedisStore("redis://127.0.0.1:1", direct_reads=False)
    with pytest.raises(ConfigError, match="remote_read_depth must be"):
        RemoteLink(
            store,
            print_=b"p" * 8,
            namespace="t",
            host_block_bytes=64,
            queue_blocks=4,
            read_depth=depth,
        )


@pytest.mark.redis
async def test_a_block_cleared_while_fetched_and_fetched_again_ends_both_fetches(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """A review: restore A reserves a block, the tier is cleared (a prefix-cache reset),
    restore B reserves the same hash again; A's commit took B's entry (the entry was by
    hash alone) and B's raised KeyError, leaving its part's blocks reserved for good and
    the end A's reservation promised never set (a third restore waiting on it hung).
    Each fetch now ends its own."""
    from asyncpin.tier import _FetchSink

    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(redis_server.url, redis_keyspace, host_blocks=BLOCKS) as (
            tier,
            _,
        ):
            remote = tier.remote
            assert remote is not None
            h = 7
            held: list[tuple[list[int | bytes], list[int]]] = []  # as a restore's
            a = _FetchSink(tier, remote, held, tier.index.stats().removed_blocks, [])
            assert a.reserve(h, 0) is not None
            a_end = tier._fetching[h]  # what a third restore meeting h would wait for
            tier.clear()
            b = _FetchSink(tier, remote, held, tier.index.stats().removed_blocks, [])
            assert b.reserve(h, 0) is not None
            b_end = tier._fetching[h]
            assert b_end is not a_end
            a.commit(0, [h], 1)
            assert a_end.is_set() and tier._fetching == {h: b_end}
            b.commit(0, [h], 1)
            assert b_end.is_set() and not tier._fetching
            assert tier.lookup([h]) == 1  # B's block, checked data
            for sink in (a, b):
                sink.close()
            for part, blocks in held:  # the restores' loads over
                tier.index.end_load(part, blocks)
            await nothing_held(tier)


@pytest.mark.redis
async def test_a_block_waited_for_is_kept_while_the_next_is_waited_for(
    redis_server: RedisServer, redis_keyspace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review: restore B meets two blocks other restores are fetching (A1's, A2's) and
    waits for each; the first, loadable once A1 is over, is kept from eviction while B
    waits for the second (before, a store in between evicted it and B got 0 of 2)."""
    from asyncpin.tier import _FetchSink

    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(redis_server.url, redis_keyspace, host_blocks=BLOCKS) as (
            tier,
            layout,
        ):
            remote = tier.remote
            assert remote is not None
            x1, x2 = 4100, 4101
            kept = await stored_and_forgotten(tier, layout, [x1, x2])
            held: list[tuple[list[int | bytes], list[int]]] = []  # the A restores'
            a1 = _FetchSink(tier, remote, held, tier.index.stats().removed_blocks, [])
            a2 = _FetchSink(tier, remote, held, tier.index.stats().removed_blocks, [])
            for sink, h in ((a1, x1), (a2, x2)):  # each reserves its block, fills it
                block = sink.reserve(h, 0)
                assert block is not None
                data = torch.cat([k[[0 if h == x1 else 1]].flatten() for k in kept])
                torch.frombuffer(block, dtype=torch.uint8).copy_(data)
            got: list[int] = []
            # B's read is in a worker thread, which wait_all_tasks_blocked counts as
            # blocked: its end is signalled.
            read, fetch_direct = anyio.Event(), remote.fetch_direct

            async def fetched(*args: Any) -> None:
                try:
                    await fetch_direct(*args)
                finally:
                    read.set()

            monkeypatch.setattr(remote, "fetch_direct", fetched)

            async def b() -> None:
                got.append(await tier.restore([x1, x2], [20, 21]))

            async with anyio.create_task_group() as tg:
                tg.start_soon(b)
                await read.wait()
                await anyio.wait_all_tasks_blocked()  # B's fetch over: waiting for A1
                a1.commit(0, [x1], 1)
                for part, blocks in held:  # A1's load over
                    tier.index.end_load(part, blocks)
                held.clear()
                await anyio.wait_all_tasks_blocked()  # B waiting for A2 now
                fresh = list(range(9000, 9000 + BLOCKS))  # every evictable block goes
                await tier.store(fresh, list(range(BLOCKS))).transfer
                a2.commit(0, [x2], 1)
            for part, blocks in held:
                tier.index.end_load(part, blocks)
            for sink in (a1, a2):
                sink.close()
            assert got == [2], got
            assert same(layout, [20, 21], kept)


@pytest.mark.redis
@pytest.mark.parametrize("when", ["waited for", "before B's part is in"])
@pytest.mark.parametrize("direct_reads", [True, False])
async def test_a_block_another_restore_lets_go_is_fetched_again(
    direct_reads: bool,
    when: str,
    redis_server: RedisServer,
    redis_keyspace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hostile trials: restore B's run meets a block restore A is fetching (B reads it
    into a spare); A lets it go (its own run ended before it: freed, not made loadable)
    while B waits for it, or before B's part is in (direct: B's commit; copying: B's
    copy into host blocks). B fetches it again itself and gets its whole run (before:
    0 of 2, the server holding both)."""
    from asyncpin.tier import _FetchSink

    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(
            redis_server.url, redis_keyspace, host_blocks=BLOCKS, direct_reads=direct_reads
        ) as (tier, layout):
            remote = tier.remote
            assert remote is not None
            x1, x2 = 4200, 4201
            kept = await stored_and_forgotten(tier, layout, [x1, x2])
            a = _FetchSink(tier, remote, [], tier.index.stats().removed_blocks, [])
            assert a.reserve(x1, 0) is not None  # A fetching x1
            commit = _FetchSink.commit

            def a_lets_go() -> None:
                commit(a, 0, [x1], 0)  # A's run ended before x1

            def a_first(sink: _FetchSink, k: int, part: Any, valid: int) -> bool:
                if sink is not a and x1 in tier._fetching:
                    a_lets_go()
                return commit(sink, k, part, valid)

            got: list[int] = []

            async def b() -> None:
                got.append(await tier.restore([x1, x2], [20, 21]))

            if when == "waited for":
                async with anyio.create_task_group() as tg:
                    tg.start_soon(b)
                    await anyio.wait_all_tasks_blocked()  # B's fetch over: waiting for x1
                    assert not got
                    a_lets_go()
            elif direct_reads:
                monkeypatch.setattr(_FetchSink, "commit", a_first)
                await b()
            else:
                await remote.copy_limiter.acquire()  # B's copy into host blocks waits
                async with anyio.create_task_group() as tg:
                    tg.start_soon(b)
                    await anyio.wait_all_tasks_blocked()
                    a_lets_go()
                    remote.copy_limiter.release()
            a.close()
            assert got == [2], got
            assert same(layout, [20, 21], kept)
            assert not tier._fetching
            await nothing_held(tier)


@pytest.mark.redis
async def test_a_block_cleared_while_copied_in_and_copied_again_ends_both(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """The same on the copying path: A's copy into host blocks waits, the tier is
    cleared, B copies the same hashes in; both end, neither raises (B raised KeyError),
    and no entry is left."""
    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(
            redis_server.url, redis_keyspace, host_blocks=BLOCKS, direct_reads=False
        ) as (tier, _):
            remote = tier.remote
            assert remote is not None
            hashes: list[int | bytes] = [3000, 3001]
            payloads = [memoryview(bytearray(remote.nbytes)) for _ in hashes]
            got: dict[str, Any] = {}

            async def copy_in(name: str) -> None:
                ready, blocks, whole = await tier._into_host(hashes, payloads, remote, [])
                tier.index.end_load(ready, blocks)
                got[name] = whole

            await remote.copy_limiter.acquire()  # A's copy waits
            async with anyio.create_task_group() as tg:
                tg.start_soon(copy_in, "A")
                await anyio.wait_all_tasks_blocked()
                assert set(tier._fetching) == set(hashes)
                tier.clear()
                tg.start_soon(copy_in, "B")
                await anyio.wait_all_tasks_blocked()
                remote.copy_limiter.release()
            assert set(got) == {"A", "B"} and not tier._fetching
            await nothing_held(tier)


class _Lying(int):
    """An int whose comparisons say it is in any range."""

    def __lt__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return False


def test_counts_are_taken_as_plain_ints_whatever_a_subclass_says() -> None:
    """A hostile trial: an int subclass whose comparisons lie passed the bounds (a depth
    of 0 made a limiter with no token: a restore waited forever; 10**6 passed the cap).
    Each count is checked and kept as the plain int it is."""
    from asyncpin.errors import ConfigError
    from asyncpin.tier.remote import RemoteLink

    store = RedisStore("redis://127.0.0.1:1", direct_reads=False)
    made: dict[str, Any] = {
        "print_": b"p" * 8,
        "namespace": "t",
        "host_block_bytes": 64,
        "queue_blocks": 4,
    }
    for bad in (_Lying(0), _Lying(10**6)):
        with pytest.raises(ConfigError, match="remote_read_depth must be"):
            RemoteLink(store, **made, read_depth=bad)
    with pytest.raises(ConfigError, match="remote_queue must be"):
        RemoteLink(store, **{**made, "queue_blocks": _Lying(0)})
    link = RemoteLink(store, **made, read_depth=_Lying(3), batch_blocks=_Lying(8))
    assert type(link.read_depth) is int and link.read_depth == 3
    assert type(link.batch) is int and link.batch == 8


async def test_the_tier_reads_four_parts_at_once_from_a_cluster_two_from_a_server() -> None:
    """``KVTier(remote_read_depth=)``: None picks by the store (a cluster's parts spread
    over its nodes, bench/RESULTS.md#remote); a count is taken as given; anything else,
    or one with no remote store, is refused and no tier is made."""
    from asyncpin import OffloadManager
    from asyncpin.errors import ConfigError

    layout = make_layout()
    async with OffloadManager.for_kv(layout, 4, backend=FakeBackend()) as mgr:
        node = RedisStore("redis://127.0.0.1:1/0")
        cluster = RedisStore("redis://127.0.0.1:1", cluster=True)
        try:
            depths = {
                "node": KVTier(mgr, remote=node).remote,
                "cluster": KVTier(mgr, remote=cluster).remote,
                "given": KVTier(mgr, remote=cluster, remote_read_depth=7).remote,
                "one": KVTier(mgr, remote=node, remote_read_depth=1).remote,
            }
            assert {k: v and v.read_depth for k, v in depths.items()} == {
                "node": 2,
                "cluster": 4,
                "given": 7,
                "one": 1,
            }
            for bad in (0, 65, True, 2.0, "4"):
                with pytest.raises(ConfigError, match="remote_read_depth must be"):
                    KVTier(mgr, remote=node, remote_read_depth=bad)  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match="give remote= too"):
                KVTier(mgr, remote_read_depth=2)
        finally:
            await node.aclose()
            await cluster.aclose()


# -- review findings of the parts read at once (each failed before its fix) ------------------


def _deferred_first_read(
    link: Any, hashes: list[int], part0_committed: threading.Event, fault: str, server: Any
) -> None:
    """``readinto`` made to read part 1 (``hashes[16:32]``) ahead of part 0, with no room
    for it (deferred); its first read goes on past part 0's commit (value 1 waits for
    ``part0_committed``). ``fault``: "corrupt" (value 5 of part 1 is corrupt on the
    server for that read only) or "lost" (that read fails at value 3, after its block
    was asked for)."""
    real: Callable[..., list[int | None]] = link.store.readinto
    first_of_part1 = [True]
    part1_begun = threading.Event()
    key = link.key_of(hashes[21])
    good = server.command("GET", key)
    if fault == "corrupt":
        server.command("SET", key, good[:-1] + bytes([good[-1] ^ 1]))

    def read(keys: Any, into: Any, **kwargs: Any) -> list[int | None]:
        if keys[0] == link.key_of(hashes[16]) and first_of_part1[0]:
            first_of_part1[0] = False

            def slowed(i: int, size: int, head: Any) -> Any:
                if i == 1:
                    assert part0_committed.wait(5)
                got = into(i, size, head)
                part1_begun.set()
                if fault == "lost" and i == 3:
                    raise ConnectionError("connection lost mid-value")
                return got

            try:
                return real(keys, slowed, **kwargs)
            finally:
                server.command("SET", key, good)  # right again for the next read
        if keys[0] == link.key_of(hashes[0]):
            assert part1_begun.wait(5)
        return real(keys, into, **kwargs)

    link.store.readinto = read


@pytest.mark.redis
@pytest.mark.parametrize("fault", ["corrupt", "lost"])
async def test_a_deferred_parts_first_read_makes_no_block_loadable(
    fault: str, redis_server: RedisServer, redis_keyspace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Part 1, read ahead with no room, is deferred; part 0 commits (room comes back)
    while that first read is still under way. Every block the restore reports is its
    own checked bytes. (Before: the rest of the deferred read took real host blocks once
    part 0 was committed, and the re-read's check made them loadable: a corrupt block,
    or one never written, was loaded, and the restore said 48.)"""
    from asyncpin.tier import _FetchSink

    with anyio.fail_after(TIMEOUT_S):
        async with a_run_behind_a_held_host(redis_server.url, redis_keyspace) as (
            tier,
            layout,
            hashes,
            others,
            held,
        ):
            kept = blocks_of(layout, list(range(48)))
            link = tier.remote
            assert link is not None and isinstance(link.store, RedisStore)
            part0_committed = threading.Event()
            _deferred_first_read(link, hashes, part0_committed, fault, redis_server)
            commit = _FetchSink.commit

            def first_frees_room(sink: _FetchSink, k: int, part: Any, valid: int) -> bool:
                go_on = commit(sink, k, part, valid)
                if k == 0:
                    tier.index.end_load(others, held)  # that load is over: room again
                    part0_committed.set()
                return go_on

            monkeypatch.setattr(_FetchSink, "commit", first_frees_room)
            for raw in layout.byte_arrays():
                raw.zero_()
            assert await tier.restore(hashes, list(range(48))) == 48  # read again: all good
            assert same(layout, list(range(48)), kept)
            await nothing_held(tier)


@pytest.mark.redis
@pytest.mark.parametrize("depth", [None, 1, 3])
async def test_parts_are_read_no_further_ahead_than_read_depth(
    depth: int | None,
    redis_server: RedisServer,
    redis_keyspace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Six parts: no part starts its read more than ``read_depth`` parts ahead of the
    commits, so a run that ends early costs at most that many parts' reads
    (and evictions); the tier's ``remote_read_depth`` sets it (a server's default: 2).
    (Before: every part asked at once, bounded only by the threads at once: parts 2-5
    were asked before part 0 was committed.)"""
    from asyncpin.tier import _FetchSink
    from asyncpin.tier.remote import RemoteLink

    with anyio.fail_after(TIMEOUT_S):
        async with _in_parts_of_4(redis_server.url, redis_keyspace, remote_read_depth=depth) as (
            tier,
            layout,
            link,
        ):
            assert link.read_depth == (depth or 2)
            hashes = list(range(1500, 1524))
            kept = await stored_and_forgotten(tier, layout, hashes)
            commits: list[int] = []
            ahead: list[int] = []  # at each part's read: its number minus the parts committed
            read_part, commit = RemoteLink._read_part, _FetchSink.commit

            async def recorded_read(self: RemoteLink, part: Any, *args: Any) -> int:
                ahead.append(args[1] - len(commits))
                return await read_part(self, part, *args)

            def recorded_commit(sink: _FetchSink, k: int, part: Any, valid: int) -> bool:
                commits.append(k)
                return commit(sink, k, part, valid)

            monkeypatch.setattr(RemoteLink, "_read_part", recorded_read)
            monkeypatch.setattr(_FetchSink, "commit", recorded_commit)
            assert await tier.restore(hashes, list(range(24))) == 24
            assert same(layout, list(range(24)), kept)
            assert len(ahead) == 6 and max(ahead) < link.read_depth, ahead
            if link.read_depth > 1:  # the parts after part 0 began before its commit
                assert max(ahead) > 0, ahead


@pytest.mark.redis
@pytest.mark.parametrize("direct_reads", [True, False])
async def test_a_hash_named_twice_in_a_run_is_fetched_once(
    direct_reads: bool, redis_server: RedisServer, redis_keyspace: str
) -> None:
    """The run names one hash twice in its first part and another in both parts (the
    second part read first): each is fetched once, and the restore finds the whole run.
    (Before: part 1 took the repeated hash's block, part 0's copy went to a spare, and
    the run ended after one block; then, a first fix ended the run at any repeat, which
    a newcomer's trial found: [A, A, B] restored 2.)"""
    with anyio.fail_after(TIMEOUT_S):
        async with _in_parts_of_4(redis_server.url, redis_keyspace, direct_reads=direct_reads) as (
            tier,
            layout,
            link,
        ):
            await stored_and_forgotten(tier, layout, list(range(1400, 1406)))
            keys = [1400, 1400, 1401, 1402, 1403, 1404, 1405, 1401]
            if direct_reads:
                _second_part_first(link.store, link.key_of(1400), link.key_of(1404))
            assert await tier.restore(keys, list(range(8))) == 8
            remote = tier.stats().remote
            assert remote is not None and remote.fetched_blocks == 6
            await nothing_held(tier)
