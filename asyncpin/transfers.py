"""The transfer's handle and job, and the checks of block ids: what the router and
every engine (``asyncpin.engines``) share.

The awaiting coroutine learns of completion through an ``anyio.Event`` set on the event
loop; cancelling the awaiting task only stops the waiting: the copy, and every buffer it
touches, stays owned by the manager until the device work is done.
"""

from __future__ import annotations

import itertools
import numbers
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, SupportsIndex, cast

import anyio
import anyio.to_thread
import structlog
import torch

from asyncpin._log import ShieldedLog
from asyncpin._outcome import Outcome
from asyncpin._text import shown
from asyncpin._threads import to_the_end
from asyncpin.errors import ConfigError, InvalidTransferError
from asyncpin.kv import KVLayout

__all__ = [
    "BlockIds",
    "Direction",
    "IntArray",
    "Method",
    "Transfer",
    "TransferInterrupted",
    "TransferJob",
    "block_ids",
    "copy_in_thread",
    "host_array_view",
    "host_blocks_view",
    "host_bytes_view",
    "interrupted",
]

# Callback errors when no manager's logger was given (``Transfer.log``); a failing sink
# must not stop the callbacks and jobs that follow.
_log = ShieldedLog(structlog.get_logger("asyncpin"))

Direction = Literal["store", "load"]
Method = Literal["auto", "host", "batch", "pack", "kernel"]


