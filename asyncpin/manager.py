"""OffloadManager: the one public entry; owns a host region, pins it in the background,
and closes in an order that never frees memory the device may still use."""

from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, SupportsIndex

import anyio
import anyio.to_thread
import structlog
import torch

from asyncpin import _sys
from asyncpin._config import (
    ManagerConfig,
    UnpinnedPolicy,
    check_host_slice,
    check_num_host_blocks,
)
from asyncpin._lifecycle import Lifecycle, ManagerState
from asyncpin._log import ShieldedLog
from asyncpin._opened import Opened, no_stats_fields
from asyncpin._router import TransferRouter
from asyncpin._tasks import OwnedTasks
from asyncpin._text import shown
from asyncpin.abc import EngineFactory, PinBackend, TransferEngine
from asyncpin.backends import resolve_backend
from asyncpin.errors import (
    ConfigError,
    PinError,
)
from asyncpin.gate import PausedContext, PauseGate
from asyncpin.kv import KVLayout, is_dense
from asyncpin.pinning import PinnedSignal
from asyncpin.region import Backing, HugePages, chunk_pieces
from asyncpin.stats import ManagerStats
from asyncpin.transfers import (
    BlockIds,
    Method,
    Transfer,
    host_array_view,
    host_blocks_view,
)

__all__ = ["ManagerState", "ManagerStats", "OffloadManager"]

_ids = itertools.count(1)


