"""The CUDA engine's copy methods: each queues one job's copy on a lane's streams.

- ``batch``: one DMA per (block, array) segment, issued with one
  ``cudaMemcpyBatchAsync`` call per stream where the runtime has it (CUDA >= 12.8; its
  signature changed in 13.0), else a loop of ``cudaMemcpyAsync``. Uses no SMs; per-copy
  overhead limits it with small blocks. A small transfer whose ids are not runs of
  consecutive ids takes this path with its addresses computed in plain Python.
- ``pack``: a copy kernel gathers the blocks into one half of a device staging buffer
  laid out like the host (block-major), then one DMA per run of consecutive host blocks
  moves it while the kernel fills the other half (load: the reverse). The kernel runs at
  device-memory speed, so the bus does the work and the SMs stay with the model.
- ``kernel``: the same copy kernel reading or writing host memory directly through UVA,
  with a bounded number of CTAs; only where the pinned chunks are registered with CUDA.
  A small transfer whose ids are runs (one Llama block always) takes it under auto: one
  launch, its ids read from a table on the device.

Jobs whose host blocks are not pinned yet copy from pageable memory in a worker thread,
on a stream of their own per direction (``pageable``).
"""

from __future__ import annotations

import array
import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from asyncpin._cudart import Runtime
from asyncpin.engines.cuda.kernel import CopyKernel, kernel_available
from asyncpin.engines.cuda.lanes import Lane
from asyncpin.engines.cuda.plan import (
    BATCH_MIN_BLOCK_BYTES,
    KERNEL_WORD,
    AddressPlan,
    is_run,
    is_small,
    pack_piece_counts,
)
from asyncpin.gate import outside_captures
from asyncpin.transfers import TransferJob

__all__ = ["KERNEL_CTAS", "CopyMethods", "load_kernel", "on_device"]

# Copy kernel CTAs: enough to reach the bus's speed, few enough to leave the SMs to the
# model (BENCH.md: 8 CTAs reach 50 GB/s D2H, H2D needs 32).
KERNEL_CTAS = {"store": 16, "load": 32}
_PACK_CTAS = 132
# The most bytes of the pack piece no DMA overlaps (a store's first, a load's last):
# 8 blocks of 2 MiB take the kernel about 22 us, and their DMAs 0.3 ms, time enough to
# queue the next piece (plan.pack_piece_counts).
EDGE_PIECE_BYTES = 16 << 20
_ID_BYTES = 8  # the ids the copy kernel reads are int64


def load_kernel(rt: Runtime) -> CopyKernel | None:
    """The copy kernel, None where this runtime has no call to load it (then the batch
    method only); raises :class:`~asyncpin.errors.BackendCallError` where the load
    fails."""
    return CopyKernel(rt) if kernel_available(rt) else None


def on_device(index: int) -> contextlib.AbstractContextManager[Any]:
    """Device ``index`` made current, unless it is already."""
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


