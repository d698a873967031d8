"""What an open manager holds, made in order when it enters and released in the close
order when it closes: the region, the pin pipeline over its chunks, and for KV the
engine with the router in front of it."""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

from asyncpin import _sys
from asyncpin._config import ManagerConfig, default_chunk_bytes
from asyncpin._router import TransferRouter
from asyncpin._tasks import OwnedTasks
from asyncpin._threads import to_the_end
from asyncpin.abc import EngineSetup, PinBackend, TransferEngine
from asyncpin.backends import registers_with_cuda
from asyncpin.engines import engine_factory, made_off_loop, make_engine
from asyncpin.errors import ConfigError, PreflightError, describe_error
from asyncpin.gate import PauseGate
from asyncpin.kv import KVLayout
from asyncpin.pinning import PinnedSignal, PinScheduler
from asyncpin.region import HostRegion
from asyncpin.transfers import Transfer, host_bytes_view

__all__ = ["Opened"]

#: How long the pin pipeline waits for an engine's background set-up before it faults the
#: region in all the same. The set-up took 14-31 ms on the H200 (runs 140-142), but it
#: waits for the capture gate and for ``pinning_paused()``, which a server may hold for
#: its whole graph capture: faulting in must not wait that long.
SET_UP_WAIT_S = 0.5


