"""The remote tier: host blocks kept on a Redis-protocol server (Redis 7, Valkey; one node
or a cluster), below the host tier, shared by every server that uses the same keys.

Three pieces:

- :class:`RemoteStore`, the protocol a remote engine implements: pipelined ``get``,
  ``put`` and ``exists`` of whole values by key, ``aclose``. Every failure of the server
  (refused, reset, timed out, out of memory) is a :class:`RemoteError`.
  :class:`RedisStore` implements it with redis-py's asyncio client (the optional extra
  ``asyncpin[remote]``). A store may also offer ``readinto`` (blocking, values read
  straight into host memory) with ``direct_reads = True``, and ``writefrom``
  (blocking, values sent straight from host memory) with ``direct_writes = True``:
  RedisStore does both on one node.
- The value format (:func:`encode_header`, :func:`decode`): a 64-byte header (magic,
  version, payload length, XXH3-64 checksum of the payload, the layout's fingerprint, a
  digest of the block hash), then the host block's bytes. A value is data only when every field
  matches what the reader expects: a truncated, corrupted, foreign (another model,
  layout or rank) or stale (another hash) value is a miss, counted, never data.
- :class:`RemoteLink`, what a :class:`~asyncpin.tier.KVTier` with ``remote=`` holds: the
  key naming, the write-behind queue (blocks stored on the host are written to the
  remote tier in the background; a full queue drops and counts, never blocks), fetches
  into host blocks, and the counters. A failing server makes lookups miss and marks the
  tier ``degraded`` until an operation succeeds again; serving goes on from the host.

Keys are ``<namespace>:<fingerprint>:<block>``: the fingerprint names what the bytes mean
(the model's name given by the application, every array's block shape, dtype and element
order, the host block's size, the tensor-parallel rank), so that different models or
shardings never read each other's blocks.
"""

from __future__ import annotations

import contextlib
import decimal
import functools
import hashlib
import hmac
import json
import math
import re
import ssl
import struct
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import anyio
import anyio.to_thread
import structlog

from asyncpin._log import ShieldedLog
from asyncpin._text import shown
from asyncpin.errors import AsyncpinError, ConfigError

__all__ = [
    "HEADER_BYTES",
    "RedisStore",
    "RemoteError",
    "RemoteLink",
    "RemoteReadCut",
    "RemoteStats",
    "RemoteStore",
    "decode",
    "encode_header",
    "fingerprint",
]

_log = ShieldedLog(structlog.get_logger("asyncpin"))
_SLOTS = 16384  # a Redis Cluster's hash slots
# A host a node may announce: a name or an IPv4 or IPv6 address, nothing a URL would read
# as something else.
_HOST = re.compile(r"[A-Za-z0-9._:%-]{1,253}")
# Options of redis-py's cluster client alone (the direct path's clients are per node).
_CLUSTER_CLIENT_ONLY = frozenset(
    {
        "address_remap",
        "cluster_error_retry_attempts",
        "dynamic_startup_nodes",
        "load_balancing_strategy",
        "read_from_replicas",
        "reinitialize_steps",
        "require_full_coverage",
        "startup_nodes",
    }
)
T = TypeVar("T")

MAGIC = b"APKV"
# 2: the payload's checksum is XXH3-64 (version 1's CRC-32 ran at ~5 GB/s on one core, a
# third of a 2 MiB block's time on the wire; XXH3 runs at 30-50).
VERSION = 2
# magic, version, 3 reserved, payload length, checksum, fingerprint, hash digest,
# 8 reserved: 64 bytes
_HEADER = struct.Struct("<4sB3xQQ16s16s8x")
HEADER_BYTES = _HEADER.size  # 64
# Parts of a direct fetch read at once (bench/RESULTS.md#remote): from one server, two
# (a server's one socket moves ~2 GB/s however many read it); from a cluster, four (the
# parts' keys spread over the nodes, several nodes send at once).
READ_DEPTH = 2
CLUSTER_READ_DEPTH = 4
MAX_READ_DEPTH = 64
# Batches the writer sends at once, each in a worker thread on a connection of its own:
# one batch's wait for its replies is the other's time on the wire.
WRITERS = 2


class RemoteError(AsyncpinError, RuntimeError):
    """The remote server failed an operation (refused, reset, timed out, out of memory).
    The message never holds credentials."""


class RemoteReadCut(RemoteError):
    """A direct read (``RedisStore.readinto``) cut short by a failing server or node:
    ``sizes`` is what the read returns for the keys read before the failure, in order,
    and None for the rest."""

    def __init__(self, message: str, sizes: list[int | None]) -> None:
        super().__init__(message)
        self.sizes = sizes


