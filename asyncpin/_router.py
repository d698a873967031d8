"""The transfer router, between the manager and its engine: validate → the unpinned
policy → the engine → completion → counts and observers.

It is the one place where an engine's error becomes a :class:`TransferError` naming
the transfer (direction, method, CUDA code), and it reads the pin pipeline's chunk table
only: it never looks into the pipeline itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, cast, get_args

import anyio
import anyio.lowlevel
import torch

from asyncpin._config import UnpinnedPolicy
from asyncpin._text import shown
from asyncpin.abc import TransferEngine
from asyncpin.chunks import ChunkState, ChunkTable
from asyncpin.errors import ConfigError, InvalidTransferError, TransferError
from asyncpin.kv import KVLayout
from asyncpin.region import HostRegion
from asyncpin.transfers import (
    BlockIds,
    CheckedIds,
    Direction,
    Method,
    Transfer,
    TransferInterrupted,
    TransferJob,
    block_ids,
    interrupted,
)

METHODS: tuple[str, ...] = get_args(Method)

__all__ = ["TransferCounts", "TransferRouter"]

Ids = BlockIds

_PINNED = ChunkState.PINNED
#: A job waiting for its host chunks: the job, those chunks, its submitter's context.
_Waiting = tuple[TransferJob, list[int], contextvars.Context]


class TransferCounts:
    """What ``stats()`` reports of transfers; kept after close."""

    __slots__ = ("bytes_loaded", "bytes_stored", "failed", "loaded", "pageable", "stored", "waited")

    def __init__(self) -> None:
        self.stored = self.loaded = self.bytes_stored = self.bytes_loaded = 0
        self.waited = self.pageable = self.failed = 0


class TransferRouter:
    """Routes one manager's stores and loads to its engine; see the module docstring."""

    def __init__(
        self,
        *,
        layout: KVLayout,
        num_host_blocks: int,
        engine: TransferEngine,
        table: ChunkTable,
        region: HostRegion,
        policy: UnpinnedPolicy,
        start_soon: Callable[..., object],
        observers: list[Callable[[Transfer], None]],
        log: Any,
        host_slice: tuple[int, int] = (0, 1),
    ) -> None:
        self.layout = layout
        # Host block c of this manager: host_block_bytes at c * stride + offset.
        rank, ranks = host_slice
        self._stride = layout.host_block_bytes * ranks
        self._offset = layout.host_block_bytes * rank
        self.num_host_blocks = num_host_blocks
        self.engine = engine
        self._table = table
        self._region = region
        self._policy = policy
        self._start_soon = start_soon
        self._observers = observers
        self._log = log
        self._fallbacks_logged: set[object] = set()
        self.counts = TransferCounts()
        self.in_flight: set[Transfer] = set()
        self._idle = anyio.Event()
        self._idle.set()
        # The engine is prepared in the background (``engine_prepared``): until then, jobs
        # wait here, in submission order.
        self._prepared = False
        self._engine_error: BaseException | None = None
        self._unprepared: deque[TransferJob] = deque()
        # Jobs waiting for their chunks to pin, in submission order (each with the chunks
        # and its submitter's context), and whether the task that queues them runs.
        self._waiting: deque[_Waiting] = deque()
        self._dispatching = False
        self._pageable_early = bool(getattr(engine, "pageable_before_prepare", False))
        # The KV arrays' memory as of the open, when the engine took its addresses: a
        # storage resized since (or freed, resize_(0)) would have it copy to and from
        # memory the arrays no longer own. Checked at each call (3 us for 32 storages, H200).
        # Each distinct storage (storage, its address, an array in it), and each array's
        # storage as an index into them.
        entries: list[tuple[torch.UntypedStorage, int, int]] = []
        found: dict[int, int] = {}
        self._array_storages: list[int] = []
        for a, array in enumerate(layout.arrays):
            storage = array.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in found:
                found[ptr] = len(entries)
                entries.append((storage, ptr, a))
            self._array_storages.append(found[ptr])
        self._storages = tuple(entries)
        # Those of a group of arrays (a layer-wise copy checks its group's only).
        self._group_storages: dict[range, tuple[tuple[torch.UntypedStorage, int, int], ...]] = {}
        # An engine may refuse a caller's context (the CUDA engine: a graph capture on the
        # caller's current stream) before anything is made of the call.
        self._check_caller: Callable[[Direction], None] | None = getattr(
            engine, "check_caller", None
        )

    async def drained(self) -> None:
        """Returns once no transfer is in flight (their device work is done)."""
        await self._idle.wait()

    def submit(
        self,
        direction: Direction,
        gpu: Ids,
        cpu: Ids,
        method: Method,
        arrays: range | None = None,
        *,
        checked: bool = False,
    ) -> Transfer:
        """Validate, then hand the job to the engine now, or once its host chunks are
        pinned (``wait``), or through pageable memory (``pageable``). Bad input raises
        InvalidTransferError with nothing enqueued. ``checked``: ``check_call`` passed
        for this call already (the groups of one layer-wise load, queued at once)."""
        job = self._validated(direction, gpu, cpu, method, arrays, checked)
        transfer = job.transfer
        if self._engine_error is not None:
            error = TransferError(
                f"{direction} refused: the transfer engine could not be set up "
                f"({self._engine_error!r})",
                direction=direction,
            )
            raise error from self._engine_error
        needed = self._table.unpinned(self._spans(job.cpu_ids))
        early = needed and self._policy == "pageable" and self._pageable_early
        if not self._prepared and not early:
            # The copy waits for what the caller's stream has queued now, as below. (A
            # pageable copy of an engine that takes one before its set-up goes now,
            # even while pinning_paused() holds the set-up back.)
            job.ready = self.engine.record_ready()
            self._track(transfer)
            self._unprepared.append(job)
            return transfer
        if needed and self._policy == "wait":
            # A store must not copy blocks before the compute stream has produced them,
            # and a load must not overwrite blocks the compute stream is still reading:
            # the copy, queued later, waits for what the caller's stream has queued now.
            # (Before tracking: if it raises, nothing is in flight.)
            job.ready = self.engine.record_ready()
        self._track(transfer)
        self._route(job, needed)
        return transfer

    def engine_prepared(self, error: BaseException | None) -> None:
        """On the event loop, once the engine's ``prepare()`` returned (``error`` None) or
        failed: the jobs that waited go on, in order, or fail with a TransferError."""
        waiting, self._unprepared = self._unprepared, deque()
        if error is None:
            self._prepared = True
        else:
            self._engine_error = error
        for job in waiting:
            if error is not None:
                why = (
                    "the manager closed before the transfer engine was set up"
                    if isinstance(error, anyio.ClosedResourceError)
                    else f"the transfer engine could not be set up ({error!r})"
                )
                failed = TransferError(
                    f"{job.transfer.direction} failed: {why}", direction=job.transfer.direction
                )
                failed.__cause__ = error
                job.transfer._finish(failed)
                continue
            with contextlib.suppress(TransferError):  # reported through the handle
                self._route(job, self._table.unpinned(self._spans(job.cpu_ids)))

    def _route(self, job: TransferJob, needed: list[int]) -> None:
        """The unpinned policy, then the engine, for a tracked job whose host chunks
        ``needed`` are not pinned yet."""
        if not needed:
            self._enqueue(job, pageable=False)
        elif self._policy == "pageable":
            self.counts.pageable += 1
            region = self._region
            if region.backing == "shared":
                spans = list(self._spans(job.cpu_ids))
                job.reserve = lambda: region.reserve(spans)
            self._enqueue(job, pageable=True)
        else:
            self.counts.waited += 1
            self._waiting.append((job, needed, contextvars.copy_context()))
            if not self._dispatching:
                self._start_soon(self._enqueue_when_pinned)
                self._dispatching = True

    def _validated(
        self,
        direction: Direction,
        gpu_ids: Ids,
        cpu_ids: Ids,
        method: Method,
        arrays: range | None,
        checked: bool,
    ) -> TransferJob:
        layout = self.layout
        nbytes = layout.host_block_bytes
        if arrays is not None:
            check_arrays(arrays, layout.num_arrays)
            if len(arrays) == layout.num_arrays:
                arrays = None
            else:
                nbytes = layout.span(arrays)[1]
        # Destinations are distinct: no more ids than the destination has blocks.
        most = self.num_host_blocks if direction == "store" else layout.num_blocks
        why = f" (one to each {'host' if direction == 'store' else 'device'} block)"
        gpu = block_ids(gpu_ids, "gpu_block_ids", layout.num_blocks, most, why)
        cpu = block_ids(cpu_ids, "cpu_block_ids", self.num_host_blocks, most, why)
        if len(gpu) != len(cpu):
            raise InvalidTransferError(
                f"gpu_block_ids has {len(gpu)} ids and cpu_block_ids {len(cpu)}"
            )
        dst, given = (cpu, cpu_ids) if direction == "store" else (gpu, gpu_ids)
        unique = type(given) is CheckedIds and given.unique  # False unless sealed
        if not unique and len(set(dst)) != len(dst):
            raise InvalidTransferError(
                f"{'cpu' if direction == 'store' else 'gpu'}_block_ids has duplicate "
                "destinations: the result would depend on copy order"
            )
        if not checked:
            self.check_call(direction, arrays, moves=bool(gpu))
        method = self.check_method(method)
        transfer = Transfer(direction, len(gpu), len(gpu) * nbytes)
        transfer.log = self._log  # the manager's, shielded: a raising done callback's
        return TransferJob(transfer, gpu, cpu, method, arrays, on_finish=_settle)

    def check_call(
        self, direction: Direction, arrays: range | None = None, *, moves: bool = True
    ) -> None:
        """What refuses a call whatever its ids: KV memory that moved (ConfigError; of
        ``arrays`` only, when given; not for a call that ``moves`` no block), and a
        context the engine refuses (LifecycleError: a CUDA graph capture on the caller's
        stream)."""
        if moves:
            self._check_memory(arrays)
        if self._check_caller is not None:
            self._check_caller(direction)

    def _check_memory(self, arrays: range | None) -> None:
        """ConfigError if a KV array's memory moved since the open (its storage resized
        or freed): the engine copies to and from the addresses it took then."""
        storages = self._storages
        if arrays is not None:
            group = self._group_storages.get(arrays)
            if group is None:
                group = tuple(
                    storages[i] for i in sorted({self._array_storages[a] for a in arrays})
                )
                self._group_storages[arrays] = group
            storages = group
        for storage, was, array in storages:
            if storage.data_ptr() != was:
                found = [(t, r) for t, r in enumerate(self.layout.tensor_arrays) if array in r]
                tensor, of = found[0] if found else (None, range(array, array + 1))
                which = f"array {of.start}" if len(of) == 1 else f"arrays {of.start}-{of.stop - 1}"
                what = f"KV tensor {tensor}" if tensor is not None else f"KV {which}"
                raise ConfigError(
                    f"{what}'s memory moved since the manager opened ({which}; its storage "
                    "was resized or freed): transfers copy to and from the addresses it "
                    "had then. Keep the KV tensors in place while the manager is open, or "
                    "close it and open one over the tensors as they are now"
                )

    def _spans(self, cpu_ids: list[int]) -> Iterator[tuple[int, int]]:
        """``(offset, nbytes)`` in the region of each host block (this rank's part)."""
        size, stride, offset = self.layout.host_block_bytes, self._stride, self._offset
        return ((c * stride + offset, size) for c in cpu_ids)

    def check_method(self, method: object) -> Method:
        """The method a transfer asking for ``method`` runs with: itself where the engine
        has it, else ``auto`` (an engine without it: the host engine, or a CUDA engine
        whose runtime cannot load the copy kernel; logged once a method), so that code
        naming a method runs on any machine. InvalidTransferError for a name that is no method."""
        # A str's own text: ``in`` compares with ==, which an array, an odd object or a str
        # subclass answers its own way.
        if not isinstance(method, str) or (method := str.__str__(method)) not in METHODS:
            raise InvalidTransferError(f"method {shown(method)} is no method; use one of {METHODS}")
        if method == "auto" or method in self.engine.methods():
            return cast(Method, method)
        if method not in self._fallbacks_logged:
            self._fallbacks_logged.add(method)
            self._log.warning(
                "transfer.method_fallback",
                requested=method,
                fallback="auto",
                reason=f"this engine runs {', '.join(self.engine.methods())}",
            )
        return "auto"

    def _track(self, transfer: Transfer) -> None:
        if transfer.direction == "store":
            self.counts.stored += 1
        else:
            self.counts.loaded += 1
        if not self.in_flight:
            self._idle = anyio.Event()
        self.in_flight.add(transfer)
        transfer._callbacks.append(self._transfer_done)

    def _transfer_done(self, transfer: Transfer) -> None:
        self.in_flight.discard(transfer)
        if transfer.error is not None:
            self.counts.failed += 1
        elif transfer.direction == "store":
            self.counts.bytes_stored += transfer.nbytes
        else:
            self.counts.bytes_loaded += transfer.nbytes
        if not self.in_flight:
            self._idle.set()
        for observer in self._observers:
            try:
                observer(transfer)
            except Exception as exc:
                self._log.error(
                    "transfer.observer_failed", observer=repr(observer), error=repr(exc)
                )

    def _enqueue(self, job: TransferJob, *, pageable: bool) -> None:
        try:
            self.engine.submit(job, pageable=pageable)
        except Exception as exc:
            transfer = job.transfer
            error = TransferError(
                f"{transfer.direction} could not be enqueued: {exc}",
                direction=transfer.direction,
                method=transfer.method,
                **_codes(exc),
            )
            error.__cause__ = exc
            transfer._finish(error)
            raise error from exc

    async def _enqueue_when_pinned(self) -> None:
        """Queue each waiting job once its chunks are pinned, or fail it once the pipeline
        stopped short of them; each in its submitter's context. One task for all, judging
        a batch by one look at the table, so that jobs whose chunks are pinned by the same
        time go in submission order: whatever order the event loop wakes tasks in, and
        even if a pin thread marks a chunk while the batch is handled."""
        waiting, table = self._waiting, self._table
        batch: deque[_Waiting] = deque()
        kept: list[_Waiting] = []
        try:
            while waiting:
                # Done callbacks may submit more meanwhile: they join the queue's end.
                batch.extend(waiting)
                waiting.clear()
                stopped = table.stopped
                states = table.states()
                while batch:
                    job, chunks, context = batch[0]
                    missing = next((i for i in chunks if states[i] is not _PINNED), None)
                    if missing is None:
                        context.run(self._enqueue_pinned, job)
                    elif stopped:
                        context.run(self._fail_unpinned, job, missing)
                    else:
                        kept.append(batch[0])
                    batch.popleft()
                waiting.extendleft(reversed(kept))
                kept.clear()
                if not waiting:
                    break
                if table.stopped:
                    # Submitted by a done callback after the pipeline stopped: failed on
                    # the next pass, after the loop has run the others.
                    await anyio.lowlevel.checkpoint()
                else:
                    await table.progressed()
        except BaseException as exc:
            for job, _, _ in (*kept, *batch, *waiting):
                job.finish(interrupted(exc))  # a finished one stays as it is
            waiting.clear()
            raise
        finally:
            self._dispatching = False

    def _enqueue_pinned(self, job: TransferJob) -> None:
        with contextlib.suppress(TransferError):  # reported through the handle
            self._enqueue(job, pageable=False)

    def _fail_unpinned(self, job: TransferJob, missing: int) -> None:
        reason = self._table.error
        transfer = job.transfer
        error = TransferError(
            f"host chunk {missing} of this {transfer.direction} will not be pinned: "
            + ("pinning failed" if reason else "the manager closed"),
            direction=transfer.direction,
        )
        error.__cause__ = reason
        transfer._finish(error)


