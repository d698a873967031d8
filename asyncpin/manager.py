"""OffloadManager: the one public entry; owns a host region, pins it in the background,
and closes in an order that never frees memory the device may still use."""

from __future__ import annotations

import enum
import itertools
import math
import os
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import anyio.to_thread
import structlog
import torch
from anyio.abc import TaskGroup

from asyncpin import _sys
from asyncpin.backends import PinBackend, resolve_backend
from asyncpin.errors import ConfigError, PinError, PreflightError
from asyncpin.gate import PausedContext, PauseGate
from asyncpin.pinning import PinnedSignal, PinScheduler
from asyncpin.region import Backing, HostRegion, HugePages, validate_nbytes

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ManagerState",
    "ManagerStats",
    "OffloadManager",
    "default_prefault_threads",
]

# Measured on the H200 (bench/RESULTS.md): 16 MiB chunks keep each cudaHostRegister short
# enough that a concurrent 24 ms GPU step stretches by ~15% at most, at full pinning speed;
# 256 MiB chunks stretched it 2.6x.
DEFAULT_CHUNK_BYTES = 16 << 20


def default_prefault_threads() -> int:
    """Up to 8 fault threads, always leaving one core to the event loop: on a 2-core VM,
    2 threads faulting cold huge pages stalled the loop for ~0.5 s (bench/RESULTS.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, (cores or 1) - 1))


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
        _attach: bool = False,
    ) -> None:
        self._nbytes = 0 if _attach else validate_nbytes(nbytes)
        if backing not in ("anonymous", "shared"):
            raise ConfigError(f"unknown backing {backing!r}: use 'anonymous' or 'shared'")
        if hugepages not in ("thp", "hugetlb", "none"):
            raise ConfigError(
                f"unknown hugepages policy {hugepages!r}: use 'thp', 'hugetlb' or 'none'"
            )
        if (
            isinstance(chunk_bytes, bool)
            or not isinstance(chunk_bytes, int)
            or chunk_bytes <= 0
            or chunk_bytes % _sys.PAGE_SIZE
        ):
            raise ConfigError(
                f"chunk_bytes={chunk_bytes!r} must be a positive multiple of the page size "
                f"({_sys.PAGE_SIZE})"
            )
        if prefault_threads is None:
            prefault_threads = default_prefault_threads()
        for knob, value in (("prefault_threads", prefault_threads), ("pin_threads", pin_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{knob} must be an int >= 1, got {value!r}")
        if (
            isinstance(pin_interval_s, bool)
            or not isinstance(pin_interval_s, int | float)
            or not 0 <= pin_interval_s < math.inf
        ):
            raise ConfigError(
                f"pin_interval_s must be a finite number >= 0, got {pin_interval_s!r}"
            )
        self._backend = resolve_backend(backend, device)
        # Never ask one backend call for more than the platform takes in one go.
        self._chunk_bytes = min(
            chunk_bytes, self._backend.max_pin_bytes // _sys.PAGE_SIZE * _sys.PAGE_SIZE
        )
        self._backing: Backing = backing
        self._name = name
        self._attach = _attach
        self._hugepages: HugePages = hugepages
        self._prefault_threads = prefault_threads
        self._pin_threads = pin_threads
        self._pin_interval_s = pin_interval_s
        self._id = next(_ids)
        base = logger if logger is not None else structlog.get_logger("asyncpin")
        self._log = base.bind(manager=self._id, backend=self._backend.name)
        self._state = ManagerState.NEW
        self._gate = PauseGate()
        self._pinned = PinnedSignal()
        self._closed_event = anyio.Event()
        self._region: HostRegion | None = None
        self._scheduler: PinScheduler | None = None
        self._tg: TaskGroup | None = None
        self._t_enter: float | None = None
        self._seconds_to_enter: float | None = None
        self._seconds_to_pinned: float | None = None
        self._hugepage_bytes: int | None = None
        self._close_seconds: float | None = None
        self._leaked = 0

    @classmethod
    def attached(cls, name: str, **kwargs: Any) -> OffloadManager:
        """A manager over the shared region another process created as ``name``.

        It pins its own mapping (as CUDA requires per process) and never unlinks it.
        """
        return cls(0, backing="shared", name=name, _attach=True, **kwargs)

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> OffloadManager:
        if self._state is not ManagerState.NEW:
            raise RuntimeError("an OffloadManager can be entered only once")
        t0 = time.perf_counter()
        self._t_enter = t0
        if self._attach:
            assert self._name is not None
            region = HostRegion.attach(self._name, hugepages=self._hugepages)
        else:
            self._preflight()
            region = HostRegion.create(
                self._nbytes, backing=self._backing, name=self._name, hugepages=self._hugepages
            )
        try:
            self._nbytes = region.nbytes
            chunks = region.chunks(self._chunk_bytes)
            self._scheduler = PinScheduler(
                region,
                self._backend,
                chunks,
                prefault_threads=self._prefault_threads,
                pin_threads=self._pin_threads,
                pin_interval_s=self._pin_interval_s,
                gate=self._gate,
            )
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        except BaseException:
            region.release()
            raise
        self._region = region
        self._state = ManagerState.OPEN
        self._tg.start_soon(self._run_pinning)
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
        try:
            await self.aclose()
        finally:
            assert self._tg is not None
            # aclose() has waited for the pinning task to end, so the group has nothing
            # left to cancel. Handing it the body's exception would make anyio wrap that
            # exception in an ExceptionGroup; the caller must get it unchanged.
            await self._tg.__aexit__(None, None, None)
        return None

    def _preflight(self) -> None:
        available = _sys.mem_available_bytes()
        if self._nbytes > available:
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
        try:
            await scheduler.run()
        finally:
            self._settle_pinning(scheduler)

    def _settle_pinning(self, scheduler: PinScheduler) -> None:
        if scheduler.error is not None:
            error = scheduler.error
            self._log.error(
                "pin.failed",
                chunk=error.chunk_index,
                offset=error.offset,
                nbytes=error.nbytes,
                code=error.code,
                code_name=error.code_name,
                reason=error.reason,
            )
            self._pinned.resolve(error)
        elif scheduler.all_pinned():
            assert self._t_enter is not None and scheduler.finished_at is not None
            self._seconds_to_pinned = scheduler.finished_at - self._t_enter
            self._log.info(
                "pin.complete", seconds=self._seconds_to_pinned, gib_per_s=self._gib_per_s()
            )
            self._pinned.resolve()
        else:
            self._log.info("pin.stopped", pinned_bytes=scheduler.pinned_bytes, nbytes=self._nbytes)

    async def aclose(self) -> None:
        """Close in order; see the class docstring for the guarantees."""
        with anyio.CancelScope(shield=True):
            if self._state is ManagerState.NEW:
                self._state = ManagerState.CLOSED
                self._pinned.resolve(anyio.ClosedResourceError("the manager was never opened"))
                self._closed_event.set()
                return
            if self._state is not ManagerState.OPEN:
                await self._closed_event.wait()
                return
            self._state = ManagerState.CLOSING
            t0 = time.perf_counter()
            scheduler, region = self._scheduler, self._region
            assert scheduler is not None and region is not None
            scheduler.stop()
            self._log.info("manager.closing", pinned_bytes=scheduler.pinned_bytes)
            try:
                await scheduler.done.wait()
                leaked = await anyio.to_thread.run_sync(scheduler.unpin_all)
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
                await anyio.to_thread.run_sync(lambda: region.release(keep=keep))
            finally:
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
        return self._pinned

    def is_pinned(self) -> bool:
        """Non-blocking readiness probe: True once every chunk is pinned."""
        return self._pinned.succeeded()

    @property
    def pin_error(self) -> PinError | None:
        error = self._pinned.error
        return error if isinstance(error, PinError) else None

    @property
    def state(self) -> ManagerState:
        return self._state

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def backend(self) -> PinBackend:
        return self._backend

    @property
    def region_name(self) -> str | None:
        return self._region.name if self._region is not None else self._name

    def pinning_paused(self) -> PausedContext:
        """Hold pin and unpin calls: ``with`` from any thread, or ``async with``.

        On entry it waits for the call in flight to return; until exit, no new call
        starts. Wrap CUDA graph capture (or a whole warm-up) in it. Note that close's
        unpins also wait for the pause to end.
        """
        return self._gate.paused()

    def host_view(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor over part of the region; valid until the manager closes."""
        if self._state is not ManagerState.OPEN or self._region is None:
            raise anyio.ClosedResourceError("the manager is not open")
        return self._region.view(offset, nbytes)

    async def measure_hugepages(self) -> int:
        """Bytes of the region backed by huge pages, measured now in a worker thread
        (reading /proc/self/smaps walks every mapping of the process: 100+ ms in a CUDA
        process, so never on the event loop); ``stats().hugepage_bytes`` keeps the value."""
        region = self._region
        if self._state is not ManagerState.OPEN or region is None:
            raise anyio.ClosedResourceError("the manager is not open")
        self._hugepage_bytes = await anyio.to_thread.run_sync(region.hugepage_bytes)
        return self._hugepage_bytes

    def _gib_per_s(self) -> float | None:
        if not self._seconds_to_pinned:
            return None
        return self._nbytes / (1 << 30) / self._seconds_to_pinned

    def stats(self) -> ManagerStats:
        scheduler = self._scheduler
        error = self._pinned.error
        return ManagerStats(
            state=self._state.value,
            backend=self._backend.name,
            backing=self._backing,
            nbytes=self._nbytes,
            chunk_bytes=self._chunk_bytes,
            chunks_total=len(scheduler.chunks) if scheduler else 0,
            chunks_pinned=scheduler.chunks_pinned if scheduler else 0,
            pinned_bytes=scheduler.pinned_bytes if scheduler else 0,
            chunks_leaked=self._leaked,
            seconds_to_enter=self._seconds_to_enter,
            seconds_to_pinned=self._seconds_to_pinned,
            pin_gib_per_s=self._gib_per_s(),
            hugepages=self._hugepages,
            hugepage_bytes=self._hugepage_bytes,
            slowest_pin_seconds=scheduler.slowest_pin_seconds if scheduler else 0.0,
            unpin_seconds=scheduler.unpin_seconds if scheduler else None,
            close_seconds=self._close_seconds,
            error=str(error) if isinstance(error, PinError) else None,
        )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<OffloadManager #{self._id} {s.state} backend={s.backend} "
            f"pinned={s.pinned_bytes}/{s.nbytes} chunks={s.chunks_pinned}/{s.chunks_total}>"
        )