class Opened:
    """The resources of one open manager. ``open()`` makes them (releasing what it made
    if it fails or is cancelled); ``close_in_order()`` releases them, once."""

    def __init__(self, region: HostRegion, scheduler: PinScheduler, pinned: PinnedSignal) -> None:
        self.region = region
        self.scheduler = scheduler
        self.pinned = pinned  # the manager's: pinning done and, for KV, the engine prepared
        # Settled when the engine's prepare() has returned or failed.
        self.engine_ready = PinnedSignal()
        self.engine: TransferEngine | None = None
        self.router: TransferRouter | None = None
        self.host_blocks: torch.Tensor | None = None
        self.leaked = 0

    @classmethod
    async def open(
        cls,
        config: ManagerConfig,
        backend: PinBackend,
        *,
        chunk_bytes: int,
        gate: PauseGate,
        pinned: PinnedSignal,
        tasks: OwnedTasks,
        observers: list[Callable[[Transfer], None]],
        log: Any,
        started_at: float,
    ) -> Opened:
        """Map the region and make the pipeline; for KV, the engine and its router, and
        prepare the engine in a worker thread, unless it prepares in the background
        (``prepare_in_background``: the CUDA engine, whose kernel load and device
        buffers take up to a second in a fresh process). Nothing is started (``start()``).

        The region is mapped, after the pre-flight, in a worker thread (``_map_off_loop``):
        with 64-100 GiB and other threads busy in CUDA, the reads of /proc and the cgroup,
        the mmap and the madvise held the event loop 10-13 ms."""
        region = await _map_off_loop(config, backend, log)
        opened: Opened | None = None
        try:
            if config.attach and config.chunk_default:
                # The region's size is known only now.
                cap = backend.max_pin_bytes // _sys.PAGE_SIZE * _sys.PAGE_SIZE
                chunk_bytes = min(default_chunk_bytes(region.nbytes), cap)
            layout = config.kv_layout
            if layout is not None:
                needed = config.num_host_blocks * config.host_block_stride
                if region.nbytes < needed:
                    raise ConfigError(
                        f"shared region {config.name!r} holds {region.nbytes} bytes: too small "
                        f"for {config.num_host_blocks} host blocks of "
                        f"{config.host_block_stride} bytes ({needed} bytes)"
                    )
            scheduler = PinScheduler(
                region,
                backend,
                region.chunks(chunk_bytes),
                prefault_threads=config.prefault_threads,
                pin_threads=config.pin_threads,
                pin_interval_s=config.pin_interval_s,
                gate=gate,
                pinned=pinned,
                log=log,
                started_at=started_at,
                chunk_bytes=chunk_bytes,
            )
            opened = cls(region, scheduler, pinned)
            if layout is not None:
                engine = await opened._open_engine(
                    config, layout, chunk_bytes, tasks, observers, log
                )
                if opened.background:
                    # `pinned` waits for the engine too: settled by whichever ends last.
                    scheduler.pinned = _Settles(opened._settle_pinned)
                else:
                    # A cancellation is taken before it; once it began, it runs to its
                    # end (a cancelled entry closes the engine after it), in a thread of
                    # its own (the application's default pool may be full).
                    await anyio.lowlevel.checkpoint_if_cancelled()
                    await to_the_end(engine.prepare)
                    opened._engine_prepared(None)
        except BaseException:  # a cancellation included
            if opened is None:
                region.release()  # nothing else was made
            else:
                await opened.abandon()
            raise
        return opened

    async def _open_engine(
        self,
        config: ManagerConfig,
        layout: KVLayout,
        chunk_bytes: int,
        tasks: OwnedTasks,
        observers: list[Callable[[Transfer], None]],
        log: Any,
    ) -> TransferEngine:
        """The engine and the router in front of it, over the region's host blocks. An
        engine made off the loop (``made_off_loop``: the CUDA engine) is made in a worker
        thread, waited for to its end whatever cancellations come, so that the entry's
        clean-up closes it (``abandon``)."""
        self.host_blocks = host_bytes_view(
            self.region.view(), layout, config.num_host_blocks, config.host_slice
        )
        factory = engine_factory(config.engine, layout)
        host_registered = registers_with_cuda(self.scheduler.backend)
        loop = anyio.lowlevel.current_token()

        def make() -> None:
            # The setup is this call's alone: a frame of the entry that held it past a
            # failure or a cancellation would keep the region mapped (its host view).
            assert self.host_blocks is not None
            setup = EngineSetup(
                layout,
                self.host_blocks,
                chunk_bytes,
                tasks.start_soon,
                host_registered=host_registered,
                loop=loop,
            )
            try:
                self.engine = make_engine(factory, setup)
            except BaseException as exc:
                del setup
                # So do the factory's frames, in the traceback of what it raised and of
                # the errors chained to it.
                _clear_frames(exc)
                raise

        if made_off_loop(factory):
            await to_the_end(make)
            # An anyio cancellation waited for the thread: it is raised here, not at the
            # next await, which an engine prepared in the background leaves to the body.
            await anyio.lowlevel.checkpoint_if_cancelled()
        else:
            make()
        assert self.engine is not None
        self.router = TransferRouter(
            layout=layout,
            num_host_blocks=config.num_host_blocks,
            engine=self.engine,
            table=self.scheduler.table,
            region=self.region,
            policy=config.unpinned_policy,
            host_slice=config.host_slice,
            start_soon=tasks.start_soon,
            observers=observers,
            log=log,
        )
        return self.engine

    @property
    def background(self) -> bool:
        """Whether the engine is prepared after entry, before the region pins."""
        return bool(getattr(self.engine, "prepare_in_background", False))

    def _engine_prepared(self, error: BaseException | None) -> None:
        assert self.router is not None
        self.router.engine_prepared(error)
        self.engine_ready.resolve(error)
        if self.background:
            self._settle_pinned()

    def start(self, tasks: OwnedTasks, log: Any) -> None:
        """Start pinning and the engine's preparation in the background, as the manager's
        tasks; ``pinned`` is settled once both are over (a close leaves it to the
        manager)."""
        if self.background:
            # Its worker thread is started with the pipeline's, before anything is faulted
            # (the memory-map lock) and before the set-up runs (its torch calls hold the
            # GIL, and each thread start on the loop waits for the new thread to take
            # the GIL). The set-up runs after the backend's warm-up and before the region
            # is faulted in (unless it takes over SET_UP_WAIT_S): on the H200 it took
            # 14-31 ms so, against 128-155 ms beside 100 GiB faulting in, where a model's
            # step stretched up to 2.08x (bench/RESULTS.md#startup, runs 137 and 140-142).
            tasks.start_soon(
                self.scheduler.run,
                partial(tasks.start_soon, self._prepare_engine, log),
                self._set_up_first,
            )
        else:
            tasks.start_soon(self.scheduler.run)

    async def _set_up_first(self) -> None:
        """Return once the engine's set-up is over, or after ``SET_UP_WAIT_S``."""
        with anyio.move_on_after(SET_UP_WAIT_S):
            await self.engine_ready.settled()

    async def _prepare_engine(self, log: Any) -> None:
        engine = self.engine
        assert engine is not None
        try:
            # Its own thread slot (the application's default pool may be full), waited
            # for to its end: a native Task.cancel() (asyncio.run gives one to every task
            # left at its end) would end the wait at once and let a close free the host
            # blocks the set-up still uses.
            await to_the_end(self._prepare_paused)
        except Exception as exc:
            if not isinstance(exc, anyio.ClosedResourceError):
                log.error("engine.prepare_failed", engine=engine.name, error=repr(exc))
            self._engine_prepared(exc)
            return
        except BaseException:  # cancelled by a close: the thread has returned
            self._engine_prepared(anyio.ClosedResourceError("the manager closed"))
            raise
        self._engine_prepared(None)

    def _prepare_paused(self) -> None:
        """``engine.prepare()``, never while ``pinning_paused()`` is held: a capture
        wrapped in it must not see the set-up's allocations, kernel load or launches."""
        assert self.engine is not None
        gate = self.scheduler.gate
        if not gate.enter_local(abort=self.scheduler.stop_event):
            raise anyio.ClosedResourceError("the manager closed before its engine was set up")
        try:
            self.engine.prepare()
        finally:
            gate.exit_local()

    def _settle_pinned(self) -> None:
        """``pinned``, from the pin pipeline's outcome and the engine's: the first failure
        at once, success once both are done (unless a close began: it settles it)."""
        pins, engine = self.scheduler.pinned, self.engine_ready
        for part in (pins, engine):
            if part.is_set() and part.error is not None:
                self.pinned.resolve(part.error)
                return
        if pins.is_set() and engine.is_set() and not self.scheduler.stopping:
            self.pinned.resolve()

    def stats_fields(self, *, forked: bool) -> dict[str, Any]:
        """The part of ``ManagerStats`` these resources know (in a forked child, none of
        the pipeline's: its chunks are pinned in the parent, not there)."""
        scheduler = self.scheduler
        fields = no_stats_fields()
        fields.update(
            chunks_leaked=self.leaked,
            seconds_to_pinned=scheduler.seconds_to_pinned,
            mapped_by_views_bytes=self.region.mapped_by_views_bytes(),
        )
        if not forked:
            fields.update(
                chunks_total=len(scheduler.chunks),
                chunks_pinned=scheduler.chunks_pinned,
                pinned_bytes=scheduler.pinned_bytes,
                faulted_bytes=scheduler.faulted_bytes,
                slowest_pin_seconds=scheduler.slowest_pin_seconds,
                unpin_seconds=scheduler.unpin_seconds,
            )
        router = self.router
        if router is not None:
            counts = router.counts
            fields.update(
                transfers_stored=counts.stored,
                transfers_loaded=counts.loaded,
                bytes_stored=counts.bytes_stored,
                bytes_loaded=counts.bytes_loaded,
                transfers_waited_for_pinning=counts.waited,
                transfers_pageable=counts.pageable,
                transfers_failed=counts.failed,
                transfers_in_flight=len(router.in_flight),
            )
        return fields

    async def abandon(self) -> None:
        """Release what an entry that failed made (no transfer ever ran, nothing was
        pinned): the engine, then the mapping, in a worker thread as at close (the engine
        joins its threads; an munmap of many GiB takes tens of ms), to the end whatever
        cancellations come (``to_the_end``)."""
        await to_the_end(self._abandon)

    def _abandon(self) -> None:
        try:
            if self.engine is not None:
                self.engine.close()
        finally:
            self.engine = None
            self.host_blocks = None  # the manager's own view: it must not hold the range
            self.region.release()

    async def close_in_order(self, tasks: OwnedTasks, log: Any) -> None:
        """Stop pinning → wait for the pipeline's calls and the transfers' device work →
        end the manager's tasks → close the engine → unpin every pinned chunk once →
        release the mapping. Call it shielded, once."""
        scheduler, region = self.scheduler, self.region
        scheduler.stop()
        log.info("manager.closing", pinned_bytes=scheduler.pinned_bytes)
        await scheduler.done.wait()
        if self.router is not None:
            await self.router.drained()  # in-flight transfers' device work
        # What is left of the manager's tasks (a sweep between periods, a copy task
        # settling its transfer) ends before the engine closes.
        await tasks.aclose()
        # Its own thread slot: the application's default pool may be full.
        limiter = anyio.CapacityLimiter(1)
        if self.engine is not None:
            # Off the loop: it joins the engine's threads, and a completion waiter may be
            # held at the capture gate until a capture ends.
            try:
                await anyio.to_thread.run_sync(self.engine.close, limiter=limiter)
            except Exception as failed:  # every transfer is over: the close goes on
                log.error(
                    "engine.close_failed",
                    engine=self.engine.name,
                    error=describe_error(failed),
                    action="unpinned and released all the same: every transfer is over",
                )
        # The manager's own views go, so that only the application's can keep the address
        # range mapped past close.
        self.engine = None
        self.host_blocks = None
        leaked = await anyio.to_thread.run_sync(scheduler.unpin_all, limiter=limiter)
        for chunk, exc in leaked:
            log.error(
                "unpin.failed",
                chunk=chunk.index,
                offset=chunk.offset,
                nbytes=chunk.nbytes,
                error=describe_error(exc),
                action="left mapped (leaked): no device access can hit freed memory",
            )
        self.leaked = len(leaked)
        # munmap of many GiB takes tens of ms: off the event loop too.
        keep = [chunk for chunk, _ in leaked]
        unmapped = await anyio.to_thread.run_sync(
            lambda: region.release(keep=keep), limiter=limiter
        )
        if not unmapped:
            log.warning(
                "region.kept_by_views",
                nbytes=region.nbytes,
                action="unpinned; the range stays mapped until the last view of it is gone",
            )