def _codes(error: BaseException) -> dict[str, Any]:
    code = getattr(error, "code", None)
    name = getattr(error, "code_name", None)
    return {
        "code": code if isinstance(code, int) and not isinstance(code, bool) else None,
        "code_name": name if isinstance(name, str) else None,
    }


def _settle(job: TransferJob, error: BaseException | None) -> None:
    """The engine's report, as the transfer's outcome: an error becomes a TransferError
    naming the transfer (the cause chained), unless it is one already or the transfer was
    interrupted by the close."""
    transfer = job.transfer
    if error is not None and not isinstance(error, TransferError | TransferInterrupted):
        wrapped = TransferError(
            f"{transfer.direction} failed ({transfer.method}, {transfer.path}): {error}",
            direction=transfer.direction,
            method=transfer.method,
            **_codes(error),
        )
        wrapped.__cause__ = error
        error = wrapped
    transfer._finish(error)


def check_arrays(arrays: object, num_arrays: int) -> None:
    """``arrays`` is a non-empty range of consecutive array indices of the layout."""
    if not isinstance(arrays, range):
        raise InvalidTransferError(
            f"arrays must be a range of array indices, not {type(arrays).__name__}"
        )
    if not arrays or arrays.step != 1:
        raise InvalidTransferError(f"arrays must be non-empty and consecutive, got {shown(arrays)}")
    if arrays.start < 0 or arrays.stop > num_arrays:
        raise InvalidTransferError(
            f"arrays {shown(arrays)} is outside the layout's range(0, {num_arrays})"
        )
