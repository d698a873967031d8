"""Writes sent straight from host blocks (``RedisStore.writefrom``, the default on a node).

The sender on a socket pair: a peer that takes nothing stops it (deadline, quiet limit,
cancellation); the replies to SET. Then on a real server: the values are byte for byte
what the copying writer makes (header, checksum, expiry), read back by both fetch paths;
refused writes are counted one by one and leave the connection in step; a writer cut
short at close holds no block afterwards."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import anyio
import pytest
import structlog

from asyncpin.tier import RedisStore, RemoteError
from asyncpin.tier.remote import (
    HEADER_BYTES,
    WRITERS,
    _Wire,
    checksum,
    decode,
    hash_digest,
)
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


_PUSH = (
    b">4\r\n$10\r\ninvalidate\r\n*2\r\n$3\r\nkey\r\n$4\r\nkey2\r\n"
    b"%1\r\n+at\r\n:1\r\n|1\r\n+ttl\r\n:3\r\n,1.5\r\n"
)


@pytest.mark.parametrize("pushes", [1, 3])
def test_resp3_pushes_before_a_reply_are_read_and_dropped(pushes: int) -> None:
    """A RESP3 push (a server's out-of-band notice) before a reply to SET or GET is
    dropped, and the reply read as if it were not there (review: every write and read
    on such a connection failed, the tier degraded for good)."""
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.sendall(_PUSH * pushes + b"+OK\r\n" + _PUSH * pushes + b"$5\r\nhello\r\n")
        wire = _Wire(a, float("inf"), lambda: None)
        assert wire.status() is None
        head = memoryview(bytearray(8))
        assert wire.value_into(head, lambda size: None) == 5
        assert bytes(head[:5]) == b"hello"


@pytest.mark.parametrize(
    "push",
    [
        b">1\r\n" * 20 + b":1\r\n",  # nested past the bounds
        b">1\r\n$%d\r\n" % (2 << 20),  # a pushed value of 2 MiB
        b">2000\r\n",  # more elements than a notice holds
        b">1\r\n?what\r\n",  # not RESP
    ],
)
def test_a_push_past_its_bounds_is_an_error(push: bytes) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5)
        b.sendall(push + b"+OK\r\n")
        with pytest.raises(ConnectionError):
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
            connections = list(store._idle)
            assert connections
            redis_server.set_maxmemory(0)
            kept = await stored_and_forgotten(tier, layout, [4, 5])
            remote = tier.stats().remote
            assert remote is not None
            assert (remote.failed_writes, remote.written_blocks) == (3, 2)
            assert not remote.degraded
            # the same connections, none closed
            assert all(any(c is d for d in store._idle) for c in connections)
            assert await tier.restore([4, 5], [10, 11]) == 2
            assert same(layout, [10, 11], kept)


@pytest.mark.redis
async def test_a_write_cut_short_at_close_is_over_before_its_blocks_go_back(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """Behind a paused server, leaving the tier cuts the direct writes short, within
    the flush's deadline: each writer's thread has stopped sending before the blocks it
    sends from are released (after which the host's memory may be unmapped), and every
    held block is released."""
    sending = threading.Event()
    over: list[str] = []  # the keys of the sends that are over
    ended_after_the_send: list[bool] = []

    class Watched(RedisStore):
        def writefrom(self, items: Any, **kwargs: Any) -> list[str | None]:
            sending.set()
            try:
                return super().writefrom(items, **kwargs)
            finally:
                over.extend(key for key, _ in items)

    store = Watched(redis_server.url, timeout_s=5.0)
    redis_server.pause()
    try:
        with anyio.fail_after(TIMEOUT_S):
            async with remote_tier(
                redis_server.url, redis_keyspace, store=store, flush_timeout_s=0.2
            ) as (tier, _):
                end_load = tier.index.end_load

                def watched_end_load(hashes: Any, *args: Any, **kwargs: Any) -> None:
                    assert tier.remote is not None
                    ended_after_the_send.append(all(tier.remote.key_of(h) in over for h in hashes))
                    end_load(hashes, *args, **kwargs)

                tier.index.end_load = watched_end_load  # type: ignore[method-assign]
                await tier.store(list(range(8)), list(range(8))).transfer
                await wait_thread_event(sending)
                start = anyio.current_time()
            # the flush (0.2 s) and the store's close (0.2 s), and a poll or two
            assert anyio.current_time() - start < 2.0
        assert tier.remote is not None
        assert ended_after_the_send and all(ended_after_the_send), ended_after_the_send
        # each block sent held, released once: every write under way (at most WRITERS
        # batches; what was still queued was dropped, never held)
        assert len(ended_after_the_send) == len(over) <= min(8, WRITERS * tier.remote.write_batch)
        remote = tier.stats().remote
        assert remote is not None and remote.written_blocks == 0
        assert remote.dropped_blocks + remote.failed_writes == 8
    finally:
        redis_server.resume()


# -- review: values as bytes, keys as redis-py spells them, TLS, redis-py's own checks ------


@pytest.mark.redis
async def test_a_value_part_of_wider_items_is_sent_as_its_bytes(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """A part whose items are wider than a byte (int32), or of two dimensions, is
    declared and sent as all its bytes (review: its length in items was declared, the
    rest of its bytes ran as commands); a part that is no contiguous buffer is refused
    with nothing sent."""
    import numpy as np

    store = RedisStore(redis_server.url, timeout_s=2.0)
    wide = np.arange(24, dtype=np.int32)
    square = np.arange(64, dtype=np.uint8).reshape(8, 8)
    keys = [f"{redis_keyspace}wide", f"{redis_keyspace}square", f"{redis_keyspace}strided"]
    try:
        parts: list[tuple[bytes | memoryview, ...]] = [
            (b"H", memoryview(cast(Any, wide))),
            (memoryview(cast(Any, square)), b"T"),
        ]
        assert store.writefrom(list(zip(keys[:2], parts, strict=True))) == [None, None]
        assert redis_server.command("GET", keys[0]) == b"H" + wide.tobytes()
        assert redis_server.command("GET", keys[1]) == square.tobytes() + b"T"
        assert redis_server.command("DBSIZE") == 2  # nothing ran as a command
        strided = memoryview(cast(Any, np.arange(64, dtype=np.uint8)[::2]))
        with pytest.raises(RemoteError, match="no buffer"):
            store.writefrom([(keys[2], (strided,))])
        assert redis_server.command("EXISTS", keys[2]) == 0
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_keys_are_spelled_as_redis_py_spells_them(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """With ``encoding="latin-1"`` a non-ASCII key written directly is the key that
    redis-py's own calls and the direct reads ask for (review: it was UTF-8)."""
    store = RedisStore(redis_server.url, timeout_s=2.0, encoding="latin-1")
    key = f"{redis_keyspace}café"
    try:
        assert store.writefrom([(key, (b"0123456789",))]) == [None]
        assert await store.exists([key]) == [True]
        sizes = await anyio.to_thread.run_sync(
            lambda: store.readinto([key], lambda i, size, head: None, head_bytes=4)
        )
        assert sizes == [10]
        assert redis_server.command("EXISTS", key.encode("latin-1")) == 1
    finally:
        await store.aclose()


class _SlowReplies:
    """A proxy in front of a server whose replies each arrive ``delay_s`` late: a server
    further away than one 50 ms poll."""

    def __init__(self, server: tuple[str, int], delay_s: float) -> None:
        self._server, self._delay_s = server, delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._server)
            self._sockets += [client, upstream]
            for src, dst, delay in ((client, upstream, 0.0), (upstream, client, self._delay_s)):
                pump = threading.Thread(target=self._pump, args=(src, dst, delay), daemon=True)
                self._threads.append(pump)
                pump.start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while data := src.recv(65536):
                time.sleep(delay_s)  # the injected latency itself, not a wait for an event
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for sock in self._sockets:  # a shutdown wakes a thread blocked on it; a close not
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join()
        for sock in self._sockets:
            sock.close()


@pytest.mark.redis
async def test_a_direct_read_takes_no_health_check_under_the_poll(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """With redis-py's ``health_check_interval``, direct reads from a server whose
    replies come 0.1 s late (two polls) are read (review: redis-py's PING waited for its
    answer under the 50 ms poll, failed, and the read went on on a closed socket)."""
    key = f"{redis_keyspace}far"
    redis_server.command("SET", key, b"x" * 100)
    proxy = _SlowReplies(redis_server.address, 0.1)
    store = RedisStore(
        f"redis://127.0.0.1:{proxy.port}", timeout_s=5.0, health_check_interval=0.001
    )
    try:
        for _ in range(3):  # each past the interval
            sizes = await anyio.to_thread.run_sync(
                lambda: store.readinto([key], lambda i, size, head: None, head_bytes=8)
            )
            assert sizes == [100]
    finally:
        await store.aclose()
        proxy.close()


def _tls_pair(certificate: Any) -> tuple[socket.socket, socket.socket]:
    import ssl

    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(certificate, certificate.with_name("key.pem"))
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(certificate)
    a, b = socket.socketpair()
    wrapped: list[socket.socket] = []
    handshake = threading.Thread(target=lambda: wrapped.append(server.wrap_socket(b, True)))
    handshake.start()
    a = client.wrap_socket(a, server_hostname="127.0.0.1")
    handshake.join()
    return a, wrapped[0]


def test_a_tls_send_to_a_slow_reader_goes_on_while_bytes_flow(tmp_path: Any) -> None:
    """A TLS socket's send is all or nothing: a 4 MiB part drained at ~3 MB/s took longer
    than the quiet limit and failed although bytes flowed (review). Sent in pieces, each
    piece's progress counts, and every byte arrives once, in order."""
    from tests.redis_servers import make_certificate, tls_available

    if (reason := tls_available()) is not None:
        pytest.skip(reason)
    a, b = _tls_pair(make_certificate(tmp_path))
    data = bytes(range(256)) * 16384  # 4 MiB
    got = bytearray()

    def slow_reader() -> None:  # 16 KiB every 5 ms
        while len(got) < len(data):
            chunk = b.recv(16384)
            if not chunk:
                return
            got.extend(chunk)
            time.sleep(0.005)

    reader = threading.Thread(target=slow_reader)
    reader.start()
    try:
        a.settimeout(_Wire.POLL_S)
        _Wire(a, time.monotonic() + 60, lambda: None, quiet_s=0.5).send(memoryview(data))
        reader.join()
        assert bytes(got) == data
    finally:
        a.close()
        b.close()
        reader.join()


@pytest.mark.redis
@pytest.mark.parametrize("direct", [True, False])
async def test_a_prefix_goes_and_comes_back_over_tls(
    direct: bool, redis_tls_server: RedisServer, redis_keyspace: str
) -> None:
    """``rediss://`` with the server's CA: written and fetched back, direct (TLS socket
    of redis-py's blocking client) and through redis-py's asyncio client."""
    store = RedisStore(
        redis_tls_server.tls_url,
        timeout_s=5.0,
        ssl_ca_certs=str(redis_tls_server.certificate),
        direct_reads=direct,
    )
    assert store.direct_writes is direct
    with anyio.fail_after(TIMEOUT_S):
        async with remote_tier(
            redis_tls_server.tls_url, redis_keyspace, store=store, host_blocks=BLOCKS
        ) as (tier, layout):
            hashes = list(range(40, 52))
            kept = await stored_and_forgotten(tier, layout, hashes)
            ids = list(range(12, 24))
            assert await tier.restore(hashes, ids) == len(hashes)
            assert same(layout, ids, kept)
            remote = tier.stats().remote
            assert remote is not None and not remote.degraded
            assert remote.written_blocks == len(hashes) and remote.hit_blocks == len(hashes)
    assert len(redis_tls_server.keys(redis_keyspace)) == len(hashes)


@contextlib.contextmanager
def _never_accepting() -> Iterator[tuple[int, socket.socket]]:
    """A loopback port whose listener never accepts and whose backlog is full: a connect
    to it waits (the kernel drops its SYNs) until its own timeout."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    fillers: list[socket.socket] = []
    try:
        while len(fillers) < 64:  # until a connect does not get through: the backlog is full
            filler = socket.socket()
            fillers.append(filler)
            filler.settimeout(0.2)
            try:
                filler.connect(("127.0.0.1", port))
            except TimeoutError:
                break
        else:
            pytest.skip("the backlog of a listener never filled")
        yield port, listener
    finally:
        for sock in [*fillers, listener]:
            sock.close()


@pytest.mark.parametrize("direct", [True, False])
async def test_leaving_never_waits_for_a_connect_nobody_answers(direct: bool) -> None:
    """A server that never accepts: leaving the tier takes the flush's deadline, not the
    connect's timeout (review: the direct paths waited for their connect thread), and a
    restore cancelled meanwhile returns at once."""
    with _never_accepting() as (port, _):
        store = RedisStore(f"redis://127.0.0.1:{port}", timeout_s=10.0, direct_reads=direct)
        with anyio.fail_after(TIMEOUT_S):
            async with remote_tier(
                store=store, url="", keyspace="never:", host_blocks=BLOCKS, flush_timeout_s=0.3
            ) as (tier, _):
                await tier.store(list(range(8)), list(range(8))).transfer
                start = anyio.current_time()
                with anyio.move_on_after(0.2):
                    await tier.restore(list(range(100, 104)), [20, 21, 22, 23])
                assert anyio.current_time() - start < 2.0  # not the 10 s connect
                start = anyio.current_time()
            assert anyio.current_time() - start < 2.0  # flush 0.3 s, the store's close 0.3 s
        remote = tier.stats().remote
        assert remote is not None
        assert remote.written_blocks + remote.failed_writes + remote.dropped_blocks == 8


class _QuotingServer:
    """A server that answers every command with an error quoting its arguments, as Redis
    does for a command it does not know (a Redis 5 for redis-py's ``HELLO 3 AUTH user
    password``)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._clients: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._clients.append(client)
            with contextlib.suppress(OSError):
                words = client.recv(65536).split(b"\r\n")[2::2]
                quoted = b"".join(b"`" + word + b"`, " for word in words[1:])
                client.sendall(
                    b"-ERR unknown command `%s`, with args beginning with: %s\r\n"
                    % (words[0], quoted)
                )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join()
        for client in self._clients:
            client.close()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("where", ["url", "options"])
async def test_a_password_the_server_quotes_back_never_shows(direct: bool, where: str) -> None:
    """The server's error repeats the handshake's arguments, the password among them:
    it never reaches a log, an error or the counters (review: only a URL's
    ``//user:password@`` was taken out)."""
    server = _QuotingServer()
    secret, user = "S3cret-Pw-x1", "admin-u5er"
    options: dict[str, Any] = {}
    if where == "url":
        url = f"redis://{user}:{secret}@127.0.0.1:{server.port}/0"
    else:
        url, options = f"redis://127.0.0.1:{server.port}/0", {"username": user, "password": secret}
    try:
        with structlog.testing.capture_logs() as events:
            store = RedisStore(url, timeout_s=0.5, protocol=3, direct_reads=direct, **options)
            with anyio.fail_after(TIMEOUT_S):
                async with remote_tier(
                    url, "quoted:", store=store, host_blocks=BLOCKS, flush_timeout_s=1.0
                ) as (tier, _):
                    await tier.store(list(range(4)), list(range(4))).transfer
                    await tier.remote_written()
                    assert await tier.restore(list(range(10, 12)), [20, 21]) == 0
                    with pytest.raises(RemoteError) as info:
                        await store.get(["k"])
                    stats = tier.stats()
        assert stats.remote is not None and stats.remote.failed_writes == 4
        said = repr(events) + str(info.value) + repr(stats)
        assert "unknown command" in said  # the server's text is there, less the secrets
        assert secret not in said and user not in said
    finally:
        server.close()


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"timeout_s": float("nan")}, "timeout_s must be"),
        ({"timeout_s": float("inf")}, "timeout_s must be"),
        ({"timeout_s": 1e9}, "timeout_s must be"),
        ({"ttl_s": float("nan")}, "ttl_s must be"),
        ({"ttl_s": float("inf")}, "ttl_s must be"),
        ({"ttl_s": 1e16}, "ttl_s must be"),  # past what the server takes in ms
        ({"ttl_s": 10**400}, "ttl_s must be"),  # past any float (review: OverflowError)
        ({"timeout_s": 10**400}, "timeout_s must be"),
        ({"protocol": 4}, "protocol must be 2 or 3"),
        ({"protocol": 4, "direct_reads": False}, "protocol must be 2 or 3"),
        ({"ssl_cert_reqs": "bogus"}, "refuses"),
    ],
)
def test_options_nobody_could_use_are_refused_as_config_errors(
    options: dict[str, Any], words: str
) -> None:
    """(An attacker's trial: these escaped as ValueError, OverflowError or redis-py's own
    errors, or were taken and made every write fail.)"""
    from asyncpin import ConfigError

    with pytest.raises(ConfigError, match=words):
        RedisStore("redis://127.0.0.1:1/0", **options)


