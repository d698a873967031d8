"""CUDA transfer engine: KV blocks between device arrays and the pinned host region.

Store and load each have a dedicated stream, so both directions run at once. Methods:

- ``batch``: one DMA per (block, array) segment, issued with one
  ``cudaMemcpyBatchAsync`` call where the runtime has it (CUDA >= 12.8; its signature
  changed in 13.0), else a loop of ``cudaMemcpyAsync``. Uses no SMs; per-copy overhead
  limits it with small blocks.
- ``pack``: a copy kernel gathers the blocks into a device staging buffer laid out like
  the host (block-major), then one DMA per run of consecutive host blocks moves it (load:
  the reverse). The kernel runs at device-memory speed for a few percent of the DMA's
  time, so the bus does the work and the SMs stay with the model.
- ``kernel``: the same copy kernel reading or writing host memory directly through UVA,
  with a bounded number of CTAs.

Completion: each stream has one waiter thread that blocks on a blocking-sync CUDA event
(the thread sleeps; no core spins) and then wakes the event loop. Buffers a copy uses are
kept alive until that moment.
"""

from __future__ import annotations

import asyncio
import ctypes
import queue
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch

from asyncpin.cuda import _cudart
from asyncpin.errors import BackendUnavailableError, TransferError
from asyncpin.kv import KVLayout
from asyncpin.transfers import Direction, TransferJob, settle_interrupted

__all__ = ["CudaTransferEngine", "batch_copy_available"]

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from UVA
_STAGING_BYTES = 256 << 20
# Copy kernel CTAs: enough to reach the bus's speed, few enough to leave the SMs to the
# model (BENCH.md: 8 CTAs reach 50 GB/s D2H, H2D needs 32).
KERNEL_CTAS = {"store": 16, "load": 32}
_PACK_CTAS = 132
# From here on one DMA per segment is as fast as packing (H200: 2 MiB batch 51.5 GB/s,
# pack 49.9; at 256 KiB batch 45.4, pack 49.4): bench/RESULTS.md.
_BATCH_MIN_BLOCK_BYTES = 1 << 20


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class _Runtime:
    """The libcudart calls the engine makes, bound once through ctypes."""

    def __init__(self) -> None:
        lib = _cudart()
        if lib is None:
            raise BackendUnavailableError("cuda", "libcudart is not loaded as a shared library")
        self.lib = lib
        version = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.version = version.value
        lib.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self.batch = getattr(lib, "cudaMemcpyBatchAsync", None) if self.version >= 12080 else None
        # src order "stream" (1); prefer overlap with compute (1): leave the SMs alone.
        self.attrs = _MemcpyAttributes(1, _MemLocation(0, 0), _MemLocation(0, 0), 1)
        self.attr_index = (ctypes.c_size_t * 1)(0)

    def copy_segments(
        self, dsts: torch.Tensor, srcs: torch.Tensor, sizes: torch.Tensor, stream: int
    ) -> None:
        """Enqueue ``len(dsts)`` copies (int64 CPU tensors of addresses and sizes)."""
        count = int(dsts.numel())
        if count == 0:
            return
        if self.batch is not None:
            args: list[Any] = [
                ctypes.c_void_p(dsts.data_ptr()),
                ctypes.c_void_p(srcs.data_ptr()),
                ctypes.c_void_p(sizes.data_ptr()),
                ctypes.c_size_t(count),
                ctypes.byref(self.attrs),
                self.attr_index,
                ctypes.c_size_t(1),
            ]
            if self.version < 13000:  # 12.8/12.9 had a failIdx out-parameter here
                fail_index = ctypes.c_size_t(0)
                args.append(ctypes.byref(fail_index))
            args.append(ctypes.c_void_p(stream))
            self._check("cudaMemcpyBatchAsync", self.batch(*args))
            return
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            code = self.lib.cudaMemcpyAsync(dst, src, size, _MEMCPY_DEFAULT, stream)
            self._check("cudaMemcpyAsync", code)

    def _check(self, op: str, code: int) -> None:
        if code != 0:
            self.lib.cudaGetLastError()
            name = self.lib.cudaGetErrorName(code)
            raise TransferError(f"{op} failed with {name.decode() if name else code} ({code})")


def batch_copy_available() -> bool:
    """Whether the CUDA runtime has cudaMemcpyBatchAsync (12.8 and later)."""
    return _Runtime().batch is not None


def _loop_caller() -> Callable[..., None]:
    """A thread-safe, non-blocking "run this on the event loop soon" for the current loop:
    asyncio's call_soon_threadsafe where it applies, anyio's portal otherwise."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio): anyio's portal
        token = anyio.lowlevel.current_token()

        def call(fn: Callable[..., None], *args: Any) -> None:
            anyio.from_thread.run_sync(fn, *args, token=token)

        return call

    def call_soon(fn: Callable[..., None], *args: Any) -> None:
        loop.call_soon_threadsafe(fn, *args)

    return call_soon


class _Waiter:
    """One thread per stream: waits for each transfer's event in order, then reports."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Callable[[BaseException | None], None]] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, event: Any, report: Callable[[BaseException | None], None]) -> None:
        self._queue.put((event, report))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            event, report = item
            try:
                event.synchronize()  # a blocking-sync event: the thread sleeps
            except BaseException as exc:
                report(exc)
            else:
                report(None)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


