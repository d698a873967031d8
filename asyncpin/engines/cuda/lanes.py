"""One direction's lane of the CUDA engine: its streams, ordering events and device
buffers.

Each direction (store, load) has a lane of its own streams, so both directions run at
once: a kernel stream, where copy kernels run, and two DMA streams that share a large
job's DMAs (two streams keep the bus busy between DMAs: on the H200, 2 MiB DMAs both ways
reach 95 GB/s on two streams per direction and 89 on one; bench/RESULTS.md#both-ways).
Pageable jobs have a stream of their own.
"""

from __future__ import annotations

import os
import threading

import torch

from asyncpin._cudart import Runtime

__all__ = ["STAGING_BYTES", "Lane", "give_back", "own_stream"]

STAGING_BYTES = 256 << 20  # per direction, in two halves


class Lane:
    """One direction's streams, ordering events, and the device buffers its copy kernels
    use: the block ids of a job (room for the most a job of this direction can have) and
    the pack method's staging. The engine makes lanes at open (``prepare``), with the
    staging where pack is the layout's default method: allocating device memory while
    another thread captures a CUDA graph fails and breaks the capture."""

    def __init__(
        self, rt: Runtime, device: torch.device, max_ids: int, made: list[torch.cuda.Stream]
    ) -> None:
        # Each stream goes into ``made`` as it comes: the engine gives them back at close,
        # whatever fails after.
        self.kernel = own_stream(rt, device, made)
        self.dma = (own_stream(rt, device, made), own_stream(rt, device, made))
        # Recorded and waited on by one thread at a time (the event loop's, or for stores
        # the submitter's while it is busy), in job order: shared by all jobs.
        self.ready = rt.event()  # the caller's stream at submission
        self.last = rt.event()  # the end of the previous job of this direction
        self.step = rt.event()  # kernel stream -> DMA streams
        self.moved = (rt.event(), rt.event())  # each DMA stream -> another stream
        # free[h][k]: staging half h may be written again, as far as DMA stream k is
        # concerned (store: stream k has read it; load: the kernel has drained it).
        self.free = [[rt.event(), rt.event()], [rt.event(), rt.event()]]
        # Written and read on the kernel stream only, so each job may reuse them.
        with torch.cuda.stream(self.kernel):
            self.ids = torch.empty(2 * max_ids, dtype=torch.int64, device=device)
        self.staging: torch.Tensor | None = None
        self.halves = (0, 0)  # the two halves' device addresses
        self.half = 0  # the staging half the next piece uses

    def allocate_staging(self, rt: Runtime, host_block_bytes: int) -> torch.Tensor:
        """Allocated on the kernel stream, which the DMA streams wait for: torch's allocator
        may hand out memory whose last user is still queued on the stream the allocation
        is made on, so it must be a stream this lane orders after."""
        per_half = max(STAGING_BYTES // 2 // host_block_bytes, 1)
        per_half += per_half * host_block_bytes % 16 // 8  # both halves 16-byte aligned
        with torch.cuda.stream(self.kernel):
            self.staging = torch.empty(
                (2, per_half * host_block_bytes), dtype=torch.uint8, device=self.kernel.device
            )
        self.halves = (self.staging[0].data_ptr(), self.staging[1].data_ptr())
        if any(half % 16 for half in self.halves):  # never with torch's allocator
            self.staging, self.halves = None, (0, 0)
            raise RuntimeError("pack staging is not 16-byte aligned")
        for event in (*self.free[0], *self.free[1]):
            rt.record(event, self.kernel.cuda_stream)
        return self.staging

    def events(self) -> list[int]:
        return [self.ready, self.last, self.step, *self.moved, *self.free[0], *self.free[1]]

    def streams(self) -> list[torch.cuda.Stream]:
        return [self.kernel, *self.dma]


# The engines' idle streams, by device index: made once, given back at an engine's close,
# and never destroyed, because torch's allocator keeps the stream of the memory allocated
# on it (with expandable segments it synchronises that stream when it unmaps the memory,
# long after the engine has closed).
_idle: dict[int, list[int]] = {}
_idle_lock = threading.Lock()


def own_stream(
    rt: Runtime, device: torch.device, made: list[torch.cuda.Stream]
) -> torch.cuda.Stream:
    """A stream for the engine alone, appended to ``made``: an idle one an engine gave
    back, or a new one (``Runtime.stream``, on the current device: the caller's
    ``torch.cuda.device``). Never one of ``torch.cuda.Stream()``'s pool, which a model's
    thread may be capturing a graph on."""
    index = device.index if device.index is not None else 0
    with _idle_lock:
        idle = _idle.get(index)
        handle = idle.pop() if idle else None
    if handle is None:
        handle = rt.stream()
    try:
        stream = torch.cuda.ExternalStream(handle, device=device)
    except BaseException:
        with _idle_lock:
            _idle.setdefault(index, []).append(handle)  # not lost: streams live on
        raise
    made.append(stream)
    return stream


def give_back(streams: list[torch.cuda.Stream]) -> None:
    """Streams an engine made, idle now (every transfer has finished), for later engines."""
    with _idle_lock:
        for stream in streams:
            index = stream.device.index if stream.device.index is not None else 0
            _idle.setdefault(index, []).append(stream.cuda_stream)


def _forget_in_child() -> None:
    """A forked child has none of the parent's streams (nor its CUDA), and a lock another
    thread held at the fork would stay held."""
    global _idle_lock
    _idle.clear()
    _idle_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
