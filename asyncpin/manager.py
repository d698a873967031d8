"""OffloadManager: the one public entry; owns a host region, pins it in the background,
and closes in an order that never frees memory the device may still use."""

from __future__ import annotations

import enum
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.to_thread
import structlog
import torch

from asyncpin import _sys
from asyncpin._config import (
    DEFAULT_CHUNK_BYTES,
    ManagerConfig,
    UnpinnedPolicy,
    check_num_host_blocks,
)
from asyncpin._router import TransferCounts, TransferRouter
from asyncpin._tasks import OwnedTasks, current_loop
from asyncpin.abc import EngineFactory, EngineSetup, PinBackend, TransferEngine
from asyncpin.backends import resolve_backend
from asyncpin.engines import make_engine
from asyncpin.errors import (
    ConfigError,
    ForkedManagerError,
    LifecycleError,
    PinError,
    PreflightError,
)
from asyncpin.gate import PausedContext, PauseGate, held_here
from asyncpin.kv import KVLayout
from asyncpin.pinning import PinnedSignal, PinScheduler
from asyncpin.region import Backing, HostRegion, HugePages
from asyncpin.transfers import Method, Transfer, host_blocks_view

__all__ = ["ManagerState", "ManagerStats", "OffloadManager"]

_ids = itertools.count(1)