class Transfer(Outcome):
    """Handle of one store or load: awaitable, with ``done()``, ``nbytes``, ``elapsed_s``.

    ``await transfer`` (or ``await transfer.wait()``) returns when the device work is
    complete and raises the TransferError if it failed (``ClosedResourceError`` if the
    manager closed under it; one still waiting, for its chunks' pinning or for the
    engine's set-up, fails with a TransferError saying the manager closed). For a load
    on CUDA, ``event`` is a ``torch.cuda.Event``
    recorded after the copy: ``torch.cuda.current_stream().wait_event(transfer.event)``
    orders later compute after it without blocking. It is None until the copy is queued
    (immediately when the host blocks are pinned; later for a transfer that waits for
    pinning or copies through pageable memory).
    """

    __slots__ = (
        "_callbacks",
        "direction",
        "event",
        "log",
        "method",
        "nbytes",
        "num_blocks",
        "path",
        "t_done",
        "t_submit",
    )

    def __init__(self, direction: Direction, num_blocks: int, nbytes: int) -> None:
        self.direction: Direction = direction
        self.num_blocks = num_blocks
        self.nbytes = nbytes
        self.method: str = "-"
        self.path: str = "pinned"
        self.event: Any = None
        self.log: ShieldedLog = _log  # the manager's, set by its router
        self.t_submit = time.perf_counter()
        self.t_done: float | None = None
        super().__init__()
        self._callbacks: list[Callable[[Transfer], None]] = []

    def done(self) -> bool:
        return self.is_set()

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from submission to completion (None while in flight)."""
        return None if self.t_done is None else self.t_done - self.t_submit

    def add_done_callback(self, callback: Callable[[Transfer], None]) -> None:
        """Call ``callback(transfer)`` on the event loop when the transfer finishes (at
        once if it has): done or failed (``transfer.error``), its device work over. An
        exception from a callback called when the transfer finishes is logged
        (``transfer.callback_failed``) and reaches neither the other callbacks, the
        engine nor the manager; one called at once raises to the caller."""
        if self.done():
            callback(self)
        else:
            self._callbacks.append(callback)

    def _finish(self, error: BaseException | None = None) -> None:
        t_done = time.perf_counter()
        if self._settle(error):
            self.t_done = t_done
            callbacks, self._callbacks = self._callbacks, []  # a kept handle keeps nothing else
            for callback in callbacks:
                # The engine finishes its jobs through here: a callback's error must not
                # stop it settling the others (a close waits for every one of them).
                try:
                    callback(self)
                except Exception as exc:
                    self.log.error(
                        "transfer.callback_failed", callback=shown(callback), error=shown(exc)
                    )

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return (
            f"<Transfer {self.direction} {self.num_blocks} blocks {self.nbytes} bytes "
            f"{self.method}/{self.path} {state}>"
        )


@dataclass(eq=False)
class TransferJob:
    """Everything an engine needs for one validated transfer."""

    transfer: Transfer
    gpu_ids: list[int]
    cpu_ids: list[int]
    method: Method
    # The arrays to copy (consecutive); None: every array.
    arrays: range | None = None
    ready: Any = None  # for a job submitted late: the caller's stream when it was made
    keep: list[Any] = field(default_factory=list)  # buffers alive until the copy is done
    # CUDA engine: the error of a job only partly queued, reported once its streams drain;
    # and whether a loop-side sweep has seen its event complete.
    failure: BaseException | None = None
    seen_done: bool = False
    # A pageable job on a shared region: gives its host blocks their memory first, in the
    # copy's worker thread (a full /dev/shm is then an error, not SIGBUS).
    reserve: Callable[[], None] | None = None
    # Set by the router: turns the engine's raw error into the transfer's outcome.
    on_finish: Callable[[TransferJob, BaseException | None], None] | None = None

    def finish(self, error: BaseException | None = None) -> None:
        """The engine's one report of the job, on the event loop thread: the copy is over
        (``error`` None) or failed with ``error``, as raised."""
        self.keep.clear()
        if self.on_finish is not None:
            self.on_finish(self, error)
        else:
            self.transfer._finish(error)


class TransferInterrupted(anyio.ClosedResourceError):
    """A transfer's driving task was cancelled because the manager is closing: the
    awaiter sees a ClosedResourceError (the caller closed the manager), never the
    cancellation itself, which belongs to that task."""


def interrupted(exc: BaseException) -> TransferInterrupted:
    """The outcome of a transfer interrupted by ``exc`` (chained)."""
    error = TransferInterrupted("the transfer was interrupted: the manager is closing")
    error.__cause__ = exc
    return error


async def copy_in_thread(
    job: TransferJob,
    copy: Callable[[TransferJob], None],
    *,
    limiter: anyio.CapacityLimiter | None = None,
) -> None:
    """Run ``copy(job)`` in a worker thread once ``limiter`` (by default anyio's default
    pool) gives it a slot, return once the copy is over, and finish the job: done, or
    failed (the error through the handle, never lost). A cancellation while it waits for
    its slot interrupts it; once the copy began, a cancellation (asyncio's own
    ``Task.cancel()`` included) is raised after it: a later copy to the same blocks must
    not be overtaken by this one."""
    copied: list[Exception | None] = []  # the copy's outcome, once it is over

    def run() -> None:
        try:
            if job.reserve is not None:
                job.reserve()
            copy(job)
        except Exception as exc:
            copied.append(exc)
        else:
            copied.append(None)

    slots = limiter if limiter is not None else anyio.to_thread.current_default_thread_limiter()
    slot = object()
    try:
        await slots.acquire_on_behalf_of(slot)  # cancellable: a copy not begun
    except BaseException as exc:
        job.finish(interrupted(exc))
        raise
    try:
        await to_the_end(run)  # a thread of its own, for the slot taken
    except Exception as exc:  # no thread ran it (none could start, say)
        job.finish(copied[0] if copied else exc)
    except BaseException as exc:
        job.finish(copied[0] if copied else interrupted(exc))
        raise
    else:
        job.finish(copied[0])
    finally:
        slots.release_on_behalf_of(slot)


def host_bytes_view(
    region_view: torch.Tensor,
    layout: KVLayout,
    num_host_blocks: int,
    host_slice: tuple[int, int] = (0, 1),
) -> torch.Tensor:
    """``[num_host_blocks, host_block_bytes]`` uint8 over the region's bytes. With
    ``host_slice=(rank, ranks)``, host blocks of ``ranks`` such layouts are interleaved
    (``ranks * host_block_bytes`` apart) and this is rank ``rank``'s part of each."""
    rank, ranks = host_slice
    size = layout.host_block_bytes
    return region_view[rank * size :].as_strided(
        (num_host_blocks, size), (ranks * size, 1), region_view.storage_offset() + rank * size
    )


