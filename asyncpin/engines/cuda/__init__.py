"""CUDA transfer engine: KV blocks between device arrays and the pinned host region.

Each direction (store, load) has a lane of its own streams, so both directions run at
once: a kernel stream, where copy kernels run, and two DMA streams that share a large
job's DMAs (two streams keep the bus busy between DMAs: on the H200, 2 MiB
DMAs both ways reach 95 GB/s on two streams per direction and 89 on one; see
bench/RESULTS.md). Jobs of one direction queued at once (their host blocks pinned) run in
submission order; a job that waited for pinning is queued when its chunks are pinned, and
pageable jobs have a stream of their own. Methods:

- ``batch``: one DMA per (block, array) segment, issued with one
  ``cudaMemcpyBatchAsync`` call per stream where the runtime has it (CUDA >= 12.8; its
  signature changed in 13.0), else a loop of ``cudaMemcpyAsync``. Uses no SMs; per-copy
  overhead limits it with small blocks. A small transfer (one Llama block) takes this
  path with its addresses computed in plain Python: a handful of microseconds to submit.
- ``pack``: a copy kernel gathers the blocks into one half of a device staging buffer
  laid out like the host (block-major), then one DMA per run of consecutive host blocks
  moves it while the kernel fills the other half (load: the reverse). The kernel runs at
  device-memory speed, so the bus does the work and the SMs stay with the model.
- ``kernel``: the same copy kernel reading or writing host memory directly through UVA,
  with a bounded number of CTAs.

The copy kernel moves 8-byte words (``KERNEL_WORD``). A misaligned access faults with
cudaErrorMisalignedAddress, an error that poisons the CUDA context for the rest of the
process, so the kernel runs only on a layout where every address it computes (each
array's base, its block stride, the block size and so every host block and staging slot)
is a multiple of the word (``kernel_misalignment``, decided when the engine is made). On
any other layout (device arrays that start a few bytes into a buffer, say) ``auto`` is
``batch``, and an explicit ``pack`` or ``kernel`` runs as ``batch`` (DMA copies any
alignment): ``Transfer.method`` says so, and the first such request per method is logged.

Submission: loads, and small stores, are queued on the calling (event loop) thread; other
stores are queued by a submitter thread, so the loop is not held for the milliseconds of
driver calls a large store takes, and a load submitted next starts at once.

Completion: each direction has one waiter thread that blocks on a blocking-sync CUDA
event (the thread sleeps; no core spins) and then wakes the event loop. Buffers a copy
uses are kept alive until that moment. A thread needs the GIL to wake the loop, and a
loop kept busy in Python can starve it for seconds (bench/RESULTS.md). So, while
transfers are in flight the loop also looks every 20 ms (``_sweep``: a timer on asyncio,
a task in the manager's task group on trio, which has no timers): a transfer
whose event has been complete for a whole sweep without being reported is finished
there. The loop then counts as starving threads for a second: it looks every 2 ms, and
stores stay on the loop instead of going to the submitter thread.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Union

import anyio
import anyio.from_thread
import anyio.lowlevel
import structlog
import torch

from asyncpin.abc import EngineSetup
from asyncpin.cuda import _cudart
from asyncpin.errors import BackendUnavailableError, TransferError
from asyncpin.gate import outside_captures, unless_capturing
from asyncpin.transfers import Direction, TransferJob, copy_in_thread

__all__ = ["KERNEL_WORD", "CudaTransferEngine", "batch_copy_available", "kernel_misalignment"]

_log = structlog.get_logger("asyncpin")

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from UVA
_STAGING_BYTES = 256 << 20  # per direction, in two halves
# Copy kernel CTAs: enough to reach the bus's speed, few enough to leave the SMs to the
# model (BENCH.md: 8 CTAs reach 50 GB/s D2H, H2D needs 32).
KERNEL_CTAS = {"store": 16, "load": 32}
_PACK_CTAS = 132
# From here on one DMA per segment is as fast as packing (H200: 2 MiB batch 51.5 GB/s,
# pack 49.9; at 256 KiB batch 45.4, pack 49.4): bench/RESULTS.md.
_BATCH_MIN_BLOCK_BYTES = 1 << 20
# Up to this many segments (one block of a 32-layer K/V layout) a transfer is submitted
# with plain-Python addresses, one batched DMA call and one stream: every torch op on a
# CPU tensor would cost more than the copy's own submission.
_SMALL_SEGMENTS = 64
_EVENT_DISABLE_TIMING = 2
# The loop-side sweep for completions a starved waiter thread has not reported: its
# period (short once the loop has been seen starving threads: each sweep costs the loop
# tens of microseconds), and how long the loop counts as starving after a sweep finished
# a transfer; stores stay on the loop meanwhile.
_SWEEP_S = 0.020
_SWEEP_STARVED_S = 0.002
_STARVED_S = 1.0

# Bytes the copy kernel moves per load and store (int64 words): see kernel_misalignment.
KERNEL_WORD = 8

# Address arrays for a batched copy: int64 tensors, or array("Q") for small transfers.
Addresses = Union[torch.Tensor, "array.array[int]"]


def kernel_misalignment(
    *,
    array_ptrs: Sequence[int],
    array_strides: Sequence[int],
    block_bytes: int,
    num_arrays: int,
    host_bases: Sequence[int],
    word: int = KERNEL_WORD,
) -> str | None:
    """Why the copy kernel must not run on this layout, or None when it may.

    The kernel reads and writes ``word``-byte words at ``array_ptrs[a] + g *
    array_strides[a] + k * word`` on the device and ``base + (c * num_arrays + a) *
    block_bytes + k * word`` on the host side (``base``: the pinned region, or a pack
    staging half), for any block ``g``, host block or slot ``c``, array ``a``. Every one
    is a multiple of ``word`` exactly when each term is: each array's base address and
    block stride (bytes), the block size (so that a block is whole words and host blocks,
    ``num_arrays * block_bytes`` apart, and staging slots start on one), and each host
    base. A pure function of addresses, so that it is tested without a GPU."""
    checks: list[tuple[str, int]] = [
        ("block size", block_bytes),
        ("host block size", block_bytes * num_arrays),
    ]
    for a, (ptr, stride) in enumerate(zip(array_ptrs, array_strides, strict=True)):
        checks += [
            (f"device array {a}'s address", ptr),
            (f"device array {a}'s block stride", stride),
        ]
    checks += [(f"host base {n}", base) for n, base in enumerate(host_bases)]
    for what, value in checks:
        if value % word:
            return f"{what} ({value:#x}) is not a multiple of the copy kernel's {word}-byte word"
    return None


def _pointer(addresses: Addresses) -> int:
    if isinstance(addresses, torch.Tensor):
        return addresses.data_ptr()
    return addresses.buffer_info()[0]


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
        lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaEventDestroy.argtypes = [ctypes.c_void_p]
        lib.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self.batch = getattr(lib, "cudaMemcpyBatchAsync", None) if self.version >= 12080 else None
        # src order "stream" (1); prefer overlap with compute (1): leave the SMs alone.
        self.attrs = _MemcpyAttributes(1, _MemLocation(0, 0), _MemLocation(0, 0), 1)
        # src order "during the API call" (2): the driver reads the source before returning.
        self.upload_attrs = _MemcpyAttributes(2, _MemLocation(0, 0), _MemLocation(0, 0), 1)
        self.attr_index = (ctypes.c_size_t * 1)(0)

    def copy_segments(
        self, dsts: Addresses, srcs: Addresses, sizes: Addresses, stream: int
    ) -> None:
        """Enqueue ``len(dsts)`` copies (arrays of 64-bit addresses and sizes)."""
        count = len(dsts)
        if count == 0:
            return
        if self.batch is not None:
            self._batch_call(dsts, srcs, sizes, self.attrs, stream)
            return
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            code = self.lib.cudaMemcpyAsync(dst, src, size, _MEMCPY_DEFAULT, stream)
            self._check("cudaMemcpyAsync", code)

    def upload(self, dst: int, src: array.array[int], stream: int) -> None:
        """Copy ``src``, in pageable host memory, to device address ``dst`` in ``stream``'s
        order. The driver reads ``src`` before returning (its "during the API call" source
        order), so no pinned buffer is needed and ``src`` may be reused at once. Needs the
        batched call (``self.batch``)."""
        address, count = src.buffer_info()
        nbytes = count * src.itemsize
        self._batch_call(
            array.array("Q", [dst]),
            array.array("Q", [address]),
            array.array("Q", [nbytes]),
            self.upload_attrs,
            stream,
        )

    def _batch_call(
        self,
        dsts: Addresses,
        srcs: Addresses,
        sizes: Addresses,
        attrs: _MemcpyAttributes,
        stream: int,
    ) -> None:
        args: list[Any] = [
            ctypes.c_void_p(_pointer(dsts)),
            ctypes.c_void_p(_pointer(srcs)),
            ctypes.c_void_p(_pointer(sizes)),
            ctypes.c_size_t(len(dsts)),
            ctypes.byref(attrs),
            self.attr_index,
            ctypes.c_size_t(1),
        ]
        if self.version < 13000:  # 12.8/12.9 had a failIdx out-parameter here
            fail_index = ctypes.c_size_t(0)
            args.append(ctypes.byref(fail_index))
        args.append(ctypes.c_void_p(stream))
        assert self.batch is not None
        self._check("cudaMemcpyBatchAsync", self.batch(*args))

    def event(self) -> int:
        """A raw event for ordering streams (no timing, so recording it is cheap)."""
        handle = ctypes.c_void_p()
        code = self.lib.cudaEventCreateWithFlags(ctypes.byref(handle), _EVENT_DISABLE_TIMING)
        self._check("cudaEventCreateWithFlags", code)
        return int(handle.value or 0)

    def record(self, event: int, stream: int) -> None:
        self._check("cudaEventRecord", self.lib.cudaEventRecord(event, stream))

    def wait(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` from now on waits for ``event``'s latest record (the
        one made before this call: recording the event again later changes nothing)."""
        self._check("cudaStreamWaitEvent", self.lib.cudaStreamWaitEvent(stream, event, 0))

    def destroy(self, event: int) -> None:
        self.lib.cudaEventDestroy(event)  # released once pending work no longer needs it

    def _check(self, op: str, code: int) -> None:
        if code != 0:
            self.lib.cudaGetLastError()
            name = self.lib.cudaGetErrorName(code)
            raise TransferError(f"{op} failed with {name.decode() if name else code} ({code})")


