"""Faults on a real Redis server while two clients store and restore through the remote tier.

Two clients (two managers, each with its own device arrays and its own
``KVTier(remote=RedisStore(...))``, the same model and keys) run a seeded workload in one
event loop: each stores new prompts (chains of block hashes whose device bytes are a known
function of the hash) and restores prompts either of them stored, checking every restored
block's bytes. Meanwhile a driver applies, in order, synchronised on the clients' progress:
normal, kill, restart (empty), pause (SIGSTOP), resume, full (``noeviction``), evicting
(``allkeys-lru``), normal, values damaged behind the clients' backs (a flipped byte, a
truncated value, a foreign value, another model's value, another block's value), normal.

Invariants, whatever the timing: no wrong byte ever reaches a device block, and no restore
writes past what it returns; every restore and lookup returns within a bound set by the
store's timeout; the tiers become degraded while the server is down or paused and recover
after; every damaged value is detected, by reason; both tiers close within their flush
deadline with nothing queued and every host block free again. Hit counts depend on timing
and are reported, not asserted (beyond "some")."""

from __future__ import annotations

import functools
import hashlib
import json
import random
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncpin import KVLayout, OffloadManager
from asyncpin.testing import FakeBackend
from asyncpin.tier import KVTier, RedisStore
from asyncpin.tier.remote import (
    HEADER_BYTES,
    RemoteStats,
    encode_header,
    fingerprint,
    hash_digest,
)
from tests.redis_servers import RedisCluster, RedisServer, Reply

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

T = TypeVar("T")

MODEL = "fault-model"
BLOCKS, HOST_BLOCKS = 32, 12  # device blocks, host blocks of each client
PROMPT = 4  # blocks a prompt: a shared first block, then three of its own
STAGE = list(range(0, PROMPT))  # device blocks a store copies from
TARGET = list(range(8, 8 + PROMPT))  # device blocks a restore copies into
POISON = 0xA5  # what a target block holds before a restore
TIMEOUT_S = 0.3  # the store's timeout: a call is bounded by 4 times it
CALL_BOUND_S = 4 * TIMEOUT_S + 1.0  # a restore or lookup, with room for a busy loop
FLUSH_S = 1.0
TEST_BOUND_S = 60
PHASE_OPS = 12  # operations each client does in a phase before the driver moves on
WAIT_S = 15  # the longest the driver waits for a phase's condition


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # redis-py's client is asyncio's


def make_layout() -> KVLayout:
    kv = [torch.zeros(2, BLOCKS, 8, 4, 32, dtype=torch.float16) for _ in range(2)]
    return KVLayout.from_tensors(kv, block_dim=1)  # 4 arrays of 2 KiB a block: 8 KiB a block