@pytest.mark.parametrize("direct_reads", [True, False])
def test_a_protocol_in_the_urls_query_is_checked_too(direct_reads: bool) -> None:
    """(Review: ``?protocol=4`` got past the check with the direct paths off.)"""
    from asyncpin import ConfigError

    with pytest.raises(ConfigError, match="protocol must be 2 or 3"):
        RedisStore("redis://127.0.0.1:1/0?protocol=4", direct_reads=direct_reads)
    assert RedisStore("redis://127.0.0.1:1/0?protocol=3", direct_reads=direct_reads)


def test_client_side_caching_is_refused_on_the_direct_paths() -> None:
    """redis-py's client-side caching wraps its connections in a proxy with no socket of
    its own: the direct paths could never use it (every write failed)."""
    from redis.cache import CacheConfig

    from asyncpin import ConfigError

    with pytest.raises(ConfigError, match="direct path's blocking client refuses"):
        RedisStore("redis://127.0.0.1:1/0", protocol=3, cache_config=CacheConfig())
    RedisStore("redis://127.0.0.1:1/0", protocol=3, cache_config=CacheConfig(), direct_reads=False)


@pytest.mark.redis
async def test_a_closed_store_is_refused_by_the_next_tier(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """A tier closes its store when it is left; a second tier given the same store is
    refused at once (review: its direct writes and reads all failed, the tier degraded,
    while redis-py's own calls reconnected)."""
    from asyncpin import ConfigError

    store = RedisStore(redis_server.url, timeout_s=2.0)
    async with remote_tier(redis_server.url, redis_keyspace, store=store) as (tier, layout):
        await stored_and_forgotten(tier, layout, [1])
        # Nor while the first serves (review: the second's exit closed it under the first).
        with pytest.raises(ConfigError, match="serves another tier"):
            async with remote_tier(redis_server.url, redis_keyspace, store=store):
                pass
        assert not store.closed
        await stored_and_forgotten(tier, layout, [2])
    assert store.closed
    with pytest.raises(ConfigError, match="is closed"):
        async with remote_tier(redis_server.url, redis_keyspace, store=store):
            pass
    with pytest.raises(RemoteError, match="closed"):
        await store.get(["k"])


@pytest.mark.redis
async def test_prepare_fills_each_value_just_before_it_is_sent(
    redis_server: RedisServer, redis_keyspace: str
) -> None:
    """``writefrom(prepare=)``: each item's parts are filled in place, in order, just
    before that item goes (the tier makes each header's checksum while the values before
    it are on their way); the server holds what ``prepare`` wrote."""
    store = RedisStore(redis_server.url, timeout_s=2.0)
    keys = [f"{redis_keyspace}p{i}" for i in range(3)]
    heads = [memoryview(bytearray(4)) for _ in keys]
    bodies = [bytes([65 + i]) * (70 << 10) for i in range(3)]  # past the gathered size
    called: list[int] = []

    def prepare(i: int) -> None:
        assert called == list(range(i))  # in order, once each
        called.append(i)
        heads[i][:] = b"H%03d" % i

    try:
        items: list[tuple[str, tuple[bytes | memoryview, ...]]] = [
            (key, (head, body)) for key, head, body in zip(keys, heads, bodies, strict=True)
        ]
        assert store.writefrom(items, prepare=prepare) == [None, None, None]
        assert called == [0, 1, 2]
        for i, key in enumerate(keys):
            assert redis_server.command("GET", key) == b"H%03d" % i + bodies[i]
    finally:
        await store.aclose()


def test_a_connect_given_up_is_reaped_when_it_connects_later() -> None:
    """A connect given up while its SYN waits in a full backlog, whose server accepts it
    later and then drips its handshake's reply without end: the connect thread does not
    live on (review: it did, with its socket, for every call given up so)."""
    from asyncpin.tier.remote import _connect

    stop = threading.Event()

    def drip(client: socket.socket) -> None:
        with client, contextlib.suppress(OSError):
            client.sendall(b"+")  # a reply line that never ends, whatever was sent
            while not stop.wait(0.02):
                client.sendall(b"O")

    with _never_accepting() as (port, listener):
        store = RedisStore(f"redis://127.0.0.1:{port}", timeout_s=30.0, direct_reads=False)
        conn = store._new_connection()
        before = set(threading.enumerate())
        with pytest.raises(TimeoutError):
            _connect(conn, time.monotonic() + 0.2, lambda: None)
        (connecting,) = [t for t in set(threading.enumerate()) - before if "connect" in t.name]
        drippers = []

        def accept() -> None:  # every connection now, the given-up one among them
            listener.settimeout(0.05)
            while not stop.is_set():
                try:
                    client, _ = listener.accept()
                except (TimeoutError, OSError):
                    continue
                drippers.append(threading.Thread(target=drip, args=(client,), daemon=True))
                drippers[-1].start()

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        try:
            connecting.join(10)  # its SYN is sent again after ~1 s, then it is accepted
            assert not connecting.is_alive()
        finally:
            stop.set()
            acceptor.join()
            for thread in drippers:
                thread.join()


def test_what_a_server_quotes_back_is_taken_out_whole_and_short_secrets_left_alone() -> None:
    """Redis cuts the arguments it quotes at 128 bytes, so a long password may appear cut:
    everything after "with args beginning with:" goes. A secret under 4 characters is
    not searched for (review: it garbled every message, showing where it was). A URL's
    ``?password=`` is a secret too."""
    from asyncpin.tier.remote import _redact, _secrets_of

    cut = "ERR unknown command 'HELLO', with args beginning with: '3' 'AUTH' 'u' 'LongPassw"
    said = _redact(cut, ["LongPassw0rd-LongPassw0rd"])
    assert "LongPassw" not in said and "unknown command 'HELLO'" in said
    refused = "Error 111 connecting to 127.0.0.1:1. Connect call failed"
    assert _redact(refused, _secrets_of("redis://:e@127.0.0.1:1/0", {})) == refused
    assert "QQQQ-tail" in _secrets_of("redis://127.0.0.1:1/0?password=QQQQ-tail", {})
    assert _redact("auth QQQQ-tail refused", ["QQQQ-tail"]) == "auth *** refused"
