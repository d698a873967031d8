"""CUDA transfer engine: KV blocks between device arrays and the pinned host region.

Each direction (store, load) has a lane of its own streams (``lanes``), so both
directions run at once. Jobs of one direction queued at once (their host blocks pinned)
run in submission order; a job that waited for pinning is queued when its chunks are
pinned, and pageable jobs have a stream of their own. The parts:

- ``plan``: pure addresses, chunk cuts, pack pieces and the choice of method;
- ``methods``: the copy methods (batch, pack, kernel; pageable copies) on a lane;
- ``lanes``: a direction's streams, events and device buffers;
- ``completion``: waiter threads, the loop-side sweep, and the store submitter thread.

Submission: loads, and small stores, are queued on the calling (event loop) thread; other
stores are queued by a submitter thread, so the loop is not held for the milliseconds of
driver calls a large store takes, and a load submitted next starts at once.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import structlog
import torch

from asyncpin._cudart import Runtime, batch_copy_available
from asyncpin.abc import EngineSetup
from asyncpin.engines.cuda.completion import Completion, Submitter, loop_hooks
from asyncpin.engines.cuda.kernel import kernel_available
from asyncpin.engines.cuda.lanes import Lane, give_back, own_stream
from asyncpin.engines.cuda.methods import CopyMethods, load_kernel, on_device
from asyncpin.engines.cuda.plan import (
    BATCH_MIN_BLOCK_BYTES,
    KERNEL_WORD,
    LOOP_STORE_MAX_BLOCKS,
    AddressPlan,
    choose_method,
    is_run,
    is_small,
    kernel_misalignment,
)
from asyncpin.errors import BackendCallError, LifecycleError
from asyncpin.gate import outside_captures, unless_capturing
from asyncpin.transfers import Direction, TransferJob, copy_in_thread

__all__ = ["KERNEL_WORD", "CudaTransferEngine", "batch_copy_available", "kernel_misalignment"]

_log = structlog.get_logger("asyncpin")


class CudaTransferEngine:
    """Store/load lanes, copy methods and completion waiters for one KV layout."""

    name = "cuda"
    # Prepared after the manager's entry, before the region pins: transfers wait for it.
    prepare_in_background = True
    # Takes pageable jobs before prepare() (they need none of it): under the "pageable"
    # policy they go at once, even while pinning_paused() holds the set-up back.
    pageable_before_prepare = True
    # Large stores go to the submitter thread (False: every store is queued by the caller).
    thread_stores = True
    # Stores of at most this many bytes (and LOOP_STORE_MAX_BLOCKS blocks, by pack or
    # kernel) are queued on the event loop, as loads are: the hop to the submitter thread
    # costs about what their queuing does (H200, 32 KiB blocks, 32 MiB stores: resumed
    # after 1.36 ms queued on the loop against 1.62 ms through the thread in one run,
    # 1.04 against 1.07 in another). A 256 MiB store resumed 0.17-0.25 ms sooner queued
    # whole on the loop (runs 82, 150, 151), but its queuing held the loop 0.6-0.9 ms and
    # a load submitted next waited for it: both at once reached 83% of contiguous DMA at
    # the median (78-91%, runs 153, 156, 157) against 85.5% through the thread (80-92%,
    # runs 151, 153, 157). Queuing the first piece on the loop and the rest in the
    # thread was worse at both (run 157: the thread waited for the GIL while the bus
    # idled). bench/RESULTS.md#transfers-123.
    loop_store_max_bytes = 64 << 20
    # Made in a worker thread while the manager enters (``setup.loop`` is the loop): on
    # the loop, this module's import and the address plan over every array were what
    # the loop ran during a 64-100 GiB entry beside a model's threads, which lagged it
    # 4.6-11 ms (bench/RESULTS.md#startup).
    made_off_loop = True

    def __init__(self, setup: EngineSetup) -> None:
        layout, host_blocks = setup.layout, setup.host_blocks
        self._layout = layout
        self._device = layout.device
        # A CUDA tensor's device always has its index; the layout takes it from them.
        self._index: int = layout.device.index if layout.device.index is not None else 0
        self._start_soon = setup.start_soon
        # The copy kernel may touch pinned host blocks only if CUDA registered them.
        self._uva = setup.host_registered
        hooks = loop_hooks(setup.start_soon, setup.loop)

        self._rt = Runtime()
        ptrs = [a.data_ptr() for a in layout.arrays]
        strides = [a.stride(0) * a.dtype.itemsize for a in layout.arrays]
        self._plan = AddressPlan(
            array_ptrs=ptrs,
            array_strides=strides,
            array_bytes=layout.array_block_bytes,
            host_base=host_blocks.data_ptr(),
            chunk_bytes=setup.chunk_bytes,
            # Rows of a region that interleaves several ranks' host blocks are further
            # apart than a host block; chunks count from the region's start.
            host_stride=host_blocks.stride(0),
            region_base=host_blocks.untyped_storage().data_ptr(),
        )
        # The copy kernel (PTX the driver translates: tens of ms, GIL released) is loaded
        # by prepare(), in the background; which methods exist is known now.
        self._kernel_methods = kernel_available(self._rt)
        self._misaligned = kernel_misalignment(
            array_ptrs=ptrs,
            array_strides=strides,
            array_bytes=layout.array_block_bytes,
            host_bases=[self._plan.host_base],
            host_stride=self._plan.host_stride,
        )
        self._copies = CopyMethods(self._rt, self._plan, None)
        self._fallbacks_logged: set[str] = set()
        self._lanes: dict[Direction, Lane] = {}  # made by prepare()
        self._streams: list[torch.cuda.Stream] = []  # every stream it took (own_stream)
        # Pageable jobs' streams, one per direction, made by the first such job's worker
        # thread: a pageable job may come before prepare() (the contract).
        self._pageable: dict[Direction, torch.cuda.Stream] = {}
        self._pageable_lock = threading.Lock()
        # Their threads start in prepare(): starting a thread maps its stack, which waits
        # for the process's memory-map lock while pinning holds it (tens of ms).
        self._completion = Completion(hooks)
        self._submitter = Submitter(
            "asyncpin-store-submitter", self._enqueue, self._completion.report
        )
        self._num_host_blocks = host_blocks.shape[0]

    def _load(self) -> None:
        """The part of prepare() that makes no device buffer: the copy kernel loaded (the
        process's first manager; the driver may load it into every context then), the
        threads started. Under the capture gate, as the rest of prepare()."""
        kernel = None
        try:
            kernel = load_kernel(self._rt)
        except BackendCallError as exc:
            self._misaligned = f"the copy kernel could not be loaded: {exc}"
        if self._kernel_methods and self._misaligned is not None:
            # methods() offered pack and kernel: they run as batch, saying why.
            _log.warning("transfer.kernel_disabled", reason=self._misaligned, fallback="batch")
        self._copies.kernel = kernel if self._misaligned is None else None
        self._completion.start()
        self._submitter.start()

    def methods(self) -> tuple[str, ...]:
        """The methods a transfer may ask for: pack and kernel where the runtime can load
        the copy kernel (on a layout it cannot run on, they run as batch)."""
        return ("batch", "pack", "kernel") if self._kernel_methods else ("batch",)

    def prepare(self) -> None:
        """Streams, events and device buffers, then the copy kernel loaded (the first
        manager of a process) and loaded onto this device by launching it over no
        segment. All of it in a worker thread at open, and none of it while a graph
        capture is under way on another thread: a device allocation, a stream
        synchronisation or a module load would break it. One kernel serves every
        transfer (``asyncpin.engines.cuda.kernel``), so nothing is loaded later."""
        layout, rt, copies = self._layout, self._rt, self._copies
        # A store's host blocks are distinct, and so are a load's device blocks.
        max_ids = {"store": self._num_host_blocks, "load": layout.num_blocks}
        with outside_captures(), torch.cuda.device(self._index):
            self._load()
            if copies.kernel is not None:  # the copy kernel's tables
                # The ids 0, 1, 2, ... up to the most blocks a job can move: a store's
                # host ids and a load's device ids are distinct (the router refuses
                # duplicate destinations), so a job's id runs and a pack piece's staging
                # slots are slices of this table.
                copies.to_device(self._device, max(layout.num_blocks, self._num_host_blocks))
            for d in ("store", "load"):
                lane = Lane(rt, self._device, max_ids[d] if copies.kernel else 0, self._streams)
                whole = self._plan.all_arrays
                if (
                    copies.kernel is not None
                    and self._plan.mean_block_bytes(whole) < BATCH_MIN_BLOCK_BYTES
                ):
                    lane.allocate_staging(rt, layout.host_block_bytes)  # pack is the default
                self._lanes[d] = lane
            if copies.kernel is None:
                return
            for d, lane in self._lanes.items():
                ids, base = lane.ids.data_ptr(), self._plan.host_base
                copies.launch(lane.kernel, ids, ids, 0, base, to_host=d == "store", ctas=1)
                lane.kernel.synchronize()

    def check_caller(self, direction: Direction) -> None:
        """LifecycleError if the caller's current stream is capturing a CUDA graph: the
        copy would have to wait for work inside the graph, which breaks the capture."""
        caller = torch._C._cuda_getCurrentRawStream(self._index)
        if self._rt.capturing(caller):
            raise LifecycleError(
                f"{direction}() was called while this thread's current stream captures a "
                "CUDA graph: a transfer cannot be part of one; call it before or after the "
                "capture"
            )

    def record_ready(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def _choose(self, job: TransferJob, pageable: bool) -> str:
        """The method a job runs with (``plan.choose_method``); the first request per
        method that runs as batch because the copy kernel cannot run on this layout is
        logged."""
        kernel_usable = self._copies.kernel is not None
        fallback = not (pageable or kernel_usable) and job.method in ("pack", "kernel")
        if fallback and job.method not in self._fallbacks_logged:
            self._fallbacks_logged.add(job.method)
            _log.warning(
                "transfer.method_fallback",
                requested=job.method,
                fallback="batch",
                reason=self._misaligned,
            )
        elif job.method == "kernel" and not (
            pageable or self._uva or "uva" in self._fallbacks_logged
        ):
            self._fallbacks_logged.add("uva")
            _log.warning(
                "transfer.method_fallback",
                requested="kernel",
                fallback="pack",
                reason="the pin backend does not register host memory with CUDA",
            )
        arrays = job.arrays or self._plan.all_arrays
        return choose_method(
            job.method,
            num_blocks=job.transfer.num_blocks,
            num_arrays=len(arrays),
            block_bytes=self._plan.mean_block_bytes(arrays),
            pageable=pageable,
            kernel_usable=kernel_usable,
            staged=lambda: self._staged(job),
            partial=job.arrays is not None,
            runs=lambda: is_run(job.gpu_ids) and is_run(job.cpu_ids),
            uva=self._uva,
        )

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
                with on_device(self._index):
                    lane.allocate_staging(self._rt, self._layout.host_block_bytes)
            # torch.OutOfMemoryError is a RuntimeError; a failed runtime call (recording
            # the staging events) a BackendCallError.
            except (RuntimeError, BackendCallError) as exc:
                _log.warning("transfer.staging_failed", fallback="batch", error=repr(exc))
                return False
            return True

    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        method = self._choose(job, pageable)
        job.transfer.method = method
        job.transfer.path = "pageable" if pageable else "pinned"
        if job.transfer.num_blocks == 0:
            # Nothing to copy, but an event all the same, as README promises a load's
            # (a step with nothing to load still orders its compute after it): the
            # caller's stream as of the call, which orders nothing new.
            job.transfer.event = job.ready if job.ready is not None else self.record_ready()
            job.finish()
            return
        if pageable:
            # Copies from pageable memory make the host wait: off the event loop.
            if job.ready is None:
                job.ready = self.record_ready()
            self._start_soon(copy_in_thread, job, self._copy_pageable)
            return
        self._completion.watch(job)
        if job.transfer.direction == "store" and (
            self._submitter.busy()
            or (
                self.thread_stores
                and not self._queued_on_loop(job, method)
                and not self._completion.starved()
            )
        ):
            # Stores are queued by the submitter thread unless cheap to queue here
            # (``_queued_on_loop``) and nothing is ahead of them there. Loads are queued
            # here, on the calling thread, so that ``transfer.event`` is recorded by the
            # time load() returns.
            if job.ready is None:
                job.ready = self.record_ready()  # the caller's stream, as of now
            self._submitter.submit(job, method)
        else:
            self._enqueue(job, method)

    def _queued_on_loop(self, job: TransferJob, method: str) -> bool:
        """Whether a store is cheap enough to queue on the event loop: small (up to 64
        segments), or at most ``loop_store_max_bytes`` and ``LOOP_STORE_MAX_BLOCKS``
        blocks by a method whose queuing does not grow with the segments (pack: one DMA
        per run of host blocks; kernel: one launch)."""
        n = job.transfer.num_blocks
        if is_small(n, len(job.arrays or self._plan.all_arrays)):
            return True
        return (
            method in ("pack", "kernel")
            and n <= LOOP_STORE_MAX_BLOCKS
            and job.transfer.nbytes <= self.loop_store_max_bytes
        )

    def _copy_pageable(self, job: TransferJob) -> None:
        """In a worker thread: the job's copy on its direction's pageable stream."""
        direction = job.transfer.direction
        with outside_captures(), on_device(self._index):
            with self._pageable_lock:
                stream = self._pageable.get(direction)
                if stream is None:
                    stream = self._pageable[direction] = own_stream(
                        self._rt, self._device, self._streams
                    )
            self._copies.pageable(job, stream)

    def _enqueue(self, job: TransferJob, method: str) -> None:
        """From the event loop thread or the store submitter: queue the copy and its
        completion event. Once a stream has work of this job, a failure is reported
        through the handle only after the job's streams have drained, so no buffer is
        released while a copy may still touch it. (It raises only when not even the
        completion event can be queued; it then waits for the lane's streams first.)"""
        direction = job.transfer.direction
        lane, rt, copies = self._lanes[direction], self._rt, self._copies
        with on_device(self._index):
            if job.ready is None:
                # The raw handle of torch's current stream (what torch's own generated
                # code reads): 0.3 us, against 5.6 us for torch.cuda.current_stream().
                caller = torch._C._cuda_getCurrentRawStream(self._index)
                rt.record(lane.ready, caller)
            try:
                if method == "batch":
                    tail = copies.batch(job, lane)
                elif method == "kernel":
                    tail = copies.uva_kernel(job, lane)
                else:
                    tail = copies.pack(job, lane)
            except Exception as exc:
                job.failure, tail = exc, None
            try:
                if tail is None:
                    tail = copies.join(lane)  # whatever was queued, on any lane stream
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
        self._completion.wait(job, done)

    def close(self) -> None:
        """Called in a worker thread once every transfer has finished."""
        self._submitter.close()
        self._completion.close()
        # Device memory back to torch's allocator at close, not when the manager object
        # is collected.
        self._copies.release()
        with self._pageable_lock:
            streams, self._streams = self._streams, []
            self._pageable.clear()
        lanes, self._lanes = self._lanes, {}  # released once, whoever calls again
        with torch.cuda.device(self._index):
            for lane in lanes.values():
                lane.staging, lane.ids = None, torch.empty(0, dtype=torch.int64)
                for event in lane.events():
                    self._rt.destroy(event)
        give_back(streams)  # idle: every transfer has finished

    def streams(self) -> list[int]:
        """The streams the engine took (its lanes' and its pageable copies'), as raw
        handles; none once it is closed."""
        with self._pageable_lock:
            return [s.cuda_stream for s in self._streams]