@runtime_checkable
class RemoteStore(Protocol):
    """A key-value store of whole values, reached over the network.

    Contract: every method is a coroutine of the event loop that entered the tier; a
    failure of the server raises :class:`RemoteError` (nothing else, cancellation
    aside) and leaves the store usable (it reconnects on a later call); ``get`` of a
    missing key gives None, of a key that holds no value (another type of data) an
    empty value, which readers count as invalid; ``put`` may lose a value (the server
    evicts under memory pressure): readers check every value. ``aclose`` releases the
    connections."""

    name: str

    async def get(self, keys: Sequence[str]) -> list[bytes | None]: ...

    async def put(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        """Store each key's value, the concatenation of its parts."""
        ...

    async def exists(self, keys: Sequence[str]) -> list[bool]: ...

    async def aclose(self) -> None: ...


class RedisStore:
    """A :class:`RemoteStore` on a Redis-protocol server (Redis 7, Valkey) through
    redis-py's asyncio client: one node (``redis://``, ``rediss://`` for TLS) or, with
    ``cluster=True``, a cluster through its seed node. Commands of one call go out as one
    pipeline. ``timeout_s`` bounds every connect, read and call. ``ttl_s`` sets an
    expiry on written values (None: the server's eviction policy decides). Other keyword
    arguments go to the client (``username``, ``password``, ``ssl_ca_certs``, ...); the
    URL's credentials and these never appear in logs, errors or ``repr``."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        cluster: bool = False,
        timeout_s: float = 1.0,
        ttl_s: float | None = None,
        direct_reads: bool | None = None,
        direct_writes: bool | None = None,
        **client_options: Any,
    ) -> None:
        try:
            import redis.asyncio
            import redis.asyncio.cluster
            import redis.asyncio.retry
            import redis.backoff
            import redis.exceptions
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("RedisStore needs redis-py: pip install 'asyncpin[remote]'") from exc
        if not _finite(timeout_s, 0, _MAX_TIMEOUT_S):
            raise ConfigError(
                f"timeout_s must be a number > 0, a day at most, got {shown(timeout_s)}"
            )
        if ttl_s is not None and not _finite(ttl_s, 0, _MAX_TTL_S):
            raise ConfigError(f"ttl_s must be a finite number > 0 or None, got {shown(ttl_s)}")
        if client_options.get("decode_responses"):
            raise ConfigError("decode_responses=True would decode the blocks' bytes as text")
        for protocol in (client_options.get("protocol"), *_query_of(url).get("protocol", [])):
            if protocol not in (None, 2, 3, "2", "3"):
                raise ConfigError(f"protocol must be 2 or 3, got {shown(protocol)}")
        self._timeout_s = float(timeout_s)
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        options: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            **client_options,
        }
        self._where = _where(url)
        # What the server may quote back in an error (a HELLO's or an AUTH's arguments):
        # taken out of every message of ours, as the URL's credentials are.
        self._secrets = _secrets_of(url, client_options)
        usable = True
        try:
            if cluster:
                self._client: Any = redis.asyncio.cluster.RedisCluster.from_url(url, **options)
            else:
                # A connection the server closed (its idle timeout, a restart) is made
                # again once, at once: a client made from a URL does not retry at all.
                # (The cluster's client retries by itself.)
                retry = redis.asyncio.retry.Retry(
                    redis.backoff.NoBackoff(), 1, (redis.exceptions.ConnectionError,)
                )
                self._client = redis.asyncio.Redis.from_url(url, **{"retry": retry, **options})
        except Exception:  # ValueError, TypeError, redis-py's own errors of an option
            usable = False
        if not usable:  # raised here, not in the except: the client's error may name a
            # credential, and would be this one's __context__ ("from None" only hides it)
            raise ConfigError(f"not a usable Redis URL or option for {self._where}")
        self.cluster = cluster
        # A cluster given no choice goes direct where its options allow, and through
        # redis-py's cluster client where they are for that client alone
        # (``address_remap``, ``read_from_replicas``...: the direct path's per-node
        # clients would refuse or ignore them).
        fall_back = cluster and direct_reads is None and direct_writes is None
        if direct_reads is None:
            direct_reads = True
        if direct_writes is None:
            direct_writes = direct_reads
        for flag, on in (("direct_reads", direct_reads), ("direct_writes", direct_writes)):
            if not isinstance(on, bool):
                raise ConfigError(f"{flag} must be a bool or None, got {shown(on)}")
        # readinto's blocking client (made on first use, in a worker thread).
        self._blocking_args = (url, options)
        self._blocking: Any = None
        self._blocking_lock = threading.Lock()
        self._idle: list[Any] = []  # the direct reads' connections, not in use
        # A cluster's nodes, by (host, port): their blocking clients and idle connections,
        # and which node serves each of the 16384 slots (CLUSTER SLOTS, asked again
        # after a MOVED or an ASK, and after a node failed).
        self._node_clients: dict[tuple[str, int], Any] = {}
        self._node_idle: dict[tuple[str, int], list[Any]] = {}
        self._slots: list[tuple[str, int] | None] | None = None
        self._stale_slots = False
        self._closed = False
        if direct_reads or direct_writes:
            try:
                self._idle.append(self._direct_connection(client_options, direct_reads))
            except ConfigError:
                if not fall_back:
                    raise
                direct_reads = direct_writes = False
        #: Whether fetches read straight into host blocks (:meth:`readinto`).
        self.direct_reads: bool = direct_reads
        #: Whether writes send straight from host blocks (:meth:`writefrom`).
        self.direct_writes: bool = direct_writes

    def _direct_connection(self, client_options: Mapping[str, Any], reads: bool) -> Any:
        """A first connection for the direct path, or ConfigError for an option its
        blocking clients cannot take: now, not per call."""
        flag = "direct_reads" if reads else "direct_writes"
        for option, value in client_options.items():
            if type(value).__module__.startswith("redis.asyncio"):
                raise ConfigError(
                    f"{option}= is an object of redis-py's asyncio client, which the "
                    f"direct path's blocking client cannot use: pass {flag}=False"
                )
            if option in _CLUSTER_CLIENT_ONLY:
                raise ConfigError(
                    f"{option}= is for redis-py's cluster client, which the direct path "
                    "does not use: pass direct_reads=False, direct_writes=False"
                )
        try:
            conn = self._new_connection()
        except Exception:
            conn = None
        # A connection of another kind (client-side caching's proxy, say) has no
        # socket of its own for the direct path to read and write.
        if conn is None or not hasattr(conn, "_sock"):
            raise ConfigError(
                f"an option for {self._where} that the direct path's blocking client "
                "refuses: pass direct_reads=False, direct_writes=False"
            ) from None
        return conn

    def __repr__(self) -> str:
        return f"<RedisStore {self._where}{' cluster' if self.cluster else ''}>"

    async def _run(self, what: str, build: Callable[[Any], None]) -> list[Any]:
        """One pipeline, bounded by the timeout; any failure of the server is a
        RemoteError naming the server, never its credentials.

        The client's call runs in a task of its own: a cancellation that the client lets
        out although nobody cancelled the caller (asyncio's timeouts inside the client
        racing ours) ends that task, and is a failed operation here, not a cancellation
        of the caller. A cancellation of the caller goes on as itself."""
        if self._closed:
            raise RemoteError(f"{what} on {self._where} failed: the store is closed")
        outcome: list[Any] = []

        from redis.exceptions import ResponseError

        async def call() -> None:
            try:
                with anyio.fail_after(self._timeout_s * 4):  # connect, then read, per node
                    pipe = self._client.pipeline(transaction=False)
                    build(pipe)
                    try:
                        outcome.append(await pipe.execute(raise_on_error=True))
                    except ResponseError as exc:
                        if not _wrong_type(exc, reworded=True):
                            raise
                        # A key holds another type of data: again, each key's error in
                        # its place. (Not the first time: the cluster's pipeline would
                        # then give connection errors as results too, and not retry.)
                        pipe = self._client.pipeline(transaction=False)
                        build(pipe)
                        results = await pipe.execute(raise_on_error=False)
                        for result in results:
                            if isinstance(result, Exception) and not _wrong_type(result):
                                raise result from None
                        outcome.append(results)
            except Exception as exc:
                # The server's errors, and whatever else the client raises for them
                # (redis-py 8.1's cluster pipeline raised AttributeError on a connection
                # torn down by a node's restart): a failed operation, never the caller's
                # crash.
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
        if not outcome:  # the task ended by a cancellation of the client's own
            raise RemoteError(f"{what} on {self._where} failed: the client cancelled the call")
        if isinstance(outcome[0], Exception):
            raise self._failure(what, outcome.pop()) from None
        result: list[Any] = outcome[0]
        return result

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []

        def build(pipe: Any) -> None:
            for key in keys:
                pipe.get(key)

        # A key holding another type of data (WRONGTYPE), or a reply that is no string (a
        # RESP3 server's number, say), reads as an empty value: not ours, a counted
        # invalid value to the reader, not a failure of the server.
        return [
            v if v is None or isinstance(v, bytes) else b"" for v in await self._run("GET", build)
        ]

    async def put(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        if not items:
            return

        def build(pipe: Any) -> None:
            for key, parts in items:
                value = parts[0] if len(parts) == 1 else b"".join(parts)
                pipe.set(key, value, px=self._ttl_ms)

        await self._run("SET", build)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []

        def build(pipe: Any) -> None:
            for key in keys:
                pipe.exists(key)

        return [bool(n) for n in await self._run("EXISTS", build)]

    def readinto(
        self,
        keys: Sequence[str],
        into: Callable[[int, int, memoryview], memoryview | None],
        *,
        head_bytes: int,
        check_cancelled: Callable[[], None] = lambda: None,
    ) -> list[int | None]:
        """Blocking: run it in a worker thread. Each key's value read off the socket with
        no copy on the way: its first ``head_bytes`` into a buffer, then ``into(i, size,
        head)`` says where the rest goes (a memoryview, filled from its start; what does
        not fit, or all of it for None, is read and dropped). Returns each value's size,
        None for a missing key, 0 for one holding another type of data (``into`` is not
        called). One pipeline, each socket wait bounded by ``timeout_s``
        and the whole by 4 times it; ``check_cancelled`` is called at least every 50 ms
        while waiting (it raises to stop). Any failure is a RemoteError; a connection
        left mid-reply is closed, never reused. On a cluster each key is asked of the
        node that serves its slot, one pipeline per node; a key whose slot moved (MOVED,
        ASK) is a miss (None) and the slots are asked again before the next call.

        The sockets are redis-py's own (its connection pools: AUTH, TLS and the rest as
        configured); only the replies of these GETs are read past its parser."""
        if not self.direct_reads:
            raise RemoteError(f"{self!r} has direct_reads off")
        sizes: list[int | None] = [None] * len(keys)
        if not keys:
            return sizes
        deadline = time.monotonic() + self._timeout_s * 4
        failure: RemoteError | None = None
        try:
            plan = self._plan(keys, deadline, check_cancelled)
            cut: list[Exception] = []  # the failure that ended the read before its end
            with contextlib.suppress(_CutShort), contextlib.ExitStack() as stack:
                # Every node's GETs go out first, its own pipeline, then the replies are
                # read in the keys' order, each from its node's socket: ``into`` sees
                # the keys in order, as from one node. Sent as the values are read:
                # bounded by the deadline, and none of redis-py's own checks before it
                # (its health check's PING would wait for its answer under the 50 ms
                # poll as its whole timeout). A node that fails is left out: the read
                # ends at its first key, the keys before it stand.
                wires: dict[tuple[str, int] | None, _Wire] = {}
                for at in dict.fromkeys(plan):
                    try:
                        conn, wire = stack.enter_context(self._wire(deadline, check_cancelled, at))
                        mine = [
                            ("GET", key) for key, to in zip(keys, plan, strict=True) if to == at
                        ]
                        wire.send(b"".join(conn.pack_commands(mine)))
                    except Exception as exc:  # its connection is closed with the cut below
                        cut.append(exc)
                        continue
                    wires[at] = wire
                head = memoryview(bytearray(head_bytes))
                error: bytes | None = None
                for i in range(len(keys)):
                    if plan[i] not in wires:  # its node failed
                        break
                    try:
                        got = wires[plan[i]].value_into(
                            head, functools.partial(_body_of, into, i, head)
                        )
                    except Exception as exc:
                        cut.append(exc)
                        break
                    if isinstance(got, bytes) and _wrong_type(got):
                        sizes[i] = 0  # another type of data: an empty value, as get() says
                    elif isinstance(got, bytes) and _redirected(got) and self.cluster:
                        self._stale_slots = True  # a miss now; the slots asked again next
                    elif isinstance(got, bytes):
                        error = error or got
                    else:
                        sizes[i] = got
                if cut:  # the replies not read close their connections, never reused
                    raise _CutShort
            if cut:
                if self.cluster:  # a node down or failed over: the slots are asked again
                    self._stale_slots = True
                failure = RemoteReadCut(str(self._failure("GET", cut[0])), sizes)
                cut.clear()
            elif error is not None:
                failure = self._refused("GET", error)
        except Exception as exc:
            if self.cluster:  # a node down or failed over: the slots are asked again
                self._stale_slots = True
            failure = self._failure("GET", exc)
        if failure is not None:
            # Raised here, with no context, and the name dropped: the failed read's
            # traceback would keep its frames, and the host blocks' memory they name,
            # alive until a collection (a cycle through this frame's ``failure``).
            try:
                raise failure
            finally:
                failure = None
        return sizes

    def writefrom(
        self,
        items: Sequence[tuple[str, Sequence[bytes | memoryview]]],
        *,
        check_cancelled: Callable[[], None] = lambda: None,
        prepare: Callable[[int], None] | None = None,
    ) -> list[str | None]:
        """Blocking: run it in a worker thread. SET of each key to its parts, joined on
        the wire: each part goes from its own memory to the socket with no copy on the
        way (parts under 64 KiB are gathered first). Returns each key's error reply
        (the server's text, credentials taken out; None: written). One pipeline, each
        socket wait bounded by ``timeout_s`` and the whole by 4 times it;
        ``check_cancelled`` is called at least every 50 ms while waiting (it raises to
        stop). ``prepare(i)``, if given, is called just before item ``i`` is sent, to
        fill its parts in place (a header whose checksum is made while the values
        before it are on their way). Any failure of the server or the connection is a
        RemoteError, and the values may or may not be written; a connection left
        mid-command is closed, never reused, so the server never takes a cut value. On a
        cluster each key goes to the node that serves its slot, one pipeline per node; a
        key whose slot moved (MOVED, ASK) is sent once more after the slots are asked
        again (its error then, if it moved again)."""
        if not self.direct_writes:
            raise RemoteError(f"{self!r} has direct_writes off")
        errors: list[str | None] = [None] * len(items)
        if not items:
            return errors
        # As bytes: a part's length is its bytes, whatever its items (a memoryview of
        # int32, say); one that is no contiguous buffer fails here, with nothing sent.
        try:
            values = [[memoryview(part).cast("B") for part in parts] for _, parts in items]
        except (TypeError, ValueError) as exc:
            raise RemoteError(f"SET on {self._where}: a value part is no buffer: {exc}") from None
        px = b""  # the expiry's arguments
        if self._ttl_ms is not None:
            ms = b"%d" % self._ttl_ms
            px = b"$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
        deadline = time.monotonic() + self._timeout_s * 4
        failure: RemoteError | None = None
        try:
            todo = list(range(len(items)))
            for attempt in range(2):  # a second time for the keys whose slot moved
                moved = self._send_sets(
                    [items[i][0] for i in todo],
                    [values[i] for i in todo],
                    px,
                    deadline,
                    check_cancelled,
                    None if prepare is None else functools.partial(_prepare_of, prepare, todo),
                    errors_of=functools.partial(_set_at, errors, todo),
                )
                if not moved:
                    break
                if not self.cluster:  # not written: a node of a cluster, taken for a server
                    for j, said in moved:
                        errors[todo[j]] = str(self._refused("SET", said))
                    break
                self._stale_slots = True
                if attempt:  # sent away again: not written, and said so
                    for j, said in moved:
                        errors[todo[j]] = self._redact(said.decode(errors="replace"))
                todo = [todo[j] for j, _ in moved]
        except Exception as exc:
            if self.cluster:  # a node down or failed over: the slots are asked again
                self._stale_slots = True
            failure = self._failure("SET", exc)
        if failure is not None:
            try:  # as in readinto: no frame of this call kept alive by the error
                raise failure
            finally:
                failure = None
        return errors

    def _send_sets(
        self,
        keys: list[str],
        values: list[list[memoryview]],
        px: bytes,
        deadline: float,
        check_cancelled: Callable[[], None],
        prepare: Callable[[int], None] | None,
        errors_of: Callable[[int, str], None],
    ) -> list[tuple[int, bytes]]:
        """One pipeline of SETs per node (one on a single node); the server's refusals
        go to ``errors_of``. Returns the keys whose slot moved: (index, the reply)."""
        moved: list[tuple[int, bytes]] = []
        plan = self._plan(keys, deadline, check_cancelled)

        def send(at: tuple[str, int] | None, mine: list[int], said: list[int]) -> None:
            """The keys ``mine`` to the node ``at``: each whose reply is read goes into
            ``said``."""
            with self._wire(deadline, check_cancelled, at) as (conn, wire):
                small = bytearray()
                for i in mine:
                    if prepare is not None:
                        prepare(i)
                    name = conn.encoder.encode(keys[i])  # as redis-py spells it (``encoding=``)
                    size = sum(len(part) for part in values[i])
                    small += b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
                        5 if px else 3,
                        len(name),
                        name,
                        size,
                    )
                    for part in values[i]:
                        if len(part) < _SMALL_PART:
                            small += part
                        else:
                            wire.send(small)
                            small.clear()
                            wire.send(part)
                    small += b"\r\n" + px
                wire.send(small)
                for i in mine:
                    reply = wire.status()
                    said.append(i)
                    if reply is not None and _redirected(reply):
                        moved.append((i, reply))
                    elif reply is not None:
                        errors_of(i, self._redact(reply.decode(errors="replace")))

        for at in dict.fromkeys(plan):
            mine = [i for i, to in enumerate(plan) if to == at]
            said: list[int] = []  # the keys whose reply was read
            try:
                send(at, mine, said)
            except Exception as exc:
                if not self.cluster:
                    raise
                # A node down, or failing: its keys' writes failed (written or not), the
                # other nodes' go on; the slots are asked again.
                self._stale_slots = True
                text = str(self._failure("SET", exc))
                for i in mine[len(said) :]:  # the replies come in order
                    errors_of(i, text)
        return sorted(moved)

    def _plan(
        self, keys: Sequence[str], deadline: float, check_cancelled: Callable[[], None]
    ) -> list[tuple[str, int] | None]:
        """Where each key goes: None (the URL's server) on a single node; on a cluster the
        node that serves its slot, as CLUSTER SLOTS said (asked on first use and after a
        key's slot moved)."""
        if not self.cluster:
            return [None] * len(keys)
        import redis.crc

        slots = self._slots
        if slots is None or self._stale_slots:
            slots = self._ask_slots(deadline, check_cancelled)
        with self._blocking_lock:  # made once, and never again after aclose
            if self._closed:
                raise ConnectionError("the store is closed")
            encoder = self._blocking_client(None).get_encoder()
        plan = [slots[redis.crc.key_slot(encoder.encode(key))] for key in keys]
        if None in plan:  # a slot no node serves: the cluster is down there
            raise ConnectionError("a key's slot is served by no node (the cluster is down)")
        return plan

    def _ask_slots(
        self, deadline: float, check_cancelled: Callable[[], None]
    ) -> list[tuple[str, int] | None]:
        """CLUSTER SLOTS, asked of the URL's node, else of a node known before."""
        known = list(dict.fromkeys(a for a in self._slots or () if a is not None))
        failure: Exception | None = None
        for at in [None, *known]:
            try:
                with self._wire(deadline, check_cancelled, at) as (conn, wire):
                    wire.send(b"".join(conn.pack_commands([("CLUSTER", "SLOTS")])))
                    reply = wire.reply()
                asked = _host_port(self._blocking_args[0])[0] if at is None else at[0]
                slots = _slot_map(reply, asked)
            except Exception as exc:  # a node down, or a reply of another shape
                failure = failure or exc
                continue
            self._slots, self._stale_slots = slots, False
            self._forget_nodes_but(set(slots))
            return slots
        assert failure is not None
        raise failure

    def _forget_nodes_but(self, serving: set[tuple[str, int] | None]) -> None:
        """Close the clients and idle connections of nodes that serve no slot now (a
        node failed over, or gone: they are made again if it comes back)."""
        with self._blocking_lock:
            gone = [at for at in self._node_clients if at not in serving]
            clients = [self._node_clients.pop(at) for at in gone]
            conns = [c for at in gone for c in self._node_idle.pop(at, [])]
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.disconnect()
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()

    @contextlib.contextmanager
    def _wire(
        self,
        deadline: float,
        check_cancelled: Callable[[], None],
        at: tuple[str, int] | None = None,
    ) -> Iterator[tuple[Any, _Wire]]:
        """One of the direct path's connections (to the URL's server, or to the
        cluster's node ``at``), connected, and its socket as a :class:`_Wire`; put back
        for the next call once the block is left, or closed if it is left by an
        exception (mid-reply or mid-command: the next user would be out of step with
        the server)."""
        with self._blocking_lock:
            if self._closed:
                raise ConnectionError("the store is closed")
            idle = self._idle if at is None else self._node_idle.setdefault(at, [])
            conn = idle.pop() if idle else self._new_connection(at)
        _connect(conn, deadline, check_cancelled)
        try:
            sock = conn._sock
            sock.settimeout(_Wire.POLL_S)
            yield conn, _Wire(sock, deadline, check_cancelled, self._timeout_s)
            sock.settimeout(conn.socket_timeout)  # redis-py's, for its next use
        except BaseException:
            conn.disconnect()
            raise
        finally:
            with self._blocking_lock:
                # Closed, or its node forgotten meanwhile (``_forget_nodes_but``).
                if self._closed or (at is not None and self._node_idle.get(at) is not idle):
                    conn.disconnect()
                else:
                    idle.append(conn)

    def _redact(self, message: str) -> str:
        """A server's or the client's message without the credentials (``_redact``)."""
        return _redact(message, self._secrets)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called: a closed store reads and writes nothing."""
        return self._closed

    def _refused(self, what: str, said: bytes) -> RemoteError:
        """The server's error reply to a command as a RemoteError (a node of a cluster
        that moves keys elsewhere, for a store made without ``cluster=True``, says so)."""
        text = self._redact(said.decode(errors="replace"))
        if _redirected(said) and not self.cluster:
            return self._not_a_cluster(what, text)
        return RemoteError(f"{what} on {self._where} failed: {text}")

    def _not_a_cluster(self, what: str, text: str) -> RemoteError:
        return RemoteError(
            f"{what} on {self._where} was sent to another node ({text}): the server is "
            "a node of a cluster; make the store with RedisStore(url, cluster=True)"
        )

    def _failure(self, what: str, exc: Exception) -> RemoteError:
        """A failure of the client as a RemoteError naming the server, never its
        credentials (a redirect, for a store made without ``cluster=True``, says what
        to do, as ``_refused``)."""
        from redis.exceptions import AskError  # MovedError is one too

        said = f" ({self._redact(str(exc))})" if str(exc) else ""
        if isinstance(exc, AskError) and not self.cluster:
            return self._not_a_cluster(what, f"{type(exc).__name__}{said}")
        return RemoteError(f"{what} on {self._where} failed: {type(exc).__name__}{said}")

    def _new_connection(self, at: tuple[str, int] | None = None) -> Any:
        """A connection of redis-py's (not connected yet) for the direct reads and
        writes: made by the pool of a blocking client of this store's URL and options
        (for a cluster's node ``at``, the URL with that node's host and port), but kept
        in this store's own list, so that one call's failure closes its connection
        alone."""
        return self._blocking_client(at).connection_pool.make_connection()

    def _blocking_client(self, at: tuple[str, int] | None) -> Any:
        import redis

        url, options = self._blocking_args
        if at is None:
            if self._blocking is None:
                self._blocking = redis.Redis.from_url(url, **options)
            return self._blocking
        client = self._node_clients.get(at)
        if client is None:
            client = redis.Redis.from_url(_with_host_port(url, *at), **options)
            self._node_clients[at] = client
        return client

    async def aclose(self) -> None:
        with self._blocking_lock:
            self._closed = True
            blocking = [c for c in (self._blocking, *self._node_clients.values()) if c]
            self._blocking, self._node_clients = None, {}
            idle = [self._idle, *self._node_idle.values()]
            self._idle, self._node_idle = [], {}
        for conn in (conn for conns in idle for conn in conns):
            with contextlib.suppress(Exception):
                conn.disconnect()
        for client in blocking:
            with contextlib.suppress(Exception):
                await anyio.to_thread.run_sync(client.close)

        async def close() -> None:
            with contextlib.suppress(Exception):  # closing what is already broken
                await self._client.aclose()

        async with anyio.create_task_group() as tg:  # as in _run: a stray cancellation
            tg.start_soon(close)  # of the client's own ends this task, not the caller


def _where(url: str) -> str:
    """``scheme://host:port/db`` of a URL: no user, no password, no query."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        if "@" in parts.path + parts.query + parts.fragment:  # a password with '/', '?', '#
            return f"{parts.scheme}://<host>"
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{parts.path}"
    except ValueError:
        return "<a Redis URL>"


def _redact(message: str, secrets: Sequence[str] = ()) -> str:
    """A server's error message, without anything that looks like a URL's credentials,
    without the arguments a server quotes back (Redis: "with args beginning with: ...",
    cut at 128 bytes, so a secret among them may not be whole), and without any of
    ``secrets`` of 4 characters or more (a shorter one would garble the message, and
    show where it was)."""
    import re

    message = re.sub(r"(?i)(with args beginning with:).*", r"\1 ***", message)
    for secret in secrets:
        if len(secret) >= 4:
            message = message.replace(secret, "***")
    return re.sub(r"//[^@/\s]*@", "//***@", message)[:200]


def _query_of(url: str) -> dict[str, list[str]]:
    """A URL's query options (redis-py takes ``?protocol=``, ``?password=``...)."""
    from urllib.parse import parse_qs, urlsplit

    try:
        return parse_qs(urlsplit(url).query)
    except ValueError:
        return {}


def _secrets_of(url: str, options: Mapping[str, Any]) -> list[str]:
    """The credentials of a URL and of the client's options, longest first."""
    from urllib.parse import unquote, urlsplit

    found = [options.get("password"), options.get("username")]
    try:
        parts = urlsplit(url)
        found += [parts.password, parts.username]
        found += [unquote(s) for s in (parts.password, parts.username) if s]
        query = _query_of(url)  # redis-py takes ?password= and ?username= too
        found += query.get("password", []) + query.get("username", [])
        # What comes before the last '@' is what the user meant as credentials, even where
        # a '/', '?' or '#' in a password (unencoded) cut the URL elsewhere.
        tail = url.split("//", 1)[-1]
        if "@" in tail:
            meant = tail.rsplit("@", 1)[0]
            pieces = re.split(r"[:/?#]", meant)  # each part the URL's parser may show
            found += [meant, *pieces, *(unquote(piece) for piece in pieces)]
    except ValueError:
        pass
    secrets = {s for s in found if isinstance(s, str) and s}
    return sorted(secrets, key=len, reverse=True)


_MAX_TIMEOUT_S = 86_400.0  # a day: a socket's timeout must be a finite float
_MAX_TTL_S = 9_000_000_000_000_000 / 1000  # an expiry in ms the server takes (< 2**63)


def _finite(value: object, low: float, high: float) -> bool:
    """Whether ``value`` is an int or float (not a bool) with ``low < value <= high``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return low < value <= high and math.isfinite(value)
    except OverflowError:  # an int past any float
        return False


_SMALL_PART = 64 << 10  # a value's part under this is gathered with the command's text


class _Wire:
    """A pipeline on a socket: values sent from the caller's memory (``send``), the
    replies read: the short lines through a small buffer, each value's bytes straight
    into the caller's memory (``recv_into``).

    The socket waits at most ``POLL_S`` a send or a read (``RedisStore._wire`` sets it),
    so that between them the deadline, the quiet limit (no progress for ``quiet_s``) and
    ``check_cancelled`` are looked at: a cancelled caller waits at most that long for a
    stalled server."""

    _LINE_READ = 4096  # what a line's read may take of the value after it (copied)
    _MAX_LINE = 1024  # longer is not a reply to GET (an error's text is short too)
    POLL_S = 0.05
    # What one send may take on TLS: an SSL socket's send is all or nothing (it waits
    # until the whole of it is out), so progress is seen, and the quiet limit held, per
    # piece. (A plain socket sends what it can and says how much: pieces there cost
    # 15-20% of the throughput, bench/probes/redis_send.py.)
    SEND_PIECE = 256 << 10

    def __init__(
        self,
        sock: Any,
        deadline: float,
        check_cancelled: Callable[[], None],
        quiet_s: float = float("inf"),
    ) -> None:
        self._sock = sock
        self._deadline = deadline
        self._check = check_cancelled
        self._quiet_s = quiet_s
        self._buf = b""
        self._reply_left = 0  # what the reply being parsed may still take (``reply``)

    def _go_on(self, since: float, quiet: str) -> None:
        """Raises if the caller is cancelled, past the deadline, or ``quiet_s`` after
        ``since`` (the last progress: ``quiet`` says of what)."""
        self._check()
        now = time.monotonic()
        if now > self._deadline:
            raise TimeoutError("the call outlived 4 times the timeout")
        if now - since > self._quiet_s:
            raise TimeoutError(f"{quiet} for {self._quiet_s} s")

    def send(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        piece = self.SEND_PIECE if isinstance(self._sock, ssl.SSLSocket) else len(view)
        since = time.monotonic()
        while view:
            self._go_on(since, "no byte taken by the server")
            try:
                sent = self._sock.send(view[:piece])
            except TimeoutError:  # the poll's wait: look again
                continue
            view = view[sent:]
            since = time.monotonic()

    def status(self) -> bytes | None:
        """The next reply to a SET: None for OK, an error reply's text (bytes)."""
        line = self._reply_line()
        if line == b"+OK":
            return None
        if line[:1] == b"-":
            return line[1:]
        raise ConnectionError(f"not a reply to SET: {line[:40]!r}")

    def _recv(self, into: memoryview | None) -> int | bytes:
        since = time.monotonic()
        while True:
            self._go_on(since, "no byte from the server")
            try:
                got: int | bytes = (
                    self._sock.recv_into(into)
                    if into is not None
                    else self._sock.recv(self._LINE_READ)
                )
            except TimeoutError:  # the poll's wait: look again
                continue
            if not got:
                raise ConnectionError("the server closed the connection")
            return got

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            if len(self._buf) > self._MAX_LINE:  # a GET's reply lines are a few bytes
                raise ConnectionError(f"a reply line longer than {self._MAX_LINE} bytes")
            more = self._recv(None)
            assert isinstance(more, bytes)
            self._buf += more
        line, self._buf = self._buf[:end], self._buf[end + 2 :]
        return line

    _MAX_PUSH_DEPTH = 8  # RESP3 pushes: nesting, elements and bytes a push may hold
    _MAX_PUSH_ITEMS = 1024
    _MAX_PUSH_BYTES = 1 << 20

    def _reply_line(self) -> bytes:
        """The next reply's first line, past any RESP3 push before it (an out-of-band
        message of the server's, a client-side caching or maintenance notice: read and
        dropped)."""
        while (line := self._line())[:1] == b">":
            self._skip(line, 0)
        return line

    def _skip(self, line: bytes, depth: int) -> None:
        """Read and drop the RESP3 value whose first line is ``line``, within the push
        bounds above (past them, or not RESP3: ConnectionError)."""
        kind, rest = line[:1], line[1:]
        count = int(rest) if rest.isdigit() else -1 if rest == b"-1" else None
        if kind and kind in b"+-:,#_(":  # one line
            return
        if kind and kind in b"$!=" and count is not None:  # a size, then bytes and CRLF
            if count > self._MAX_PUSH_BYTES:
                raise ConnectionError(f"a pushed value of {count} bytes")
            self._drop(count + 2 if count >= 0 else 0)
            return
        if kind and kind in b"*~>%|" and count is not None:  # aggregates of count items
            items = count * 2 if kind in b"%|" else count
            if depth >= self._MAX_PUSH_DEPTH or items > self._MAX_PUSH_ITEMS:
                raise ConnectionError("a pushed value nested or long past its bounds")
            for _ in range(max(items, 0)):
                self._skip(self._line(), depth + 1)
            if kind == b"|":  # attributes come before a value of their own
                self._skip(self._line(), depth + 1)
            return
        raise ConnectionError(f"not a RESP reply: {line[:40]!r}")

    _MAX_REPLY_ITEMS = _SLOTS  # a parsed reply's bounds (CLUSTER SLOTS: a range at most a slot)
    _MAX_REPLY_BYTES = 8 << 20  # ... and its bytes in all (a large cluster's: about 2 MB)

    def reply(self, depth: int = 0) -> Any:
        """The next reply parsed: bytes, ints, None and lists (a RESP3 map flattened),
        for a small reply (CLUSTER SLOTS's); an error reply raises ConnectionError with
        its text. Bounded as a push is (nesting, bytes), with up to
        ``_MAX_REPLY_ITEMS`` items an aggregate and ``_MAX_REPLY_BYTES`` in all."""
        if depth == 0:
            self._reply_left = self._MAX_REPLY_BYTES
        line = self._reply_line() if depth == 0 else self._line()
        kind, rest = line[:1], line[1:]
        count = int(rest) if rest.isdigit() else -1 if rest == b"-1" else None
        body = count + 2 if kind == b"$" and count is not None and count >= 0 else 0
        self._reply_left -= len(line) + 2 + body
        if self._reply_left < 0:
            raise ConnectionError(f"a reply longer than {self._MAX_REPLY_BYTES} bytes")
        if kind == b"-":
            raise ConnectionError(rest.decode(errors="replace"))
        if kind == b"+":
            return rest
        if kind == b":" and rest.lstrip(b"-").isdigit():
            return int(rest)
        if kind == b"_":
            return None
        if kind == b"$" and count is not None:
            if count > self._MAX_PUSH_BYTES:
                raise ConnectionError(f"a reply's value of {count} bytes")
            if count < 0:
                return None
            value = bytearray(count + 2)
            self._fill(memoryview(value))
            return bytes(value[:count])
        if kind in (b"*", b"~", b"%") and count is not None:
            items = count * 2 if kind == b"%" else count
            if depth >= self._MAX_PUSH_DEPTH or items > self._MAX_REPLY_ITEMS:
                raise ConnectionError("a reply nested or long past its bounds")
            return None if count < 0 else [self.reply(depth + 1) for _ in range(items)]
        raise ConnectionError(f"not a reply this client reads: {line[:40]!r}")

    def _drop(self, left: int) -> None:
        """Read ``left`` bytes and drop them."""
        drop = memoryview(bytearray(min(left, 1 << 16)))
        while left:
            self._fill(drop[: min(left, len(drop))])
            left -= min(left, len(drop))

    def _fill(self, view: memoryview) -> None:
        take = min(len(view), len(self._buf))
        if take:
            view[:take] = self._buf[:take]
            self._buf = self._buf[take:]
        while take < len(view):
            got = self._recv(view[take:])
            assert isinstance(got, int)
            take += got

    def value_into(
        self, head: memoryview, body_for: Callable[[int], memoryview | None]
    ) -> int | bytes | None:
        """The next reply: a value's size (its first bytes in ``head``, the rest where
        ``body_for(size)`` says, or dropped), None (no such key), or an error reply's
        text (bytes)."""
        line = self._reply_line()
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            return rest
        if kind == b"_" or line == b"$-1":
            return None
        if kind != b"$" or not rest.isdigit():
            raise ConnectionError(f"not a reply to GET: {line[:40]!r}")
        size = int(rest)
        first = head[: min(len(head), size)]
        self._fill(first)
        left = size - len(first)
        body = body_for(size) if left else None
        if body is not None:
            part = body[: min(len(body), left)]
            self._fill(part)
            left -= len(part)
        self._drop(left)
        end = bytearray(2)
        self._fill(memoryview(end))
        if end != b"\r\n":
            raise ConnectionError("a value without its CRLF")
        return size


# -- the value format --------------------------------------------------------------------


def fingerprint(
    model: str, layout_description: Mapping[str, object], host_slice: tuple[int, int]
) -> bytes:
    """16 bytes naming what a host block's bytes mean."""
    what = {"model": model, "layout": dict(layout_description), "slice": list(host_slice)}
    return hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=16).digest()


def hash_digest(block_hash: int | bytes) -> bytes:
    """16 bytes naming a block hash (ints and bytes never collide). An int is named in
    decimal up to 4300 digits, whatever limit the interpreter sets on ints written in
    decimal (4300 by default: the names the tier has always given), and in hex beyond, so
    that an int of any size has a name."""
    if isinstance(block_hash, bytes):
        raw = b"b" + block_hash
    elif block_hash.bit_length() <= 2048:  # under any limit an interpreter may set
        raw = b"i%d" % block_hash
    elif -_DECIMAL_NAMES < block_hash < _DECIMAL_NAMES:
        raw = b"i" + str(decimal.Decimal(block_hash)).encode()  # no digit limit there
    else:
        raw = b"x%x" % block_hash
    return hashlib.blake2b(raw, digest_size=16).digest()


_DECIMAL_NAMES = 10**4300


@functools.cache
def _xxh3() -> Callable[[bytes | memoryview], int]:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the remote tier needs xxhash: pip install 'asyncpin[remote]'") from exc
    checksum: Callable[[bytes | memoryview], int] = xxhash.xxh3_64_intdigest
    return checksum


def checksum(payload: bytes | memoryview) -> int:
    """The payload's checksum in a value's header: XXH3-64."""
    return _xxh3()(payload)


# 3: the checksum is a keyed BLAKE2b-64 of the fingerprint, the hash digest and the
# payload (``secret=``): a value only a holder of the secret can make.
KEYED_VERSION = 3


def seal(
    payload: bytes | memoryview, print_: bytes, digest: bytes, secret: bytes | None = None
) -> int:
    """The header's checksum field: XXH3-64 of the payload, or with ``secret`` a keyed
    BLAKE2b-64 of the fingerprint, the hash digest and the payload."""
    if secret is None:
        return checksum(payload)
    mac = hashlib.blake2b(print_, key=secret, digest_size=8)
    mac.update(digest)
    mac.update(payload)  # hashlib lets go of the GIL over a large buffer
    return int.from_bytes(mac.digest(), "little")


def encode_header(
    payload: bytes | memoryview, print_: bytes, digest: bytes, secret: bytes | None = None
) -> bytes:
    size = memoryview(payload).nbytes  # bytes, whatever the items
    version = VERSION if secret is None else KEYED_VERSION
    return _HEADER.pack(MAGIC, version, size, seal(payload, print_, digest, secret), print_, digest)


def _wrong_type(error: Exception | bytes, *, reworded: bool = False) -> bool:
    """Whether a reply's error is about its key alone: it holds another type of data
    (the reply starts with WRONGTYPE). ``reworded``: redis-py's pipeline error, which
    puts the command, with its key, before the reply: only a hint, since the key may
    hold the word too."""
    said = error if isinstance(error, bytes) else str(error).encode(errors="replace")
    if reworded:
        return re.search(rb"(?:^|[ ('\"])WRONGTYPE ", said) is not None
    return said.startswith(b"WRONGTYPE ")


def _header_fault(
    size: int,
    head: bytes | memoryview,
    *,
    nbytes: int,
    print_: bytes,
    digest: bytes,
    keyed: bool = False,
) -> tuple[str | None, int]:
    """Why a value of ``size`` bytes that starts with ``head`` is not data (None: its
    header is right), and the header's checksum of the payload. ``keyed``: only a keyed
    value (version 3) is data; otherwise only an unkeyed one (version 2)."""
    if size < HEADER_BYTES:
        return "truncated", 0
    magic, version, length, crc, their_print, their_digest = _HEADER.unpack_from(head)
    if magic != MAGIC:
        return "magic", crc
    if version != (KEYED_VERSION if keyed else VERSION):
        return "version", crc
    if length != nbytes:
        return "length", crc
    if size != HEADER_BYTES + length:
        return "truncated", crc
    if their_print != print_:
        return "foreign", crc
    if their_digest != digest:
        return "stale", crc
    return None, crc


def decode(
    value: bytes, *, nbytes: int, print_: bytes, digest: bytes, secret: bytes | None = None
) -> memoryview | str:
    """The payload of ``value``, or why it is not data (a short reason: ``truncated``,
    ``magic``, ``version``, ``length``, ``foreign``, ``stale``, ``checksum``). With
    ``secret``, only a value sealed with it is data."""
    fault, crc = _header_fault(
        len(value), value, nbytes=nbytes, print_=print_, digest=digest, keyed=secret is not None
    )
    if fault is not None:
        return fault
    payload = memoryview(value)[HEADER_BYTES:]
    if not _same_seal(seal(payload, print_, digest, secret), crc):
        return "checksum"
    return payload


def _same_seal(made: int, said: int) -> bool:
    """Compared in constant time (a seal's bytes are a MAC's with a secret)."""
    return hmac.compare_digest(made.to_bytes(8, "little"), said.to_bytes(8, "little"))


# -- the link between a tier and its remote store ------------------------------------------


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """The remote tier's counters (``TierStats.remote``)."""

    store: str
    degraded: bool
    #: Blocks looked up remotely (host misses), and found there with a valid value.
    lookups: int
    hit_blocks: int
    missed_blocks: int
    #: Values that were not data (truncated, corrupted, foreign, stale), by reason.
    invalid_blocks: int
    invalid_by_reason: dict[str, int]
    fetched_blocks: int
    fetched_bytes: int
    written_blocks: int
    written_bytes: int
    #: Blocks not written: the queue was full or the write cut short at close
    #: (dropped), the block left the host before its turn (skipped), the server failed
    #: it (failed).
    dropped_blocks: int
    skipped_blocks: int
    failed_writes: int
    errors: int
    queued_blocks: int


class _Part:
    """Payloads read and checked, with their hashes, handed from the reader to the
    copier. Its sender clears it once handed (or not): the payloads then live only
    where they are used."""

    __slots__ = ("hashes", "payloads")

    def __init__(self, hashes: Sequence[int | bytes], payloads: list[memoryview]) -> None:
        self.hashes = hashes
        self.payloads = payloads

    def clear(self) -> None:
        self.hashes, self.payloads = (), []


class HostSink(Protocol):
    """Where ``RemoteLink.fetch_direct`` reads its parts (numbered from 0, several read
    at once): a host block reserved for each value whose header is right, as it
    arrives; then, part after part in order, the valid ones made loadable."""

    def reserve(self, block_hash: int | bytes, k: int) -> memoryview | None:
        """A host block's memory for ``block_hash``'s payload (of part ``k``), reserved
        (not loadable), or None: it needs none (on the host already, or being stored by
        another) or there is no room (``commit`` tells which). Called on the event loop
        (never once a commit said stop)."""
        ...

    def room(self) -> int:
        """Host blocks a reservation could have now (free, or evictable)."""
        ...

    def commit(self, k: int, part: Sequence[int | bytes], valid: int) -> bool:
        """The leading ``valid`` values of part ``k`` are checked data: make the blocks
        reserved for them loadable, free every other block reserved for it. Returns
        whether to read on (every one of ``part`` is on the host now, as it was when the
        run was found). Called once per part, in order, after its read, whatever
        happened (after a stop, with ``valid`` 0)."""
        ...


class RemoteLink:
    """A tier's remote store: keys, the write-behind queue, fetches, counters.

    ``key_of(hash)`` names a block. ``submit(entries)`` queues host blocks to write
    (``entries``: hash, host block); a writer task (``run``) holds each block while a
    worker thread sends it (a store with direct writes) or copies it out, releases it,
    then writes the copies. ``fetch_into`` reads values and checks them."""

    def __init__(
        self,
        store: RemoteStore,
        *,
        print_: bytes,
        namespace: str,
        host_block_bytes: int,
        queue_blocks: int,
        batch_blocks: int = 16,
        write_batch_blocks: int | None = None,
        secret: bytes | None = None,
        read_depth: int | None = None,
    ) -> None:
        if not isinstance(store, RemoteStore):
            raise ConfigError(f"remote must be a RemoteStore (RedisStore, say), not {store!r}")
        if read_depth is None:
            read_depth = (
                CLUSTER_READ_DEPTH if getattr(store, "cluster", False) is True else READ_DEPTH
            )
        counts: list[int] = []
        for what, value, most in (
            ("remote_queue", queue_blocks, None),
            ("batch", batch_blocks, None),
            ("write_batch", 1 if write_batch_blocks is None else write_batch_blocks, None),
            ("remote_read_depth", read_depth, MAX_READ_DEPTH),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{what} must be an int >= 1, got {shown(value)}")
            count = int.__index__(value)  # a plain int, whatever a subclass says it is
            if count < 1:
                raise ConfigError(f"{what} must be an int >= 1, got {shown(value)}")
            if most is not None and count > most:
                raise ConfigError(f"{what} must be at most {most}, got {shown(value)}")
            counts.append(count)
        queue_blocks, batch_blocks, write_batch, read_depth = counts
        if write_batch_blocks is not None:
            write_batch_blocks = write_batch
        if not isinstance(namespace, str) or not namespace:
            raise ConfigError(f"namespace must be a non-empty str, got {shown(namespace)}")
        _xxh3()  # the values' checksum: its library now, not at the first write
        if secret is not None and not (
            isinstance(secret, bytes | bytearray) and 16 <= len(secret) <= 64
        ):
            raise ConfigError("remote_secret must be 16 to 64 bytes (bytes), or None")
        # The key of the values' seal (never logged, never in repr).
        self._secret = None if secret is None else bytes(secret)
        self.store = store
        self.print_ = print_
        self._prefix = f"{namespace}:{print_.hex()}:"
        self.nbytes = host_block_bytes
        self.batch = batch_blocks  # blocks a fetch's pipeline reads
        # Blocks a write's pipeline sends (bench/RESULTS.md#remote, 2 MiB blocks on the
        # dev machine): sent from the host blocks, 2.30-2.39 GB/s in pipelines of 16,
        # 1.75-2.07 in pipelines of 4; copied out first, 0.73-1.03 GB/s in pipelines of
        # 4, 0.45-0.50 in pipelines of 16 (each copy a new 2 MiB buffer).
        if write_batch_blocks is None:
            write_batch_blocks = 16 if self.direct_writes else 4
        self.write_batch = write_batch_blocks
        self.capacity = queue_blocks
        self._send, self._receive = anyio.create_memory_object_stream[tuple[int | bytes, int]](
            queue_blocks
        )
        self.degraded = False
        self._finished = anyio.Event()
        # Worker threads of their own (the writer's copies; the fetches' checks): the
        # application's busy pool never stalls them.
        self._limiter = anyio.CapacityLimiter(WRITERS)
        # A direct fetch's parts read at once, each on a connection of its own.
        self.read_depth = read_depth
        self.read_limiter = anyio.CapacityLimiter(read_depth)
        self.copy_limiter = anyio.CapacityLimiter(1)  # fetched values into host blocks
        # Blocks queued and not yet written (or failed): ``idle`` waits for none.
        self._pending = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "lookups",
                "hit_blocks",
                "missed_blocks",
                "fetched_blocks",
                "fetched_bytes",
                "written_blocks",
                "written_bytes",
                "dropped_blocks",
                "skipped_blocks",
                "failed_writes",
                "errors",
            ),
            0,
        )
        self._invalid: dict[str, int] = {}
        self.running = False

    def key_of(self, block_hash: int | bytes) -> str:
        return self._prefix + hash_digest(block_hash).hex()

    # -- health -------------------------------------------------------------------------

    def _failed(self, error: RemoteError, what: str) -> None:
        self._counts["errors"] += 1
        if not self.degraded:
            _log.warning("tier.remote_degraded", store=repr(self.store), op=what, error=str(error))
        self.degraded = True

    def _ok(self, since: int) -> None:
        """An operation that began when ``errors`` was ``since`` succeeded: the tier is
        no longer degraded, unless an operation failed after this one began (whatever
        order the event loop runs the two in, when they end together)."""
        if self._counts["errors"] != since:
            return
        if self.degraded:
            _log.info("tier.remote_recovered", store=repr(self.store))
        self.degraded = False

    # -- writes -------------------------------------------------------------------------

    def submit(self, entries: Sequence[tuple[int | bytes, int]]) -> None:
        """Queue blocks to write (hash, host block); those the queue cannot take are
        dropped and counted. Never blocks, and holds nothing: a queued block may still be
        evicted (then it is skipped: see ``run``)."""
        for block_hash, block in entries:
            if not self.running:
                self._counts["dropped_blocks"] += 1
                continue
            try:
                self._send.send_nowait((block_hash, block))
            except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._counts["dropped_blocks"] += 1
                continue
            if not self._pending:
                self._idle = anyio.Event()
            self._pending += 1

    async def run(
        self,
        read_block: Callable[[int], memoryview],
        hold: Callable[[int | bytes, int], bool],
        release: Callable[[int | bytes, int], None],
        *,
        task_status: Any,
    ) -> None:
        """The writers (``WRITERS`` at once, taking turns at the queue): batches of
        queued blocks, each held (``hold(hash, block)``: False if the block no longer
        holds that hash, evicted or removed meanwhile: skipped) only while a worker
        thread reads it: sends it to the store (``direct_writes``: one pipelined write
        from the host blocks themselves), or copies it out for one pipelined write of
        the copies. When it ends (the tier's close, or a failure), what is still queued
        is dropped and counted."""
        self.running = True
        task_status.started()

        # One writer at a time waits at the queue and takes its batch: the blocks queued
        # next, in order (two waiting at once were each handed a block by one submit,
        # and which ran first took the rest: batches hung on the loop's wake order).
        turn = anyio.Lock()

        async def writer() -> None:
            while True:
                async with turn:
                    try:
                        batch = [await self._receive.receive()]
                    except anyio.EndOfStream:
                        return
                    while len(batch) < self.write_batch:
                        try:
                            batch.append(self._receive.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                try:
                    await self._write(batch, read_block, hold, release)
                except Exception as exc:  # never the writer's end (counted as dropped)
                    _log.error("tier.remote_writer_failed", error=repr(exc))

        try:
            async with anyio.create_task_group() as tg:
                for _ in range(WRITERS):
                    tg.start_soon(writer)
        finally:
            self.running = False
            while True:
                try:
                    self._receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                    break
                self._counts["dropped_blocks"] += 1
                self._settled(1)
            self._receive.close()
            self._finished.set()

    async def _write(
        self,
        batch: list[tuple[int | bytes, int]],
        read_block: Callable[[int], memoryview],
        hold: Callable[[int | bytes, int], bool],
        release: Callable[[int | bytes, int], None],
    ) -> None:
        """One pipelined write of ``batch``'s blocks that still hold their hashes. On a
        store with direct writes, a worker thread makes each header (the checksum) and
        sends the header and the host block itself (``writefrom``); otherwise it copies
        each block out after its header, and the copies go through ``put``. The blocks
        are released once the thread is over, however the caller is cancelled."""
        import anyio.from_thread

        since = self._counts["errors"]
        held = [(h, block) for h, block in batch if hold(h, block)]
        self._counts["skipped_blocks"] += len(batch) - len(held)
        direct = self.direct_writes

        def values() -> list[tuple[str, Sequence[bytes | memoryview]]]:
            items: list[tuple[str, Sequence[bytes | memoryview]]] = []
            import numpy as np  # the host blocks are read through torch's .numpy()

            for block_hash, block in held:
                payload = read_block(block)
                key = self.key_of(block_hash)
                if direct:  # the header made by ``prepare``, just before its value goes
                    items.append((key, (memoryview(bytearray(HEADER_BYTES)), payload)))
                    continue
                # One copy: the host block into the value, after its header. NumPy's copy
                # lets go of the GIL; a memoryview's slice assignment holds it.
                value = memoryview(bytearray(HEADER_BYTES + self.nbytes))
                np.copyto(
                    np.frombuffer(value[HEADER_BYTES:], dtype=np.uint8),
                    np.frombuffer(payload, dtype=np.uint8),
                )
                digest = hash_digest(block_hash)
                value[:HEADER_BYTES] = encode_header(
                    value[HEADER_BYTES:], self.print_, digest, self._secret
                )
                items.append((key, (value,)))
            return items

        def send() -> list[str | None]:
            writefrom: Callable[..., list[str | None]] = cast(Any, self.store).writefrom
            items = values()

            def prepare(i: int) -> None:  # the checksum of one block while the last goes
                header, payload = items[i][1]
                digest = hash_digest(held[i][0])
                cast(memoryview, header)[:] = encode_header(
                    payload, self.print_, digest, self._secret
                )

            return writefrom(
                items, check_cancelled=anyio.from_thread.check_cancelled, prepare=prepare
            )

        counted = False
        try:
            refused: list[str] = []
            try:
                if direct:
                    said = await _thread_to_the_end(send, self._limiter)
                    refused = [text for text in said if text is not None]
                else:
                    items = await _thread_to_the_end(values, self._limiter)
            finally:
                for h, block in held:
                    release(h, block)
            if not direct:
                await self.store.put(items)
            if refused:  # the server's own refusal (out of memory, say): those keys only
                self._failed(RemoteError(f"SET on {self.store!r} failed: {refused[0]}"), "put")
            else:
                self._ok(since)
            self._counts["failed_writes"] += len(refused)
            self._counts["written_blocks"] += len(held) - len(refused)
            self._counts["written_bytes"] += (len(held) - len(refused)) * self.nbytes
            counted = True
        except Exception as exc:
            self._failed(_remote_error(exc, self.store), "put")
            self._counts["failed_writes"] += len(held)
            counted = True
        finally:
            if not counted:  # cut short (the tier's close at its deadline): maybe written
                self._counts["dropped_blocks"] += len(held)
            self._settled(len(batch))

    @property
    def direct_writes(self) -> bool:
        """Whether writes go straight from host blocks (``writefrom``): the store has it
        and it is on."""
        return callable(getattr(self.store, "writefrom", None)) and bool(
            getattr(self.store, "direct_writes", False)
        )

    def _settled(self, n: int) -> None:
        self._pending -= n
        if not self._pending:
            self._idle.set()

    async def idle(self) -> None:
        """Returns once every block queued so far is written (or failed, or dropped)."""
        await self._idle.wait()

    async def flush(self, deadline_s: float) -> None:
        """Stop taking blocks; give the writer ``deadline_s`` to write what is queued
        (what is left is dropped and counted when the writer is cancelled)."""
        self._send.close()
        with anyio.move_on_after(deadline_s):
            await self._finished.wait()

    # -- reads --------------------------------------------------------------------------

    async def exists(self, hashes: Sequence[int | bytes]) -> int:
        """How many leading ``hashes`` have a value (not checked) on the remote store."""
        if not hashes:
            return 0
        since = self._counts["errors"]
        try:
            found = _answers(
                await self.store.exists([self.key_of(h) for h in hashes]),
                len(hashes),
                self.store,
                "exists",
                (object,),
            )
            found = [bool(item) for item in found]
        except Exception as exc:
            self._failed(_remote_error(exc, self.store), "exists")
            return 0
        self._ok(since)
        n = 0
        while n < len(found) and found[n]:
            n += 1
        return n

    async def fetch_into(
        self,
        hashes: Sequence[int | bytes],
        into: Callable[[Sequence[int | bytes], list[memoryview]], Awaitable[bool]],
    ) -> int:
        """The checked payloads of the leading ``hashes`` found valid (a miss, an error
        or an invalid value ends the run), read in pipelines of ``batch`` blocks, each
        bounded by the store's timeout, and handed to ``into`` (with their hashes) as
        they come, while the next pipeline is read and checked: a read overlaps
        the previous part's copy, and at most three parts are in memory. ``into`` returns
        whether to go on (False: the run is broken, read no more). Returns the blocks
        handed over. An exception of ``into`` (or else of the reader) ends the fetch and
        is raised as itself; blocks never asked of the server are not counted."""
        asked = found = 0
        send, receive = anyio.create_memory_object_stream[_Part](1)
        reader_error: list[Exception] = []

        async def read() -> None:
            nonlocal asked, found
            part: Sequence[int | bytes] = ()
            got: list[memoryview] = []
            async with send:
                try:
                    for lo in range(0, len(hashes), self.batch):
                        part = hashes[lo : lo + self.batch]
                        asked += len(part)
                        got = await self._fetch_part(part)
                        found += len(got)
                        if got:
                            item = _Part(part[: len(got)], got)
                            try:
                                await send.send(item)
                            except BaseException:
                                # Cancelled in send(), the item stays in its frame,
                                # which the cancellation's traceback keeps.
                                item.clear()
                                raise
                        if len(got) < len(part):
                            break
                except Exception as exc:
                    reader_error.append(exc)
                finally:  # a traceback that keeps this frame keeps no payload
                    part, got = (), []

        handed = 0
        into_error: Exception | None = None
        try:
            async with anyio.create_task_group() as tg, receive:
                tg.start_soon(read)
                try:
                    async for item in receive:
                        part, payloads = item.hashes, item.payloads
                        item.clear()
                        count = len(payloads)
                        try:
                            go_on = await into(part, payloads)
                        finally:  # not kept alive by a traceback that keeps this frame
                            del part, payloads
                        handed += count
                        if not go_on:
                            tg.cancel_scope.cancel()
                            break
                except Exception as exc:
                    into_error = exc
                    tg.cancel_scope.cancel()
            error = into_error or (reader_error[0] if reader_error else None)
            if error is not None:
                if into_error is not None and reader_error:
                    into_error.__context__ = reader_error[0]
                try:
                    raise error
                finally:  # the frame holds no exception: no cycle keeps payloads alive
                    error = into_error = None
                    reader_error.clear()
        finally:  # a cancelled fetch counts what it asked for and found
            self._counts["lookups"] += asked
            self._counts["hit_blocks"] += found
            self._counts["missed_blocks"] += asked - found
        return handed

    async def _fetch_part(self, hashes: Sequence[int | bytes]) -> list[memoryview]:
        since = self._counts["errors"]
        try:
            values = _answers(
                await self.store.get([self.key_of(h) for h in hashes]),
                len(hashes),
                self.store,
                "get",
                (bytes, bytearray, memoryview, type(None)),
            )
        except Exception as exc:
            self._failed(_remote_error(exc, self.store), "get")
            return []
        self._ok(since)

        def check() -> list[memoryview | str | None]:
            out: list[memoryview | str | None] = []
            for h, value in zip(hashes, values, strict=True):
                if value is None:
                    out.append(None)
                    break
                got = decode(
                    value,
                    nbytes=self.nbytes,
                    print_=self.print_,
                    digest=hash_digest(h),
                    secret=self._secret,
                )
                out.append(got)
                if isinstance(got, str):
                    break
            return out

        checked = await anyio.to_thread.run_sync(check, limiter=self.read_limiter)
        if checked and isinstance(checked[-1], str):
            reason = checked[-1]
            self._invalid[reason] = self._invalid.get(reason, 0) + 1
            _log.warning("tier.remote_invalid_value", reason=reason, store=repr(self.store))
        return [p for p in checked if isinstance(p, memoryview)]

    @property
    def direct(self) -> bool:
        """Whether fetches read straight into host blocks (``fetch_direct``): the store
        has ``readinto`` and it is on."""
        return callable(getattr(self.store, "readinto", None)) and bool(
            getattr(self.store, "direct_reads", False)
        )

    async def fetch_direct(self, hashes: Sequence[int | bytes], sink: HostSink) -> int:
        """``fetch_into`` for a store that reads into memory (``readinto``): the hashes in
        parts of ``batch`` blocks, up to ``read_depth`` parts read ahead of the commits
        and at once (each in a worker thread on a connection of its own; the link's
        fetches share ``read_depth`` threads), each value's payload straight into
        the host block ``sink.reserve`` gives once its header is right (no copy on the
        way), its checksum checked there. The parts are committed in order
        (``sink.commit`` makes the valid leading ones loadable): a miss, an invalid
        value, no room, a failing server or a commit that says stop ends the run, and
        the parts read ahead of it are committed with nothing valid (their blocks
        freed; ``reserve`` gives them none once it is known, but one reserved before,
        for a value found after a gap in the run, may have evicted a block for
        nothing). A part read ahead takes no room the parts before it may still need
        (``sink.room()``, as far as this fetch's parts go): where that is short, it is
        read into spares and read again in its turn. Returns the blocks committed
        valid. However the caller is cancelled (an anyio scope, or asyncio's own), every
        read is over before its blocks are freed: a read stops at its next socket wait
        (the parts it had asked for count as looked up and missed)."""
        parts = [hashes[lo : lo + self.batch] for lo in range(0, len(hashes), self.batch)]
        valid = [0] * len(parts)
        began = [False] * len(parts)  # set by the part's reading thread: asked of the server
        done = [anyio.Event() for _ in parts]
        # Blocks each part may still ask to reserve; the parts read ahead that were let
        # reserve, and those that were not (read again in their turn).
        need = [len(part) for part in parts]
        admitted: set[int] = set()
        deferred: set[int] = set()
        committed = found = 0  # committed: the parts before the next to commit
        stopped = False  # the run ended: what was read ahead is dropped, not counted

        def reserve(block_hash: int | bytes, k: int) -> memoryview | None:  # on the loop
            if stopped or k in deferred:  # past the run's end, or read again in its turn
                return None
            if k > committed and k not in admitted:
                if sink.room() < sum(need[committed : k + 1]):
                    deferred.add(k)
                    return None
                admitted.add(k)
            need[k] -= 1
            return sink.reserve(block_hash, k)

        turn = [anyio.Event() for _ in parts]  # set once part k is committed

        async def read(k: int) -> None:
            try:
                if k >= self.read_depth:  # at most read_depth parts ahead of the commits
                    await turn[k - self.read_depth].wait()
                valid[k] = await self._read_part(parts[k], reserve, k, began)
            finally:
                done[k].set()

        try:
            async with anyio.create_task_group() as tg:
                # Part k is read once part k - read_depth is committed, when a token of
                # ``read_limiter`` is free (first come, first served; the limiter is
                # the link's, shared by the fetches under way).
                for k in range(len(parts)):
                    tg.start_soon(read, k)
                for k, part in enumerate(parts):
                    await done[k].wait()
                    if k in deferred:  # read ahead into spares, short of room: again now
                        deferred.discard(k)
                        need[k] = len(part)
                        valid[k] = await self._read_part(part, reserve, k, began)
                    committed = k + 1
                    go_on = sink.commit(k, part, valid[k])
                    turn[k].set()
                    found += valid[k]
                    if valid[k] < len(part) or not go_on:
                        stopped = True
                        tg.cancel_scope.cancel()  # the parts read ahead: stopped, freed below
                        break
        finally:
            for k in range(committed, len(parts)):  # read ahead of the end, or cancelled
                sink.commit(k, parts[k], 0)
            # What was looked up: the parts committed and, of a cancelled fetch, those
            # it asked the server for.
            asked = sum(
                len(part)
                for k, part in enumerate(parts)
                if k < committed or (began[k] and not stopped)
            )
            self._counts["lookups"] += asked
            self._counts["hit_blocks"] += found
            self._counts["missed_blocks"] += asked - found
        return found

    async def _read_part(
        self,
        part: Sequence[int | bytes],
        reserve: Callable[[int | bytes, int], memoryview | None],
        k: int,
        began: list[bool],
    ) -> int:
        """How many leading values of ``part`` (the ``k``-th of a fetch) were read into
        the host blocks ``reserve`` gave and are data; ``began[k]`` is set once its read
        is under way."""
        import anyio.from_thread

        since = self._counts["errors"]
        read_into: Callable[..., list[int | None]] = cast(Any, self.store).readinto
        digests = [hash_digest(h) for h in part]
        # What each value turned out to be: a fault's name, or its payload's memory.
        seen: list[str | tuple[memoryview, int]] = ["missing"] * len(part)
        ended = False  # a fault or no room: no block is reserved past it
        last = -1  # the last value asked for a body

        def body_for(i: int, size: int, head: memoryview) -> memoryview | None:
            nonlocal ended, last
            # A value before this one had no body to ask for (missing, empty, another
            # type of data, no longer than its header): the run ends there.
            ended = ended or i != last + 1
            last = i
            fault, crc = _header_fault(
                size,
                head,
                nbytes=self.nbytes,
                print_=self.print_,
                digest=digests[i],
                keyed=self._secret is not None,
            )
            if ended or fault is not None:
                ended = True
                seen[i] = fault or "after the end"
                return None
            block = anyio.from_thread.run_sync(reserve, part[i], k)
            if block is None:  # no block needed, or no room: checked in a spare all the same
                block = memoryview(bytearray(self.nbytes))
            seen[i] = (block, crc)
            return block

        def read() -> tuple[int, str | None, str | None]:
            """The leading valid values, the fault after them, and the failure that cut
            the read short (its leading values read before it stand)."""
            began[k] = True
            failed: str | None = None
            try:
                sizes = read_into(
                    [self.key_of(h) for h in part],
                    body_for,
                    head_bytes=HEADER_BYTES,
                    check_cancelled=anyio.from_thread.check_cancelled,
                )
            except RemoteReadCut as exc:  # a node down, say: the values before it stand
                sizes, failed = exc.sizes, str(exc)
            for i in range(len(part)):
                size = sizes[i] if i < len(sizes) else None
                got = seen[i]
                if size is None:  # missing, or not read: the read was cut there
                    return i, "missing", failed
                if got == "missing":  # no payload: too short
                    got = "truncated"
                if isinstance(got, str):
                    return i, got, failed
                block, crc = got
                if not _same_seal(seal(block, self.print_, digests[i], self._secret), crc):
                    return i, "checksum", failed
            return len(part), None, failed

        try:
            valid, fault, failed = await _thread_to_the_end(read, self.read_limiter)
        except Exception as exc:
            self._failed(_remote_error(exc, self.store), "get")
            return 0
        finally:  # no frame a traceback keeps names a host block's memory
            seen.clear()
        if failed is not None:
            self._failed(RemoteError(failed), "get")
        else:
            self._ok(since)
        if fault not in (None, "missing", "after the end"):
            assert fault is not None
            self._invalid[fault] = self._invalid.get(fault, 0) + 1
            _log.warning("tier.remote_invalid_value", reason=fault, store=repr(self.store))
        return valid

    def fetched(self, blocks: int) -> None:
        self._counts["fetched_blocks"] += blocks
        self._counts["fetched_bytes"] += blocks * self.nbytes

    def stats(self) -> RemoteStats:
        c = self._counts
        return RemoteStats(
            store=repr(self.store),
            degraded=self.degraded,
            lookups=c["lookups"],
            hit_blocks=c["hit_blocks"],
            missed_blocks=c["missed_blocks"],
            invalid_blocks=sum(self._invalid.values()),
            invalid_by_reason=dict(self._invalid),
            fetched_blocks=c["fetched_blocks"],
            fetched_bytes=c["fetched_bytes"],
            written_blocks=c["written_blocks"],
            written_bytes=c["written_bytes"],
            dropped_blocks=c["dropped_blocks"],
            skipped_blocks=c["skipped_blocks"],
            failed_writes=c["failed_writes"],
            errors=c["errors"],
            queued_blocks=self._send.statistics().current_buffer_used,
        )


def _answers(got: Any, n: int, store: object, call: str, kinds: tuple[type, ...]) -> list[Any]:
    """A store's answer to ``call`` of ``n`` keys: a list of ``n`` items of ``kinds``;
    else RemoteError (a store that breaks its contract fails as a failing server does)."""
    if not isinstance(got, list | tuple) or len(got) != n:
        what = f"{len(got)} items" if isinstance(got, list | tuple) else type(got).__name__
        raise RemoteError(f"{store!r}.{call}() of {n} keys returned {what}")
    for item in got:
        if not isinstance(item, kinds):
            raise RemoteError(f"{store!r}.{call}() returned an item of {type(item).__name__}")
    return list(got)


def _remote_error(error: Exception, store: RemoteStore) -> RemoteError:
    """A store's failure as a RemoteError (a store that breaks the contract by raising
    something else is failing all the same)."""
    if isinstance(error, RemoteError):
        return error
    return RemoteError(f"{store!r} raised {type(error).__name__}")


def _connect(conn: Any, deadline: float, check_cancelled: Callable[[], None]) -> None:
    """Connect ``conn`` (redis-py's connect and handshake, which no deadline of ours
    reaches: a server that drips its replies would hold it without end; a no-op when it
    is connected and has no stray bytes) in a thread of its own, while this one looks at
    the deadline and ``check_cancelled`` every ``_Wire.POLL_S``. Past them, the error is
    raised at once and ``conn`` given up: shut now if it has a socket, else by that
    thread once its connect returns (a TCP connect or a name lookup that no one answers
    is not cut short by a close; the thread touches nothing but ``conn``)."""
    failed: list[BaseException] = []
    over = threading.Event()
    given_up = threading.Event()

    def connect() -> None:
        try:
            if conn._sock is not None:
                try:
                    stale = conn.can_read(timeout=0)  # bytes nobody asked for: start over
                except Exception:
                    stale = True
                if stale:
                    conn.disconnect()
            conn.connect()
        except BaseException as exc:
            failed.append(exc)
        finally:
            over.set()
            if given_up.is_set():  # nobody waits for it: shut what it made
                with contextlib.suppress(Exception):
                    conn.disconnect()

    threading.Thread(target=connect, name="asyncpin-redis-connect", daemon=True).start()
    try:
        while not over.wait(_Wire.POLL_S):
            check_cancelled()
            if time.monotonic() > deadline:
                raise TimeoutError("connecting outlived 4 times the timeout")
    except BaseException:
        given_up.set()  # then ``over``: one of the two sides sees the other's flag
        conn.disconnect()  # its socket, if it has one (the thread's reads then fail)
        if not over.is_set():  # a socket it makes later is shut too, by a reaper

            def reap() -> None:
                while not over.wait(_Wire.POLL_S):
                    with contextlib.suppress(Exception):
                        conn.disconnect()

            threading.Thread(target=reap, name="asyncpin-redis-reap", daemon=True).start()
        raise
    if failed:
        conn.disconnect()
        try:
            raise failed[0]
        finally:  # no cycle through this frame keeps the caller's frames alive
            failed.clear()


class _CutShort(Exception):
    """Leaves a read's connections closed: replies are left unread on them."""


def _body_of(
    into: Callable[[int, int, memoryview], memoryview | None], i: int, head: memoryview, size: int
) -> memoryview | None:
    return into(i, size, head)


def _prepare_of(prepare: Callable[[int], None], todo: list[int], j: int) -> None:
    prepare(todo[j])


def _set_at(errors: list[str | None], todo: list[int], j: int, said: str) -> None:
    errors[todo[j]] = said


def _slot_map(reply: object, asked: str) -> list[tuple[str, int] | None]:
    """CLUSTER SLOTS's reply as each slot's node (host, port), checked: ranges within the
    16384 slots and, over all ranges, no more slots than that (a cluster names each
    once), each node's host a name or address (NULL, empty or '?' is ``asked``,
    the node asked: one with no endpoint it was given) and its port a port; anything
    else is a ConnectionError, found before any work in proportion to it."""
    if not isinstance(reply, list):
        raise ConnectionError("CLUSTER SLOTS gave no list")
    slots: list[tuple[str, int] | None] = [None] * _SLOTS
    taken = 0
    for entry in reply:
        if not (
            isinstance(entry, list)
            and len(entry) >= 3
            and all(type(v) is int for v in entry[:2])
            and isinstance(entry[2], list)
            and len(entry[2]) >= 2
        ):
            raise ConnectionError("CLUSTER SLOTS gave an entry of another shape")
        first, last, (host_field, port, *_) = entry[0], entry[1], entry[2]
        if not 0 <= first <= last < _SLOTS:
            raise ConnectionError(f"CLUSTER SLOTS gave slots {first}-{last}")
        taken += last - first + 1
        if taken > _SLOTS:
            raise ConnectionError("CLUSTER SLOTS gave more slots than a cluster has")
        if not (host_field is None or (isinstance(host_field, bytes) and len(host_field) <= 253)):
            raise ConnectionError("CLUSTER SLOTS gave a host that is no name")
        if type(port) is not int or not 0 < port < 65536:
            raise ConnectionError("CLUSTER SLOTS gave a port that is no port")
        host = "" if host_field is None else host_field.decode(errors="replace")
        if host in ("", "?"):
            host = asked
        if not _HOST.fullmatch(host):
            raise ConnectionError(f"CLUSTER SLOTS named a host {host[:60]!r}")
        slots[first : last + 1] = [(host, port)] * (last - first + 1)
    return slots


def _redirected(said: bytes) -> bool:
    """Whether an error reply sends the key to another node of a cluster."""
    return said.startswith((b"MOVED ", b"ASK "))


def _host_port(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "localhost", parts.port or 6379


def _with_host_port(url: str, host: str, port: int) -> str:
    """``url`` with another host and port (its user, password, path and query kept)."""
    parts = urllib.parse.urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return parts._replace(netloc=f"{user}@{where}" if user else where).geturl()


async def _thread_to_the_end(fn: Callable[[], T], limiter: anyio.CapacityLimiter) -> T:
    """``anyio.to_thread.run_sync(fn)`` that returns, or raises, only once ``fn`` has
    returned, however the caller is cancelled. ``run_sync`` waits for its thread through
    an anyio cancellation, but not through asyncio's own (``Task.cancel``,
    ``asyncio.wait_for``): it returns at once, the thread running on. A task group's
    exit waits for its task in both cases, and cancels it, which ``fn`` sees through
    ``anyio.from_thread.check_cancelled``. Use it where the thread touches memory that
    the caller frees once the call is over."""
    out: list[T] = []
    failed: list[Exception] = []

    async def run() -> None:
        try:
            out.append(await anyio.to_thread.run_sync(fn, limiter=limiter))
        except Exception as exc:  # raised below as itself, not in an exception group
            # Without the thread's traceback: anyio's future holds the exception, whose
            # traceback holds the frames that hold the future (and what ``fn`` used).
            failed.append(exc.with_traceback(None))
        except BaseException as exc:
            # A cancellation raised in the thread (``check_cancelled``) goes on as
            # itself, but without the thread's frames, for the same reason.
            raise exc.with_traceback(None) from None

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
    if failed:
        try:
            raise failed[0]
        finally:
            failed.clear()
    return out[0]