def _load_kernel() -> Any:
    try:
        from asyncpin._kernels import kv_copy
    except ImportError:  # no Triton: the batch method only
        return None
    return kv_copy


class CudaTransferEngine:
    """Store/load streams, copy methods and completion waiters for one KV layout."""

    name = "cuda"

    def __init__(
        self, layout: KVLayout, host_blocks: torch.Tensor, start_soon: Any, *, chunk_bytes: int
    ) -> None:
        self._layout = layout
        self._chunk_bytes = chunk_bytes
        self._device = layout.device
        self._start_soon = start_soon
        self._call_soon = _loop_caller()

        self._rt = _Runtime()
        self._kernel = _load_kernel() if layout.block_bytes % 8 == 0 else None
        self._streams: dict[Direction, torch.cuda.Stream] = {
            "store": torch.cuda.Stream(self._device),
            "load": torch.cuda.Stream(self._device),
        }
        self._waiters = {d: _Waiter(f"asyncpin-{d}-waiter") for d in ("store", "load")}
        self._host_base = host_blocks.data_ptr()
        ptrs = [a.data_ptr() for a in layout.arrays]
        strides = [a.stride(0) * layout.dtype.itemsize for a in layout.arrays]
        self._ptrs_cpu = torch.tensor(ptrs, dtype=torch.int64)
        self._strides_cpu = torch.tensor(strides, dtype=torch.int64)
        self._ptrs = self._ptrs_cpu.to(self._device)
        self._strides = self._strides_cpu.to(self._device)
        self._arange_arrays = torch.arange(layout.num_arrays, dtype=torch.int64)
        self._staging: dict[Direction, torch.Tensor] = {}

    def methods(self) -> tuple[str, ...]:
        return ("batch", "pack", "kernel") if self._kernel is not None else ("batch",)

    def record_ready(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _choose(self, job: TransferJob, pageable: bool) -> str:
        if pageable or self._kernel is None:
            return "batch"
        if job.method != "auto":
            return job.method
        return "batch" if self._layout.block_bytes >= _BATCH_MIN_BLOCK_BYTES else "pack"

    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        method = self._choose(job, pageable)
        job.transfer.method = method
        job.transfer.path = "pageable" if pageable else "pinned"
        if job.transfer.num_blocks == 0:
            job.transfer._finish()
        elif pageable:
            # Copies from pageable memory make the host wait: off the event loop.
            self._start_soon(self._submit_in_thread, job)
        else:
            self._enqueue(job, method)

    async def _submit_in_thread(self, job: TransferJob) -> None:
        try:
            await anyio.to_thread.run_sync(self._enqueue, job, "batch")
        except Exception as exc:  # nothing was enqueued (see _enqueue)
            error = TransferError(f"{job.transfer.direction} could not be enqueued: {exc}")
            error.__cause__ = exc
            job.transfer._finish(error)
        except BaseException as exc:
            settle_interrupted(job.transfer, exc)
            raise

    def _enqueue(self, job: TransferJob, method: str) -> None:
        """Queue the copy and its completion event. Once the stream has work of this job,
        a failure no longer raises: it is reported through the handle only after the
        stream has drained, so no buffer is released while a copy may still touch it."""
        direction = job.transfer.direction
        stream = self._streams[direction]
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            failure: BaseException | None = None
            try:
                if job.ready is not None:
                    stream.wait_event(job.ready)
                if method == "batch":
                    self._batch(job, stream)
                elif method == "kernel":
                    self._kernel_copy(job, self._host_base, job.cpu_ids, KERNEL_CTAS[direction])
                else:
                    self._pack(job, stream)
            except Exception as exc:
                failure = exc
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
        job.transfer.event = done
        # A blocking-sync event: the waiter thread sleeps until the copy is done, and a
        # device error surfaces there as an exception. (cudaLaunchHostFunc was measured as
        # an alternative: no faster at p50, worse at p99, and it never runs after a
        # context error, which would leave the transfer pending forever.)
        self._waiters[direction].submit(done, lambda error: self._report(job, error or failure))

    def _report(self, job: TransferJob, error: BaseException | None) -> None:
        if error is not None and not isinstance(error, TransferError):
            wrapped = TransferError(f"{job.transfer.direction} failed on the device: {error}")
            wrapped.__cause__ = error
            error = wrapped
        self._call_soon(self._finish, job, error)

    @staticmethod
    def _finish(job: TransferJob, error: BaseException | None) -> None:
        job.transfer._finish(error)
        job.keep.clear()

    # -- methods ----------------------------------------------------------------------

    def _segments(self, job: TransferJob) -> tuple[torch.Tensor, torch.Tensor]:
        layout = self._layout
        g, c = job.gpu_ids[:, None], job.cpu_ids[:, None]
        device = (self._ptrs_cpu[None, :] + g * self._strides_cpu[None, :]).reshape(-1)
        host = (
            self._host_base
            + (c * layout.num_arrays + self._arange_arrays[None, :]) * layout.block_bytes
        ).reshape(-1)
        return device, host

    def _batch(self, job: TransferJob, stream: torch.cuda.Stream) -> None:
        device, host = self._segments(job)
        sizes = torch.full_like(device, self._layout.block_bytes)
        job.keep += self.copy_host(host, device, sizes, job.transfer.direction == "store", stream)

    def _kernel_copy(
        self, job: TransferJob, host_base: int, cpu_ids: torch.Tensor, ctas: int
    ) -> None:
        layout = self._layout
        assert self._kernel is not None
        ids = torch.stack([job.gpu_ids, cpu_ids]).pin_memory().to(self._device, non_blocking=True)
        n_segments = int(job.gpu_ids.numel()) * layout.num_arrays
        self._kernel[(min(ctas, n_segments),)](
            ids[0],
            ids[1],
            self._ptrs,
            self._strides,
            host_base,
            n_segments,
            layout.num_arrays,
            layout.block_bytes // 8,
            TO_HOST=job.transfer.direction == "store",
            BLOCK=512,
        )
        job.keep.append(ids)

    def _pack(self, job: TransferJob, stream: torch.cuda.Stream) -> None:
        layout = self._layout
        direction = job.transfer.direction
        staging = self._staging.get(direction)
        if staging is None:
            size = max(_STAGING_BYTES // layout.host_block_bytes, 1) * layout.host_block_bytes
            staging = self._staging[direction] = torch.empty(
                size, dtype=torch.uint8, device=self._device
            )
        per_piece = staging.numel() // layout.host_block_bytes
        for start in range(0, job.transfer.num_blocks, per_piece):
            piece = TransferJob(
                job.transfer,
                job.gpu_ids[start : start + per_piece],
                job.cpu_ids[start : start + per_piece],
                job.method,
            )
            n = int(piece.gpu_ids.numel())
            local = torch.arange(n, dtype=torch.int64)
            if direction == "store":
                self._kernel_copy(piece, staging.data_ptr(), local, _PACK_CTAS)
                self._dma_runs(
                    piece.cpu_ids, staging.data_ptr(), to_host=True, stream=stream, keep=job.keep
                )
            else:
                self._dma_runs(
                    piece.cpu_ids, staging.data_ptr(), to_host=False, stream=stream, keep=job.keep
                )
                self._kernel_copy(piece, staging.data_ptr(), local, _PACK_CTAS)
            job.keep += piece.keep

    def _dma_runs(
        self,
        cpu_ids: torch.Tensor,
        staging: int,
        *,
        to_host: bool,
        stream: torch.cuda.Stream,
        keep: list[Any],
    ) -> None:
        """One DMA per run of consecutive host blocks between staging and the region."""
        size = self._layout.host_block_bytes
        n = int(cpu_ids.numel())
        breaks = torch.ones(n, dtype=torch.bool)
        breaks[1:] = cpu_ids[1:] != cpu_ids[:-1] + 1
        starts = torch.nonzero(breaks).reshape(-1)
        lengths = torch.diff(torch.cat([starts, torch.tensor([n])]))
        host = self._host_base + cpu_ids[starts] * size
        local = staging + starts * size
        sizes = lengths * size
        keep += self.copy_host(host, local, sizes, to_host, stream)

    def copy_host(
        self,
        host: torch.Tensor,
        device: torch.Tensor,
        sizes: torch.Tensor,
        to_host: bool,
        stream: torch.cuda.Stream,
    ) -> list[torch.Tensor]:
        """DMA between host ranges of the region and device ranges; returns the address
        tensors to keep alive. A DMA must not span two registrations (the driver answers
        cudaErrorInvalidValue), so ranges are cut at chunk boundaries."""
        host, device, sizes = self._split_at_chunks(host, device, sizes)
        if to_host:
            self._rt.copy_segments(host, device, sizes, stream.cuda_stream)
        else:
            self._rt.copy_segments(device, host, sizes, stream.cuda_stream)
        return [host, device, sizes]

    def _split_at_chunks(
        self, host: torch.Tensor, other: torch.Tensor, sizes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        base, chunk = self._host_base, self._chunk_bytes
        crosses = (host - base) // chunk != (host + sizes - 1 - base) // chunk
        if not bool(crosses.any()):
            return host, other, sizes
        parts: list[tuple[int, int, int]] = []
        for h, o, z in zip(
            host[crosses].tolist(), other[crosses].tolist(), sizes[crosses].tolist(), strict=True
        ):
            while z > 0:
                part = min(z, base + ((h - base) // chunk + 1) * chunk - h)
                parts.append((h, o, part))
                h, o, z = h + part, o + part, z - part
        extra = torch.tensor(parts, dtype=torch.int64)
        keep = ~crosses
        return (
            torch.cat([host[keep], extra[:, 0]]),
            torch.cat([other[keep], extra[:, 1]]),
            torch.cat([sizes[keep], extra[:, 2]]),
        )

    def close(self) -> None:
        for waiter in self._waiters.values():
            waiter.close()
