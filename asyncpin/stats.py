"""What a manager reports of itself: :class:`ManagerStats`, a frozen snapshot."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ManagerStats"]


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

    @property
    def pinned_fraction(self) -> float:
        return self.pinned_bytes / self.nbytes if self.nbytes else 0.0