class ManagerState(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


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


class OffloadManager:
    """A pinned host buffer for KV blocks, embedded in an async program.

    ``async with OffloadManager(nbytes) as mgr`` returns once the region is mapped (its
    cost does not grow with ``nbytes``); pinning goes on in worker threads. ``await
    mgr.pinned`` completes when every chunk is pinned or raises :class:`PinError`;
    ``mgr.is_pinned()`` answers at once.

    Close contract (``aclose()`` and ``__aexit__``): idempotent, safe from any state and
    from concurrent callers, shielded from the caller's cancellation, and always in this
    order: refuse new use (``ClosedResourceError``) → stop the pin pipeline and wait for
    its in-flight calls → unpin every chunk that was pinned, once → release the mapping.
    A chunk whose unpin failed is left mapped (leaked and logged), never freed under the
    device.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        backend: str | PinBackend = "auto",
        device: int | None = None,
        backing: Backing = "anonymous",
        name: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        prefault_threads: int | None = None,
        pin_threads: int = 1,
        pin_interval_s: float = 0.0,
        hugepages: HugePages = "thp",
        logger: Any = None,
        kv_layout: KVLayout | None = None,
        num_host_blocks: int | None = None,
        unpinned_policy: UnpinnedPolicy = "wait",
        engine: str | EngineFactory = "auto",
        _attach: bool = False,
    ) -> None:
        self._config = config = ManagerConfig.validated(
            nbytes,
            backing=backing,
            name=name,
            chunk_bytes=chunk_bytes,
            prefault_threads=prefault_threads,
            pin_threads=pin_threads,
            pin_interval_s=pin_interval_s,
            hugepages=hugepages,
            kv_layout=kv_layout,
            num_host_blocks=num_host_blocks,
            unpinned_policy=unpinned_policy,
            engine=engine,
            attach=_attach,
        )
        self._nbytes = config.nbytes
        self._backend = resolve_backend(backend, device)
        # Never ask one backend call for more than the platform takes in one go.
        self._chunk_bytes = min(
            config.chunk_bytes, self._backend.max_pin_bytes // _sys.PAGE_SIZE * _sys.PAGE_SIZE
        )
        self._engine: TransferEngine | None = None
        self._router: TransferRouter | None = None
        self._loop_thread: int | None = None  # the thread that entered: store/load only there
        self._host_blocks: torch.Tensor | None = None
        self._observers: list[Callable[[Transfer], None]] = []
        self._id = next(_ids)
        base = logger if logger is not None else structlog.get_logger("asyncpin")
        self._log = base.bind(manager=self._id, backend=self._backend.name)
        self._state = ManagerState.NEW
        self._gate = PauseGate()
        self._pinned = PinnedSignal()
        self._closed_event = anyio.Event()
        self._region: HostRegion | None = None
        self._scheduler: PinScheduler | None = None
        # The manager's background tasks (the pin pipeline, the engine's, transfers waiting
        # for a chunk): its own, not the entering task's, so any task can close it.
        self._tasks = OwnedTasks(self._log)
        # The close order runs as a task of its own: a caller cancelled while it waits
        # (asyncio's native cancel, Ctrl-C) stops waiting, never the close.
        self._closer = OwnedTasks(self._log)
        self._pid: int | None = None  # the process that opened it
        self._seconds_to_enter: float | None = None
        self._hugepage_bytes: int | None = None
        self._close_seconds: float | None = None
        self._leaked = 0

    @classmethod
    def for_kv(cls, layout: KVLayout, num_host_blocks: int, **kwargs: Any) -> OffloadManager:
        """A manager whose region holds ``num_host_blocks`` host blocks of ``layout``."""
        check_num_host_blocks(num_host_blocks)
        if layout.device.type == "cuda":
            # Pinned for the GPU the blocks move to, whichever device is current.
            kwargs.setdefault("device", layout.device.index)
        return cls(
            layout.host_block_bytes * num_host_blocks,
            kv_layout=layout,
            num_host_blocks=num_host_blocks,
            **kwargs,
        )

    @classmethod
    def attached(cls, name: str, **kwargs: Any) -> OffloadManager:
        """A manager over the shared region another process created as ``name``.

        It pins its own mapping (as CUDA requires per process) and never unlinks it. With
        ``kv_layout=`` and ``num_host_blocks=``, entering raises ConfigError (and releases
        the mapping) if the region is smaller than ``num_host_blocks`` host blocks.
        """
        return cls(0, backing="shared", name=name, _attach=True, **kwargs)

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> OffloadManager:
        if self._state is not ManagerState.NEW:
            raise RuntimeError("an OffloadManager can be entered only once")
        t0 = time.perf_counter()
        config = self._config
        region = self._map_region()
        try:
            self._nbytes = region.nbytes
            layout = config.kv_layout
            if layout is not None:
                needed = config.num_host_blocks * layout.host_block_bytes
                if region.nbytes < needed:
                    raise ConfigError(
                        f"shared region {config.name!r} holds {region.nbytes} bytes: too small "
                        f"for {config.num_host_blocks} host blocks of "
                        f"{layout.host_block_bytes} bytes ({needed} bytes)"
                    )
            chunks = region.chunks(self._chunk_bytes)
            self._scheduler = PinScheduler(
                region,
                self._backend,
                chunks,
                prefault_threads=config.prefault_threads,
                pin_threads=config.pin_threads,
                pin_interval_s=config.pin_interval_s,
                gate=self._gate,
                pinned=self._pinned,
                log=self._log,
                started_at=t0,
            )
            self._tasks.bind()
            self._closer.bind()
            if layout is not None:
                self._engine = self._open_engine(region, layout)
                # Off the event loop: compiling a copy kernel can take a second.
                await anyio.to_thread.run_sync(self._engine.prepare)
            if self._state is not ManagerState.NEW:
                # Closed by another task while this one waited: it must not open now.
                raise anyio.ClosedResourceError("the manager was closed while it was entered")
        except BaseException:  # a cancellation included
            if self._engine is not None:
                self._engine.close()
                self._engine = None
            self._router = None
            self._host_blocks = None  # the manager's own view: it must not hold the range
            region.release()
            raise
        self._region = region
        self._state = ManagerState.OPEN
        self._loop_thread = threading.get_ident()
        self._pid = os.getpid()
        self._tasks.start_soon(self._run_pinning)
        self._seconds_to_enter = time.perf_counter() - t0
        self._log.info(
            "manager.opened",
            nbytes=self._nbytes,
            chunks=len(chunks),
            backing=region.backing,
            region_name=region.name,
            enter_seconds=self._seconds_to_enter,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        # No cancel scope spans the body: this is aclose(), from whichever task runs it,
        # and the body's exception goes on unchanged.
        await self.aclose()
        return None

    def _map_region(self) -> HostRegion:
        config = self._config
        if config.attach:
            assert config.name is not None
            return HostRegion.attach(
                config.name,
                hugepages=config.hugepages,
                preflight=self._backend.preflight,
                layout=config.layout_description(),
            )
        self._preflight()
        region = HostRegion.create(
            config.nbytes,
            backing=config.backing,
            name=config.name,
            hugepages=config.hugepages,
            layout=config.layout_description(),
        )
        if region.reclaimed_stale:
            self._log.warning(
                "region.reclaimed_stale",
                region_name=region.name,
                reason="its creator was gone; the new region replaces it",
            )
        return region

    def _open_engine(self, region: HostRegion, layout: KVLayout) -> TransferEngine:
        """The engine and the router in front of it, over the region's host blocks."""
        config = self._config
        self._host_blocks = host_blocks_view(region.view(), layout, config.num_host_blocks)
        setup = EngineSetup(layout, self._host_blocks, self._chunk_bytes, self._tasks.start_soon)
        engine = make_engine(config.engine, setup)
        assert self._scheduler is not None
        self._router = TransferRouter(
            layout=layout,
            num_host_blocks=config.num_host_blocks,
            engine=engine,
            table=self._scheduler.table,
            region=region,
            policy=config.unpinned_policy,
            start_soon=self._tasks.start_soon,
            observers=self._observers,
            log=self._log,
        )
        return engine

    def _preflight(self) -> None:
        available = _sys.mem_available_bytes()
        # A hugetlb region comes from the reserved pool, which MemAvailable leaves out;
        # the pool itself is checked when the region is mapped.
        if self._config.hugepages != "hugetlb" and self._nbytes > available:
            raise PreflightError(
                "memory",
                self._nbytes,
                available,
                "ask for a smaller buffer or free memory (MemAvailable and the cgroup "
                "memory limit both count)",
            )
        self._backend.preflight(self._nbytes)

    async def _run_pinning(self) -> None:
        scheduler = self._scheduler
        assert scheduler is not None
        self._log.info("pin.started", chunks=len(scheduler.chunks), chunk_bytes=self._chunk_bytes)
        await scheduler.run()  # it settles `pinned`, but for a close

    def _forked(self) -> bool:
        """Whether this process is a fork of the one that opened the manager."""
        return self._pid is not None and os.getpid() != self._pid

    def _check_process(self) -> None:
        if self._forked():
            raise ForkedManagerError(
                f"this OffloadManager belongs to process {self._pid}, not to this forked "
                f"child ({os.getpid()}): its region is not mapped here and its pins are the "
                "parent's; open a new manager in this process"
            )

    def _check_can_close(self) -> None:
        """Refuse a close that could only hang or break, before anything changes."""
        held = held_here(self._gate)
        if held is not None:
            raise LifecycleError(
                f"aclose() called inside {held}: the close waits for the pin calls and "
                f"transfers that {held} holds back, so it would never return; close the "
                f"manager after leaving the {held} block (it is still open)"
            )
        if current_loop() is not self._tasks.loop:
            raise LifecycleError(
                "aclose() called from another event loop than the one that opened the "
                "manager, whose tasks run there: close it on that loop (from another "
                "thread, through anyio.from_thread.run(mgr.aclose))"
            )

    async def aclose(self) -> None:
        """Close in order; see the class docstring for the guarantees.

        From any task of the loop that opened the manager. Refused with LifecycleError,
        changing nothing, inside ``pinning_paused()`` or ``capture_gate()`` (the close
        would wait for the hold to end) or from another event loop. In a process forked
        from the owner it does nothing: the region and its pins are the parent's."""
        if self._forked() or self._state is ManagerState.CLOSED:
            return
        if self._state is not ManagerState.NEW:
            self._check_can_close()
        with anyio.CancelScope(shield=True):
            if self._state is ManagerState.NEW:
                self._state = ManagerState.CLOSED
                self._pinned.resolve(anyio.ClosedResourceError("the manager was never opened"))
                self._closed_event.set()
                return
            if self._state is ManagerState.OPEN:
                self._state = ManagerState.CLOSING
                self._closer.start_soon(self._close_in_order)
            await self._closed_event.wait()

    async def _close_in_order(self) -> None:
        """The close order, in a task of its own that no caller's cancellation reaches."""
        with anyio.CancelScope(shield=True):
            t0 = time.perf_counter()
            scheduler, region = self._scheduler, self._region
            assert scheduler is not None and region is not None
            scheduler.stop()
            self._log.info("manager.closing", pinned_bytes=scheduler.pinned_bytes)
            try:
                await scheduler.done.wait()
                if self._router is not None:
                    await self._router.drained()  # in-flight transfers' device work
                # What is left of the manager's tasks (a sweep between periods, a copy
                # task settling its transfer) ends before the engine closes.
                await self._tasks.aclose()
                # Its own thread slot: the application's default pool may be full.
                limiter = anyio.CapacityLimiter(1)
                if self._engine is not None:
                    # Off the loop: it joins the engine's threads, and a completion waiter
                    # may be held at the capture gate until a capture ends.
                    await anyio.to_thread.run_sync(self._engine.close, limiter=limiter)
                # The manager's own views go, so that only the application's can keep the
                # address range mapped past close.
                self._engine = None
                self._host_blocks = None
                leaked = await anyio.to_thread.run_sync(scheduler.unpin_all, limiter=limiter)
                for chunk, exc in leaked:
                    self._log.error(
                        "unpin.failed",
                        chunk=chunk.index,
                        offset=chunk.offset,
                        nbytes=chunk.nbytes,
                        error=str(exc),
                        action="left mapped (leaked): no device access can hit freed memory",
                    )
                self._leaked = len(leaked)
                # munmap of many GiB takes tens of ms: off the event loop too.
                keep = [chunk for chunk, _ in leaked]
                unmapped = await anyio.to_thread.run_sync(
                    lambda: region.release(keep=keep), limiter=limiter
                )
                if not unmapped:
                    self._log.warning(
                        "region.kept_by_views",
                        nbytes=region.nbytes,
                        action="unpinned; the range stays mapped until the last view of it is gone",
                    )
            finally:
                await self._tasks.aclose()  # no task outlives the close (a no-op if done)
                self._pinned.resolve(
                    anyio.ClosedResourceError("the manager closed before pinning completed")
                )
                self._close_seconds = time.perf_counter() - t0
                self._state = ManagerState.CLOSED
                self._closed_event.set()
                self._log.info(
                    "manager.closed", close_seconds=self._close_seconds, leaked_chunks=self._leaked
                )

    # -- queries ----------------------------------------------------------------------

    @property
    def pinned(self) -> PinnedSignal:
        """Awaitable: done when all chunks are pinned; raises PinError if pinning failed."""
        self._check_process()
        return self._pinned

    def is_pinned(self) -> bool:
        """Non-blocking readiness probe: True while open with every chunk pinned (never in
        a forked child)."""
        return self.state is ManagerState.OPEN and self._pinned.succeeded()

    @property
    def pin_error(self) -> PinError | None:
        error = self._pinned.error
        return error if isinstance(error, PinError) else None

    @property
    def state(self) -> ManagerState:
        """CLOSED in a forked child: nothing of the manager is usable there."""
        return ManagerState.CLOSED if self._forked() else self._state

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def backend(self) -> PinBackend:
        return self._backend

    @property
    def region_name(self) -> str | None:
        return self._region.name if self._region is not None else self._config.name

    def pinning_paused(self) -> PausedContext:
        """Hold pin and unpin calls: ``with`` from any thread, or ``async with``.

        On entry it waits for the call in flight to return; until exit, no new call
        starts. Wrap CUDA graph capture (or a whole warm-up) in it. Note that close's
        unpins also wait for the pause to end: ``aclose()`` inside it raises
        LifecycleError.
        """
        self._check_process()
        return self._gate.paused()

    def host_view(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor over part of the region. It keeps that memory mapped while it
        lives, past close too (then no longer pinned): drop it to give the memory back."""
        self._check_process()
        if self._state is not ManagerState.OPEN or self._region is None:
            raise anyio.ClosedResourceError("the manager is not open")
        return self._region.view(offset, nbytes)

    async def measure_hugepages(self) -> int:
        """Bytes of the region backed by huge pages, measured now in a worker thread
        (reading /proc/self/smaps walks every mapping of the process: 100+ ms in a CUDA
        process, so never on the event loop); ``stats().hugepage_bytes`` keeps the value."""
        self._check_process()
        region = self._region
        if self._state is not ManagerState.OPEN or region is None:
            raise anyio.ClosedResourceError("the manager is not open")
        self._hugepage_bytes = await anyio.to_thread.run_sync(region.hugepage_bytes)
        return self._hugepage_bytes

    def _seconds_to_pinned(self) -> float | None:
        scheduler = self._scheduler
        return scheduler.seconds_to_pinned if scheduler is not None else None

    def _gib_per_s(self) -> float | None:
        seconds = self._seconds_to_pinned()
        return self._nbytes / (1 << 30) / seconds if seconds else None

    def stats(self) -> ManagerStats:
        scheduler, region = self._scheduler, self._region
        if self._forked():
            scheduler = None  # its chunks are pinned in the parent, not here
        error = self._pinned.error
        router = self._router
        counts = router.counts if router is not None else TransferCounts()
        return ManagerStats(
            state=self.state.value,
            backend=self._backend.name,
            backing=self._config.backing,
            nbytes=self._nbytes,
            chunk_bytes=self._chunk_bytes,
            chunks_total=len(scheduler.chunks) if scheduler else 0,
            chunks_pinned=scheduler.chunks_pinned if scheduler else 0,
            pinned_bytes=scheduler.pinned_bytes if scheduler else 0,
            chunks_leaked=self._leaked,
            seconds_to_enter=self._seconds_to_enter,
            seconds_to_pinned=self._seconds_to_pinned(),
            pin_gib_per_s=self._gib_per_s(),
            hugepages=self._config.hugepages,
            hugepage_bytes=self._hugepage_bytes,
            slowest_pin_seconds=scheduler.slowest_pin_seconds if scheduler else 0.0,
            unpin_seconds=scheduler.unpin_seconds if scheduler else None,
            close_seconds=self._close_seconds,
            error=str(error) if isinstance(error, PinError) else None,
            transfers_stored=counts.stored,
            transfers_loaded=counts.loaded,
            bytes_stored=counts.bytes_stored,
            bytes_loaded=counts.bytes_loaded,
            transfers_waited_for_pinning=counts.waited,
            transfers_pageable=counts.pageable,
            transfers_failed=counts.failed,
            transfers_in_flight=len(router.in_flight) if router is not None else 0,
            mapped_by_views_bytes=region.mapped_by_views_bytes() if region is not None else 0,
        )

    # -- KV transfers -----------------------------------------------------------------

    @property
    def kv_layout(self) -> KVLayout | None:
        return self._config.kv_layout

    def host_blocks(self) -> torch.Tensor:
        """``[num_host_blocks, num_arrays, *block_shape]`` view of the host KV blocks."""
        self._check_process()
        if self._state is not ManagerState.OPEN:
            raise anyio.ClosedResourceError("the manager is not open")
        if self._host_blocks is None:
            raise ConfigError("this manager has no KV layout (use OffloadManager.for_kv)")
        return self._host_blocks

    def store(
        self,
        gpu_block_ids: Sequence[int] | torch.Tensor,
        cpu_block_ids: Sequence[int] | torch.Tensor,
        *,
        method: Method = "auto",
    ) -> Transfer:
        """Copy device KV blocks to host blocks (all arrays at once); returns the handle.

        The copy first waits for work already queued on the caller's current stream (the
        work that produced the blocks). Bad input raises InvalidTransferError before
        anything is enqueued; a closed manager raises ClosedResourceError."""
        return self._submit("store", gpu_block_ids, cpu_block_ids, method)

    def load(
        self,
        cpu_block_ids: Sequence[int] | torch.Tensor,
        gpu_block_ids: Sequence[int] | torch.Tensor,
        *,
        method: Method = "auto",
    ) -> Transfer:
        """Copy host blocks into device KV blocks; returns the handle. On CUDA, the
        handle's ``event`` lets the compute stream wait for the load without blocking."""
        return self._submit("load", gpu_block_ids, cpu_block_ids, method)

    def _submit(
        self,
        direction: Literal["store", "load"],
        gpu_block_ids: Sequence[int] | torch.Tensor,
        cpu_block_ids: Sequence[int] | torch.Tensor,
        method: Method,
    ) -> Transfer:
        self._check_process()
        if self._state is not ManagerState.OPEN:
            raise anyio.ClosedResourceError("the manager is closed to new transfers")
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError(
                f"{direction}() must be called from the event loop's thread (the one that "
                "entered the manager); from another thread, go through "
                "anyio.from_thread.run_sync"
            )
        if self._router is None:
            raise ConfigError("this manager has no KV layout (use OffloadManager.for_kv)")
        return self._router.submit(direction, gpu_block_ids, cpu_block_ids, method)

    def add_transfer_observer(self, observer: Callable[[Transfer], None]) -> None:
        """Call ``observer(transfer)`` on the event loop as each transfer of this manager
        finishes, failed ones included (``transfer.error``), once ``stats()`` counts it;
        ``transfer.elapsed_s`` is set. Add it before entering to see every transfer. It
        must be quick and not block; an exception from it is logged
        (``transfer.observer_failed``) and never reaches the transfer or the manager."""
        self._observers.append(observer)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<OffloadManager #{self._id} {s.state} backend={s.backend} "
            f"pinned={s.pinned_bytes}/{s.nbytes} chunks={s.chunks_pinned}/{s.chunks_total}>"
        )

