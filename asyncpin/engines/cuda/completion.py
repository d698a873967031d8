"""How the CUDA engine learns that a job's device work is over, and how large stores are
queued off the event loop.

Completion: each direction has one waiter thread that blocks on a blocking-sync CUDA
event (the thread sleeps; no core spins) and then wakes the event loop. Buffers a copy
uses are kept alive until that moment. A thread needs the GIL to wake the loop, and a
loop kept busy in Python can starve it for seconds (bench/RESULTS.md#starved-threads). So, while
transfers are in flight the loop also looks every 20 ms (``Completion.sweep``: a timer on
asyncio, a task of the manager on trio, which has no timers): a transfer whose event has
been complete for a whole sweep without being reported is finished there. The loop then
counts as starving threads for a second: it looks every 2 ms, and stores stay on the
loop instead of going to the submitter thread.

What differs between asyncio and trio (how a thread wakes the loop, how the sweep is
scheduled) is decided once, when the engine is made (``loop_hooks``, from the loop the
manager gives it).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import structlog

from asyncpin.gate import outside_captures, unless_capturing
from asyncpin.transfers import Direction, TransferJob

__all__ = [
    "AsyncioHooks",
    "Completion",
    "LoopHooks",
    "Submitter",
    "TrioHooks",
    "Waiter",
    "loop_hooks",
]

_log = structlog.get_logger("asyncpin")

# The loop-side sweep for completions a starved waiter thread has not reported: its
# period (short once the loop has been seen starving threads: each sweep costs the loop
# tens of microseconds), and how long the loop counts as starving after a sweep finished
# a transfer; stores stay on the loop meanwhile.
_SWEEP_S = 0.020
_SWEEP_STARVED_S = 0.002
_STARVED_S = 1.0


class _Worker:
    """A thread that handles the items put to it one at a time, in order (``_handle``)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread (once); items put before are handled then."""
        if self._thread.ident is None:
            self._thread.start()

    def _handle(self, item: Any) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._handle(item)

    def close(self) -> None:
        """Returns once every item put before has been handled (none if never started)."""
        self._queue.put(None)
        if self._thread.ident is not None:
            self._thread.join()


class Waiter(_Worker):
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


class Submitter(_Worker):
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


# -- the event loop's specifics ---------------------------------------------------------


class LoopHooks:
    """What the completion side needs of the event loop it was made on."""

    def call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """From any thread: run ``fn(*args)`` on the event loop."""
        raise NotImplementedError

    def start_sweeping(self, completion: Completion) -> None:
        """On the loop: sweep ``completion`` after a period (the first job is watched)."""
        raise NotImplementedError

    def sweep_again(self, completion: Completion) -> None:
        """On the loop, after a sweep that left jobs outstanding."""
        raise NotImplementedError


class AsyncioHooks(LoopHooks):
    """asyncio: ``call_soon_threadsafe`` (it returns at once), and the sweep as a timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def start_sweeping(self, completion: Completion) -> None:
        self.loop.call_later(completion.period(), completion.sweep)

    def sweep_again(self, completion: Completion) -> None:
        self.loop.call_later(completion.period(), completion.sweep)


class TrioHooks(LoopHooks):
    """trio: anyio's portal (it returns once the loop has run the call, with its error),
    and the sweep as a task started with ``start_soon`` (trio has no timers)."""

    def __init__(self, start_soon: Callable[..., object], token: Any) -> None:
        self.start_soon = start_soon
        self._token = token

    def call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        anyio.from_thread.run_sync(fn, *args, token=self._token)

    def start_sweeping(self, completion: Completion) -> None:
        self.start_soon(self._sweeper, completion)

    def sweep_again(self, completion: Completion) -> None:
        pass  # the task loops

    @staticmethod
    async def _sweeper(completion: Completion) -> None:
        """Sweeps as a task, until a sweep finds nothing outstanding. A sweep that raises
        (a transfer's callback did) is logged, as asyncio logs a failed timer callback,
        instead of failing the manager's task."""
        try:
            while completion.sweeping:
                await anyio.sleep(completion.period())
                try:
                    completion.sweep()
                except Exception as exc:
                    _log.error("transfer.sweep_failed", error=repr(exc), exc_info=exc)
        finally:  # cancelled with the manager's tasks: the next job watched starts a new one
            completion.sweeping = False