class OffloadManager:
    """A pinned host buffer for KV blocks, embedded in an async program.

    ``async with OffloadManager(nbytes) as mgr`` returns once the region is mapped (its
    cost does not grow with ``nbytes``); pinning goes on in worker threads. ``await
    mgr.pinned`` completes when every chunk is pinned (and, for a KV manager on a GPU, its
    transfer engine is set up) or raises :class:`PinError` (or the set-up's error);
    ``mgr.is_pinned()`` answers at once.

    Close contract (``aclose()`` and ``__aexit__``): idempotent, safe from any state and
    from concurrent callers, shielded from the caller's cancellation, and always in this
    order: refuse new use (``ClosedResourceError``) → stop the pin pipeline and wait for
    its in-flight calls → wait for the transfers in flight (their device work) → close
    the engine → the backend's ``before_unpin`` (on a GPU: one wait for all the device's
    work, which copies your own code queued on views must not outlast) → unpin every
    chunk that was pinned, once → release the mapping. A chunk whose unpin failed is
    left mapped (leaked and logged), never freed under the device.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        backend: str | PinBackend = "auto",
        device: int | None = None,
        backing: Backing = "anonymous",
        name: str | None = None,
        chunk_bytes: int | None = None,
        prefault_threads: int | None = None,
        pin_threads: int = 1,
        pin_interval_s: float = 0.0,
        hugepages: HugePages = "thp",
        logger: Any = None,
        kv_layout: KVLayout | None = None,
        num_host_blocks: int | None = None,
        unpinned_policy: UnpinnedPolicy = "wait",
        engine: str | EngineFactory = "auto",
        host_slice: tuple[int, int] | None = None,
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
            host_slice=host_slice,
        )
        self._nbytes = config.nbytes
        self._backend = resolve_backend(backend, device)
        # Never ask one backend call for more than the platform takes in one go.
        self._chunk_bytes = min(
            config.chunk_bytes, self._backend.max_pin_bytes // _sys.PAGE_SIZE * _sys.PAGE_SIZE
        )
        self._opened: Opened | None = None
        self._observers: list[Callable[[Transfer], None]] = []
        self._id = next(_ids)
        base = logger if logger is not None else structlog.get_logger("asyncpin")
        self._log = ShieldedLog(base).bind(manager=self._id, backend=self._backend.name)
        self._gate = PauseGate()
        self._pinned = PinnedSignal()
        # The manager's background tasks (the pin pipeline, the engine's, transfers waiting
        # for a chunk): its own, not the entering task's, so any task can close it.
        self._tasks = OwnedTasks(self._log)
        self._life = Lifecycle(self._gate, self._tasks, self._log)
        self._seconds_to_enter: float | None = None
        self._hugepage_bytes: int | None = None

    @classmethod
    def for_kv(cls, layout: KVLayout, num_host_blocks: int, **kwargs: Any) -> OffloadManager:
        """A manager whose region holds ``num_host_blocks`` host blocks of ``layout``.

        ``host_slice=(rank, ranks)``: the region holds ``ranks`` such layouts' blocks
        (tensor-parallel ranks' slices of the same KV blocks, say), host block ``c`` of
        every rank side by side, and this manager moves rank ``rank``'s part. The other
        ranks attach (``OffloadManager.attached``) with their own ``host_slice``."""
        num_host_blocks = check_num_host_blocks(num_host_blocks)
        ranks = check_host_slice(kwargs.get("host_slice"))[1]
        if layout.device.type == "cuda":
            # Pinned for the GPU the blocks move to, whichever device is current.
            kwargs.setdefault("device", layout.device.index)
        return cls(
            layout.host_block_bytes * ranks * num_host_blocks,
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
        for fixed in ("nbytes", "backing", "_attach"):
            if fixed in kwargs and not (fixed == "backing" and kwargs[fixed] == "shared"):
                raise ConfigError(
                    f"attached() takes no {fixed}=: the region is the shared one named "
                    f"{name!r}, whose size its creator chose"
                )
        kwargs.pop("backing", None)
        return cls(0, backing="shared", name=name, _attach=True, **kwargs)

    # -- lifecycle --------------------------------------------------------------------

    async def __aenter__(self) -> OffloadManager:
        self._life.entering()
        t0 = time.perf_counter()
        try:
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
        except BaseException as exc:  # a cancellation included
            # Nothing stays mapped (Opened.open released it); the manager is closed, and
            # whoever awaits `pinned` learns why instead of waiting without end.
            if isinstance(exc, Exception):
                self._pinned.resolve(exc)
            self._life.entered()
            await self._life.aclose(self._close_in_order, self._never_opened, self._leaked)
            raise
        if not self._life.is_new:
            # Closed by another task while this one waited: it must not open now. That
            # close returns once this has let go of all it made.
            try:
                await opened.abandon()
            finally:
                self._life.entered()
            raise anyio.ClosedResourceError("the manager was closed while it was entered")
        self._opened = opened
        self._nbytes = opened.region.nbytes
        self._chunk_bytes = opened.scheduler.chunk_bytes  # an attacher's, from its region
        self._life.opened()
        self._life.entered()
        scheduler = opened.scheduler
        opened.start(self._tasks, self._log)  # they settle `pinned`, but for a close
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

    async def aclose(self) -> None:
        """Close in order; see the class docstring for the guarantees.

        From any task of the loop that opened the manager. Refused with LifecycleError,
        changing nothing, inside ``pinning_paused()`` or ``capture_gate()`` (the close
        would wait for the hold to end) or from another event loop. In a process forked
        from the owner it does nothing: the region and its pins are the parent's."""
        await self._life.aclose(self._close_in_order, self._never_opened, self._leaked)

    def _never_opened(self) -> None:
        self._pinned.resolve(anyio.ClosedResourceError("the manager was never opened"))

    def _leaked(self) -> int:
        return self._opened.leaked if self._opened is not None else 0

    async def _close_in_order(self) -> None:
        opened = self._opened
        assert opened is not None
        try:
            await opened.close_in_order(self._tasks, self._log)
        finally:
            await self._tasks.aclose()  # no task outlives the close (a no-op if done)
            self._pinned.resolve(
                anyio.ClosedResourceError("the manager closed before pinning completed")
            )

    # -- queries ----------------------------------------------------------------------

    @property
    def pinned(self) -> PinnedSignal:
        """Awaitable: done when all chunks are pinned and an engine set up in the
        background is ready; raises PinError if pinning failed, the set-up's error if that
        failed."""
        self._life.check_process()
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
        return self._life.state

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
        self._life.check_process()
        return self._gate.paused()

    def host_view(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor over part of the region. It keeps that memory mapped while it
        lives, past close too (then no longer pinned): drop it to give the memory back."""
        self._life.check_open()
        assert self._opened is not None
        return self._opened.region.view(offset, nbytes)

    def host_copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False
    ) -> None:
        """``dst.copy_(src)``, where one of them is a view of this region (``host_view()``,
        ``host_bytes()``, ``host_blocks()``, ``host_array(a)`` or a view of them) and the
        other a tensor of the same shape and dtype (on the GPU, say). A dense view is
        copied in pieces that never span two chunks: each chunk is a pinned registration
        of its own, and the CUDA driver refuses one copy across two
        (``cudaErrorInvalidValue``); the other tensor is first laid out as the view where
        its strides differ. Any other view goes to torch as it is (torch copies it through
        a buffer of its own). ConfigError for tensors it cannot copy so."""
        self._life.check_open()
        assert self._opened is not None
        region = self._opened.region
        for t in (dst, src):
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"host_copy copies tensors, not {type(t).__name__}")
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ConfigError(
                f"host_copy needs two tensors of one shape and dtype, not {tuple(dst.shape)} "
                f"{dst.dtype} and {tuple(src.shape)} {src.dtype}"
            )
        if dst.numel() == 0:
            return
        if any(t.is_conj() or t.is_neg() for t in (dst, src)):
            raise ConfigError("host_copy copies plain tensors: resolve a conjugate view first")
        inside = [_within(t, region.address, region.nbytes) for t in (dst, src)]
        if not any(inside):
            raise ConfigError("host_copy needs one tensor to be a view of this region")
        host = dst if inside[0] else src
        if all(inside) and _overlap(dst, src):
            if (dst.data_ptr(), dst.stride()) == (src.data_ptr(), src.stride()):
                return  # the same elements: nothing to copy
            raise ConfigError(
                "host_copy between overlapping views of the region: the bytes would "
                "depend on the copy's order"
            )
        if not is_dense(host):
            dst.copy_(src, non_blocking=non_blocking)
            return
        other = src if host is dst else dst
        like = other
        if other.stride() != host.stride():
            like = torch.empty_strided(
                host.shape, host.stride(), dtype=host.dtype, device=other.device
            )
        if like is not other and host is dst:
            like.copy_(src, non_blocking=non_blocking)
        to, frm = (host, like) if host is dst else (like, host)
        to_bytes, frm_bytes = (
            t.as_strided((t.numel(),), (1,)).view(torch.uint8) for t in (to, frm)
        )
        offset = host.data_ptr() - region.address
        for lo, hi in chunk_pieces(offset, to_bytes.numel(), self._chunk_bytes):
            _copy_piece(to_bytes[lo:hi], frm_bytes[lo:hi], non_blocking)
        if like is not other and host is src:
            dst.copy_(like, non_blocking=non_blocking)

    async def measure_hugepages(self) -> int:
        """Bytes of the region backed by huge pages, measured now in a worker thread
        (reading /proc/self/smaps walks every mapping of the process: 100+ ms in a CUDA
        process, so never on the event loop); ``stats().hugepage_bytes`` keeps the value."""
        self._life.check_open()
        assert self._opened is not None
        self._hugepage_bytes = await anyio.to_thread.run_sync(self._opened.region.hugepage_bytes)
        return self._hugepage_bytes

    def stats(self) -> ManagerStats:
        opened = self._opened
        fields = (
            opened.stats_fields(forked=self._life.forked())
            if opened is not None
            else no_stats_fields()
        )
        seconds = fields["seconds_to_pinned"]
        error = self._pinned.error
        return ManagerStats(
            state=self.state.value,
            backend=self._backend.name,
            backing=self._config.backing,
            nbytes=self._nbytes,
            chunk_bytes=self._chunk_bytes,
            seconds_to_enter=self._seconds_to_enter,
            pin_gib_per_s=self._nbytes / (1 << 30) / seconds if seconds else None,
            hugepages=self._config.hugepages,
            hugepage_bytes=self._hugepage_bytes,
            close_seconds=self._life.close_seconds,
            # Why the manager will not be ready: pinning or the engine's set-up failed.
            error=(
                None
                if error is None or isinstance(error, anyio.ClosedResourceError)
                else str(error)
            ),
            **fields,
        )

    # -- KV transfers -----------------------------------------------------------------

    @property
    def kv_layout(self) -> KVLayout | None:
        return self._config.kv_layout

    @property
    def host_slice(self) -> tuple[int, int]:
        """(rank, ranks): this manager's part of the host blocks (``(0, 1)``: all)."""
        return self._config.host_slice

    @property
    def num_host_blocks(self) -> int:
        """Host blocks of the KV layout (0 without one)."""
        return self._config.num_host_blocks

    def host_blocks(self) -> torch.Tensor:
        """``[num_host_blocks, num_arrays, *block_shape]`` view of the host KV blocks, for
        a layout whose arrays share block shape and dtype (else ConfigError: see
        ``host_array``)."""
        return host_blocks_view(self._host_bytes(), self._layout_of())

    def host_array(self, array: SupportsIndex) -> torch.Tensor:
        """``[num_host_blocks, *array_shapes[array]]`` view of one array's host blocks."""
        layout = self._layout_of()
        if isinstance(array, bool) or not isinstance(array, numbers.Integral):
            raise ConfigError(f"an array index is an int, not {type(array).__name__}")
        array = int(array)
        if not 0 <= array < layout.num_arrays:
            raise ConfigError(f"array {shown(array)} is outside [0, {layout.num_arrays})")
        return host_array_view(self._host_bytes(), layout, array)

    def host_bytes(self) -> torch.Tensor:
        """``[num_host_blocks, host_block_bytes]`` uint8 view of the host KV blocks."""
        return self._host_bytes()

    def _layout_of(self) -> KVLayout:
        self._life.check_open()
        layout = self._config.kv_layout
        if layout is None:
            raise ConfigError("this manager has no KV layout (use OffloadManager.for_kv)")
        return layout

    def _host_bytes(self) -> torch.Tensor:
        self._layout_of()
        if self._opened is None or self._opened.host_blocks is None:
            raise ConfigError("this manager has no KV layout (use OffloadManager.for_kv)")
        return self._opened.host_blocks

    def store(
        self,
        gpu_block_ids: BlockIds,
        cpu_block_ids: BlockIds,
        *,
        method: Method = "auto",
        arrays: range | None = None,
    ) -> Transfer:
        """Copy device KV blocks to host blocks; returns the handle. Every array, or only
        ``arrays`` (consecutive array indices: a group of layers, say).

        The copy first waits for work already queued on the caller's current stream (the
        work that produced the blocks). Bad input raises InvalidTransferError before
        anything is enqueued; a closed manager raises ClosedResourceError."""
        return self._submit("store", gpu_block_ids, cpu_block_ids, method, arrays)

    def load(
        self,
        cpu_block_ids: BlockIds,
        gpu_block_ids: BlockIds,
        *,
        method: Method = "auto",
        arrays: range | None = None,
    ) -> Transfer:
        """Copy host blocks into device KV blocks (every array, or only ``arrays``);
        returns the handle. On CUDA, the handle's ``event`` lets the compute stream wait
        for the load without blocking."""
        return self._submit("load", gpu_block_ids, cpu_block_ids, method, arrays)

    def _submit(
        self,
        direction: Literal["store", "load"],
        gpu_block_ids: BlockIds,
        cpu_block_ids: BlockIds,
        method: Method,
        arrays: range | None,
        *,
        checked: bool = False,
    ) -> Transfer:
        return self._router(direction).submit(
            direction, gpu_block_ids, cpu_block_ids, method, arrays, checked=checked
        )

    def _router(self, direction: Literal["store", "load"]) -> TransferRouter:
        self._life.check_open("the manager is closed to new transfers")
        self._life.check_loop_thread(direction)
        router = self._opened.router if self._opened is not None else None
        if router is None:
            raise ConfigError("this manager has no KV layout (use OffloadManager.for_kv)")
        return router

    def _check_submit(
        self,
        direction: Literal["store", "load"],
        method: Method,
        arrays: range | None = None,
        *,
        moves: bool = True,
    ) -> None:
        """What ``store`` and ``load`` check before the ids (open, this thread, a KV
        layout, the method), for a caller that must know before it changes anything."""
        router = self._router(direction)
        router.check_call(direction, arrays, moves=moves)
        router.check_method(method)

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


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` that a (non-empty) tensor's elements lie in."""
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _within(t: torch.Tensor, address: int, nbytes: int) -> bool:
    """Whether every element of CPU tensor ``t`` lies in ``[address, address + nbytes)``."""
    if t.device.type != "cpu":
        return False
    start, end = _span(t)
    return address <= start and end <= address + nbytes


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _copy_piece(to: torch.Tensor, frm: torch.Tensor, non_blocking: bool) -> None:
    """One piece of ``host_copy`` (within one chunk)."""
    to.copy_(frm, non_blocking=non_blocking)