class _Settles(PinnedSignal):
    """A pin pipeline's outcome that calls ``then()`` once it is settled."""

    __slots__ = ("_then",)

    def __init__(self, then: Callable[[], None]) -> None:
        super().__init__()
        self._then = then

    def resolve(self, error: BaseException | None = None) -> None:
        super().resolve(error)
        self._then()


def _clear_frames(exc: BaseException) -> None:
    """The locals of the finished frames in the tracebacks of ``exc`` and of every
    error chained to it (``__cause__``, ``__context__``) dropped."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        todo += [error.__cause__, error.__context__]


def no_stats_fields() -> dict[str, Any]:
    """The part of ``ManagerStats`` an open manager's resources report, before it opens."""
    return {
        "chunks_total": 0,
        "chunks_pinned": 0,
        "pinned_bytes": 0,
        "chunks_leaked": 0,
        "seconds_to_pinned": None,
        "slowest_pin_seconds": 0.0,
        "unpin_seconds": None,
    }


async def _map_off_loop(config: ManagerConfig, backend: PinBackend, log: Any) -> HostRegion:
    """``_map_region`` in a worker thread of its own (the application's default pool may
    be full). An anyio cancellation waits for the thread, and the caller releases the
    region it returns. A native asyncio cancel (``Task.cancel()``, which anyio does not
    hold back) ends the wait at once: then the region is released here if the thread
    has made it, else by the thread, and this still returns only once the thread is
    over (through further native cancels too), so that no region, nor its shared name,
    outlives an entry that failed."""
    handoff = _Handoff()
    try:
        await anyio.to_thread.run_sync(
            handoff.run,
            partial(_map_region, config, backend, log),
            limiter=anyio.CapacityLimiter(1),
        )
    except BaseException:
        left, running = handoff.abandon()
        if left is not None:
            left.release()
        if running:
            with contextlib.suppress(anyio.get_cancelled_exc_class()):  # raised below
                await to_the_end(handoff.over.wait)
        raise
    return handoff.take()


