"""The KV tier: host blocks addressed by the engine's block hashes.

:class:`KVTier` puts a :class:`~asyncpin.tier.index.BlockIndex` in front of an open
manager with a KV layout: ``lookup`` how much of a prompt's prefix is on the host,
``store`` device blocks under their hashes, ``load`` hashes into device blocks. The
copies are the manager's :class:`~asyncpin.Transfer` handles; the bookkeeping is
synchronous and O(number of hashes), safe to call from an engine's scheduler step.
Without a GPU or in a process that moves no bytes, use the :class:`BlockIndex` alone and
hand its host block ids to the workers.

Importing this package imports no torch (the manager and the transfers are imported for
type checking only, ``block_ids`` by the call that checks device block ids), so
``asyncpin.tier.index`` runs in a process that cannot import it.
"""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream

from asyncpin._lifecycle import ManagerState
from asyncpin._text import shown
from asyncpin.errors import ConfigError, InvalidTransferError, TransferError
from asyncpin.stats import TierStats
from asyncpin.tier.index import (
    BlockEvent,
    BlockHash,
    BlockIndex,
    IndexStats,
    StorePlan,
    all_checked,
)
from asyncpin.tier.policies import POLICY_NAMES
from asyncpin.tier.remote import (
    RedisStore,
    RemoteError,
    RemoteLink,
    RemoteStore,
    _thread_to_the_end,
    fingerprint,
)

if TYPE_CHECKING:  # torch: a process with the index alone never imports it
    import torch

    from asyncpin.manager import OffloadManager
    from asyncpin.transfers import BlockIds, Method, Transfer


# The remote stores that a tier in use serves: a store serves one tier at a time (the
# tier closes it when it is left).
_STORES_IN_USE: weakref.WeakSet[Any] = weakref.WeakSet()
# The tier that serves each manager: its index hands out the manager's host blocks, so a
# second tier would hand out the same ones. A tier serves until it is left (``async
# with``) or dropped; then a new one may take the manager over.
_TIER_OF: weakref.WeakKeyDictionary[Any, weakref.ref[KVTier]] = weakref.WeakKeyDictionary()

__all__ = [
    "POLICY_NAMES",
    "BlockEvent",
    "BlockHash",
    "BlockIndex",
    "IndexStats",
    "KVTier",
    "LayerLoad",
    "LayerStore",
    "RedisStore",
    "RemoteError",
    "RemoteStore",
    "StorePlan",
    "TierStats",
    "TierStore",
]


@dataclass(frozen=True, slots=True)
class TierStore:
    """One ``KVTier.store``: the copy of the new blocks, and what the index decided
    (``plan.present``: already there; ``plan.skipped``: no block could be freed)."""

    transfer: Transfer
    plan: StorePlan

    @property
    def skipped(self) -> tuple[BlockHash, ...]:
        return self.plan.skipped


async def _every_one(transfers: Iterable[Transfer]) -> None:
    """Wait for every transfer, then raise the first failure (later groups may still be
    running when an earlier one fails)."""
    first: Exception | None = None
    for transfer in transfers:
        try:
            await transfer
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first


class LayerLoad:
    """One ``KVTier.load_layers``: a transfer per group of arrays, queued in order, so
    that the model can run layer 0 while later layers are still on their way.

    ``transfers[i]`` moves the arrays ``groups[i]``; on CUDA its ``event`` is recorded
    when that group is in place (``torch.cuda.current_stream().wait_event(...)`` before
    the layer runs). ``await load`` returns once every group is done, and raises the
    first failure."""

    __slots__ = ("groups", "transfers")

    def __init__(self, groups: tuple[range, ...], transfers: tuple[Transfer, ...]) -> None:
        self.groups = groups
        self.transfers = transfers

    def done(self) -> bool:
        return all(t.done() for t in self.transfers)

    async def wait(self) -> None:
        await _every_one(self.transfers)

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    def __repr__(self) -> str:
        done = sum(t.done() for t in self.transfers)
        return f"<LayerLoad {done}/{len(self.transfers)} groups done>"


