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

from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from asyncpin.errors import ConfigError, InvalidTransferError
from asyncpin.stats import TierStats
from asyncpin.tier.index import BlockEvent, BlockHash, BlockIndex, IndexStats, StorePlan
from asyncpin.tier.policies import POLICY_NAMES

if TYPE_CHECKING:  # torch: a process with the index alone never imports it
    from asyncpin.manager import OffloadManager
    from asyncpin.transfers import BlockIds, Method, Transfer

__all__ = [
    "POLICY_NAMES",
    "BlockEvent",
    "BlockHash",
    "BlockIndex",
    "IndexStats",
    "KVTier",
    "LayerLoad",
    "LayerStore",
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
        for transfer in self.transfers:
            await transfer

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
    RuntimeError, waiting for nothing, while a group is neither queued nor aborted."""

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
        self._tier, self._gpu, self._method = tier, gpu, method
        self._closed = False  # every group queued, or aborted: no more queued
        self._failed = False
        self._running = 0
        self._ended = False
        if not plan.hashes:  # nothing to copy: over at once
            self._closed = True
            self._maybe_end()

    @property
    def skipped(self) -> tuple[BlockHash, ...]:
        return self.plan.skipped

    def store_group(self, i: int) -> Transfer:
        """Queue group ``i``'s copy (once per group)."""
        if self._closed:
            raise InvalidTransferError("this layer-wise store is complete or aborted")
        if not 0 <= i < len(self.groups) or self.transfers[i] is not None:
            raise InvalidTransferError(f"group {i} is not a group still to store")
        try:
            transfer = self._tier.manager.store(
                self._gpu,
                list(self.plan.host_blocks),
                method=self._method,
                arrays=self.groups[i],
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
        """Queue no more groups; the blocks are freed once the copies queued are over."""
        if not self._closed:
            self._closed, self._failed = True, True
            self._maybe_end()

    def _group_done(self, transfer: Transfer) -> None:
        self._running -= 1
        self._failed |= transfer.error is not None
        self._maybe_end()

    def _maybe_end(self) -> None:
        if self._closed and not self._running and not self._ended:
            self._ended = True
            self._tier.index.end_store(self.plan, ok=not self._failed)

    async def wait(self) -> None:
        if not self._closed:
            raise RuntimeError("a group of this layer-wise store is not queued (or abort())")
        for transfer in self.transfers:
            if transfer is not None:
                await transfer

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()


class KVTier:
    """Block hashes → the host blocks of ``manager`` (open, with a KV layout)."""

    def __init__(self, manager: OffloadManager, *, policy: str = "lru") -> None:
        layout = manager.kv_layout
        if layout is None:
            raise ConfigError("a KV tier needs a manager with a KV layout (OffloadManager.for_kv)")
        self.manager = manager
        self.index = BlockIndex(manager.num_host_blocks, policy=policy)
        #: Events a subscriber's full buffer could not take.
        self.dropped_events = 0
        self._num_blocks = layout.num_blocks

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes can be loaded now."""
        return self.index.lookup(hashes)

    def store(
        self,
        hashes: Sequence[BlockHash],
        gpu_block_ids: BlockIds,
        *,
        method: Method = "auto",
    ) -> TierStore:
        """Store device block ``gpu_block_ids[i]`` under ``hashes[i]``: hashes already
        present are skipped, new ones get host blocks (evicting the least valuable blocks
        no copy uses), and become loadable once the copy is done. A failed copy leaves
        nothing indexed. Bad input raises InvalidTransferError with nothing changed."""
        gpu = self._ids(hashes, gpu_block_ids)
        plan = self.index.begin_store(hashes)
        try:
            transfer = self.manager.store(
                [gpu[i] for i in plan.positions], list(plan.host_blocks), method=method
            )
        except BaseException:
            self.index.end_store(plan, ok=False)
            raise
        transfer.add_done_callback(lambda t: self.index.end_store(plan, ok=t.error is None))
        return TierStore(transfer, plan)

    def load(
        self,
        hashes: Sequence[BlockHash],
        gpu_block_ids: BlockIds,
        *,
        method: Method = "auto",
    ) -> Transfer:
        """Load ``hashes`` (all loadable: see ``lookup``) into device blocks; they are kept
        from eviction until the copy is done."""
        gpu = self._ids(hashes, gpu_block_ids)
        keys = list(hashes)
        host = self.index.begin_load(keys)
        try:
            transfer = self.manager.load(host, gpu, method=method)
        except BaseException:
            self.index.end_load(keys, host)
            raise
        transfer.add_done_callback(lambda t: self.index.end_load(keys, host))
        return transfer

    def load_layers(
        self,
        hashes: Sequence[BlockHash],
        gpu_block_ids: BlockIds,
        groups: Sequence[range] | None = None,
        *,
        method: Method = "auto",
    ) -> LayerLoad:
        """``load``, one transfer per group of arrays (ranges of consecutive arrays; by
        default ``layout.tensor_arrays``: one group per tensor the layout was made from,
        a layer's K and V say), queued in order. The blocks are kept from eviction until
        every group is done. Bad input raises InvalidTransferError, nothing queued."""
        ranges = self._groups(groups)
        gpu = self._ids(hashes, gpu_block_ids)
        keys = list(hashes)
        host = self.index.begin_load(keys)
        transfers: list[Transfer] = []
        left = [0]

        def one_done(_: Transfer) -> None:
            left[0] -= 1
            if left[0] == 0:
                self.index.end_load(keys, host)

        try:
            for group in ranges:
                transfers.append(self.manager.load(host, gpu, method=method, arrays=group))
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
        hashes: Sequence[BlockHash],
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
        gpu = self._ids(hashes, gpu_block_ids)
        plan = self.index.begin_store(hashes)
        return LayerStore(self, plan, [gpu[i] for i in plan.positions], ranges, method)

    def _groups(self, groups: Sequence[range] | None) -> tuple[range, ...]:
        from asyncpin._router import check_arrays  # torch: see the module docstring

        layout = self.manager.kv_layout
        assert layout is not None
        if groups is None:
            return layout.tensor_arrays
        if isinstance(groups, range) or not groups:
            raise InvalidTransferError("groups is a non-empty sequence of ranges of arrays")
        ranges = tuple(groups)
        for group in ranges:
            check_arrays(group, layout.num_arrays)
        return ranges

    def touch(self, hashes: Iterable[BlockHash]) -> None:
        self.index.touch(hashes)

    def remove(self, hashes: Iterable[BlockHash]) -> int:
        return self.index.remove(hashes)

    def clear(self) -> None:
        self.index.clear()

    def add_listener(self, listener: Callable[[BlockEvent], None]) -> None:
        """Events of blocks stored and removed (see ``BlockIndex.add_listener``)."""
        self.index.add_listener(listener)

    @contextmanager
    def subscribe(self, max_buffer: int = 1024) -> Iterator[MemoryObjectReceiveStream[BlockEvent]]:
        """The events as an async iterator: ``with tier.subscribe() as events: async for
        event in events: ...`` (from a task of its own, say). Up to ``max_buffer`` events
        wait for the reader; past that, new ones are dropped and counted in
        ``dropped_events``, so a slow reader never holds up the index. Leaving the block
        ends the subscription."""
        send, receive = anyio.create_memory_object_stream[BlockEvent](max_buffer)

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

    def stats(self) -> TierStats:
        """The index's counters, the bytes its resident blocks hold, the policy and
        ``dropped_events``: a frozen snapshot, O(1) (``TierCollector`` exports it)."""
        layout = self.manager.kv_layout
        return TierStats.from_index(
            self.index,
            host_block_bytes=layout.host_block_bytes if layout is not None else None,
            dropped_events=self.dropped_events,
        )

    def _ids(self, hashes: Sequence[BlockHash], gpu_block_ids: BlockIds) -> list[int]:
        from asyncpin.transfers import block_ids  # torch: see the module docstring

        gpu = block_ids(gpu_block_ids, "gpu_block_ids", self._num_blocks)
        if len(gpu) != len(hashes):
            raise InvalidTransferError(
                f"{len(hashes)} hashes and {len(gpu)} gpu_block_ids: one device block a hash"
            )
        return gpu