class _Handoff:
    """A region made in a worker thread, passed to the task waiting for it, or released
    by the thread if that task stopped waiting first."""

    __slots__ = ("_abandoned", "_lock", "_region", "_started", "over")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._region: HostRegion | None = None
        self._abandoned = self._started = False
        self.over = threading.Event()  # set once a started run() has returned

    def run(self, make: Callable[[], HostRegion]) -> None:
        with self._lock:
            if self._abandoned:
                return  # nobody waits: make nothing
            self._started = True
        try:
            region = make()
            with self._lock:
                if not self._abandoned:
                    self._region = region
                    return
            region.release()
        finally:
            self.over.set()

    def take(self) -> HostRegion:
        region = self._region
        assert region is not None
        return region

    def abandon(self) -> tuple[HostRegion | None, bool]:
        """Stop waiting: the region if it was made (else None), and whether the thread
        is still making it (it then releases what it makes, and sets ``over``)."""
        with self._lock:
            self._abandoned = True
            region, self._region = self._region, None
            return region, self._started and not self.over.is_set()


def _map_region(config: ManagerConfig, backend: PinBackend, log: Any) -> HostRegion:
    if config.attach:
        assert config.name is not None
        return HostRegion.attach(
            config.name,
            hugepages=config.hugepages,
            preflight=backend.preflight,
            layout=config.layout_description(),
        )
    _preflight(config, backend)
    region = HostRegion.create(
        config.nbytes,
        backing=config.backing,
        name=config.name,
        hugepages=config.hugepages,
        layout=config.layout_description(),
    )
    if region.reclaimed_stale:
        log.warning(
            "region.reclaimed_stale",
            region_name=region.name,
            reason="its creator was gone; the new region replaces it",
        )
    return region


def _preflight(config: ManagerConfig, backend: PinBackend) -> None:
    available = _sys.mem_available_bytes()
    # A hugetlb region comes from the reserved pool, which MemAvailable leaves out; the
    # pool itself is checked when the region is mapped.
    if config.hugepages != "hugetlb" and config.nbytes > available:
        raise PreflightError(
            "memory",
            config.nbytes,
            available,
            "ask for a smaller buffer or free memory (MemAvailable and the cgroup memory "
            "limit both count)",
        )
    backend.preflight(config.nbytes)