class LayerStore:
    """One ``KVTier.store_layers``: the host blocks are given now (``plan``), and each
    group of arrays is copied when the caller says, as prefill writes that layer:
    ``store_group(i)`` queues group ``i``'s copy after the work on the caller's current
    stream. The blocks become loadable once every group is copied; a failed group, or
    ``abort()`` (the request went away), frees them once the copies queued are over.

    ``await store`` waits for every group's copy (raising the first failure); it raises
    RuntimeError, waiting for nothing, while a group is neither queued nor aborted.

    ``async with tier.store_layers(...) as store:`` aborts the store when the block ends
    with a group not queued (the body raised, was cancelled, or skipped one), so a
    request that goes away never holds its host blocks; a block that ends normally then
    waits for the copies."""

    def __init__(
        self,
        tier: KVTier,
        plan: StorePlan,
        gpu: list[int],
        groups: tuple[range, ...],
        method: Method,
    ) -> None:
        self.plan = plan
        self.groups = groups
        #: The copy of each group, None until queued.
        self.transfers: list[Transfer | None] = [None] * len(groups)
        from asyncpin.transfers import CheckedIds  # torch: see the module docstring

        # Checked once for every group's copy.
        self._gpu = CheckedIds(gpu, "gpu_block_ids", tier._num_blocks)
        self._host = CheckedIds(plan.host_blocks, "cpu_block_ids", tier.manager.num_host_blocks)
        self._tier, self._method = tier, method
        self._closed = False  # every group queued, or aborted: no more queued
        self._failed = False
        self._running = 0
        self._ended = False
        if not plan.hashes:  # nothing to copy: the plan is over at once (groups copy none)
            self._ended = True
            tier.index.end_store(plan, ok=True)

    @property
    def skipped(self) -> tuple[BlockHash, ...]:
        return self.plan.skipped

    def store_group(self, i: int) -> Transfer:
        """Queue group ``i``'s copy (once per group). Refused (nothing changed) off the
        event loop's thread, for a bad ``i``, for a group whose KV memory moved since
        the open (ConfigError), or while the caller's stream captures a CUDA graph
        (LifecycleError); a closed manager or a copy that cannot be queued aborts the
        store."""
        if self._closed:
            raise InvalidTransferError("this layer-wise store is complete or aborted")
        if (
            isinstance(i, bool)
            or not isinstance(i, int)
            or not 0 <= i < len(self.groups)
            or self.transfers[i] is not None
        ):
            raise InvalidTransferError(f"group {shown(i)} is not a group still to store")
        manager, group = self._tier.manager, self.groups[i]
        manager._life.check_loop_thread("store_group")
        if manager.state is ManagerState.OPEN:  # (a closed one aborts the store, below)
            # Refused, nothing changed, as off the thread: the group may go later.
            manager._check_submit("store", self._method, group, moves=bool(self._gpu))
        try:
            transfer = manager._submit(
                "store", self._gpu, self._host, self._method, group, checked=True
            )
        except BaseException:
            self.abort()
            raise
        self.transfers[i] = transfer
        self._running += 1
        if all(t is not None for t in self.transfers):
            self._closed = True
        transfer.add_done_callback(self._group_done)
        return transfer

    def abort(self) -> None:
        """Queue no more groups, and index none of the blocks: they are freed once the
        copies queued are over (every group queued too; nothing changes once the store
        has ended)."""
        if not self._ended:
            self._failed = True
        self._closed = True  # an ended (empty) store too: wait() has nothing to wait for
        self._maybe_end()

    def _group_done(self, transfer: Transfer) -> None:
        self._running -= 1
        self._failed |= transfer.error is not None
        self._maybe_end()

    def _maybe_end(self) -> None:
        if self._closed and not self._running and not self._ended:
            self._ended = True
            self._tier._end_store(self.plan, ok=not self._failed)

    async def wait(self) -> None:
        if not self._closed:
            raise RuntimeError("a group of this layer-wise store is not queued (or abort())")
        await _every_one([t for t in self.transfers if t is not None])

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    async def __aenter__(self) -> LayerStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._closed:  # a group not queued: the block ended early
            self.abort()
        if exc_type is None:
            await self.wait()


