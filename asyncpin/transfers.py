"""KV block transfers between the engine's KV arrays and the pinned host region.

A transfer is validated completely before anything is enqueued, then runs on the engine
of the manager's backend:

- ``HostTransferEngine`` (no GPU): the "device" arrays are CPU tensors; copies run in a
  worker thread, one direction's in submission order. It exists so that every test of the
  API runs without a GPU.
- ``asyncpin.cuda_transfers.CudaTransferEngine``: dedicated store and load streams, copy
  methods chosen per transfer, completion reported by one waiter thread per direction.

The awaiting coroutine learns of completion through an ``anyio.Event`` set on the event
loop; cancelling the awaiting task only stops the waiting: the copy, and every buffer it
touches, stays owned by the manager until the device work is done.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
import anyio.to_thread
import torch

from asyncpin._outcome import Outcome
from asyncpin.errors import InvalidTransferError, TransferError
from asyncpin.kv import KVLayout

__all__ = [
    "Direction",
    "HostTransferEngine",
    "Method",
    "Transfer",
    "TransferEngine",
    "TransferJob",
    "block_ids",
    "copy_in_thread",
    "host_blocks_view",
    "settle_interrupted",
]

Direction = Literal["store", "load"]
Method = Literal["auto", "host", "batch", "pack", "kernel"]


class Transfer(Outcome):
    """Handle of one store or load: awaitable, with ``done()``, ``nbytes``, ``elapsed_s``.

    ``await transfer`` (or ``await transfer.wait()``) returns when the device work is
    complete and raises the TransferError if it failed (``ClosedResourceError`` if the
    manager closed under it). For a load on CUDA, ``event`` is a ``torch.cuda.Event``
    recorded after the copy: ``torch.cuda.current_stream().wait_event(transfer.event)``
    orders later compute after it without blocking. It is None until the copy is queued
    (immediately when the host blocks are pinned; later for a transfer that waits for
    pinning or copies through pageable memory).
    """

    __slots__ = (
        "_callbacks",
        "direction",
        "event",
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

    def _finish(self, error: BaseException | None = None) -> None:
        t_done = time.perf_counter()
        if self._settle(error):
            self.t_done = t_done
            callbacks, self._callbacks = self._callbacks, []  # a kept handle keeps nothing else
            for callback in callbacks:
                callback(self)

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
    ready: Any = None  # for a job submitted late: the caller's stream when it was made
    keep: list[Any] = field(default_factory=list)  # buffers alive until the copy is done
    # CUDA engine: the error of a job only partly queued, reported once its streams drain;
    # and whether a loop-side sweep has seen its event complete.
    failure: BaseException | None = None
    seen_done: bool = False
    # A pageable job on a shared region: gives its host blocks their memory first, in the
    # copy's worker thread (a full /dev/shm is then an error, not SIGBUS).
    reserve: Callable[[], None] | None = None


class TransferEngine(Protocol):
    """Runs validated jobs. ``submit`` enqueues at once (from the event loop thread) and
    arranges for ``job.transfer._finish`` to be called on the loop when the copy is done.
    The copy waits for the work queued so far on the caller's current stream: at
    ``submit`` time, or at ``record_ready()`` time for a job submitted later (``job.ready``)."""

    name: str

    def methods(self) -> tuple[str, ...]: ...

    def submit(self, job: TransferJob, *, pageable: bool) -> None: ...

    def record_ready(self) -> Any: ...

    def prepare(self) -> None:
        """Called once, in a worker thread, before the first transfer: allocate device
        resources and compile kernels, so that none of it happens mid-serving."""

    def close(self) -> None: ...


def settle_interrupted(transfer: Transfer, exc: BaseException) -> None:
    """Settle a transfer whose driving task was cancelled (the manager is closing) without
    handing the cancellation itself to whoever awaits the transfer."""
    error = anyio.ClosedResourceError("the transfer was interrupted: the manager is closing")
    error.__cause__ = exc
    transfer._finish(error)


async def copy_in_thread(
    job: TransferJob,
    copy: Callable[[TransferJob], None],
    failed: str,
    *,
    limiter: anyio.CapacityLimiter | None = None,
) -> None:
    """Run ``copy(job)`` in a worker thread, which returns once the copy is over, and
    settle the transfer: done; failed (the error through the handle, never lost); or
    interrupted, when the driving task is cancelled because the manager is closing."""
    def run() -> None:
        if job.reserve is not None:
            job.reserve()
        copy(job)

    try:
        await anyio.to_thread.run_sync(run, limiter=limiter)
    except Exception as exc:
        error = TransferError(f"{job.transfer.direction} {failed}: {exc}")
        error.__cause__ = exc
        job.transfer._finish(error)
    except BaseException as exc:
        settle_interrupted(job.transfer, exc)
        raise
    else:
        job.transfer._finish()
    finally:
        job.keep.clear()


def host_blocks_view(
    region_view: torch.Tensor, layout: KVLayout, num_host_blocks: int
) -> torch.Tensor:
    """``[num_host_blocks, num_arrays, *block_shape]`` over the region's bytes."""
    nbytes = num_host_blocks * layout.host_block_bytes
    return (
        region_view[:nbytes]
        .view(layout.dtype)
        .view(num_host_blocks, layout.num_arrays, *layout.block_shape)
    )


