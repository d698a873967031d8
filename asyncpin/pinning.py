"""The pin pipeline: chunks → prefault → pin, in worker threads, with a pause gate.

Prefault workers are anyio tasks that hand each chunk's faulting to a worker thread
through ``anyio.to_thread.run_sync`` with their own capacity limiter (so the
application's default thread pool stays free); each chunk faulted in goes on a
thread-safe queue. Once the whole region is faulted in, a pin worker, one worker thread,
takes the chunks from that queue and pins them one after the other, without going back
to the event loop in between (each round trip cost about 0.27 ms per chunk on the H200
beside a model: 0.28 s of 4.1 s at 64 GiB in 64 MiB chunks, 1.1 s of 5.8 s in 16 MiB
ones; bench/RESULTS.md#startup); it tells the loop of its progress without waiting for
it. Pinning waits for faulting because the two slow each other down: on the H200 at 64
GiB, pin calls made while eight threads faulted took up to 16-20 ms (1.4-1.6 ms
otherwise) and stretched a model's GPU step beside them 1.65-1.71x, and faulting took
2.9-3.1 s against 1.7 s alone, so one after the other was ready as soon (3.2-3.5 s against
3.3-3.7 s) with every step within 1.4x (``PIN_BESIDE_FAULTING``; bench/RESULTS.md#startup).
Chunk state changes happen inside the threads themselves, so a chunk whose pin returned
is recorded as pinned whatever happens to the awaiting task: close then knows exactly
what to unpin, and it waits for the pin thread to end (``to_the_end``), whatever
cancellations come.
"""

from __future__ import annotations

import contextlib
import errno
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import structlog

from asyncpin._log import ShieldedLog
from asyncpin._outcome import Outcome
from asyncpin._threads import call_soon, to_the_end
from asyncpin.backends import call_hook
from asyncpin.chunks import ChunkState, ChunkTable
from asyncpin.errors import BackendCallError, PinError, describe_error
from asyncpin.gate import PauseGate
from asyncpin.region import Chunk, HostRegion

if TYPE_CHECKING:
    from asyncpin.backends import PinBackend

__all__ = ["PinScheduler", "PinnedSignal"]


class PinnedSignal(Outcome):
    """Awaitable readiness: completes when every chunk is pinned, raises if that failed.

    ``await mgr.pinned`` and ``await mgr.pinned.wait()`` are the same. On failure it raises
    the :class:`PinError` (or, for an engine set up in the background, the set-up's
    error); if the manager closed first it raises ``ClosedResourceError``.
    """

    __slots__ = ()

    def succeeded(self) -> bool:
        return self.is_set() and self.error is None

    def resolve(self, error: BaseException | None = None) -> None:
        self._settle(error)


async def _start_threads(count: int) -> None:
    """Have ``count`` worker threads in the pool before faulting (and again before
    pinning), so that none starts while either runs: starting a thread maps its stack,
    which waits for the process's memory-map lock, and faulting and pinning hold that
    lock nearly all the time (an event loop that started a thread meanwhile stalled 25
    ms on the H200).
    The threads meet at a barrier, so each call gets a thread of its own; they go back
    to the pool idle, where the pipeline's calls find them."""
    barrier = threading.Barrier(count)

    def meet() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=_THREAD_START_S)

    limiter = anyio.CapacityLimiter(count)
    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(partial(anyio.to_thread.run_sync, meet, limiter=limiter))


_THREAD_START_S = 5.0

# Pin each chunk as soon as it is faulted in, beside the faulting of the others, as the
# pipeline did before runs 148-149 (module docstring); False: pin once the whole region
# is faulted in. For bench/startup.py's --pin-beside-faulting, to measure
# the one against the other.
PIN_BESIDE_FAULTING = False