def _typed(
    host_bytes: torch.Tensor,
    dtype: torch.dtype,
    offset: int,
    shape: tuple[int, ...],
    inner: tuple[int, ...],
    what: str,
) -> torch.Tensor:
    """``host_bytes`` (rows of host blocks) seen as ``dtype``: element ``(c, *i)`` at byte
    ``offset`` of host block ``c``, then ``inner`` strides (elements)."""
    size = dtype.itemsize
    start = host_bytes.storage_offset() + offset
    if start % size or host_bytes.stride(0) % size:
        raise ConfigError(
            f"{what} ({dtype}) does not start on a multiple of its {size}-byte elements in "
            "every host block; read it as bytes (host_bytes)"
        )
    typed = torch.empty(0, dtype=dtype, device=host_bytes.device)
    typed.set_(
        host_bytes.untyped_storage(),
        start // size,
        (host_bytes.shape[0], *shape),
        (host_bytes.stride(0) // size, *inner),
    )
    return typed


def host_array_view(host_bytes: torch.Tensor, layout: KVLayout, a: int) -> torch.Tensor:
    """``[num_host_blocks, *array_shapes[a]]`` typed view of array ``a``'s host blocks,
    whose bytes lie as on the device (a block's strides are the device array's)."""
    return _typed(
        host_bytes,
        layout.array_dtypes[a],
        layout.array_offsets[a],
        layout.array_shapes[a],
        tuple(layout.arrays[a].stride()[1:]),
        f"array {a}",
    )


def host_blocks_view(host_bytes: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``[num_host_blocks, num_arrays, *block_shape]`` over the host blocks, for a layout
    whose arrays share block shape and dtype (ConfigError otherwise)."""
    dtype = layout.dtype
    # The order of a block's elements (the strides of its dimensions of size 1 are moot).
    inner = {
        tuple(st if n > 1 else 0 for n, st in zip(array.shape[1:], array.stride()[1:], strict=True))
        for array in layout.arrays
    }
    if len(inner) > 1:
        raise ConfigError(
            "the KV arrays order their blocks' elements differently; view each with host_array(a)"
        )
    return _typed(
        host_bytes,
        dtype,
        0,
        (layout.num_arrays, *layout.block_shape),
        (layout.block_bytes // dtype.itemsize, *layout.arrays[0].stride()[1:]),
        "the KV blocks",
    )


class IntArray(Protocol):
    """What block ids may also be: a 1-D array of integers such as NumPy's."""

    @property
    def dtype(self) -> Any: ...

    @property
    def ndim(self) -> int: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    def tolist(self) -> Any: ...


#: Block ids: a sequence of ints (NumPy's integer scalars included), a CPU tensor, or a
#: NumPy array of integers.
BlockIds = Sequence[int] | Sequence[SupportsIndex] | torch.Tensor | IntArray

# The dtypes of tensors that may hold block ids (not bool, not the quantized ones).
_INT_DTYPES = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.uint8, torch.uint16, torch.uint32, torch.uint64}
)


def _is_array(ids: object) -> bool:
    """A NumPy array (or anything shaped like one), without importing NumPy."""
    return all(hasattr(ids, name) for name in ("dtype", "ndim", "shape", "tolist"))


_SEAL = object()  # only CheckedIds.__new__ has it: a CheckedIds made otherwise is not trusted