def batch_copy_available() -> bool:
    """Whether the CUDA runtime has cudaMemcpyBatchAsync (12.8 and later)."""
    return _Runtime().batch is not None


def _asyncio_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (trio)
        return None


def _loop_caller() -> Callable[..., None]:
    """A thread-safe "run this on the event loop" for the current loop: asyncio's
    call_soon_threadsafe where it applies (it returns at once), anyio's portal otherwise
    (it returns once the loop has run it, with its error)."""
    loop = _asyncio_loop()
    if loop is None:
        token = anyio.lowlevel.current_token()

        def call(fn: Callable[..., None], *args: Any) -> None:
            anyio.from_thread.run_sync(fn, *args, token=token)

        return call

    def call_soon(fn: Callable[..., None], *args: Any) -> None:
        loop.call_soon_threadsafe(fn, *args)

    return call_soon


class _Worker:
    """A thread that handles the items put to it one at a time, in order (``_handle``)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _handle(self, item: Any) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._handle(item)

    def close(self) -> None:
        """Returns once every item put before has been handled."""
        self._queue.put(None)
        self._thread.join()


class _Waiter(_Worker):
    """One thread per direction: waits for each transfer's event in order, then reports."""

    def submit(
        self,
        event: Any,
        report: Callable[[BaseException | None], None],
        settled: Callable[[], bool] = lambda: False,
    ) -> None:
        """Call ``report(error)`` in this thread once ``event`` has completed, unless
        ``settled()`` is already true when its turn comes (then nothing)."""
        self._queue.put((event, report, settled))

    def _handle(self, item: Any) -> None:
        event, report, settled = item
        if settled():  # a starved thread drains what the loop finished, GIL held
            return
        error: BaseException | None = None
        try:
            # Waiting on an event would break a graph capture under way on another
            # thread: not while the capture gate is held.
            with outside_captures():
                event.synchronize()  # a blocking-sync event: the thread sleeps
        except BaseException as exc:
            error = exc
        try:
            report(error)
        except Exception as exc:
            # On trio the report waits for the loop to run the completion and returns
            # its error. Logged, as asyncio logs a failed callback: this thread must
            # live on to report the transfers queued behind.
            _log.error("transfer.report_failed", error=repr(exc), exc_info=exc)