def expected(block_hash: int, array: int, nbytes: int) -> torch.Tensor:
    """The bytes of array ``array`` of the block stored under ``block_hash``."""
    data = hashlib.shake_128(b"%d:%d" % (block_hash, array)).digest(nbytes)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def chain(parent: int, *parts: object) -> int:
    raw = repr((parent, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 1


SHARED = [chain(0, "system", g) for g in range(3)]  # first blocks that prompts share


def prompt_hashes(client: int, j: int) -> list[int]:
    hashes = [SHARED[j % len(SHARED)]]
    for k in range(1, PROMPT):
        hashes.append(chain(hashes[-1], client, j, k))
    return hashes


@dataclass
class Probe:
    """A restore the driver asks a client for (after it forgot ``hashes`` on its host)."""

    hashes: list[int]
    done: anyio.Event = field(default_factory=anyio.Event)
    restored: int = -1


@dataclass
class Client:
    index: int
    tier: KVTier
    layout: KVLayout
    rng: random.Random
    probes: MemoryObjectReceiveStream[Probe]
    leaving: Leaving
    ops: int = 0
    stores: int = 0
    restores: int = 0
    lookups: int = 0
    restored_blocks: int = 0
    checked_bytes: int = 0
    wrong_bytes: int = 0
    clobbered_bytes: int = 0  # bytes a restore changed past the blocks it returned
    slowest_call_s: float = 0.0
    slowest_in: str = ""  # the phase the slowest call ended in
    ended_by: str = ""  # what ended the client's operations early (a traceback)
    phase: Callable[[], str] = lambda: ""

    @property
    def remote(self) -> RemoteStats:
        stats = self.tier.stats().remote
        assert stats is not None
        return stats


@dataclass
class Shared:
    published: list[tuple[int, list[int]]] = field(default_factory=list)  # (owner, hashes)
    stop: anyio.Event = field(default_factory=anyio.Event)
    tick: anyio.Event = field(default_factory=anyio.Event)

    def progressed(self) -> None:
        """A client did an operation: wake whoever waits for progress."""
        self.tick.set()
        self.tick = anyio.Event()

    async def next_operation(self) -> None:
        await self.tick.wait()


def fill(layout: KVLayout, ids: list[int], hashes: list[int]) -> None:
    for a, raw in enumerate(layout.byte_arrays()):
        for i, h in zip(ids, hashes, strict=True):
            raw[i] = expected(h, a, raw.shape[1])


def poison(layout: KVLayout, ids: list[int]) -> None:
    for raw in layout.byte_arrays():
        raw[ids] = POISON


def check(client: Client, hashes: list[int], n: int) -> None:
    """Count the wrong bytes of the ``n`` blocks restored, and any byte written past them."""
    for a, raw in enumerate(client.layout.byte_arrays()):
        for i, h in zip(TARGET[:n], hashes[:n], strict=True):
            client.wrong_bytes += int((raw[i] != expected(h, a, raw.shape[1])).sum())
            client.checked_bytes += raw.shape[1]
        for i in TARGET[n : len(hashes)]:
            client.clobbered_bytes += int((raw[i] != POISON).sum())


async def timed(client: Client, call: Callable[[], Awaitable[T]]) -> T:
    """``await call()``, the slowest such call kept."""
    start = anyio.current_time()
    result = await call()
    took = anyio.current_time() - start
    if took > client.slowest_call_s:
        client.slowest_call_s, client.slowest_in = took, client.phase()
    return result


async def restore(client: Client, hashes: list[int]) -> int:
    poison(client.layout, TARGET)
    n = await timed(client, functools.partial(client.tier.restore, hashes, TARGET[: len(hashes)]))
    assert 0 <= n <= len(hashes)
    client.restores += 1
    client.restored_blocks += n
    check(client, hashes, n)
    return n


async def run_client(client: Client, shared: Shared) -> None:
    """:func:`operate`, with whatever ends it early kept in ``client.ended_by``: a task
    of a task group that ends with a cancellation no scope of ours made cancels the
    group's body (the driver) without an error, so the test says what it was."""
    try:
        await operate(client, shared)
    except BaseException as exc:
        if not shared.stop.is_set():
            client.ended_by = "".join(traceback.format_exception(exc))
        raise


async def operate(client: Client, shared: Shared) -> None:
    """Store a new prompt or restore one (the client's own or the other's), one operation
    at a time; forget the host's blocks now and then, so that restores reach the server;
    serve the driver's probes first."""
    j = 0
    while not shared.stop.is_set():
        try:
            probe = client.probes.receive_nowait()
        except anyio.WouldBlock:
            pass
        else:
            client.tier.remove(probe.hashes)
            probe.restored = await restore(client, probe.hashes)
            probe.done.set()
            continue
        roll = client.rng.random()
        if roll < 0.4 or not shared.published:
            hashes = prompt_hashes(client.index, j)
            j += 1
            fill(client.layout, STAGE, hashes)
            await client.tier.store(hashes, STAGE).transfer
            shared.published.append((client.index, hashes))
            client.stores += 1
        elif roll < 0.9:
            # Recent prompts mostly: the older ones the host (and the server) may have lost.
            recent = shared.published[-30:]
            _, hashes = recent[client.rng.randrange(len(recent))]
            await restore(client, hashes)
        else:
            _, hashes = shared.published[client.rng.randrange(len(shared.published))]
            found = await timed(client, functools.partial(client.tier.lookup_remote, hashes))
            assert 0 <= found <= len(hashes)
            client.lookups += 1
        if client.rng.random() < 0.15:
            client.tier.clear()
        client.ops += 1
        shared.progressed()
        await anyio.lowlevel.checkpoint()


@dataclass
class Leaving:
    """How long leaving a tier took (its writer flushed, its store closed)."""

    seconds: float = -1.0


@asynccontextmanager
async def client_tier(
    target: Target, keyspace: str
) -> AsyncIterator[tuple[KVTier, KVLayout, Leaving]]:
    layout = make_layout()
    store = RedisStore(target.url, cluster=target.cluster, timeout_s=TIMEOUT_S)
    leaving = Leaving()
    async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
        await mgr.pinned
        tier = KVTier(
            mgr,
            remote=store,
            model=MODEL,
            namespace=keyspace.rstrip(":"),
            remote_queue=64,
            flush_timeout_s=FLUSH_S,
        )
        async with tier:
            try:
                yield tier, layout, leaving
            finally:  # set whatever ends the body (an unbound name hid the real error)
                start = anyio.current_time()
        leaving.seconds = anyio.current_time() - start


class Target:
    """The server under fault: a single node. Commands behind the clients' backs go to the
    node that holds the key."""

    cluster = False

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def victim(self) -> RedisServer:
        """The node killed and paused."""
        return self.server

    @property
    def nodes(self) -> list[RedisServer]:
        return [self.server]

    def node_of(self, key: str) -> RedisServer:
        return self.server

    def command(self, key: str, *args: str | bytes | int) -> Reply:
        """A command on ``key`` (the command's first argument after ``args[0]``)."""
        return self.node_of(key).command(args[0], key, *args[1:])

    async def healed(self) -> None:
        """After a node is back: the server serves every key again."""

    def limit(self, headroom: int, policy: str) -> None:
        for node in self.nodes:
            node.set_maxmemory(node.used_memory() + headroom, policy)

    def unlimit(self) -> None:
        for node in self.nodes:
            node.set_maxmemory(0, "noeviction")


class ClusterTarget(Target):
    """A three-node cluster: one node (the first's) is killed and paused."""

    cluster = True

    def __init__(self, cluster: RedisCluster) -> None:
        self._cluster = cluster
        super().__init__(cluster.nodes[0])

    @property
    def url(self) -> str:
        return self._cluster.url

    @property
    def victim(self) -> RedisServer:
        return self._cluster.nodes[1]

    @property
    def nodes(self) -> list[RedisServer]:
        return list(self._cluster.nodes)

    def node_of(self, key: str) -> RedisServer:
        return self._cluster.node_for_slot(self._cluster.keyslot(key))

    async def healed(self) -> None:
        await anyio.to_thread.run_sync(self._cluster.wait_ok)


class Driver:
    def __init__(self, target: Target, clients: list[Client], shared: Shared) -> None:
        self.target = target
        self.shared = shared
        self.phase = "start"
        for client in clients:
            client.phase = lambda: self.phase
        self.clients = clients
        self.log: list[dict[str, Any]] = []
        self.seen: dict[str, Any] = {}

    async def until(self, what: str, condition: Callable[[], bool]) -> None:
        """Wait (bounded) until ``condition()``, checking as the clients make progress."""
        with anyio.fail_after(WAIT_S):
            while not condition():
                await self.shared.next_operation()
        self.log.append({"phase": what, "t": anyio.current_time(), **snapshot(self.clients)})

    async def progress(self, what: str, extra: Callable[[], bool] = lambda: True) -> None:
        """Every client does ``PHASE_OPS`` operations (and ``extra()`` holds)."""
        start = [c.ops for c in self.clients]
        self.phase = what
        await self.until(
            what,
            lambda: (
                all(c.ops - s >= PHASE_OPS for c, s in zip(self.clients, start, strict=True))
                and extra()
            ),
        )

    def every(self, test: Callable[[Client], bool]) -> Callable[[], bool]:
        return lambda: all(test(c) for c in self.clients)


def snapshot(clients: list[Client]) -> dict[str, Any]:
    """The counters a phase ends with (for the summary)."""
    return {
        "ops": [c.ops for c in clients],
        "degraded": [c.remote.degraded for c in clients],
        "errors": [c.remote.errors for c in clients],
        "hit_blocks": [c.remote.hit_blocks for c in clients],
        "failed_writes": [c.remote.failed_writes for c in clients],
        "invalid": [c.remote.invalid_by_reason for c in clients],
    }


async def damage(
    driver: Driver, shared: Shared, sends: list[MemoryObjectSendStream[Probe]]
) -> dict[str, int]:
    """Damage one value of each of five recent prompts (each written in full, and never
    written again), then have the client that did not store the prompt forget it and
    restore it: the damaged block (the third) and what follows never come back."""
    target, clients = driver.target, driver.clients
    link = clients[0].tier.remote
    assert link is not None
    used: set[int] = set()

    def written(hashes: list[int]) -> bool:
        return all(target.command(link.key_of(h), "EXISTS") == 1 for h in hashes)

    async def a_written_prompt() -> tuple[int, list[int]]:
        def find() -> tuple[int, list[int]] | None:
            for owner, hashes in reversed(shared.published[-40:]):
                if hashes[1] not in used and written(hashes):
                    return owner, hashes
            return None

        with anyio.fail_after(WAIT_S):
            while (found := find()) is None:
                await shared.next_operation()
        used.add(found[1][1])
        return found

    wanted: dict[str, int] = {}
    for kind in ("checksum", "truncated", "magic", "foreign", "stale"):
        owner, hashes = await a_written_prompt()
        key = link.key_of(hashes[2])
        value = target.command(key, "GET")
        assert isinstance(value, bytes)
        if kind == "checksum":  # one byte of the payload, flipped in place
            at = len(value) - 100
            target.command(key, "SETRANGE", at, bytes([value[at] ^ 0x01]))
        elif kind == "truncated":  # the last byte gone
            target.command(key, "SET", value[:-1])
        elif kind == "magic":  # a value that is not one of ours at all
            target.command(key, "SET", b"someone else's value " * 8)
        elif kind == "foreign":  # another model's value for this block, well formed
            payload = value[HEADER_BYTES:]
            other = fingerprint("another-model", {"arrays": 4}, (0, 1))
            header = encode_header(payload, other, hash_digest(hashes[2]))
            target.command(key, "SET", header + payload)
        else:  # the next block's value under this key
            next_value = target.command(link.key_of(hashes[3]), "GET")
            assert isinstance(next_value, bytes)
            target.command(key, "SET", next_value)
        probe = Probe(hashes)
        await sends[1 - owner].send(probe)
        with anyio.fail_after(WAIT_S):
            await probe.done.wait()
        assert probe.restored == 2, (kind, probe.restored)
        wanted[kind] = wanted.get(kind, 0) + 1
    driver.log.append({"phase": "damaged", **snapshot(clients)})
    return wanted


async def drive(
    driver: Driver, shared: Shared, sends: list[MemoryObjectSendStream[Probe]]
) -> dict[str, int]:
    """The phases, in order; each ends once every client did ``PHASE_OPS`` operations in
    it and its condition holds."""
    target, clients, every, seen = driver.target, driver.clients, driver.every, driver.seen
    try:
        await driver.progress("normal", every(lambda c: c.remote.written_blocks > 0))

        target.victim.kill()
        await driver.progress("killed", every(lambda c: c.remote.degraded))
        seen["degraded_when_killed"] = True

        target.victim.restart()  # empty
        await target.healed()
        await driver.progress("restarted", every(lambda c: not c.remote.degraded))
        seen["recovered_after_restart"] = True

        target.victim.pause()
        try:
            await driver.progress("paused", every(lambda c: c.remote.degraded))
            seen["degraded_when_paused"] = True
        finally:
            target.victim.resume()
        await target.healed()
        await driver.progress("resumed", every(lambda c: not c.remote.degraded))
        seen["recovered_after_resume"] = True

        failed = [c.remote.failed_writes for c in clients]
        target.limit(16 * 1024, "noeviction")
        await driver.progress(
            "full",
            lambda: all(c.remote.failed_writes > f for c, f in zip(clients, failed, strict=True)),
        )
        seen["writes_failed_when_full"] = True

        target.limit(256 * 1024, "allkeys-lru")
        written = [c.remote.written_blocks for c in clients]
        await driver.progress(
            "evicting",
            lambda: all(
                c.remote.written_blocks > w and not c.remote.degraded
                for c, w in zip(clients, written, strict=True)
            ),
        )
        seen["written_when_evicting"] = True

        target.unlimit()
        await driver.progress("normal again", every(lambda c: not c.remote.degraded))

        wanted = await damage(driver, shared, sends)

        hits = [c.remote.hit_blocks for c in clients]
        await driver.progress(
            "normal at the end",
            lambda: all(
                c.remote.hit_blocks > h and not c.remote.degraded
                for c, h in zip(clients, hits, strict=True)
            ),
        )
        return wanted
    finally:
        shared.stop.set()


@pytest.fixture(
    params=[
        "node",
        "cluster",
    ]
)
def target(request: pytest.FixtureRequest) -> Target:
    if request.param == "node":
        return Target(request.getfixturevalue("redis_server"))
    return ClusterTarget(request.getfixturevalue("redis_cluster"))


async def test_two_clients_through_kill_restart_pause_full_and_damage(
    target: Target, redis_keyspace: str, tmp_path: Path
) -> None:
    shared = Shared()
    sends: list[MemoryObjectSendStream[Probe]] = []
    clients: list[Client] = []
    start = anyio.current_time()
    with anyio.fail_after(TEST_BOUND_S):
        async with AsyncExitStack() as stack:
            for i in range(2):
                tier, layout, leaving = await stack.enter_async_context(
                    client_tier(target, redis_keyspace)
                )
                send, receive = anyio.create_memory_object_stream[Probe](4)
                sends.append(send)
                clients.append(Client(i, tier, layout, random.Random(1234 + i), receive, leaving))
            links = [c.tier.remote for c in clients]
            assert links[0] is not None and links[1] is not None
            assert links[0].key_of(1) == links[1].key_of(1)  # the same keys: shared prefixes

            driver = Driver(target, clients, shared)
            wanted: dict[str, int] | None = None
            async with anyio.create_task_group() as tasks:
                for client in clients:
                    tasks.start_soon(run_client, client, shared)
                wanted = await drive(driver, shared, sends)
        # Both tiers left (writers flushed, stores closed), then their managers.
    elapsed = anyio.current_time() - start
    # A rare CI failure: the drive ended by a cancellation and no error (the task group
    # cancels its body when a client's task ends with a cancellation); say what ended it.
    assert wanted is not None, "the drive was cancelled: " + " | ".join(
        f"client {c.index}: {c.ended_by or 'ran on'}" for c in clients
    )

    stats = [c.remote for c in clients]
    invalid: dict[str, int] = {}
    for s in stats:
        for reason, n in s.invalid_by_reason.items():
            invalid[reason] = invalid.get(reason, 0) + n
    summary = {
        "target": "cluster" if target.cluster else "node",
        "elapsed_s": round(elapsed, 2),
        "phases": [{**p, "t": round(p["t"] - start, 2)} if "t" in p else p for p in driver.log],
        "clients": [
            {
                "ops": c.ops,
                "stores": c.stores,
                "restores": c.restores,
                "lookups": c.lookups,
                "restored_blocks": c.restored_blocks,
                "checked_bytes": c.checked_bytes,
                "wrong_bytes": c.wrong_bytes,
                "clobbered_bytes": c.clobbered_bytes,
                "slowest_call_s": round(c.slowest_call_s, 3),
                "slowest_in": c.slowest_in,
                "leave_s": round(c.leaving.seconds, 3),
                "remote": {k: v for k, v in asdict(s).items() if k != "store"},
            }
            for c, s in zip(clients, stats, strict=True)
        ],
        "invalid_by_reason": invalid,
        "damaged": wanted,
    }
    text = json.dumps(summary, indent=1, sort_keys=True)
    (tmp_path / "remote_faults.json").write_text(text)
    print(text)

    for c, s in zip(clients, stats, strict=True):
        # Never a wrong byte, never a byte written past what a restore returned.
        assert c.wrong_bytes == 0 and c.clobbered_bytes == 0
        assert c.restored_blocks > 0 and c.checked_bytes > 0
        # Every restore and lookup bounded by the store's timeout.
        assert c.slowest_call_s < CALL_BOUND_S
        # Leaving: the flush deadline, then the store's close (bounded by it as well).
        assert 0 <= c.leaving.seconds < 2 * FLUSH_S + 0.5
        assert s.hit_blocks > 0 and s.hit_blocks + s.missed_blocks == s.lookups
        assert s.errors > 0 and s.failed_writes > 0 and not s.degraded
        assert s.queued_blocks == 0
        # Nothing held: every host block is free once the index forgets its blocks.
        c.tier.clear()
        assert c.tier.index.stats().free_blocks == HOST_BLOCKS
    # No value was invalid before the driver damaged some (a timed-out call never leaves a
    # reply behind for the next one); then every damaged value detected, for its reason.
    before = driver.log[: [p["phase"] for p in driver.log].index("damaged")]
    assert all(p["invalid"] == [{}, {}] for p in before), before
    for reason, n in wanted.items():
        assert invalid.get(reason, 0) >= n, (reason, invalid)
    assert set(invalid) <= set(wanted), invalid
    assert all(driver.seen.get(what) for what in SEEN), driver.seen


SEEN = (
    "degraded_when_killed",
    "recovered_after_restart",
    "degraded_when_paused",
    "recovered_after_resume",
    "writes_failed_when_full",
    "written_when_evicting",
)


# -- defects found by the fault runs (each failed before its fix) ---------------------------


class _BrokenPipeline:
    """A redis-py pipeline whose ``execute`` raises what redis-py 8.1's cluster pipeline
    raised in the fault run (a node killed, then restarted): not a RedisError."""

    def __getattr__(self, name: str) -> Callable[..., _BrokenPipeline]:
        return lambda *_, **__: self  # pipe.set(...), pipe.get(...): queued, nothing sent

    async def execute(self, **_: object) -> list[object]:
        raise AttributeError("'NoneType' object has no attribute 'writelines'")


def broken_store(url: str, monkeypatch: pytest.MonkeyPatch) -> RedisStore:
    """The asyncio client broken (fetches through it: the direct reads' own case is in
    tests/test_remote_direct.py)."""
    store = RedisStore(url, timeout_s=TIMEOUT_S, direct_reads=False)
    monkeypatch.setattr(store._client, "pipeline", lambda **_: _BrokenPipeline())
    return store


async def test_a_client_library_error_in_the_writer_is_a_failed_write(
    redis_server: RedisServer, redis_keyspace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write counts as failed, the tier is degraded, the body of the tier goes on
    (before the fix: the body was cancelled and leaving the tier raised the
    AttributeError, in an ExceptionGroup)."""
    store = broken_store(redis_server.url, monkeypatch)
    body_finished = False
    crashed: list[BaseException] = []
    with anyio.fail_after(10):
        try:
            async with OffloadManager.for_kv(
                make_layout(), HOST_BLOCKS, backend=FakeBackend()
            ) as mgr:
                await mgr.pinned
                async with KVTier(mgr, remote=store, namespace=redis_keyspace.rstrip(":")) as tier:
                    await tier.store([1], [0]).transfer
                    await tier.remote_written()
                    assert await tier.restore([1], [1]) == 1  # the host serves on
                    body_finished = True
        except BaseExceptionGroup as group:
            crashed.extend(group.exceptions)
    assert not crashed, crashed
    assert body_finished
    remote = tier.stats().remote
    assert remote is not None and remote.failed_writes == 1 and remote.degraded


async def test_a_client_library_error_in_a_fetch_is_a_miss(
    redis_server: RedisServer, redis_keyspace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """restore returns 0 (a counted miss, the tier degraded); before the fix it raised the
    AttributeError."""
    store = broken_store(redis_server.url, monkeypatch)
    with anyio.fail_after(10):
        async with OffloadManager.for_kv(make_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            async with KVTier(mgr, remote=store, namespace=redis_keyspace.rstrip(":")) as tier:
                try:
                    restored = await tier.restore([1, 2], [0, 1])
                except AttributeError as exc:
                    raise AssertionError(f"restore raised {exc!r}") from exc
                assert restored == 0
                remote = tier.stats().remote
                assert remote is not None and remote.missed_blocks == 2 and remote.degraded