class CheckedIds(tuple[int, ...]):
    """Block ids checked once, to be handed to several transfers (a layer-wise load's
    groups): ints, with their ``bound`` (one past the largest, 0 when empty) and whether
    they are ``unique``. Immutable, attributes included, so ``block_ids`` checks only the
    bound again; one not made by its constructor (``tuple.__new__``) is checked in full,
    and a copy or a pickle comes back as a plain tuple."""

    def __new__(cls, ids: BlockIds, what: str, limit: int) -> CheckedIds:
        values = block_ids(ids, what, limit)
        self = super().__new__(cls, values)
        bound = max(values) + 1 if values else 0
        self.__dict__["_checked"] = (_SEAL, bound, len(set(values)) == len(values))
        return self

    def _sealed(self) -> tuple[object, int, bool] | None:
        checked = self.__dict__.get("_checked")
        return checked if checked is not None and checked[0] is _SEAL else None

    @property
    def bound(self) -> int:
        checked = self._sealed()
        return checked[1] if checked is not None else 0

    @property
    def unique(self) -> bool:
        checked = self._sealed()
        return checked[2] if checked is not None else False

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("CheckedIds is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("CheckedIds is immutable")

    def __reduce__(self) -> tuple[type[tuple[int, ...]], tuple[tuple[int, ...]]]:
        return tuple, (tuple(self),)


def _ints(values: list[Any], what: str) -> list[int]:
    """``values`` as plain ints; InvalidTransferError if any is no integer (or a bool).
    Exact ints take one pass over the types (a generator of isinstance calls costs ~5x
    more: ~0.1 ms for 1024 ids); int subclasses other than bool are ints too."""
    kinds = set(map(type, values))
    if kinds <= {int}:
        return values
    if not all(issubclass(k, numbers.Integral) and not issubclass(k, bool) for k in kinds):
        raise InvalidTransferError(f"{what} must hold ints only")
    return [operator.index(v) for v in values]  # NumPy's integer scalars, say


def _too_many(what: str, count: int | None, max_len: int, why: str) -> InvalidTransferError:
    many = f"{count} ids, more" if count is not None else "more ids"
    blocks = "block" if max_len == 1 else "blocks"
    return InvalidTransferError(
        f"{what} has {many} than the {max_len} {blocks} this call can move{why}"
    )


def block_ids(
    ids: BlockIds, what: str, limit: int, max_len: int | None = None, why: str = ""
) -> list[int]:
    """Validate a list of block ids: 1-D integers on the CPU (a sequence of ints, a CPU
    tensor or a NumPy array), all in ``[0, limit)``, and at most ``max_len`` of them
    (told before any list is made of them: ``range(2**62)`` is refused, not built;
    ``why`` says where that bound comes from). An empty tensor or array is no ids,
    whatever its dtype (``np.array([])`` is float64).

    Returns a copy as a plain list (the caller may reuse its buffer at once). Plain Python
    keeps a small transfer's submission to a few microseconds; a torch op on a CPU tensor
    costs several."""
    if type(ids) is CheckedIds and ids._sealed() is not None:
        if ids.bound > limit:
            raise InvalidTransferError(f"{what} holds {ids.bound - 1}, outside [0, {limit})")
        if max_len is not None and len(ids) > max_len:
            raise _too_many(what, len(ids), max_len, why)
        return list(ids)
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise InvalidTransferError(
                f"{what} must be on the CPU (got a tensor on {ids.device}): reading ids from "
                "a device would make every transfer wait for it"
            )
        if ids.layout != torch.strided:
            raise InvalidTransferError(f"{what} must be a dense tensor, not {ids.layout}")
        if ids.dim() == 1 and ids.shape[0] == 0:
            return []
        if ids.dtype not in _INT_DTYPES:  # quantized ones too: tolist() cannot read them
            raise InvalidTransferError(f"{what} must be integers, got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise InvalidTransferError(f"{what} must be 1-D, got shape {tuple(ids.shape)}")
        if max_len is not None and ids.shape[0] > max_len:
            raise _too_many(what, ids.shape[0], max_len, why)
        values: list[int] = ids.tolist()
    elif not isinstance(ids, list | tuple) and _is_array(ids):  # lists: the hot path
        # A NumPy array (engines keep block tables in them): integer kinds only.
        array = cast(IntArray, ids)
        if array.ndim == 1 and array.shape[0] == 0:
            return []
        if getattr(array.dtype, "kind", "") not in ("i", "u"):
            raise InvalidTransferError(f"{what} must be integers, got dtype {array.dtype}")
        if array.ndim != 1:
            raise InvalidTransferError(f"{what} must be 1-D, got shape {tuple(array.shape)}")
        if max_len is not None and array.shape[0] > max_len:
            raise _too_many(what, array.shape[0], max_len, why)
        # Ints, but for a masked array's masked entries (None): checked as a list's are.
        values = _ints(array.tolist(), what)
    else:
        if isinstance(ids, set | frozenset | dict | str | bytes | bytearray | memoryview):
            # Unordered (ids pair by position), or bytes rather than ids.
            raise InvalidTransferError(
                f"{what} must be a sequence of ints, not a {type(ids).__name__}"
            )
        try:
            if max_len is None:
                listed = list(cast(Sequence[int], ids))
            elif isinstance(ids, list | tuple):  # the hot path: its length is known
                if len(ids) > max_len:
                    raise _too_many(what, len(ids), max_len, why)
                listed = list(ids)
            else:  # a range, a generator: no more than one id too many is made
                listed = list(itertools.islice(cast(Iterable[int], ids), max_len + 1))
                if len(listed) > max_len:
                    raise _too_many(what, None, max_len, why)
            values = _ints(listed, what)
        except TypeError:
            raise InvalidTransferError(f"{what} must be a sequence of ints or a tensor") from None
    if values:
        lo, hi = min(values), max(values)
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise InvalidTransferError(f"{what} holds {shown(bad)}, outside [0, {limit})")
    return values
