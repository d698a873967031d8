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
from asyncpin._opened import Opened
from asyncpin._router import TransferCounts
from asyncpin._tasks import OwnedTasks, current_loop
from asyncpin.abc import EngineFactory, PinBackend, TransferEngine
from asyncpin.backends import resolve_backend
from asyncpin.errors import (
    ConfigError,
    ForkedManagerError,
    LifecycleError,
    PinError,
)
from asyncpin.gate import PausedContext, PauseGate, held_here
from asyncpin.kv import KVLayout
from asyncpin.pinning import PinnedSignal
from asyncpin.region import Backing, HugePages
from asyncpin.transfers import Method, Transfer

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
        self._opened: Opened | None = None
        self._loop_thread: int | None = None  # the thread that entered: store/load only there
        self._observers: list[Callable[[Transfer], None]] = []
        self._id = next(_ids)
        base = logger if logger is not None else structlog.get_logger("asyncpin")
        self._log = base.bind(manager=self._id, backend=self._backend.name)
        self._state = ManagerState.NEW
        self._gate = PauseGate()
        self._pinned = PinnedSignal()
        self._closed_event = anyio.Event()
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
        opened = await Opened.open(
            self._config,
            self._backend,
            chunk_bytes=self._chunk_bytes,
            gate=self._gate,
            pinned=self._pinned,
            tasks=self._tasks,
            observers=self._observers,
            log=self._log,
            started_at=t0,
        )
        if self._state is not ManagerState.NEW:
            # Closed by another task while this one waited: it must not open now.
            opened.drop_engine()
            opened.region.release()
            raise anyio.ClosedResourceError("the manager was closed while it was entered")
        self._closer.bind()
        self._opened = opened
        self._nbytes = opened.region.nbytes
        self._state = ManagerState.OPEN
        self._loop_thread = threading.get_ident()
        self._pid = os.getpid()
        scheduler = opened.scheduler
        self._tasks.start_soon(scheduler.run)  # it settles `pinned`, but for a close
        self._seconds_to_enter = time.perf_counter() - t0
        self._log.info(
            "manager.opened",
            nbytes=self._nbytes,
            chunks=len(scheduler.chunks),
            backing=opened.region.backing,
            region_name=opened.region.name,
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
            opened = self._opened
            assert opened is not None
            try:
                await opened.close_in_order(self._tasks, self._log)
            finally:
                await self._tasks.aclose()  # no task outlives the close (a no-op if done)
                self._pinned.resolve(
                    anyio.ClosedResourceError("the manager closed before pinning completed")
                )
                self._close_seconds = time.perf_counter() - t0
                self._state = ManagerState.CLOSED
                self._closed_event.set()
                self._log.info(
                    "manager.closed", close_seconds=self._close_seconds, leaked_chunks=opened.leaked
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
        return self._opened.region.name if self._opened is not None else self._config.name

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
        if self._state is not ManagerState.OPEN or self._opened is None:
            raise anyio.ClosedResourceError("the manager is not open")
        return self._opened.region.view(offset, nbytes)

    async def measure_hugepages(self) -> int:
        """Bytes of the region backed by huge pages, measured now in a worker thread
        (reading /proc/self/smaps walks every mapping of the process: 100+ ms in a CUDA
        process, so never on the event loop); ``stats().hugepage_bytes`` keeps the value."""
        self._check_process()
        if self._state is not ManagerState.OPEN or self._opened is None:
            raise anyio.ClosedResourceError("the manager is not open")
        self._hugepage_bytes = await anyio.to_thread.run_sync(self._opened.region.hugepage_bytes)
        return self._hugepage_bytes

    def stats(self) -> ManagerStats:
        opened = self._opened
        scheduler = opened.scheduler if opened is not None else None
        region = opened.region if opened is not None else None
        router = opened.router if opened is not None else None
        if self._forked():
            scheduler = None  # its chunks are pinned in the parent, not here
        seconds = scheduler.seconds_to_pinned if scheduler is not None else None
        error = self._pinned.error
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
            chunks_leaked=opened.leaked if opened is not None else 0,
            seconds_to_enter=self._seconds_to_enter,
            seconds_to_pinned=seconds,
            pin_gib_per_s=self._nbytes / (1 << 30) / seconds if seconds else None,
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
        if self._opened is None or self._opened.host_blocks is None:
            raise ConfigError("this manager has no KV layout (use OffloadManager.for_kv)")
        return self._opened.host_blocks

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
        router = self._opened.router if self._opened is not None else None
        if router is None:
            raise ConfigError("this manager has no KV layout (use OffloadManager.for_kv)")
        return router.submit(direction, gpu_block_ids, cpu_block_ids, method)

    @property
    def _engine(self) -> TransferEngine | None:
        return self._opened.engine if self._opened is not None else None

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