class CopyMethods:
    """The copy methods of one layout over one host region. Each queues a job's work on
    its lane and returns the stream whose end is the job's end. ``kernel`` is the copy
    kernel where the layout may run it, else None (then only ``batch`` and ``pageable``
    are called)."""

    def __init__(self, rt: Runtime, plan: AddressPlan, kernel: CopyKernel | None) -> None:
        self._rt = rt
        self._plan = plan
        self.kernel = kernel
        # The array table on the device, for the copy kernel, and the ids 0, 1, 2, ...:
        # to_device() at prepare; the tables' addresses are the kernel's parameters.
        self._tables: tuple[torch.Tensor, ...] = ()
        self._table_ptrs: tuple[int, ...] = ()
        self._identity = torch.empty(0, dtype=torch.int64)

    def to_device(self, device: torch.device, max_id: int) -> None:
        """The copy kernel's tables on ``device``, and ids up to ``max_id`` (exclusive)."""
        plan = self._plan
        words = plan.bytes_cpu // KERNEL_WORD
        self._tables = tuple(
            t.to(device) for t in (plan.ptrs_cpu, plan.strides_cpu, words, plan.offsets_cpu)
        )
        self._table_ptrs = tuple(t.data_ptr() for t in self._tables)
        # Made here and copied up (a synchronous copy, as the tables above): a kernel
        # on the lanes' streams, which do not wait for this thread's current stream,
        # may read it as soon as prepare() returns.
        self._identity = torch.arange(max_id, dtype=torch.int64).to(device)

    def release(self) -> None:
        """Device memory back to torch's allocator (at close)."""
        self._tables = ()
        self._table_ptrs = ()
        self._identity = torch.empty(0, dtype=torch.int64)

    # -- ordering -----------------------------------------------------------------------

    def start(self, stream: torch.cuda.Stream, job: TransferJob, lane: Lane) -> None:
        """``stream`` waits for the caller's stream and for the direction's previous job."""
        self.after_caller(stream, job, lane)
        self._rt.wait(stream.cuda_stream, lane.last)

    def after_caller(self, stream: torch.cuda.Stream, job: TransferJob, lane: Lane) -> None:
        """``stream`` waits for the work queued on the caller's stream at submission."""
        if job.ready is not None:
            stream.wait_event(job.ready)
        else:
            self._rt.wait(stream.cuda_stream, lane.ready)

    def join(self, lane: Lane) -> torch.cuda.Stream:
        """The kernel stream waits for everything queued so far on the DMA streams."""
        for dma, moved in zip(lane.dma, lane.moved, strict=True):
            self._rt.record(moved, dma.cuda_stream)
            self._rt.wait(lane.kernel.cuda_stream, moved)
        return lane.kernel

    # -- batch --------------------------------------------------------------------------

    def batch(self, job: TransferJob, lane: Lane) -> torch.cuda.Stream:
        to_host = job.transfer.direction == "store"
        plan = self._plan
        arrays = job.arrays or plan.all_arrays
        if is_small(job.transfer.num_blocks, len(arrays)):
            stream = lane.dma[0]
            self.start(stream, job, lane)
            host, device, sizes = plan.small_segments(job.gpu_ids, job.cpu_ids, arrays)
            addresses = [array.array("Q", a) for a in (host, device, sizes)]
            dst, src = (addresses[0], addresses[1]) if to_host else (addresses[1], addresses[0])
            self._rt.copy_segments(dst, src, addresses[2], stream.cuda_stream)
            job.keep += addresses
            return stream
        # Many small segments make the batched call itself slow (about 0.8 us each), and
        # the driver starts copying while it is still in it: a second stream would only
        # start after the first call returns. Large segments use both DMA streams (up to
        # 64 segments, whatever their size, take the one-stream small path above).
        large = plan.mean_block_bytes(arrays) >= BATCH_MIN_BLOCK_BYTES
        streams = lane.dma if large else lane.dma[:1]
        for stream in streams:
            self.start(stream, job, lane)
        dev, hst, lengths = plan.segments(job.gpu_ids, job.cpu_ids, arrays)
        job.keep += self.copy_host(hst, dev, lengths, to_host=to_host, streams=streams)
        return self.join(lane)

    def copy_host(
        self,
        host: torch.Tensor,
        device: torch.Tensor,
        sizes: torch.Tensor,
        *,
        to_host: bool,
        streams: Sequence[torch.cuda.Stream],
    ) -> list[torch.Tensor]:
        """DMA between host ranges of the region and device ranges, spread over
        ``streams``; returns the address tensors to keep alive. A DMA must not span two
        registrations (the driver answers cudaErrorInvalidValue), so ranges are cut at
        chunk boundaries."""
        host, device, sizes = self._plan.cut_tensors(host, device, sizes)
        k, keep = len(streams), []
        for i, stream in enumerate(streams):
            h, d, z = (t[i::k].contiguous() for t in (host, device, sizes))
            if to_host:
                self._rt.copy_segments(h, d, z, stream.cuda_stream)
            else:
                self._rt.copy_segments(d, h, z, stream.cuda_stream)
            keep += [h, d, z]
        return keep

    # -- pageable jobs, in a worker thread ------------------------------------------------

    def pageable(self, job: TransferJob, stream: torch.cuda.Stream) -> None:
        """Copy on ``stream`` (the lane's pageable stream) and wait, in this worker thread,
        on the job's device: the host waits for pageable copies anyway. Pageable jobs
        have a stream of their own per direction, so they take no part in the order of
        pinned jobs. Whatever happens, the thread returns only once the stream has
        drained, so nothing the copy touches is released early."""
        try:
            stream.wait_event(job.ready)
            device, host, sizes = self._plan.segments(job.gpu_ids, job.cpu_ids, job.arrays)
            job.keep += self.copy_host(
                host, device, sizes, to_host=job.transfer.direction == "store", streams=[stream]
            )
        finally:
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
            job.transfer.event = done
            done.synchronize()

    # -- the copy kernel ----------------------------------------------------------------

    def ids_on_device(self, lane: Lane, lists: Sequence[list[int]]) -> list[int]:
        """The device address of an int64 array holding each of ``lists`` (at most two,
        none empty: empty jobs finish in ``submit``). A list that is a run of consecutive
        ids (a job of one block always is) is a slice of the table of ids 0, 1, 2, ...
        made at prepare: no upload. The others go into the lane's device buffer, copied
        on its kernel stream, on which every reader of the buffer runs.

        They go up from pageable memory in one batched call that reads them before it
        returns: no pinned buffer, so no call that a CUDA graph capture on another thread
        forbids (torch's pinned-memory cache queries events to reuse its blocks)."""
        table = self._identity.data_ptr()
        addresses: list[int] = []
        flat = array.array("q")
        for ids in lists:
            if is_run(ids):
                addresses.append(table + ids[0] * _ID_BYTES)
            else:
                addresses.append(lane.ids.data_ptr() + len(flat) * _ID_BYTES)
                flat.extend(ids)
        if not flat:
            return addresses
        if self._rt.batch is not None:
            self._rt.upload(lane.ids.data_ptr(), flat, lane.kernel.cuda_stream)
            return addresses
        # No batched call (CUDA < 12.8): through torch's pinned-memory cache, which a
        # capture under way on another thread forbids: held back until it ends.
        with outside_captures():
            pinned = torch.frombuffer(flat, dtype=torch.int64).pin_memory()
        with torch.cuda.stream(lane.kernel):
            lane.ids[: len(flat)].copy_(pinned, non_blocking=True)
        return addresses

    def launch(
        self,
        stream: torch.cuda.Stream,
        gpu_ids: int,
        cpu_ids: int,
        count: int,
        host_base: int,
        *,
        to_host: bool,
        ctas: int,
        arrays: range | None = None,
        slot: bool = False,
    ) -> None:
        """The copy kernel on ``stream`` over ``count`` blocks: block ``gpu_ids[i]`` of
        each array of ``arrays`` (all by default) to or from host block ``cpu_ids[i]`` of
        the region at ``host_base``, or (``slot``) to or from slot ``cpu_ids[i]`` of a
        staging buffer at ``host_base`` whose slots hold the arrays' span. ``gpu_ids``
        and ``cpu_ids`` are device addresses of int64 arrays (``ids_on_device``)."""
        plan = self._plan
        assert self.kernel is not None
        arrays = plan.all_arrays if arrays is None else arrays
        if slot:
            offset, stride = plan.span(arrays)
            host_base -= offset  # the span's first array lies at the slot's start
        else:
            stride = plan.host_stride
        n_segments = count * len(arrays)
        grid = max(min(ctas, n_segments), 1)
        args = (
            gpu_ids,
            cpu_ids,
            *self._table_ptrs,
            host_base,
            stride,
            arrays.start,
            n_segments,
            len(arrays),
        )
        self.kernel.launch(stream.cuda_stream, grid, args, to_host=to_host)

    def uva_kernel(self, job: TransferJob, lane: Lane) -> torch.cuda.Stream:
        direction = job.transfer.direction
        self.start(lane.kernel, job, lane)
        gpu, cpu = self.ids_on_device(lane, [job.gpu_ids, job.cpu_ids])
        self.launch(
            lane.kernel,
            gpu,
            cpu,
            job.transfer.num_blocks,
            self._plan.host_base,
            to_host=direction == "store",
            ctas=KERNEL_CTAS[direction],
            arrays=job.arrays,
        )
        return lane.kernel

    def pack(self, job: TransferJob, lane: Lane) -> torch.cuda.Stream:
        """Pieces of the job go through the two staging halves in turn, so the kernel
        fills (store) or drains (load) one half while DMAs move the other. A piece's DMAs
        are planned in plain Python just before it is queued (``AddressPlan.pack_pieces``
        is lazy): the first piece goes out at once, and no torch op hands the GIL to
        another submitting thread meanwhile."""
        rt, plan = self._rt, self._plan
        store = job.transfer.direction == "store"
        kernel, dma = lane.kernel, lane.dma
        self.start(kernel, job, lane)
        buffer = lane.staging
        assert buffer is not None  # allocated when the job was submitted (_staged)
        arrays = job.arrays or plan.all_arrays
        span = plan.span(arrays)[1]
        per_piece = buffer.shape[1] // span
        n = job.transfer.num_blocks
        if not store:
            # A load's DMAs read host blocks that work on the caller's stream may still
            # write; the staging halves order them after earlier loads.
            for stream in dma:
                self.after_caller(stream, job, lane)
        [gpu] = self.ids_on_device(lane, [job.gpu_ids])
        # Block j of a piece goes to or from staging slot j: the ids 0, 1, 2, ...
        slots = self._identity.data_ptr()
        counts = pack_piece_counts(
            n, per_piece, max(EDGE_PIECE_BYTES // span, 1), small_last=not store
        )
        pieces = plan.pack_pieces(
            job.cpu_ids, counts=counts, halves=lane.halves, first_half=lane.half, arrays=arrays
        )
        for piece in pieces:
            lane.half = piece.half ^ 1
            staging, free = lane.halves[piece.half], lane.free[piece.half]
            piece_ids = (gpu + piece.lo * _ID_BYTES, slots, piece.count)
            ranges = piece.dmas
            job.keep.append(ranges)
            if store:
                # The half is free once both DMA streams have read it; neither DMA
                # stream waits for the other.
                for event in free:
                    rt.wait(kernel.cuda_stream, event)
                self.launch(
                    kernel,
                    *piece_ids,
                    staging,
                    to_host=True,
                    ctas=_PACK_CTAS,
                    arrays=arrays,
                    slot=True,
                )
                rt.record(lane.step, kernel.cuda_stream)
                for k, (host, local, sizes) in enumerate(ranges):
                    rt.wait(dma[k].cuda_stream, lane.step)
                    rt.copy_segments(host, local, sizes, dma[k].cuda_stream)
                    rt.record(free[k], dma[k].cuda_stream)
            else:
                for k, (host, local, sizes) in enumerate(ranges):
                    rt.wait(dma[k].cuda_stream, free[k])
                    rt.copy_segments(local, host, sizes, dma[k].cuda_stream)
                    rt.record(lane.moved[k], dma[k].cuda_stream)
                    rt.wait(kernel.cuda_stream, lane.moved[k])
                self.launch(
                    kernel,
                    *piece_ids,
                    staging,
                    to_host=False,
                    ctas=_PACK_CTAS,
                    arrays=arrays,
                    slot=True,
                )
                for event in free:
                    rt.record(event, kernel.cuda_stream)
        return self.join(lane) if store else kernel