class PinScheduler:
    """Runs the pipeline for one region; :meth:`stop` ends it after the prefault pieces
    and pin calls under way.

    It owns the chunk table and settles ``pinned`` when it ends: done when every chunk
    is pinned, the PinError when one failed (a close leaves it to the manager)."""

    def __init__(
        self,
        region: HostRegion,
        backend: PinBackend,
        chunks: Sequence[Chunk],
        *,
        prefault_threads: int,
        pin_threads: int,
        pin_interval_s: float,
        gate: PauseGate,
        pinned: PinnedSignal | None = None,
        log: Any = None,
        started_at: float | None = None,
        chunk_bytes: int | None = None,
    ) -> None:
        self.region = region
        self.backend = backend
        self.table = ChunkTable(chunks)
        self.chunks = chunks
        self.gate = gate
        self.pinned = pinned if pinned is not None else PinnedSignal()
        self._log = ShieldedLog(log if log is not None else structlog.get_logger("asyncpin"))
        self._prefault_threads = prefault_threads
        self._pin_threads = pin_threads
        self._pin_interval_s = pin_interval_s
        # The size asked for (a region smaller than one chunk has one shorter chunk).
        self._chunk_bytes = (
            chunk_bytes if chunk_bytes is not None else (chunks[0].nbytes if chunks else 0)
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next = 0
        # Chunks faulted in, for the pin threads; None tells one of them to end.
        self._faulted: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()
        self._notify_pending = False
        self.slowest_pin_seconds = 0.0
        self.unpin_seconds: float | None = None
        self.done = anyio.Event()
        # Time to pinned counts from here (the manager's entry).
        self.started_at = time.perf_counter() if started_at is None else started_at
        self.finished_at: float | None = None
        self.seconds_to_pinned: float | None = None

    @property
    def chunk_bytes(self) -> int:
        """The chunk size asked for (the last chunk may be shorter)."""
        return self._chunk_bytes

    @property
    def error(self) -> PinError | None:
        return self.table.error

    @property
    def pinned_bytes(self) -> int:
        return self.table.pinned_bytes

    @property
    def faulted_bytes(self) -> int:
        return self.table.faulted_bytes

    @property
    def chunks_pinned(self) -> int:
        return self.table.chunks_pinned

    # -- control ----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the pipeline to end after the prefault pieces and pin calls under way
        (thread-safe)."""
        self._stop.set()
        self.table.stop()
        self.gate.wake()
        self._end_pin_threads()

    def _end_pin_threads(self) -> None:
        for _ in range(self._pin_threads):
            self._faulted.put(None)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def stop_event(self) -> threading.Event:
        """Set by :meth:`stop` (a close or a failure): for a wait to abort on."""
        return self._stop

    def states(self) -> list[ChunkState]:
        return self.table.states()

    def all_pinned(self) -> bool:
        return self.table.all_pinned()

    # -- pipeline ---------------------------------------------------------------------

    async def run(
        self,
        beside: Callable[[], object] | None = None,
        then: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """Run the pipeline. ``beside()``, if given, is called once the pipeline's threads
        (and one more for it) have started and the backend's ``warm_up()`` has returned,
        or at once if the pipeline failed before: what it starts in a worker thread finds
        one waiting. ``then()``, if given, is awaited after it, before anything is
        faulted or pinned (a KV manager's: the engine's set-up, which ``beside()``
        starts, for at most ``asyncpin._opened.SET_UP_WAIT_S``).

        The warm-up comes first, alone: on the H200 the CUDA backend's context took
        0.11-0.14 s made so, 0.8-1.35 s with a 16 GiB region prefaulting beside it, and
        0.3-1.5 s with the CUDA engine's first set-up beside it
        (``bench/probes/first_pin.py``). The engine's set-up comes next, alone unless it
        outlasts ``then()``: 14-31 ms made so, against 128-155 ms beside 100 GiB faulting
        in, where a model's step stretched up to 2.08x (bench/RESULTS.md#startup)."""
        self._log.info("pin.started", chunks=len(self.chunks), chunk_bytes=self._chunk_bytes)
        try:
            prefault_limiter = anyio.CapacityLimiter(self._prefault_threads)
            # The pin threads begin once faulting is over (PIN_BESIDE_FAULTING: at once).
            early = self._pin_threads if PIN_BESIDE_FAULTING else 0
            try:
                extra = 0 if beside is None else 1
                await _start_threads(self._prefault_threads + early + extra)
                # Waited for to its end: what beside() starts must not overlap it, even
                # when a native Task.cancel() ends the wait.
                await to_the_end(self._warm_up)
            except BaseException:
                self.stop()  # what beside() starts then gives up at once
                raise
            finally:
                if beside is not None:
                    beside()
            if then is not None:
                await then()
            pins_over = anyio.Event()
            left = [self._pin_threads]
            async with anyio.create_task_group() as tg:
                for _ in range(early):
                    tg.start_soon(self._pin_worker, left, pins_over)
                try:
                    async with anyio.create_task_group() as faulting:
                        for _ in range(self._prefault_threads):
                            faulting.start_soon(self._prefault_worker, prefault_limiter)
                    if not early and not self._stop.is_set():
                        # Started now, when nothing faults or pins: threads started
                        # with the faulting ones idled through it, and the pool lets a
                        # thread go after 10 s idle (anyio).
                        await _start_threads(self._pin_threads)
                    for _ in range(self._pin_threads - early):
                        tg.start_soon(self._pin_worker, left, pins_over)
                    self._end_pin_threads()  # once they have pinned what is queued
                    # Waited for here, not only by the task group: a cancellation
                    # (asyncio.run's Task.cancel() to the tasks left at its end, a trio
                    # run's end) must stop the pin threads, which a shield keeps going.
                    await pins_over.wait()
                except BaseException:
                    self.stop()  # the pin threads end after the call under way
                    raise
        except Exception as exc:
            # A bug here must surface through `pinned`, never cancel the host's task group
            # nor vanish.
            error = PinError(-1, 0, 0, None, None, f"pin pipeline crashed: {exc!r}")
            error.__cause__ = exc
            self.table.set_error(error)
            self.stop()
        finally:
            self.finished_at = time.perf_counter()
            self.table.stop()
            self.done.set()
            self.table.notify()
            self._settle()

    def _settle(self) -> None:
        """Settle ``pinned`` from how the pipeline ended; a stop by close leaves it."""
        error = self.table.error
        if error is not None:
            self._log.error(
                "pin.failed",
                chunk=error.chunk_index,
                offset=error.offset,
                nbytes=error.nbytes,
                code=error.code,
                code_name=error.code_name,
                reason=error.reason,
            )
            self.pinned.resolve(error)
        elif self.table.all_pinned():
            assert self.finished_at is not None
            self.seconds_to_pinned = self.finished_at - self.started_at
            nbytes = self.table.nbytes
            seconds = self.seconds_to_pinned
            self._log.info(
                "pin.complete",
                seconds=seconds,
                gib_per_s=nbytes / (1 << 30) / seconds if seconds else None,
            )
            self.pinned.resolve()
        else:
            self._log.info(
                "pin.stopped", pinned_bytes=self.table.pinned_bytes, nbytes=self.region.nbytes
            )

    def _take(self) -> Iterator[Chunk]:
        while not self._stop.is_set():
            with self._lock:
                if self._next >= len(self.chunks):
                    return
                chunk = self.chunks[self._next]
                self._next += 1
            yield chunk

    async def _prefault_worker(self, limiter: anyio.CapacityLimiter) -> None:
        for chunk in self._take():
            if await anyio.to_thread.run_sync(self._prefault_one, chunk, limiter=limiter):
                self._faulted.put(chunk)

    async def _pin_worker(self, left: list[int], over: anyio.Event) -> None:
        """Pin chunks in a worker thread of its own until told to end, waited for to its
        end (a close must not unpin while a pin call is under way); ``over`` is set when
        the last of the ``left`` pin workers has ended."""
        try:
            await to_the_end(partial(self._pin_loop, call_soon(self._notify)))
        finally:
            left[0] -= 1
            if not left[0]:
                over.set()

    def _notify(self) -> None:
        """On the loop: wake the transfers waiting for chunks."""
        self._notify_pending = False
        self.table.notify()

    def _pin_loop(self, wake: Callable[[], None]) -> None:
        while (chunk := self._faulted.get()) is not None and not self._stop.is_set():
            self._pin_one(chunk)
            # The loop is told of the progress once per wake-up it has not handled yet
            # (its notify() looks again at every chunk).
            if not self._notify_pending:
                self._notify_pending = True
                try:
                    wake()
                except RuntimeError:  # the loop is closed (trio: RunFinishedError)
                    self.stop()  # nothing waits for the chunks any more
                    return
            self._pause()

    def _pause(self) -> None:
        """Wait ``pin_interval_s`` after a pin call, or less if stop() is called: in
        slices of at most a second (an ``Event.wait`` over ``threading.TIMEOUT_MAX``
        raises)."""
        deadline = time.monotonic() + self._pin_interval_s
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            self._stop.wait(min(left, 1.0))

    # -- thread side ------------------------------------------------------------------

    def _prefault_one(self, chunk: Chunk) -> bool:
        if self._stop.is_set():
            return False
        try:
            self.region.prefault(chunk.offset, chunk.nbytes, self._stop)
        except BaseException as exc:
            self._fail(chunk, exc, "prefault")
            return False
        if self._stop.is_set():
            return False  # it may have stopped between two pieces: not all faulted in
        self.table.mark(chunk.index, ChunkState.PREFAULTED)
        return True

    def _warm_up(self) -> None:
        """The backend's optional ``warm_up()``, once, through the gate, before the first
        pin call; what it raises is logged as ``pin.warm_up_failed`` and pinning goes on
        (the pin calls report what still fails)."""
        if not self.gate.enter_call(abort=self._stop):
            return
        try:
            if self._stop.is_set():
                return
            error = call_hook(self.backend, "warm_up")
        finally:
            self.gate.exit_call()
        if error is not None:
            self._log.warning("pin.warm_up_failed", error=describe_error(error))

    def _pin_one(self, chunk: Chunk) -> None:
        if not self.gate.enter_call(abort=self._stop):
            return
        try:
            if self._stop.is_set():
                return
            t0 = time.perf_counter()
            try:
                self.backend.pin(self.region.address + chunk.offset, chunk.nbytes)
            except BaseException as exc:
                self._fail(chunk, exc, "pin")
                return
            seconds = time.perf_counter() - t0
            with self._lock:
                self.slowest_pin_seconds = max(self.slowest_pin_seconds, seconds)
            self.table.mark(chunk.index, ChunkState.PINNED)
        finally:
            self.gate.exit_call()

    def _before_unpin(self) -> None:
        """The backend's optional ``before_unpin()``; what it raises is logged as
        ``unpin.wait_failed`` and unpinning goes on: what it waits for is the device's,
        and a device that fails here fails every copy too."""
        error = call_hook(self.backend, "before_unpin")
        if error is not None:
            self._log.warning("unpin.wait_failed", error=describe_error(error))

    def _fail(self, chunk: Chunk, exc: BaseException, stage: str) -> None:
        code = getattr(exc, "code", None) if isinstance(exc, BackendCallError) else None
        code_name = exc.code_name if isinstance(exc, BackendCallError) else None
        if code is None and isinstance(exc, OSError) and exc.errno is not None:
            code, code_name = exc.errno, errno.errorcode.get(exc.errno)
        reason = f"{stage}: {exc}"
        held = self.region.truncated_to() if stage == "pin" else None
        if held is not None and held < chunk.offset + chunk.nbytes:
            # mlock says ENOMEM of this chunk's pages past the file's end
            code, code_name = errno.EFAULT, "EFAULT"
            reason = (
                f"{stage}: /dev/shm/{self.region.name} was truncated to {held} bytes, short "
                f"of the region's {self.region.nbytes} (by another process) ({exc})"
            )
        error = PinError(chunk.index, chunk.offset, chunk.nbytes, code, code_name, reason)
        error.__cause__ = exc
        self.table.fail(chunk.index, error)
        self.stop()

    def unpin_all(self) -> list[tuple[Chunk, BaseException]]:
        """Unpin every pinned chunk once, in order, through the gate; returns the chunks
        whose unpin failed, with why (they must stay mapped). Call once the pipeline is
        done. Nothing a backend raises stops it: each chunk is unpinned or leaked."""
        leaked: list[tuple[Chunk, BaseException]] = []
        t0 = time.perf_counter()
        if self.table.chunks_pinned:
            self.gate.enter_call()
            try:
                self._before_unpin()
            finally:
                self.gate.exit_call()
        for index in range(len(self.chunks)):
            if not self.table.is_pinned(index):
                continue
            chunk = self.chunks[index]  # made only for the chunks to unpin
            self.gate.enter_call()
            try:
                self.backend.unpin(self.region.address + chunk.offset, chunk.nbytes)
            except BaseException as exc:  # a backend's bug must not end the close here
                self.table.mark(chunk.index, ChunkState.LEAKED)
                leaked.append((chunk, exc))
            else:
                self.table.mark(chunk.index, ChunkState.UNPINNED)
            finally:
                self.gate.exit_call()
        self.unpin_seconds = time.perf_counter() - t0
        return leaked
