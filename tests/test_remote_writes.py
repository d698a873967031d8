"""Writes sent straight from host blocks (``RedisStore.writefrom``, the default on a node).

The sender on a socket pair: a peer that takes nothing stops it (deadline, quiet limit,
cancellation); the replies to SET. Then on a real server: the values are byte for byte
what the copying writer makes (header, checksum, expiry), read back by both fetch paths;
refused writes are counted one by one and leave the connection in step; a writer cut
short at close holds no block afterwards."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import anyio
import pytest

from asyncpin.tier import RedisStore
from asyncpin.tier.remote import HEADER_BYTES, _Wire, checksum, decode, hash_digest
from tests.helpers import wait_thread_event
from tests.redis_servers import RedisServer
from tests.test_remote_tier import (
    BLOCKS,
    TIMEOUT_S,
    nothing_held,
    remote_tier,
    same,
    stored_and_forgotten,
)

pytestmark = [pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis-py's client is asyncio's


class _Stop(Exception):
    pass


def test_a_peer_that_takes_nothing_stops_a_send() -> None:
    """Deadline, quiet limit and cancellation each stop a send the peer never reads."""
    checks: list[int] = []

    def cancelled_at_the_third_look() -> None:
        checks.append(1)
        if len(checks) == 3:
            raise _Stop

    data = memoryview(bytearray(16 << 20))  # far more than the two buffers take
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(_Wire.POLL_S)
        with pytest.raises(TimeoutError, match="4 times the timeout"):
            _Wire(a, time.monotonic() + 0.1, lambda: None).send(data)
        with pytest.raises(TimeoutError, match=r"no byte taken by the server for 0\.1 s"):
            _Wire(a, float("inf"), lambda: None, quiet_s=0.1).send(data)
        with pytest.raises(_Stop):
            _Wire(a, float("inf"), cancelled_at_the_third_look).send(data)


def test_a_send_goes_on_while_the_peer_reads_slowly() -> None:
    """Partial sends go on from where they stopped: every byte arrives, in order."""
    data = bytes(range(256)) * 16384  # 4 MiB
    a, b = socket.socketpair()
    got = bytearray()

    def read() -> None:
        while len(got) < len(data):
            chunk = b.recv(65536)
            if not chunk:
                break
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    with a, b:
        a.settimeout(_Wire.POLL_S)
        _Wire(a, time.monotonic() + 30, lambda: None, quiet_s=10).send(memoryview(data))
        reader.join()
    assert bytes(got) == data


@pytest.mark.parametrize(
    ("wire_bytes", "said"),
    [(b"+OK\r\n", None), (b"-OOM command not allowed\r\n", b"OOM command not allowed")],
)
def test_the_replies_to_set(wire_bytes: bytes, said: bytes | None) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.sendall(wire_bytes)
        assert _Wire(a, float("inf"), lambda: None).status() == said


@pytest.mark.parametrize("wire_bytes", [b"$2\r\nOK\r\n", b":1\r\n", b"+QUEUED\r\n"])
def test_a_reply_that_is_no_reply_to_set_is_an_error(wire_bytes: bytes) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.sendall(wire_bytes)
        with pytest.raises(ConnectionError, match="not a reply to SET"):
            _Wire(a, float("inf"), lambda: None).status()


# -- on a real server ------------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.parametrize("ttl_s", [None, 600.0])
@pytest.mark.parametrize("namespace", ["plain", "ключи-ü"])
async def test_direct_writes_read_back_byte_for_byte(
    ttl_s: float | None, namespace: str, redis_server: RedisServer, redis_keyspace: str
) -> None:
    """Each value is the header (right checksum) and the host block's bytes, under the
    key the copying writer uses, with the expiry asked for; both fetch paths read it."""
    hashes = [11, 12, 13, 14, 15]
    keyspace = f"{redis_keyspace.rstrip(':')}-{namespace}"
    for direct_reads in (True, False):
        store = RedisStore(redis_server.url, timeout_s=2.0, ttl_s=ttl_s, direct_reads=direct_reads)
        store.direct_writes = True  # written directly, read back both ways
        with anyio.fail_after(TIMEOUT_S):
            async with remote_tier(redis_server.url, keyspace, store=store, host_blocks=BLOCKS) as (
                tier,
                layout,
            ):
                kept = await stored_and_forgotten(tier, layout, hashes)
                remote = tier.remote
                assert remote is not None and remote.direct_writes
                for i, h in enumerate(hashes):
                    value = redis_server.command("GET", remote.key_of(h))
                    assert isinstance(value, bytes)
                    assert len(value) == HEADER_BYTES + remote.nbytes
                    payload = decode(
                        value, nbytes=remote.nbytes, print_=remote.print_, digest=hash_digest(h)
                    )
                    assert isinstance(payload, memoryview)
                    assert checksum(payload) == int.from_bytes(value[16:24], "little")
                    assert payload.tobytes() == b"".join(k[i].numpy().tobytes() for k in kept)
                    ttl_ms = redis_server.command("PTTL", remote.key_of(h))
                    assert isinstance(ttl_ms, int)
                    if ttl_s is None:
                        assert ttl_ms == -1
                    else:
                        assert 0 < ttl_ms <= ttl_s * 1000
                ids = [20, 21, 22, 23, 24]
                assert await tier.restore(hashes, ids) == len(hashes)
                assert same(layout, ids, kept)
                await nothing_held(tier)
        redis_server.flushall()


@pytest.mark.redis
async def test_refused_writes_are_counted_each_and_the_connection_stays_in_step(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """A full server refuses each SET (OOM): each is a failed write, the tier degraded;
    the replies were all read, so the same connection writes on once there is room."""
    store = RedisStore(redis_server.url, timeout_s=2.0)
    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(redis_server.url, redis_keyspace, store=store) as (tier, layout):
            redis_server.set_maxmemory(1, "noeviction")  # below what it uses: full
            await tier.store([1, 2, 3], [0, 1, 2]).transfer
            await tier.remote_written()
            remote = tier.stats().remote
            assert remote is not None
            assert (remote.failed_writes, remote.written_blocks) == (3, 0) and remote.degraded
            (connection,) = store._idle
            redis_server.set_maxmemory(0)
            kept = await stored_and_forgotten(tier, layout, [4, 5])
            remote = tier.stats().remote
            assert remote is not None
            assert (remote.failed_writes, remote.written_blocks) == (3, 2)
            assert not remote.degraded
            assert store._idle == [connection]  # the same connection, never closed
            assert await tier.restore([4, 5], [10, 11]) == 2
            assert same(layout, [10, 11], kept)


@pytest.mark.redis
async def test_a_write_cut_short_at_close_is_over_before_its_blocks_go_back(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """Behind a paused server, leaving the tier cuts the direct write short, within
    the flush's deadline: the writer's thread has stopped sending before the blocks it
    sends from are released (after which the host's memory may be unmapped), and every
    held block is released."""
    sending = threading.Event()
    over: list[bool] = []
    ended_after_the_send: list[bool] = []

    class Watched(RedisStore):
        def writefrom(self, items: Any, **kwargs: Any) -> list[str | None]:
            sending.set()
            try:
                return super().writefrom(items, **kwargs)
            finally:
                over.append(True)

    store = Watched(redis_server.url, timeout_s=5.0)
    redis_server.pause()
    try:
        with anyio.fail_after(TIMEOUT_S):
            async with remote_tier(
                redis_server.url, redis_keyspace, store=store, flush_timeout_s=0.2
            ) as (tier, _):
                end_load = tier.index.end_load

                def watched_end_load(*args: Any, **kwargs: Any) -> None:
                    ended_after_the_send.append(bool(over))
                    end_load(*args, **kwargs)

                tier.index.end_load = watched_end_load  # type: ignore[method-assign]
                await tier.store(list(range(8)), list(range(8))).transfer
                await wait_thread_event(sending)
                start = anyio.current_time()
            # the flush (0.2 s) and the store's close (0.2 s), and a poll or two
            assert anyio.current_time() - start < 2.0
        assert over == [True]
        assert ended_after_the_send and all(ended_after_the_send), ended_after_the_send
        assert tier.remote is not None  # each block held, released once
        assert len(ended_after_the_send) == min(8, tier.remote.write_batch)
        remote = tier.stats().remote
        assert remote is not None and remote.written_blocks == 0
        assert remote.dropped_blocks + remote.failed_writes == 8
    finally:
        redis_server.resume()