def loop_hooks(start_soon: Callable[..., object], loop: Any = None) -> LoopHooks:
    """The hooks of the event loop ``loop`` (``anyio.lowlevel.current_token()`` taken
    on it, as ``EngineSetup.loop``; from any thread), or of the running one when it is
    None (call it on the loop then)."""
    token = anyio.lowlevel.current_token() if loop is None else loop
    native = token.native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        return AsyncioHooks(native)
    return TrioHooks(start_soon, token)


# -- completion -------------------------------------------------------------------------


class Completion:
    """Reports each job queued on the device once, on the event loop: through its
    direction's waiter thread, or through the loop-side sweep when that thread is
    starved."""

    def __init__(self, hooks: LoopHooks) -> None:
        self.hooks = hooks
        self.waiters = {d: Waiter(f"asyncpin-{d}-waiter") for d in ("store", "load")}
        # Jobs queued on the device and not yet reported, per direction, in order.
        self.outstanding: dict[Direction, deque[TransferJob]] = {
            "store": deque(),
            "load": deque(),
        }
        self.sweeping = False
        self._starved_until = 0.0

    def report(self, job: TransferJob, error: BaseException | None) -> None:
        """From any thread: finish ``job`` on the event loop."""
        self.hooks.call_soon(job.finish, error)

    def wait(self, job: TransferJob, done: Any) -> None:
        """Report ``job`` once ``done``, a blocking-sync event, has completed (with its
        device error, else the job's own ``failure``), unless the sweep finished it."""
        self.waiters[job.transfer.direction].submit(
            done, lambda error: self.report(job, error or job.failure), job.transfer.done
        )

    def watch(self, job: TransferJob) -> None:
        """Track a job queued for the device until it is reported; sweep while any is."""
        self.outstanding[job.transfer.direction].append(job)
        if not self.sweeping:
            self.hooks.start_sweeping(self)
            self.sweeping = True

    def starved(self) -> bool:
        """Whether a sweep lately finished a transfer its waiter thread had not reported."""
        return time.monotonic() < self._starved_until

    def period(self) -> float:
        return _SWEEP_STARVED_S if self.starved() else _SWEEP_S

    def sweep(self) -> None:
        """On the event loop, every ``_SWEEP_S`` (``_SWEEP_STARVED_S`` while the loop counts
        as starving threads) while jobs are outstanding: drop the ones reported, and
        finish, in order, each one whose event was already complete at the previous sweep.
        A waiter thread reports within tens of microseconds unless the loop starves it of
        the GIL, so finishing one here is the sign of that."""
        try:
            for jobs in self.outstanding.values():
                self._sweep_direction(jobs)
        finally:  # a transfer's callback that raises must not end the sweeping
            if not any(self.outstanding.values()):
                self.sweeping = False
            else:
                self.hooks.sweep_again(self)

    def _sweep_direction(self, jobs: deque[TransferJob]) -> None:
        in_order = True  # every job ahead of this one is finished
        i = 0  # by index: a callback run by a finish may submit (append) another job
        while i < len(jobs):
            job = jobs[i]
            i += 1
            if job.transfer.done():
                continue
            event = job.transfer.event
            if event is None or not _complete(event):
                # Not yet queued (the submitter has it), or still copying; a direction's
                # events complete in job order, so none after it has.
                break
            if job.seen_done and in_order:
                self._starved_until = time.monotonic() + _STARVED_S
                job.finish(job.failure)
            else:
                job.seen_done = True  # its waiter has until the next sweep
                in_order = False
        while jobs and jobs[0].transfer.done():
            jobs.popleft()

    def start(self) -> None:
        for waiter in self.waiters.values():
            waiter.start()

    def close(self) -> None:
        """Returns once every waiter thread has ended."""
        for waiter in self.waiters.values():
            waiter.close()


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
