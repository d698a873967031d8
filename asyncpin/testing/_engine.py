"""A transfer engine for tests of faults and order: it records every job and finishes
them when told to. It is never a stand-in for the real copy path."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import anyio
import anyio.from_thread
import anyio.lowlevel

from asyncpin.abc import EngineSetup
from asyncpin.engines.host import HostTransferEngine
from asyncpin.transfers import Direction, TransferJob, interrupted

__all__ = ["FakeEngine", "SubmittedJob"]


@dataclass(eq=False)
class SubmittedJob:
    """One job the engine took: ``released`` once it was handed on to be finished (by
    :meth:`FakeEngine.finish_next` or ``auto``), ``finished`` once it was reported, with
    ``error`` (None on success)."""

    job: TransferJob
    pageable: bool
    released: bool = False
    finished: bool = False
    error: BaseException | None = None

    @property
    def direction(self) -> Direction:
        return self.job.transfer.direction


class FakeEngine:
    """A :class:`~asyncpin.abc.TransferEngine` that keeps the contract and does what a
    test says.

    - Every job taken by :meth:`submit` is recorded in :attr:`submitted` (with
      ``pageable``) and held in a FIFO per direction. :meth:`finish_next` hands on the
      oldest held job of a direction; with ``auto=True`` a task of the setup's
      ``start_soon`` hands on every job soon after it is submitted.
    - Each job is reported exactly once, on the event loop thread, in submission order per
      direction.
    - :meth:`fail_submit`: the next submissions raise, with nothing queued.
      :meth:`fail_copy` (or ``finish_next(direction, error)``): a job is reported with
      the injected error.
    - ``copy=False`` (default): nothing is copied; a job handed on is reported at once,
      and its ``reserve`` (pageable jobs) is called on the loop just before (keep it
      quick in such a test). Any KV layout works, CUDA included, and nothing runs on a
      device.
    - ``copy=True``: the bytes really move, through a
      :class:`~asyncpin.engines.host.HostTransferEngine` made from the same setup (so the
      KV arrays must be CPU tensors): a job handed on is copied in a worker thread and
      reported once its copy is over. A job failed on command is copied all the same (a
      copy that fails part way may have written some bytes) and reported with the
      error, in its turn.
    - ``background=True``: the manager prepares it after entry, as the CUDA engine
      (``prepare_in_background``; it takes pageable jobs before that,
      ``pageable_before_prepare``); :meth:`prepare` then waits for :meth:`let_prepare`
      (from any thread) when ``hold_prepare()`` was called before.
    - A subclass that sets ``made_off_loop = True`` is made in a worker thread, as the
      CUDA engine is.

    It refuses what the contract forbids of its caller: :meth:`submit` off the event
    loop thread, before :meth:`prepare` (but for a pageable job of an engine prepared in
    the background) or after :meth:`close`, and :meth:`close` while a
    job it took is not finished (RuntimeError).
    """

    name = "fake"

    def __init__(
        self,
        setup: EngineSetup,
        *,
        auto: bool = False,
        copy: bool = False,
        background: bool = False,
    ) -> None:
        self.auto = auto
        self.prepare_in_background = background
        self.pageable_before_prepare = background  # as the CUDA engine
        self.copy = copy
        self._start_soon = setup.start_soon
        self._inner = HostTransferEngine(setup) if copy else None
        # Made off the loop (a subclass that sets ``made_off_loop``): the loop says
        # which thread it runs on.
        self._loop_thread = (
            threading.get_ident()
            if setup.loop is None or _on_a_loop()
            else anyio.from_thread.run_sync(threading.get_ident, token=setup.loop)
        )
        #: Every job taken, in submission order.
        self.submitted: list[SubmittedJob] = []
        self.prepared = False
        self.closed = False
        self._prepare_gate: threading.Event | None = None
        self._held: dict[Direction, deque[SubmittedJob]] = {"store": deque(), "load": deque()}
        self._draining: dict[Direction, bool] = {"store": False, "load": False}
        self._submit_errors: deque[BaseException] = deque()
        # [direction or None for either, error, how many more jobs get it]
        self._copy_errors: list[list[object]] = []

    # -- faults on command --------------------------------------------------------------

    def fail_submit(self, error: BaseException | None = None, *, count: int = 1) -> None:
        """The next ``count`` calls of :meth:`submit` raise ``error`` (by default a
        RuntimeError), having queued nothing."""
        for _ in range(count):
            self._submit_errors.append(error or RuntimeError("injected submit failure"))

    def fail_copy(
        self,
        error: BaseException | None = None,
        *,
        direction: Direction | None = None,
        count: int = 1,
    ) -> None:
        """The next ``count`` jobs handed on (of ``direction``, or of either) are reported
        with ``error`` (by default an OSError) instead of success."""
        self._copy_errors.append([direction, error or OSError("injected copy failure"), count])

    # -- driving it ----------------------------------------------------------------------

    def held(self, direction: Direction) -> list[TransferJob]:
        """The jobs of ``direction`` taken and not handed on yet, oldest first."""
        return [entry.job for entry in self._held[direction]]

    def finish_next(self, direction: Direction, error: BaseException | None = None) -> TransferJob:
        """Hand on the oldest held job of ``direction`` and return it: it is reported
        with ``error`` (None: success, unless :meth:`fail_copy` injected one) at once, or
        once its copy is over (``copy=True``). Call it on the event loop thread; raises
        LookupError when no job of ``direction`` is held."""
        self._check_loop("finish_next")
        held = self._held[direction]
        if not held:
            raise LookupError(f"no {direction} job is held")
        entry = held.popleft()
        self._release(entry, error)
        return entry.job

    # -- the TransferEngine protocol --------------------------------------------------------

    def methods(self) -> tuple[str, ...]:
        return self._inner.methods() if self._inner is not None else ("fake",)

    def hold_prepare(self) -> None:
        """:meth:`prepare` waits, from now on, until :meth:`let_prepare`."""
        self._prepare_gate = threading.Event()

    def let_prepare(self) -> None:
        if self._prepare_gate is not None:
            self._prepare_gate.set()

    def prepare(self) -> None:
        if self._prepare_gate is not None:
            self._prepare_gate.wait()
        if self._inner is not None:
            self._inner.prepare()
        self.prepared = True

    def record_ready(self) -> None:
        return None

    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        self._check_loop("submit")
        early = not self.prepared and not (pageable and self.pageable_before_prepare)
        if early or self.closed:
            raise RuntimeError("submit() before prepare()" if early else "submit() after close()")
        if self._submit_errors:
            raise self._submit_errors.popleft()
        job.transfer.method = self.methods()[0]
        job.transfer.path = "pageable" if pageable else "pinned"
        entry = SubmittedJob(job, pageable)
        direction = entry.direction
        if self.auto and not self._draining[direction]:
            self._start_soon(self._drain, direction)  # if this raises, nothing is queued
            self._draining[direction] = True
        self.submitted.append(entry)
        self._held[direction].append(entry)

    def close(self) -> None:
        unfinished = [entry for entry in self.submitted if not entry.finished]
        if unfinished:
            raise RuntimeError(f"close() while {len(unfinished)} jobs it took are not finished")
        if self._inner is not None:
            self._inner.close()
        self.closed = True

    # -- inside ---------------------------------------------------------------------------

    def _check_loop(self, what: str) -> None:
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError(f"{what}() must be called on the event loop thread")

    async def _drain(self, direction: Direction) -> None:
        """auto: hand on every held job of ``direction``, oldest first, until none is held.
        Cancelled (the manager is closing): held jobs are reported as interrupted."""
        held = self._held[direction]
        try:
            while True:
                await anyio.lowlevel.checkpoint()
                if not held:
                    break
                while held:
                    self._release(held.popleft(), None)
        except BaseException as exc:
            while held:
                self._report(held.popleft(), interrupted(exc))
            raise
        finally:
            self._draining[direction] = False

    def _take_copy_error(self, direction: Direction) -> BaseException | None:
        for injected in self._copy_errors:
            wanted, error, left = injected
            if wanted is None or wanted == direction:
                assert isinstance(error, BaseException) and isinstance(left, int)
                if left <= 1:
                    self._copy_errors.remove(injected)
                else:
                    injected[2] = left - 1
                return error
        return None

    def _release(self, entry: SubmittedJob, error: BaseException | None) -> None:
        entry.released = True
        job = entry.job
        if error is None:
            error = self._take_copy_error(entry.direction)
        if self._inner is None:
            if entry.pageable and job.reserve is not None and error is None:
                try:
                    job.reserve()
                except Exception as exc:
                    error = exc
            self._report(entry, error)
            return
        injected = error
        original = job.on_finish

        def report(finished: TransferJob, copy_error: BaseException | None) -> None:
            finished.on_finish = original
            self._report(entry, copy_error if injected is None else injected)

        job.on_finish = report
        try:
            self._inner.submit(job, pageable=entry.pageable)
        except BaseException as exc:
            job.on_finish = original
            self._report(entry, exc)

    @staticmethod
    def _report(entry: SubmittedJob, error: BaseException | None) -> None:
        entry.finished = True
        entry.error = error
        entry.job.finish(error)

    def __repr__(self) -> str:
        held = {d: len(q) for d, q in self._held.items()}
        return (
            f"<FakeEngine auto={self.auto} copy={self.copy} submitted={len(self.submitted)} "
            f"held={held}>"
        )


def _on_a_loop() -> bool:
    """Whether the calling thread runs an event loop."""
    try:
        anyio.lowlevel.current_token()
    except RuntimeError:
        return False
    return True