def block_ids(ids: Sequence[int] | torch.Tensor, what: str, limit: int) -> list[int]:
    """Validate a list of block ids: 1-D integers on the CPU, all in ``[0, limit)``.

    Returns a copy as a plain list (the caller may reuse its buffer at once). Plain Python
    keeps a small transfer's submission to a few microseconds; a torch op on a CPU tensor
    costs several."""
    if isinstance(ids, torch.Tensor):
        if ids.device.type != "cpu":
            raise InvalidTransferError(
                f"{what} must be on the CPU (got a tensor on {ids.device}): reading ids from "
                "a device would make every transfer wait for it"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise InvalidTransferError(f"{what} must be integers, got dtype {ids.dtype}")
        if ids.dim() != 1:
            raise InvalidTransferError(f"{what} must be 1-D, got shape {tuple(ids.shape)}")
        values: list[int] = ids.tolist()
    else:
        try:
            values = list(ids)
        except TypeError:
            raise InvalidTransferError(f"{what} must be a sequence of ints or a tensor") from None
        # Exact ints take one pass over the types (a generator of isinstance calls costs
        # ~5x more: ~0.1 ms for 1024 ids); int subclasses other than bool are ints too.
        kinds = set(map(type, values))
        if not kinds <= {int} and not all(
            issubclass(k, int) and not issubclass(k, bool) for k in kinds
        ):
            raise InvalidTransferError(f"{what} must hold ints only")
    if values:
        lo, hi = min(values), max(values)
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise InvalidTransferError(f"{what} holds {bad}, outside [0, {limit})")
    return values


class HostTransferEngine:
    """Copies between CPU tensors standing in for device KV and the host region, in a
    worker thread (torch's copy kernels release the GIL).

    Each direction has one FIFO, drained by one task at a time that copies its jobs one
    after the other: jobs of one direction run in submission order (a later store to the
    same host block wins, as on the CUDA engine's streams), while a store and a load run
    at once. The draining task is started when a direction's FIFO gets a job and none is
    running, and ends when the FIFO is empty, so nothing outlives the transfers."""

    name = "host"

    def __init__(self, layout: KVLayout, host_blocks: torch.Tensor, start_soon: Any) -> None:
        self._layout = layout
        self._host: torch.Tensor | None = host_blocks
        self._start_soon = start_soon
        # One worker thread per direction, apart from the application's default pool.
        self._limiter = anyio.CapacityLimiter(2)
        self._queues: dict[Direction, deque[TransferJob]] = {"store": deque(), "load": deque()}
        self._draining: dict[Direction, bool] = {"store": False, "load": False}

    def methods(self) -> tuple[str, ...]:
        return ("host",)

    def prepare(self) -> None:
        """Nothing to prepare: copies are torch CPU ops."""

    def record_ready(self) -> None:
        return None

    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        job.transfer.method = "host"
        job.transfer.path = "pageable" if pageable else "pinned"
        direction = job.transfer.direction
        if not self._draining[direction]:
            # If this raises, nothing was queued: the caller fails the transfer.
            self._start_soon(self._drain, direction)
            self._draining[direction] = True
        self._queues[direction].append(job)

    async def _drain(self, direction: Direction) -> None:
        """Copy the direction's jobs one at a time, oldest first, until none is left.

        A failed copy fails its own transfer only. Cancelled (the manager is closing): the
        job being copied is settled by ``copy_in_thread`` once its copy is over, and the
        jobs still queued, which never started, are settled as interrupted."""
        queue = self._queues[direction]
        try:
            while queue:
                job = queue.popleft()
                await copy_in_thread(job, self._copy, "failed", limiter=self._limiter)
        except BaseException as exc:
            while queue:
                job = queue.popleft()
                job.keep.clear()
                settle_interrupted(job.transfer, exc)
            raise
        finally:
            self._draining[direction] = False

    def _copy(self, job: TransferJob) -> None:
        host = self._host
        assert host is not None, "a copy after close"
        gpu_ids = torch.tensor(job.gpu_ids, dtype=torch.int64)
        cpu_ids = torch.tensor(job.cpu_ids, dtype=torch.int64)
        for a, array in enumerate(self._layout.arrays):
            if job.transfer.direction == "store":
                host[cpu_ids, a] = array[gpu_ids]
            else:
                array[gpu_ids] = host[cpu_ids, a]

    def close(self) -> None:
        """Drop the view of the host blocks: only the application's views may keep the
        region mapped past close."""
        self._host = None