class _FetchSink:
    """Where a restore's direct fetch reads (a ``HostSink``): a host block reserved in the
    index for each value as it arrives, then, per part, the valid ones made loadable and
    kept from eviction (in ``held``, until the restore's load is over) and the rest
    freed. A block another restore is fetching meanwhile does not end the run: its end
    is waited for (``waits``) before the restore looks its run up again."""

    def __init__(
        self,
        tier: KVTier,
        remote: RemoteLink,
        held: list[tuple[list[BlockHash], list[int]]],
        removed: int,
        waits: list[tuple[BlockHash, anyio.Event]],
    ) -> None:
        self._index = tier.index
        self._fetching = tier._fetching
        self._rows: torch.Tensor | None = tier.manager.host_bytes()
        self._remote = remote
        self._held = held
        self._waits = waits
        self._removed = removed  # the index's removals when the run was found
        # Hashes another restore was fetching when this one read them (into spares).
        self._others: set[BlockHash] = set()
        # Reserved, by part, in order.
        self._parts: dict[int, list[tuple[BlockHash, StorePlan, anyio.Event]]] = {}

    def reserve(self, block_hash: BlockHash, k: int) -> memoryview | None:
        if self._rows is None:
            raise RuntimeError("the restore this fetch was for is over")
        plan = self._index.begin_store([block_hash])
        if not plan.hashes:  # on the host, being stored by another, or no room
            self._index.end_store(plan, ok=False)
            if block_hash in self._fetching:
                self._others.add(block_hash)
            return None
        fetched = self._fetching[block_hash] = anyio.Event()  # set once loadable or freed
        self._parts.setdefault(k, []).append((block_hash, plan, fetched))
        view: memoryview = self._rows[plan.host_blocks[0]].numpy().data
        return view

    def room(self) -> int:
        return self._index.room()

    def close(self) -> None:
        """The restore is over: the sink names the host memory no longer. (A cancelled
        restore's frames stay in reference cycles of asyncio's own until a collection;
        they must not keep the region mapped meanwhile.)"""
        self._rows = None

    def commit(self, k: int, part: Sequence[BlockHash], valid: int) -> bool:
        reserved = self._parts.pop(k, [])
        good = set(part[:valid])
        try:
            for h, plan, _ in reserved:
                self._index.end_store(plan, ok=h in good)  # not written back: it came from there
        finally:
            _fetched(self._fetching, [(h, e) for h, _, e in reserved])
        self._remote.fetched(sum(1 for h, _, _ in reserved if h in good))
        ready, whole = _ready_or_fetched(
            self._index, self._fetching, part[:valid], self._waits, self._others
        )
        self._held.append((ready, self._index.begin_load(ready, touch=False)))
        return whole and valid == len(part) and self._index.stats().removed_blocks == self._removed


def _fetched(
    fetching: dict[BlockHash, anyio.Event], ends: list[tuple[BlockHash, anyio.Event]]
) -> None:
    """Each fetch's end set, and its entry dropped if it is still its own (a hash removed
    while fetched may be reserved again by another restore meanwhile)."""
    for h, event in ends:
        if fetching.get(h) is event:
            del fetching[h]
        event.set()


def _ready_or_fetched(
    index: BlockIndex,
    fetching: dict[BlockHash, anyio.Event],
    hashes: Sequence[BlockHash],
    waits: list[tuple[BlockHash, anyio.Event]],
    others: Collection[BlockHash],
) -> tuple[list[BlockHash], bool]:
    """Of ``hashes`` (a fetched part's leading valid ones), those loadable now, and
    whether every one is loadable or another restore's (``others``: being fetched by
    another when this one read it): its end, or that it has ended, added to ``waits``.
    False at the first that is neither (no room for it, say)."""
    ready: list[BlockHash] = []
    for h in hashes:
        if h in index:
            ready.append(h)
        elif h in fetching:  # another restore's: the run goes on, its end waited for
            waits.append((h, fetching[h]))
        elif h in others:  # another's, ended without it: fetched again after this run
            ended = anyio.Event()
            ended.set()
            waits.append((h, ended))
        else:
            return ready, False
    return ready, True


# Fetches of a restore's run: again where another restore fetching one of its blocks
# let it go (its own run ended before it, or it was cancelled).
_FETCH_ROUNDS = 3


_MAX_EVENT_BUFFER = 1 << 30
_MAX_FLUSH_TIMEOUT_S = 86_400.0  # a day


def _serving(manager: OffloadManager) -> KVTier | None:
    """The tier that serves ``manager`` and may not be taken over: not left, or left with
    a copy, load or fetch still under way."""
    held = _TIER_OF.get(manager)
    tier = held() if held is not None else None
    if tier is None or (tier._left and tier.index.idle() and not tier._fetching):
        return None
    return tier


def _claim(manager: OffloadManager, tier: KVTier) -> None:
    """Make ``tier`` the one that serves ``manager``: ConfigError if another tier serves
    it (a dropped one may wait in a reference cycle: collected first)."""
    if _serving(manager) is not None:
        gc.collect()
    if _serving(manager) is not None:
        raise ConfigError(
            "this manager has a KV tier already: the tier picks the manager's host blocks, "
            "so a second one would hand out the same blocks. Use that tier, or leave it "
            "(async with; it frees the manager once no copy, load or fetch of it is under "
            "way) or drop every reference to it first"
        )
    _TIER_OF[manager] = weakref.ref(tier)


