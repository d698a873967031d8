"""The KV tier: host blocks addressed by the engine's block hashes.

:class:`KVTier` puts a :class:`~asyncpin.tier.index.BlockIndex` in front of an open
manager with a KV layout: ``lookup`` how much of a prompt's prefix is on the host,
``store`` device blocks under their hashes, ``load`` hashes into device blocks. The
copies are the manager's :class:`~asyncpin.Transfer` handles; the bookkeeping is
synchronous and O(number of hashes), safe to call from an engine's scheduler step.
Without a GPU or in a process that moves no bytes, use the :class:`BlockIndex` alone and
hand its host block ids to the workers.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from asyncpin._router import check_arrays
from asyncpin.errors import ConfigError, InvalidTransferError
from asyncpin.manager import OffloadManager
from asyncpin.tier.index import BlockEvent, BlockHash, BlockIndex, IndexStats, StorePlan
from asyncpin.tier.policies import POLICY_NAMES
from asyncpin.transfers import BlockIds, Method, Transfer, block_ids

__all__ = [
    "POLICY_NAMES",
    "BlockEvent",
    "BlockHash",
    "BlockIndex",
    "IndexStats",
    "KVTier",
    "LayerLoad",
    "StorePlan",
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
        layout = self.manager.kv_layout
        assert layout is not None
        if groups is None:
            groups = layout.tensor_arrays
        if isinstance(groups, range) or not groups:
            raise InvalidTransferError("groups is a non-empty sequence of ranges of arrays")
        ranges = tuple(groups)
        for group in ranges:
            check_arrays(group, layout.num_arrays)
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

    def _ids(self, hashes: Sequence[BlockHash], gpu_block_ids: BlockIds) -> list[int]:
        gpu = block_ids(gpu_block_ids, "gpu_block_ids", self._num_blocks)
        if len(gpu) != len(hashes):
            raise InvalidTransferError(
                f"{len(hashes)} hashes and {len(gpu)} gpu_block_ids: one device block a hash"
            )
        return gpu