class _Submitter(_Worker):
    """One thread that queues large stores' device work, in the order they were submitted.

    Queuing a 2 GiB pack store takes milliseconds of driver calls (about 4 ms on the H200,
    8 ms while the GPU is already copying): off the event loop, the loop goes on, and a
    load submitted right after starts at once instead of behind it. ``busy()`` is true
    while jobs are queued or being queued here; the loop then sends every store here, so
    stores keep their submission order."""

    def __init__(
        self,
        name: str,
        enqueue: Callable[[TransferJob, str], None],
        fail: Callable[[TransferJob, BaseException], None],
    ) -> None:
        self._enqueue, self._fail = enqueue, fail
        self._lock = threading.Lock()
        self._pending = 0
        super().__init__(name)

    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0

    def submit(self, job: TransferJob, method: str) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put((job, method))

    def _handle(self, item: Any) -> None:
        job, method = item
        try:
            self._enqueue(job, method)
        except BaseException as exc:  # reported through the handle, never lost
            self._fail(job, exc)
        finally:
            with self._lock:
                self._pending -= 1


def _load_kernel() -> Any:
    try:
        from asyncpin._kernels import kv_copy
    except ImportError:  # no Triton: the batch method only
        return None
    return kv_copy


class _Lane:
    """One direction's streams, ordering events, and the device buffers its copy kernels
    use: the block ids of a job (room for the most a job of this direction can have) and
    the pack method's staging. The engine makes lanes at open (``prepare``), with the
    staging where pack is the layout's default method: allocating device memory while
    another thread captures a CUDA graph fails and breaks the capture."""

    def __init__(self, rt: _Runtime, device: torch.device, max_ids: int) -> None:
        self.kernel = torch.cuda.Stream(device)
        self.dma = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        self.pageable = torch.cuda.Stream(device)  # used from a worker thread only
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

    def allocate_staging(self, rt: _Runtime, host_block_bytes: int) -> torch.Tensor:
        """Allocated on the kernel stream, which the DMA streams wait for: torch's allocator
        may hand out memory whose last user is still queued on the stream the allocation
        is made on, so it must be a stream this lane orders after."""
        per_half = max(_STAGING_BYTES // 2 // host_block_bytes, 1)
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


class CudaTransferEngine:
    """Store/load lanes, copy methods and completion waiters for one KV layout."""

    name = "cuda"
    # Large stores go to the submitter thread (False: every store is queued by the caller).
    thread_stores = True

    def __init__(self, setup: EngineSetup) -> None:
        layout, host_blocks, chunk_bytes = setup.layout, setup.host_blocks, setup.chunk_bytes
        start_soon = setup.start_soon
        self._layout = layout
        self._chunk_bytes = chunk_bytes
        self._device = layout.device
        # A CUDA tensor's device always has its index; the layout takes it from them.
        self._index: int = layout.device.index if layout.device.index is not None else 0
        self._start_soon = start_soon
        self._call_soon = _loop_caller()
        self._loop = _asyncio_loop()  # None on trio: the sweep runs as a task there
        # Jobs queued on the device and not yet reported, per direction, in order.
        self._outstanding: dict[Direction, deque[TransferJob]] = {
            "store": deque(),
            "load": deque(),
        }
        self._sweeping = False
        self._starved_until = 0.0

        self._rt = _Runtime()
        self._host_base = host_blocks.data_ptr()
        ptrs = [a.data_ptr() for a in layout.arrays]
        strides = [a.stride(0) * layout.dtype.itemsize for a in layout.arrays]
        kernel = _load_kernel()
        # pack and kernel may be asked for where Triton is; they run as batch on a layout
        # the copy kernel cannot run on safely (``_choose``).
        self._kernel_methods = kernel is not None
        self._misaligned = kernel_misalignment(
            array_ptrs=ptrs,
            array_strides=strides,
            block_bytes=layout.block_bytes,
            num_arrays=layout.num_arrays,
            host_bases=[self._host_base],
        )
        self._kernel = kernel if self._misaligned is None else None
        if kernel is not None and self._misaligned is not None:
            _log.warning("transfer.kernel_disabled", reason=self._misaligned, fallback="batch")
        self._fallbacks_logged: set[str] = set()
        self._lanes: dict[Direction, _Lane] = {}  # made by prepare()
        self._waiters = {d: _Waiter(f"asyncpin-{d}-waiter") for d in ("store", "load")}
        self._submitter = _Submitter("asyncpin-store-submitter", self._enqueue, self._report)
        self._num_host_blocks = host_blocks.shape[0]
        # The same table three ways: python (small transfers), CPU and device tensors.
        self._arrays = list(zip(ptrs, strides, strict=True))
        self._offsets = [a * layout.block_bytes for a in range(layout.num_arrays)]
        self._ptrs_cpu = torch.tensor(ptrs, dtype=torch.int64)
        self._strides_cpu = torch.tensor(strides, dtype=torch.int64)
        self._ptrs = self._strides = torch.empty(0, dtype=torch.int64)  # on the device: prepare()
        self._arange_arrays = torch.arange(layout.num_arrays, dtype=torch.int64)
        # Host blocks start at the region's start, as chunks do: no block crosses a
        # registration boundary when blocks tile chunks.
        self._blocks_tile_chunks = chunk_bytes % layout.host_block_bytes == 0

    def methods(self) -> tuple[str, ...]:
        """The methods a transfer may ask for: pack and kernel where Triton is (on a
        layout the copy kernel cannot run on, they run as batch)."""
        return ("batch", "pack", "kernel") if self._kernel_methods else ("batch",)

    def prepare(self) -> None:
        """Streams, events and device buffers, then the copy kernel compiled and loaded for
        both directions by launching it over no segment. All of it in a worker thread at
        open, and none of it while a graph capture is under way on another thread: a
        device allocation, a stream synchronisation or a module load would break it.
        Compiling mid-serving would also stall the submitting thread. The kernel variants
        are the ones transfers use: it is specialised on its base address's alignment,
        and the region and both staging halves are 16-byte aligned."""
        layout, rt = self._layout, self._rt
        # A store's host blocks are distinct, and so are a load's device blocks.
        max_ids = {"store": self._num_host_blocks, "load": layout.num_blocks}
        with outside_captures(), torch.cuda.device(self._index):
            self._ptrs = self._ptrs_cpu.to(self._device)
            self._strides = self._strides_cpu.to(self._device)
            for d in ("store", "load"):
                lane = _Lane(rt, self._device, max_ids[d] if self._kernel else 0)
                if self._kernel is not None and layout.block_bytes < _BATCH_MIN_BLOCK_BYTES:
                    lane.allocate_staging(rt, layout.host_block_bytes)  # pack is the default
                self._lanes[d] = lane
            if self._kernel is None:
                return
            for d, lane in self._lanes.items():
                ids = lane.ids[:2].view(2, 1)
                with torch.cuda.stream(lane.kernel):
                    for base in (self._host_base, *(h for h in lane.halves if h)):
                        self._launch(ids, base, to_host=d == "store", ctas=1, count=0)
                lane.kernel.synchronize()

    def record_ready(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _is_small(self, job: TransferJob) -> bool:
        return job.transfer.num_blocks * self._layout.num_arrays <= _SMALL_SEGMENTS

    def _choose(self, job: TransferJob, pageable: bool) -> str:
        """The method a job runs with. Never the copy kernel (pack, kernel) on a layout it
        cannot run on safely: a misaligned access would end the process's CUDA context."""
        if pageable:
            return "batch"
        if self._kernel is None:
            if job.method in ("pack", "kernel") and job.method not in self._fallbacks_logged:
                self._fallbacks_logged.add(job.method)
                _log.warning(
                    "transfer.method_fallback",
                    requested=job.method,
                    fallback="batch",
                    reason=self._misaligned,
                )
            return "batch"
        if job.method != "auto":
            method = job.method
        elif self._is_small(job):
            return "batch"
        else:
            method = "batch" if self._layout.block_bytes >= _BATCH_MIN_BLOCK_BYTES else "pack"
        if method == "pack" and job.transfer.num_blocks and not self._staged(job):
            return "batch"
        return method

    def _staged(self, job: TransferJob) -> bool:
        """Whether the job's lane has its pack staging, allocating it on the first pack job
        of a layout whose default method is batch. Not while a graph capture is under way
        on another thread (a device allocation would break it), and not if the device has
        no room for it: the job then uses batch."""
        lane = self._lanes[job.transfer.direction]
        if lane.staging is not None:
            return True
        with unless_capturing() as free:
            if not free:
                return False
            try:
                with self._on_device():
                    lane.allocate_staging(self._rt, self._layout.host_block_bytes)
            except RuntimeError as exc:  # torch.OutOfMemoryError is one
                _log.warning("transfer.staging_failed", fallback="batch", error=repr(exc))
                return False
            return True

    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        method = self._choose(job, pageable)
        job.transfer.method = method
        job.transfer.path = "pageable" if pageable else "pinned"
        if job.transfer.num_blocks == 0:
            job.finish()
            return
        if pageable:
            # Copies from pageable memory make the host wait: off the event loop.
            if job.ready is None:
                job.ready = self.record_ready()
            self._start_soon(copy_in_thread, job, self._copy_pageable)
            return
        self._watch(job)
        if job.transfer.direction == "store" and (
            self._submitter.busy()
            or (self.thread_stores and not self._is_small(job) and not self._starved())
        ):
            # Stores are queued by the submitter thread unless small and nothing is ahead
            # of them there. Loads are queued here, on the calling thread, so that
            # ``transfer.event`` is recorded by the time load() returns.
            if job.ready is None:
                job.ready = self.record_ready()  # the caller's stream, as of now
            self._submitter.submit(job, method)
        else:
            self._enqueue(job, method)

    # -- the loop-side sweep ------------------------------------------------------------

    def _watch(self, job: TransferJob) -> None:
        """Track a job queued for the device until it is reported; sweep while any is."""
        self._outstanding[job.transfer.direction].append(job)
        if not self._sweeping:
            if self._loop is not None:
                self._loop.call_later(self._sweep_period(), self._sweep)
            else:
                self._start_soon(self._sweeper)
            self._sweeping = True

    async def _sweeper(self) -> None:
        """trio: sweeps as a task, until a sweep finds nothing outstanding. A sweep that
        raises (a transfer's callback did) is logged, as asyncio logs a failed timer
        callback, instead of failing the manager's task group."""
        try:
            while self._sweeping:
                await anyio.sleep(self._sweep_period())
                try:
                    self._sweep()
                except Exception as exc:
                    _log.error("transfer.sweep_failed", error=repr(exc), exc_info=exc)
        finally:  # cancelled with the task group: the next job watched starts a new task
            self._sweeping = False

    def _starved(self) -> bool:
        """Whether a sweep lately finished a transfer its waiter thread had not reported."""
        return time.monotonic() < self._starved_until

    def _sweep_period(self) -> float:
        return _SWEEP_STARVED_S if self._starved() else _SWEEP_S

    def _sweep(self) -> None:
        """On the event loop, every ``_SWEEP_S`` (``_SWEEP_STARVED_S`` while the loop counts
        as starving threads) while jobs are outstanding: drop the ones reported, and
        finish, in order, each one whose event was already complete at the previous sweep.
        A waiter thread reports within tens of microseconds unless the loop starves it of
        the GIL, so finishing one here is the sign of that."""
        try:
            for jobs in self._outstanding.values():
                self._sweep_direction(jobs)
        finally:  # a transfer's callback that raises must not end the sweeping
            if not any(self._outstanding.values()):
                self._sweeping = False
            elif self._loop is not None:  # on trio, _sweeper loops
                self._loop.call_later(self._sweep_period(), self._sweep)

    def _sweep_direction(self, jobs: deque[TransferJob]) -> None:
        in_order = True  # every job ahead of this one is finished
        i = 0  # by index: a callback run by a finish may submit (append) another job
        while i < len(jobs):
            job = jobs[i]
            i += 1
            if job.transfer.done():
                continue
            event = job.transfer.event
            if event is None or not self._complete(event):
                # Not yet queued (the submitter has it), or still copying; a direction's
                # events complete in job order, so none after it has.
                break
            if job.seen_done and in_order:
                self._starved_until = time.monotonic() + _STARVED_S
                self._finish(job, job.failure)
            else:
                job.seen_done = True  # its waiter has until the next sweep
                in_order = False
        while jobs and jobs[0].transfer.done():
            jobs.popleft()

    @staticmethod
    def _complete(event: Any) -> bool:
        """``event.query()``, unless a capture under way forbids it. A device error is left
        to the waiter thread, which reports it."""
        with unless_capturing() as free:
            if not free:
                return False
            try:
                return bool(event.query())
            except Exception:
                return False

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        if torch.cuda.current_device() == self._index:
            return contextlib.nullcontext()
        return torch.cuda.device(self._index)

    # -- pinned jobs, from the event loop thread or the store submitter ------------------

    def _enqueue(self, job: TransferJob, method: str) -> None:
        """Queue the copy and its completion event. Once a stream has work of this job,
        a failure is reported through the handle only after the job's streams have
        drained, so no buffer is released while a copy may still touch it. (It raises
        only when not even the completion event can be queued; it then waits for the
        lane's streams first.)"""
        direction = job.transfer.direction
        lane, rt = self._lanes[direction], self._rt
        with self._on_device():
            if job.ready is None:
                # The raw handle of torch's current stream (what torch's own generated
                # code reads): 0.3 us, against 5.6 us for torch.cuda.current_stream().
                caller = torch._C._cuda_getCurrentRawStream(self._index)
                rt.record(lane.ready, caller)
            try:
                if method == "batch":
                    tail = self._batch(job, lane)
                elif method == "kernel":
                    tail = self._uva_kernel(job, lane)
                else:
                    tail = self._pack(job, lane)
            except Exception as exc:
                job.failure, tail = exc, None
            try:
                if tail is None:
                    tail = self._join(lane)  # whatever was queued, on any lane stream
                done = torch.cuda.Event(blocking=True)
                done.record(tail)
                rt.record(lane.last, tail.cuda_stream)
            except Exception:
                # The device refuses even to order work (a sticky error): wait here for
                # everything the lane has queued, so that the failure, reported by the
                # caller, releases nothing a copy may still touch.
                for stream in (lane.kernel, *lane.dma):
                    with contextlib.suppress(Exception):
                        stream.synchronize()
                raise
        job.transfer.event = done
        # A blocking-sync event: the waiter thread sleeps until the copy is done, and a
        # device error surfaces there as an exception. (cudaLaunchHostFunc was measured as
        # an alternative: no faster at p50, worse at p99, and it never runs after a
        # context error, which would leave the transfer pending forever.)
        self._waiters[direction].submit(
            done, lambda error: self._report(job, error or job.failure), job.transfer.done
        )

    def _start(self, stream: torch.cuda.Stream, job: TransferJob, lane: _Lane) -> None:
        """``stream`` waits for the caller's stream and for the direction's previous job."""
        self._after_caller(stream, job, lane)
        self._rt.wait(stream.cuda_stream, lane.last)

    def _after_caller(self, stream: torch.cuda.Stream, job: TransferJob, lane: _Lane) -> None:
        """``stream`` waits for the work queued on the caller's stream at submission."""
        if job.ready is not None:
            stream.wait_event(job.ready)
        else:
            self._rt.wait(stream.cuda_stream, lane.ready)

    def _join(self, lane: _Lane) -> torch.cuda.Stream:
        """The kernel stream waits for everything queued so far on the DMA streams."""
        for dma, moved in zip(lane.dma, lane.moved, strict=True):
            self._rt.record(moved, dma.cuda_stream)
            self._rt.wait(lane.kernel.cuda_stream, moved)
        return lane.kernel

    def _report(self, job: TransferJob, error: BaseException | None) -> None:
        """From any thread: finish ``job`` on the event loop."""
        self._call_soon(self._finish, job, error)

    @staticmethod
    def _finish(job: TransferJob, error: BaseException | None) -> None:
        job.finish(error)

    # -- pageable jobs, in a worker thread ------------------------------------------------

    def _copy_pageable(self, job: TransferJob) -> None:
        """Copy and wait, in this worker thread: the host waits for pageable copies
        anyway. Pageable jobs have a stream of their own per direction, so they take no
        part in the order of pinned jobs. Whatever happens, the thread returns only once
        the stream has drained, so nothing the copy touches is released early."""
        stream = self._lanes[job.transfer.direction].pageable
        with outside_captures(), self._on_device():
            try:
                stream.wait_event(job.ready)
                device, host = self.segments(job.gpu_ids, job.cpu_ids)
                sizes = torch.full_like(device, self._layout.block_bytes)
                job.keep += self.copy_host(
                    host, device, sizes, to_host=job.transfer.direction == "store", streams=[stream]
                )
            finally:
                done = torch.cuda.Event(blocking=True)
                done.record(stream)
                job.transfer.event = done
                done.synchronize()

    # -- methods ----------------------------------------------------------------------

    def segments(self, gpu_ids: list[int], cpu_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Device and host addresses of every (block, array) segment, block by block."""
        layout = self._layout
        g = torch.tensor(gpu_ids, dtype=torch.int64)[:, None]
        c = torch.tensor(cpu_ids, dtype=torch.int64)[:, None]
        device = (self._ptrs_cpu[None, :] + g * self._strides_cpu[None, :]).reshape(-1)
        host = (
            self._host_base
            + (c * layout.num_arrays + self._arange_arrays[None, :]) * layout.block_bytes
        ).reshape(-1)
        return device, host

    def _batch(self, job: TransferJob, lane: _Lane) -> torch.cuda.Stream:
        to_host = job.transfer.direction == "store"
        size = self._layout.block_bytes
        if self._is_small(job):
            stream = lane.dma[0]
            self._start(stream, job, lane)
            device = [p + g * stride for g in job.gpu_ids for p, stride in self._arrays]
            base, block = self._host_base, self._layout.host_block_bytes
            host = [base + c * block + off for c in job.cpu_ids for off in self._offsets]
            sizes = [size] * len(host)
            if not self._blocks_tile_chunks:
                parts = self._cut_all(host, device, sizes)
                host, device, sizes = ([p[i] for p in parts] for i in range(3))
            addresses = [array.array("Q", a) for a in (host, device, sizes)]
            dst, src = (addresses[0], addresses[1]) if to_host else (addresses[1], addresses[0])
            self._rt.copy_segments(dst, src, addresses[2], stream.cuda_stream)
            job.keep += addresses
            return stream
        # Many small segments make the batched call itself slow (about 0.8 us each), and
        # the driver starts copying while it is still in it: a second stream would only
        # start after the first call returns. Large segments use both DMA streams (up to
        # 64 segments, whatever their size, take the one-stream small path above).
        streams = lane.dma if size >= _BATCH_MIN_BLOCK_BYTES else lane.dma[:1]
        for stream in streams:
            self._start(stream, job, lane)
        dev, hst = self.segments(job.gpu_ids, job.cpu_ids)
        job.keep += self.copy_host(
            hst, dev, torch.full_like(dev, size), to_host=to_host, streams=streams
        )
        return self._join(lane)

    def _ids_on_device(self, lane: _Lane, first: list[int], second: list[int]) -> torch.Tensor:
        """``[2, n]`` int64 ids in the lane's device buffer, copied on its kernel stream, on
        which every reader of the buffer runs (n > 0: empty jobs finish in ``submit``).

        The ids go up from pageable memory in one batched call that reads them before it
        returns: no pinned buffer, so no call that a CUDA graph capture on another thread
        forbids (torch's pinned-memory cache queries events to reuse its blocks)."""
        n = len(first)
        ids = lane.ids[: 2 * n].view(2, n)
        flat = array.array("q", [*first, *second])
        if self._rt.batch is not None:
            self._rt.upload(ids.data_ptr(), flat, lane.kernel.cuda_stream)
            return ids
        # No batched call (CUDA < 12.8): through torch's pinned-memory cache, which a
        # capture under way on another thread forbids: held back until it ends.
        with outside_captures():
            pinned = torch.frombuffer(flat, dtype=torch.int64).pin_memory()
        with torch.cuda.stream(lane.kernel):
            return ids.copy_(pinned.view(2, n), non_blocking=True)

    def _launch(
        self, ids: torch.Tensor, host_base: int, *, to_host: bool, ctas: int, count: int = -1
    ) -> None:
        """The copy kernel on the current torch stream: block ``ids[0, i]`` of every array
        to or from slot ``ids[1, i]`` of a block-major buffer at ``host_base`` (``count``
        blocks: all of ``ids`` by default)."""
        layout = self._layout
        assert self._kernel is not None
        n_segments = (ids.shape[1] if count < 0 else count) * layout.num_arrays
        self._kernel[(max(min(ctas, n_segments), 1),)](
            ids[0],
            ids[1],
            self._ptrs,
            self._strides,
            host_base,
            n_segments,
            layout.num_arrays,
            layout.block_bytes // KERNEL_WORD,
            TO_HOST=to_host,
            BLOCK=512,
        )

    def _uva_kernel(self, job: TransferJob, lane: _Lane) -> torch.cuda.Stream:
        direction = job.transfer.direction
        self._start(lane.kernel, job, lane)
        with torch.cuda.stream(lane.kernel):
            ids = self._ids_on_device(lane, job.gpu_ids, job.cpu_ids)
            self._launch(
                ids, self._host_base, to_host=direction == "store", ctas=KERNEL_CTAS[direction]
            )
        return lane.kernel

    def _pack(self, job: TransferJob, lane: _Lane) -> torch.cuda.Stream:
        """Pieces of the job go through the two staging halves in turn, so the kernel
        fills (store) or drains (load) one half while DMAs move the other. A piece's DMAs
        are planned in plain Python just before it is queued: the first piece goes out
        at once, and no torch op hands the GIL to another submitting thread meanwhile."""
        layout, rt = self._layout, self._rt
        store = job.transfer.direction == "store"
        kernel, dma = lane.kernel, lane.dma
        self._start(kernel, job, lane)
        buffer = lane.staging
        assert buffer is not None  # allocated when the job was submitted (_staged)
        per_piece = buffer.shape[1] // layout.host_block_bytes
        n = job.transfer.num_blocks
        if not store:
            # A load's DMAs read host blocks that work on the caller's stream may still
            # write; the staging halves order them after earlier loads.
            for stream in dma:
                self._after_caller(stream, job, lane)
        with torch.cuda.stream(kernel):
            slots = list(range(per_piece)) * (n // per_piece) + list(range(n % per_piece))
            ids = self._ids_on_device(lane, job.gpu_ids, slots)  # slot of block i: i % per_piece
            for lo in range(0, n, per_piece):
                half = lane.half
                lane.half ^= 1
                staging, free = lane.halves[half], lane.free[half]
                piece_ids = ids[:, lo : lo + per_piece]
                ranges = self._piece_dmas(job.cpu_ids[lo : lo + per_piece], staging)
                job.keep.append(ranges)
                if store:
                    # The half is free once both DMA streams have read it; neither DMA
                    # stream waits for the other.
                    for event in free:
                        rt.wait(kernel.cuda_stream, event)
                    self._launch(piece_ids, staging, to_host=True, ctas=_PACK_CTAS)
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
                    self._launch(piece_ids, staging, to_host=False, ctas=_PACK_CTAS)
                    for event in free:
                        rt.record(event, kernel.cuda_stream)
        return self._join(lane) if store else kernel

    def _piece_dmas(self, cpu_ids: list[int], staging: int) -> list[tuple[Addresses, ...]]:
        """The DMAs of one pack piece, as (host, staging, sizes) address arrays for each
        of the two DMA streams: one DMA per run of consecutive host blocks, never across
        a registration (chunk) boundary, dealt alternately to the streams."""
        size, base, chunk = self._layout.host_block_bytes, self._host_base, self._chunk_bytes
        host: list[int] = []
        local: list[int] = []
        sizes: list[int] = []
        for j, c in enumerate(cpu_ids):
            h = base + c * size
            # Blocks that tile chunks cross no boundary; a run is cut where a chunk starts.
            if host and h == host[-1] + sizes[-1] and (h - base) % chunk:
                sizes[-1] += size
            else:
                host.append(h)
                local.append(staging + j * size)
                sizes.append(size)
        if not self._blocks_tile_chunks:
            parts = self._cut_all(host, local, sizes)
            host, local, sizes = ([p[i] for p in parts] for i in range(3))
        return [
            (
                array.array("Q", host[k::2]),
                array.array("Q", local[k::2]),
                array.array("Q", sizes[k::2]),
            )
            for k in range(2)
        ]

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
        host, device, sizes = self._split_at_chunks(host, device, sizes)
        k, keep = len(streams), []
        for i, stream in enumerate(streams):
            h, d, z = (t[i::k].contiguous() for t in (host, device, sizes))
            if to_host:
                self._rt.copy_segments(h, d, z, stream.cuda_stream)
            else:
                self._rt.copy_segments(d, h, z, stream.cuda_stream)
            keep += [h, d, z]
        return keep

    def _cut(self, h: int, o: int, z: int) -> Iterator[tuple[int, int, int]]:
        """Range ``[h, h + z)`` of the region (and its partner at ``o``) cut at chunk
        boundaries."""
        base, chunk = self._host_base, self._chunk_bytes
        while z > 0:
            part = min(z, base + ((h - base) // chunk + 1) * chunk - h)
            yield h, o, part
            h, o, z = h + part, o + part, z - part

    def _cut_all(
        self, host: list[int], other: list[int], sizes: list[int]
    ) -> list[tuple[int, int, int]]:
        return [p for h, o, z in zip(host, other, sizes, strict=True) for p in self._cut(h, o, z)]

    def _split_at_chunks(
        self, host: torch.Tensor, other: torch.Tensor, sizes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ranges cut at chunk boundaries (the ones that cross one go last, in parts)."""
        base, chunk = self._host_base, self._chunk_bytes
        crosses = (host - base) // chunk != (host + sizes - 1 - base) // chunk
        if not bool(crosses.any()):
            return host, other, sizes
        parts = self._cut_all(
            host[crosses].tolist(), other[crosses].tolist(), sizes[crosses].tolist()
        )
        extra = torch.tensor(parts, dtype=torch.int64)
        keep = ~crosses
        return (
            torch.cat([host[keep], extra[:, 0]]),
            torch.cat([other[keep], extra[:, 1]]),
            torch.cat([sizes[keep], extra[:, 2]]),
        )

    def close(self) -> None:
        """Called in a worker thread once every transfer has finished."""
        self._submitter.close()
        for waiter in self._waiters.values():
            waiter.close()
        # Device memory back to torch's allocator at close, not when the manager object
        # is collected.
        self._ptrs = self._strides = torch.empty(0, dtype=torch.int64)
        with torch.cuda.device(self._index):
            for lane in self._lanes.values():
                lane.staging, lane.ids = None, self._ptrs
                for event in lane.events():
                    self._rt.destroy(event)