class KVTier:
    """Block hashes → the host blocks of ``manager`` (open, with a KV layout).

    With ``remote=`` (a :class:`~asyncpin.tier.remote.RemoteStore`, such as
    :class:`~asyncpin.tier.remote.RedisStore`), a remote tier lies below the host: enter
    the tier (``async with KVTier(mgr, remote=...) as tier``, inside the manager's
    block) to run its writer. Blocks stored on the host are written to the remote store
    in the background (a queue of ``remote_queue`` blocks; a full queue drops and
    counts, never blocks), so a block evicted from the host is there already;
    ``lookup_remote`` and ``restore`` reach the blocks the host misses. ``model`` names
    the model in the keys (with the layout and the rank), so that other models or
    shardings never read these blocks. ``remote_secret`` (16 to 64 bytes, shared by the
    servers that share the store) seals every value with a keyed BLAKE2b instead of an
    XXH3 checksum: then only values sealed with it are data, so a writer to the store
    without the secret cannot plant blocks. ``remote_read_depth``: the parts of a
    restore's direct fetch (16 blocks each) read at once, each on a connection and in a
    worker thread of its own (None: 4 from a cluster, 2 from one server; at most 64; a
    fetch through the client's values reads one part at a time and checks up to this
    many at once). Leaving the tier gives pending writes ``flush_timeout_s``, drops the
    rest (counted) and closes the store."""

    def __init__(
        self,
        manager: OffloadManager,
        *,
        policy: str = "lru",
        remote: RemoteStore | None = None,
        model: str = "",
        namespace: str = "asyncpin",
        remote_queue: int = 256,
        flush_timeout_s: float = 2.0,
        remote_secret: bytes | None = None,
        remote_read_depth: int | None = None,
    ) -> None:
        layout = manager.kv_layout
        if layout is None:
            raise ConfigError("a KV tier needs a manager with a KV layout (OffloadManager.for_kv)")
        self.manager = manager
        self.index = BlockIndex(manager.num_host_blocks, policy=policy)
        self._left = False
        #: Events a subscriber's full buffer could not take.
        self.dropped_events = 0
        self._num_blocks = layout.num_blocks
        # Blocks a restore is fetching into the host now (reserved, not yet loadable or
        # freed): the event is set once they are. Another restore of the same run waits
        # for them rather than ending its run there.
        self._fetching: dict[BlockHash, anyio.Event] = {}
        self.remote: RemoteLink | None = None
        if remote is None and remote_secret is not None:
            raise ConfigError("remote_secret seals a remote store's values: give remote= too")
        if remote is None and remote_read_depth is not None:
            raise ConfigError("remote_read_depth is a remote store's reads: give remote= too")
        if remote is not None:
            if not isinstance(model, str):
                raise ConfigError(f"model is a str naming the model, not {model!r}")
            if (
                not isinstance(flush_timeout_s, int | float)
                or isinstance(flush_timeout_s, bool)
                or not 0 <= flush_timeout_s <= _MAX_FLUSH_TIMEOUT_S
            ):
                raise ConfigError(
                    "flush_timeout_s must be a number from 0 to a day, got "
                    f"{shown(flush_timeout_s)}"
                )
        self._flush_timeout_s = float(flush_timeout_s)
        self._tasks: anyio.abc.TaskGroup | None = None
        self._entered = False
        self._rows: Any = None  # the host blocks as bytes, for the writer
        _claim(manager, self)  # before the link's queue is made: a refused tier holds none
        if remote is not None:
            try:
                self.remote = RemoteLink(
                    remote,
                    print_=fingerprint(model, layout.description(), manager.host_slice),
                    namespace=namespace,
                    host_block_bytes=layout.host_block_bytes,
                    queue_blocks=remote_queue,
                    secret=remote_secret,
                    read_depth=remote_read_depth,
                )
            except BaseException:
                self._left = True  # never made: it claims the manager no more
                raise

    async def __aenter__(self) -> KVTier:
        if self.remote is not None:
            if self._entered:
                raise RuntimeError("a tier with a remote store is entered once")
            store = self.remote.store
            if getattr(store, "closed", False) is True or store in _STORES_IN_USE:
                self._left = True  # never entered: it claims the manager no more
                # The tier closes its store when it is left: a store serves one tier.
                raise ConfigError(
                    f"{store!r} is closed or serves another tier (a tier closes its "
                    "remote store when it is left): make a new store for this tier"
                )
            if isinstance(self.remote.store, RedisStore):
                import asyncio

                from asyncpin._tasks import current_loop

                if not isinstance(current_loop(), asyncio.AbstractEventLoop):
                    self._left = True  # never entered: it claims the manager no more
                    raise ConfigError(
                        "RedisStore needs asyncio (redis-py's asyncio client): this event "
                        "loop is not asyncio's"
                    )
            self._entered = True
            _STORES_IN_USE.add(store)
            try:
                self._rows = self.manager.host_bytes()

                def read_block(block: int) -> memoryview:
                    # Through the tier, not a view of its own: a writer cut short at the
                    # tier's close may stay in a reference cycle until a collection, and
                    # must not keep the host mapped after the manager's close meanwhile.
                    rows = self._rows
                    if rows is None:
                        raise RemoteError("the tier was left: its host blocks are not read")
                    view: memoryview = rows[block].numpy().data
                    return view

                tasks = anyio.create_task_group()
                await tasks.__aenter__()
                self._tasks = tasks
                await tasks.start(
                    self._write_behind, self.remote, read_block, self._hold, self._release
                )
            except BaseException:
                _STORES_IN_USE.discard(store)
                self._left = True  # never entered: it claims the manager no more
                raise
        return self

    @staticmethod
    async def _write_behind(
        remote: RemoteLink,
        read_block: Callable[[int], memoryview],
        hold: Callable[[BlockHash, int], bool],
        release: Callable[[BlockHash, int], None],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        await remote.run(read_block, hold, release, task_status=task_status)

    def _hold(self, block_hash: BlockHash, block: int) -> bool:
        """Keep ``block`` from eviction while the writer copies it, if it still holds
        ``block_hash`` (not evicted, removed or reused meanwhile)."""
        if self.index.host_block(block_hash) != block:
            return False
        self.index.begin_load([block_hash], touch=False)
        return True

    def _release(self, block_hash: BlockHash, block: int) -> None:
        self.index.end_load([block_hash], [block])

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        remote, tasks = self.remote, self._tasks
        if remote is None or tasks is None:
            self._left = True
            return None
        self._tasks = None
        suppress: bool | None = None
        try:
            with anyio.CancelScope(shield=True):
                await remote.flush(self._flush_timeout_s)
        finally:
            tasks.cancel_scope.cancel()
            try:
                # The body's own exception goes through the writer's task group, so that
                # a cancellation the group made of it comes out as what caused it.
                try:
                    suppress = await tasks.__aexit__(exc_type, exc, tb)  # the writer drops the rest
                except BaseExceptionGroup as group:
                    if exc is None or list(group.exceptions) != [exc]:
                        raise
                    # The group wraps the body's exception alone: it goes on as itself.
                    suppress = None
            finally:
                self._rows = None
                try:
                    with (
                        anyio.CancelScope(shield=True),
                        anyio.move_on_after(self._flush_timeout_s),
                    ):
                        await remote.store.aclose()
                finally:
                    _STORES_IN_USE.discard(remote.store)
                    self._left = True  # the writer is over: another tier may take over
        return suppress

    def lookup(self, hashes: Iterable[BlockHash]) -> int:
        """How many leading hashes can be loaded now: none once the manager is closing
        or closed (a load would be refused)."""
        self._check_serving()
        if self.manager.state is not ManagerState.OPEN:
            all_checked(hashes)  # bad input is refused all the same
            return 0
        return self.index.lookup(hashes)

    def _check_serving(self) -> None:
        """ConfigError if another tier took this one's manager over (after this one was
        left): its index no longer says what the host blocks hold."""
        held = _TIER_OF.get(self.manager)
        if held is None or held() is not self:
            raise ConfigError(
                "this tier no longer serves its manager: another KVTier took the manager "
                "over after this one was left; use that one"
            )

    def store(
        self,
        hashes: Iterable[BlockHash],
        gpu_block_ids: BlockIds,
        *,
        method: Method = "auto",
    ) -> TierStore:
        """Store device block ``gpu_block_ids[i]`` under ``hashes[i]``: hashes already
        present are skipped, new ones get host blocks (evicting the least valuable blocks
        no copy uses), and become loadable once the copy is done. A failed copy leaves
        nothing indexed. Bad input raises InvalidTransferError with nothing changed."""
        keys, gpu = self._checked("store", hashes, gpu_block_ids, method)
        plan = self.index.begin_store(keys)
        try:
            # check_call passed in _checked: not again on this path.
            transfer = self.manager._submit(
                "store",
                [gpu[i] for i in plan.positions],
                list(plan.host_blocks),
                method,
                None,
                checked=True,
            )
        except BaseException:
            self.index.end_store(plan, ok=False)
            raise
        transfer.add_done_callback(lambda t: self._end_store(plan, ok=t.error is None))
        return TierStore(transfer, plan)

    def load(
        self,
        hashes: Iterable[BlockHash],
        gpu_block_ids: BlockIds,
        *,
        method: Method = "auto",
    ) -> Transfer:
        """Load ``hashes`` (all loadable: see ``lookup``) into device blocks; they are kept
        from eviction until the copy is done."""
        keys, gpu = self._checked("load", hashes, gpu_block_ids, method)
        host = self.index.begin_load(keys)
        try:
            transfer = self.manager._submit("load", gpu, host, method, None, checked=True)
        except BaseException:
            self.index.end_load(keys, host)
            raise
        transfer.add_done_callback(lambda t: self.index.end_load(keys, host))
        return transfer

    def load_layers(
        self,
        hashes: Iterable[BlockHash],
        gpu_block_ids: BlockIds,
        groups: Sequence[range] | None = None,
        *,
        method: Method = "auto",
    ) -> LayerLoad:
        """``load``, one transfer per group of arrays (ranges of consecutive arrays; by
        default ``layout.tensor_arrays``: one group per tensor the layout was made from,
        a layer's K and V say), queued in order. The blocks are kept from eviction until
        every group is done. Bad input raises InvalidTransferError, nothing queued. A group
        that cannot be queued after earlier ones were fails, with the rest, through the
        handle (``await load`` raises it once the queued groups are over)."""
        ranges = self._groups(groups)
        from asyncpin.transfers import CheckedIds  # torch: see the module docstring

        keys, gpu = self._checked("load", hashes, gpu_block_ids, method)
        # Checked once for every group (a 2048-block group took 0.3 ms to check).
        gpu_ids = CheckedIds(gpu, "gpu_block_ids", self._num_blocks)
        host = self.index.begin_load(keys)
        transfers: list[Transfer] = []
        left = [0]

        def one_done(_: Transfer) -> None:
            left[0] -= 1
            if left[0] == 0:
                self.index.end_load(keys, host)

        try:
            host_ids = CheckedIds(host, "cpu_block_ids", self.manager.num_host_blocks)
            for group in ranges:
                try:
                    # Checked for every group by _checked above: the groups go now.
                    transfers.append(
                        self.manager._submit("load", gpu_ids, host_ids, method, group, checked=True)
                    )
                except TransferError as exc:
                    if not transfers:
                        raise  # nothing queued: the call fails
                    # Earlier groups are queued and will write the device blocks: the
                    # handle is returned, this group and the rest failed with the error.
                    from asyncpin.transfers import Transfer as Failed  # see the docstring

                    for _ in range(len(transfers), len(ranges)):
                        failed = Failed("load", len(gpu), 0)
                        failed._finish(exc)
                        transfers.append(failed)
                    break
        finally:
            # The blocks stay protected until every transfer queued so far is over.
            left[0] = len(transfers)
            if not transfers:
                self.index.end_load(keys, host)
            for transfer in transfers:
                transfer.add_done_callback(one_done)
        return LayerLoad(ranges, tuple(transfers))

    def store_layers(
        self,
        hashes: Iterable[BlockHash],
        gpu_block_ids: BlockIds,
        groups: Sequence[range] | None = None,
        *,
        method: Method = "auto",
    ) -> LayerStore:
        """``store``, one copy per group of arrays, each queued when the caller says
        (``LayerStore.store_group(i)``, as prefill finishes layer ``i``): host blocks are
        given now; see :class:`LayerStore`. Bad input raises InvalidTransferError with
        nothing changed."""
        ranges = self._groups(groups)
        layout = self.manager.kv_layout
        assert layout is not None
        if sorted(a for group in ranges for a in group) != list(range(layout.num_arrays)):
            raise InvalidTransferError(
                "the groups of a layer-wise store must hold every array once: a block "
                "is loadable only when all of it is stored"
            )
        keys, gpu = self._checked("store", hashes, gpu_block_ids, method)
        plan = self.index.begin_store(keys)
        return LayerStore(self, plan, [gpu[i] for i in plan.positions], ranges, method)

    def _groups(self, groups: Sequence[range] | None) -> tuple[range, ...]:
        from asyncpin._router import check_arrays  # torch: see the module docstring

        layout = self.manager.kv_layout
        assert layout is not None
        if groups is None:
            groups = layout.tensor_arrays
        if not isinstance(groups, list | tuple) or not groups:
            raise InvalidTransferError(
                f"groups is a non-empty list or tuple of ranges of arrays, not {shown(groups)}"
            )
        ranges = tuple(groups)
        for group in ranges:
            check_arrays(group, layout.num_arrays)
        return ranges

    def touch(self, hashes: Iterable[BlockHash]) -> None:
        self._check_serving()
        self.index.touch(hashes)

    def remove(self, hashes: Iterable[BlockHash]) -> int:
        self._check_serving()
        return self.index.remove(hashes)

    def clear(self) -> None:
        self._check_serving()
        self.index.clear()

    def add_listener(self, listener: Callable[[BlockEvent], None]) -> None:
        """Events of blocks stored and removed (see ``BlockIndex.add_listener``)."""
        self.index.add_listener(listener)

    @contextmanager
    def subscribe(
        self, max_buffer: int | float = 1024
    ) -> Iterator[MemoryObjectReceiveStream[BlockEvent]]:
        """The events as an async iterator: ``with tier.subscribe() as events: async for
        event in events: ...`` (from a task of its own, say). Up to ``max_buffer`` events
        wait for the reader; past that, new ones are dropped and counted in
        ``dropped_events``, so a slow reader never holds up the index (an int from 0 to
        2**30, or ``math.inf``: no limit; else ConfigError). Leaving the block ends the
        subscription."""
        size: float
        if type(max_buffer) is float and max_buffer == math.inf:
            size = math.inf
        elif (
            isinstance(max_buffer, int)
            and not isinstance(max_buffer, bool)
            and 0 <= int.__index__(max_buffer) <= _MAX_EVENT_BUFFER
        ):
            size = int.__index__(max_buffer)
        else:
            raise ConfigError(
                f"max_buffer is an int from 0 to {_MAX_EVENT_BUFFER}, or math.inf, "
                f"not {shown(max_buffer)}"
            )
        send, receive = anyio.create_memory_object_stream[BlockEvent](size)

        def deliver(event: BlockEvent) -> None:
            try:
                send.send_nowait(event)
            except (anyio.WouldBlock, anyio.BrokenResourceError):
                self.dropped_events += 1

        self.index.add_listener(deliver)
        try:
            with send, receive:
                yield receive
        finally:
            self.index.remove_listener(deliver)

    def _end_store(self, plan: StorePlan, *, ok: bool) -> None:
        """A store's copy is over: the index learns it, and with a remote tier, the new
        blocks are queued to be written there (each held from eviction until copied)."""
        self.index.end_store(plan, ok=ok)
        remote = self.remote
        if not ok or remote is None or not plan.hashes:
            return
        remote.submit(
            [(h, b) for h, b in zip(plan.hashes, plan.host_blocks, strict=True) if h in self.index]
        )

    async def remote_written(self) -> None:
        """Returns once every block queued for the remote tier so far is written (or
        failed or dropped, counted in ``stats().remote``); at once without one."""
        if self.remote is not None:
            await self.remote.idle()

    async def lookup_remote(self, hashes: Iterable[BlockHash]) -> int:
        """``lookup``, then, past the host's leading hits, the leading blocks the remote
        tier has (their values are checked when fetched: ``restore`` may find fewer)."""
        keys = all_checked(hashes)
        n = self.lookup(keys)
        if self.remote is None or n == len(keys) or self.manager.state is not ManagerState.OPEN:
            return n
        return n + await self.remote.exists(keys[n:])

    async def restore(
        self,
        hashes: Iterable[BlockHash],
        gpu_block_ids: BlockIds,
        *,
        method: Method = "auto",
    ) -> int:
        """Bring the leading blocks of ``hashes`` to device blocks ``gpu_block_ids[i]``,
        from the host tier or, past its hits, from the remote tier (fetched into host
        blocks, checked, then loaded): returns how many leading blocks are on the device
        now. A remote miss, an invalid value or a failing server ends the run (counted);
        what was found is restored."""
        keys, gpu = self._checked("load", hashes, gpu_block_ids, method)
        n = self.index.lookup(keys)
        remote = self.remote
        if remote is not None and n < len(keys):
            # The host's leading hits are kept from eviction while the run after them
            # (up to the next block the host has, at most what it can hold besides) is
            # fetched and put in host blocks.
            prefix = self.index.begin_load(keys[:n], touch=False)
            # Fetched parts, each kept from eviction from its copy in to the load.
            held: list[tuple[list[BlockHash], list[int]]] = []
            # Blocks leave a held run only by remove or clear: once one did, or a part
            # found no room for all its blocks, the run is broken and no more is fetched
            # (storing it would evict others' blocks for nothing).
            removed = self.index.stats().removed_blocks

            # Ends of other restores' fetches of blocks of this run, waited for before the
            # run is looked up again.
            waits: list[tuple[BlockHash, anyio.Event]] = []

            async def into(part: Sequence[BlockHash], payloads: list[memoryview]) -> bool:
                ready, blocks, whole = await self._into_host(list(part), payloads, remote, waits)
                held.append((ready, blocks))
                return whole and self.index.stats().removed_blocks == removed

            try:
                for _ in range(_FETCH_ROUNDS):
                    # The run: up to the next block the host has, at most what it can
                    # hold besides the hits. A hash it names twice is fetched once (the
                    # parts are read at once: a later copy would take the earlier's
                    # block); the lookup after the fetch finds it in both places.
                    end = n
                    while (
                        end < len(keys)
                        and end - n < self.index.num_host_blocks - n
                        and keys[end] not in self.index
                    ):
                        end += 1
                    run = list(dict.fromkeys(keys[n:end]))
                    waits.clear()
                    if remote.direct:  # read straight into host blocks
                        sink = _FetchSink(self, remote, held, removed, waits)
                        try:
                            await remote.fetch_direct(run, sink)
                        finally:
                            sink.close()
                    else:  # each part goes into host blocks while the next is read
                        await remote.fetch_into(run, into)
                    given_up: set[BlockHash] = set()
                    for h, fetched in waits:  # other restores' fetches of this run's blocks
                        await fetched.wait()
                        if h in self.index:  # kept from eviction from now on, as fetched
                            held.append(([h], self.index.begin_load([h], touch=False)))
                        else:  # that restore's run ended before it, or it was cancelled
                            given_up.add(h)
                    n = self.index.leading(keys)  # the call's one lookup was counted
                    # Round again only where the run stops at a block another restore
                    # was fetching and let go: this one fetches it (and what follows).
                    if (
                        n == len(keys)
                        or keys[n] not in given_up
                        or self.index.stats().removed_blocks != removed
                    ):
                        break
                transfer = self.load(keys[:n], gpu[:n], method=method) if n else None
            finally:
                for part, blocks in held:
                    self.index.end_load(part, blocks)
                self.index.end_load(keys[: len(prefix)], prefix)
            if transfer is not None:
                await transfer
            return n
        if n:
            await self.load(keys[:n], gpu[:n], method=method)
        return n

    async def _into_host(
        self,
        keys: list[BlockHash],
        payloads: list[memoryview],
        remote: RemoteLink,
        waits: list[tuple[BlockHash, anyio.Event]],
    ) -> tuple[list[BlockHash], list[int], bool]:
        """Fetched blocks into host blocks the index gives them, then indexed. Returns
        those loadable now, kept from eviction (``index.end_load`` them), and whether
        every one is loadable or being fetched by another restore (its end added to
        ``waits``)."""
        # The host rows and the payloads, dropped once the copy is over: this frame may
        # outlive the call in a cancellation's reference cycles, and must not keep the
        # host memory mapped meanwhile.
        work = [(self.manager.host_bytes(), dict(zip(keys, payloads, strict=True)))]
        plan = self.index.begin_store(keys)
        others = {h for h in plan.present if h in self._fetching}  # another restore's
        ends = [(h, anyio.Event()) for h in plan.hashes]  # set once loadable or freed
        self._fetching.update(ends)

        def copy_in() -> None:
            import numpy as np  # with torch's .numpy(): see the module docstring

            rows, by_hash = work[0]
            # NumPy's copy lets go of the GIL (a memoryview's slice assignment holds it
            # for every byte): the event loop's thread is not kept waiting meanwhile.
            for h, block in zip(plan.hashes, plan.host_blocks, strict=True):
                np.copyto(rows[block].numpy(), np.frombuffer(by_hash[h], dtype=np.uint8))

        ok = False
        try:
            await _thread_to_the_end(copy_in, remote.copy_limiter)
            ok = True
        finally:
            work.clear()
            try:
                self.index.end_store(plan, ok=ok)  # not written back: it came from there
            finally:
                _fetched(self._fetching, ends)
        remote.fetched(len(plan.hashes))
        ready, whole = _ready_or_fetched(self.index, self._fetching, keys, waits, others)
        return ready, self.index.begin_load(ready, touch=False), whole

    def stats(self) -> TierStats:
        """The index's counters, the bytes its resident blocks hold, the policy and
        ``dropped_events``: a frozen snapshot, O(1) (``TierCollector`` exports it)."""
        layout = self.manager.kv_layout
        return TierStats.from_index(
            self.index,
            host_block_bytes=layout.host_block_bytes if layout is not None else None,
            dropped_events=self.dropped_events,
            remote=self.remote.stats() if self.remote is not None else None,
        )

    def _checked(
        self,
        direction: Literal["store", "load"],
        hashes: Iterable[BlockHash],
        gpu_block_ids: BlockIds,
        method: Method,
    ) -> tuple[list[BlockHash], list[int]]:
        """The hashes and device block ids, and everything the manager would refuse,
        checked before the index changes: a refused call changes nothing."""
        from asyncpin.transfers import block_ids  # torch: see the module docstring

        self._check_serving()
        keys = all_checked(hashes)
        # The count first, where a sequence tells it (a tensor or an array is checked as
        # ids first: its shape, then its length).
        try:
            count = len(gpu_block_ids) if isinstance(gpu_block_ids, list | tuple | range) else None
        except OverflowError:  # a range past sys.maxsize
            count = None
        if count is not None and count != len(keys):
            raise InvalidTransferError(
                f"{len(keys)} hashes and {count} gpu_block_ids: one device block a hash"
            )
        gpu = block_ids(
            gpu_block_ids, "gpu_block_ids", self._num_blocks, len(keys), " (one a hash)"
        )
        if len(gpu) != len(keys):
            raise InvalidTransferError(
                f"{len(keys)} hashes and {len(gpu)} gpu_block_ids: one device block a hash"
            )
        if direction == "load" and len(set(gpu)) != len(gpu):
            raise InvalidTransferError(
                "gpu_block_ids has duplicate destinations: the result would depend on copy order"
            )
        self.manager._check_submit(direction, method, moves=bool(keys))
        return keys, gpu
