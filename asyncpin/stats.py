"""What a manager and a KV tier report of themselves: :class:`ManagerStats` and
:class:`TierStats`, frozen snapshots. This module imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncpin.tier.index import BlockIndex
    from asyncpin.tier.remote import RemoteStats

__all__ = ["ManagerStats", "TierStats"]


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """A snapshot of one manager; cheap to take at any time from the event loop."""

    state: str
    backend: str
    backing: str
    nbytes: int
    chunk_bytes: int
    chunks_total: int
    chunks_pinned: int
    pinned_bytes: int
    chunks_leaked: int
    seconds_to_enter: float | None
    seconds_to_pinned: float | None
    pin_gib_per_s: float | None
    hugepages: str
    hugepage_bytes: int | None
    slowest_pin_seconds: float
    unpin_seconds: float | None
    close_seconds: float | None
    error: str | None
    transfers_stored: int = 0
    transfers_loaded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    transfers_waited_for_pinning: int = 0
    transfers_pageable: int = 0
    transfers_failed: int = 0
    transfers_in_flight: int = 0
    #: Bytes still mapped after close because tensors viewing them are alive (0 once the
    #: last view is gone): never pinned, never handed to anything else.
    mapped_by_views_bytes: int = 0
    #: Bytes faulted in so far, pinned ones included: pinning begins once every chunk
    #: is faulted in, so ``pinned_bytes`` stays 0 until this reaches ``nbytes``. A count
    #: of the pipeline's progress: after close it keeps its value (the region is gone).
    faulted_bytes: int = 0

    @property
    def pinned_fraction(self) -> float:
        return self.pinned_bytes / self.nbytes if self.nbytes else 0.0


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of a KV tier (``KVTier.stats()``), or of a bare block index
    (:meth:`from_index`): the index's counters (see
    :class:`~asyncpin.tier.index.IndexStats`), what its blocks hold in bytes, its policy,
    and the events a subscriber's full buffer dropped. O(1) to take."""

    policy: str
    num_host_blocks: int
    lookups: int
    hit_blocks: int
    looked_up_blocks: int
    stores: int
    stored_blocks: int
    skipped_blocks: int
    failed_blocks: int
    evicted_blocks: int
    removed_blocks: int
    resident_blocks: int
    free_blocks: int
    #: Bytes of one host block (every KV array's block), and of the resident blocks; None
    #: for an index whose block size was not given.
    host_block_bytes: int | None
    resident_bytes: int | None
    dropped_events: int = 0
    #: The remote tier's counters (``KVTier(..., remote=...)``), else None.
    remote: RemoteStats | None = None

    @property
    def hit_rate(self) -> float:
        """Blocks found over blocks looked up (0.0 before any lookup)."""
        return self.hit_blocks / self.looked_up_blocks if self.looked_up_blocks else 0.0

    @classmethod
    def from_index(
        cls,
        index: BlockIndex,
        *,
        host_block_bytes: int | None = None,
        dropped_events: int = 0,
        remote: RemoteStats | None = None,
    ) -> TierStats:
        """The snapshot of ``index`` (``resident_bytes`` only with ``host_block_bytes``)."""
        s = index.stats()
        return cls(
            policy=index.policy,
            num_host_blocks=index.num_host_blocks,
            lookups=s.lookups,
            hit_blocks=s.hit_blocks,
            looked_up_blocks=s.looked_up_blocks,
            stores=s.stores,
            stored_blocks=s.stored_blocks,
            skipped_blocks=s.skipped_blocks,
            failed_blocks=s.failed_blocks,
            evicted_blocks=s.evicted_blocks,
            removed_blocks=s.removed_blocks,
            resident_blocks=s.resident_blocks,
            free_blocks=s.free_blocks,
            host_block_bytes=host_block_bytes,
            resident_bytes=(
                None if host_block_bytes is None else s.resident_blocks * host_block_bytes
            ),
            dropped_events=dropped_events,
            remote=remote,
        )
