"""The chunk table: the state of each chunk of the host region, written by the pin
pipeline and read by transfers.

The pipeline's worker threads change a chunk's state inside the pin or unpin call's
thread, under the table's lock, so that a chunk whose pin returned is recorded even if
the awaiting task is cancelled at that moment: close then knows exactly what to unpin.
Transfers read only the table: which chunks a block range needs, whether they are
pinned, and they wait on its progress signal, which the pipeline raises on the event
loop after each pin call and when it stops.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Sequence

import anyio

from asyncpin.errors import PinError
from asyncpin.region import Chunk

__all__ = ["ChunkState", "ChunkTable"]


class ChunkState(enum.Enum):
    PENDING = "pending"
    PREFAULTED = "prefaulted"
    PINNED = "pinned"
    FAILED = "failed"
    UNPINNED = "unpinned"
    LEAKED = "leaked"


class ChunkTable:
    """Chunks of equal size (the last may be shorter), from the region's start."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        self.chunks = chunks
        self._size = chunks[0].nbytes if chunks else 1
        #: Bytes the chunks span, from the first's start.
        self.nbytes = chunks[-1].offset + chunks[-1].nbytes if chunks else 0
        self._states = [ChunkState.PENDING] * len(chunks)
        self._lock = threading.Lock()
        self.pinned_bytes = 0
        self.chunks_pinned = 0
        #: Bytes of the chunks faulted in so far, pinned ones included.
        self.faulted_bytes = 0
        #: The pipeline's first failure; set once.
        self.error: PinError | None = None
        self._stopped = False
        self._progress: anyio.Event | None = None

    # -- written by the pipeline --------------------------------------------------------

    def mark(self, index: int, state: ChunkState) -> None:
        """Record a chunk's new state (any thread); pinned bytes follow PINNED in and out,
        faulted bytes a chunk's first step out of PENDING to PREFAULTED or PINNED."""
        nbytes = self.chunks[index].nbytes
        with self._lock:
            was = self._states[index]
            self._states[index] = state
            if was is ChunkState.PENDING and state in (ChunkState.PREFAULTED, ChunkState.PINNED):
                self.faulted_bytes += nbytes
            if state is ChunkState.PINNED and was is not ChunkState.PINNED:
                self.pinned_bytes += nbytes
                self.chunks_pinned += 1
            elif was is ChunkState.PINNED and state is ChunkState.UNPINNED:
                self.pinned_bytes -= nbytes
                self.chunks_pinned -= 1

    def fail(self, index: int, error: PinError) -> None:
        """A chunk failed; the first failure is the table's ``error`` (any thread)."""
        with self._lock:
            self._states[index] = ChunkState.FAILED
            if self.error is None:
                self.error = error

    def set_error(self, error: PinError) -> None:
        with self._lock:
            if self.error is None:
                self.error = error

    def stop(self) -> None:
        """No chunk pinned from now on will be (any thread); waiters learn it at the next
        :meth:`notify`."""
        self._stopped = True

    def notify(self) -> None:
        """Wake the transfers waiting for chunks (on the event loop)."""
        event, self._progress = self._progress, None
        if event is not None:
            event.set()

    # -- read by transfers and stats ----------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self._stopped

    def states(self) -> list[ChunkState]:
        with self._lock:
            return list(self._states)

    def state(self, index: int) -> ChunkState:
        return self._states[index]

    def is_pinned(self, index: int) -> bool:
        return self._states[index] is ChunkState.PINNED

    def all_pinned(self) -> bool:
        return self.chunks_pinned == len(self.chunks)

    def chunks_of(self, offset: int, nbytes: int) -> range:
        """Indices of the chunks that ``[offset, offset+nbytes)`` touches."""
        return range(offset // self._size, (offset + nbytes - 1) // self._size + 1)

    def unpinned(self, spans: Iterable[tuple[int, int]]) -> list[int]:
        """The chunks not pinned yet that the ``(offset, nbytes)`` spans touch, in order."""
        if self.all_pinned():
            return []
        needed: set[int] = set()
        for offset, nbytes in spans:
            needed.update(self.chunks_of(offset, nbytes))
        return sorted(i for i in needed if not self.is_pinned(i))

    async def progressed(self) -> None:
        """Returns at the pipeline's next progress signal (a pin call returned, or the
        pipeline stopped: ``stopped``)."""
        if self._progress is None:
            self._progress = anyio.Event()
        await self._progress.wait()
