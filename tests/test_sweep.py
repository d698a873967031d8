"""The CUDA engine's loop-side sweep, without a GPU: what finishes a transfer whose waiter
thread cannot report it (an event loop busy in Python starves threads of the GIL).

The sweep is called by hand here, standing in for the loop's timer, and events are
stand-ins whose completion the test sets; on trio, where the sweep is a task, it runs for
real.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from structlog.testing import capture_logs

from asyncpin import capture_gate
from asyncpin.engines.cuda import CudaTransferEngine, _Waiter
from asyncpin.transfers import Direction, Transfer, TransferJob


class _Event:
    def __init__(self) -> None:
        self.complete = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.complete


class _Loop:
    """Records the sweeps the engine schedules instead of running them."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def call_later(self, delay: float, fn: Any) -> None:
        self.delays.append(delay)


def _engine() -> CudaTransferEngine:
    engine = CudaTransferEngine.__new__(CudaTransferEngine)
    engine._loop = _Loop()  # type: ignore[assignment]
    engine._outstanding = {"store": deque(), "load": deque()}
    engine._sweeping = False
    engine._starved_until = 0.0
    return engine


def _job(direction: Direction = "load", blocks: int = 1) -> TransferJob:
    job = TransferJob(Transfer(direction, blocks, 4096 * blocks), [0], [0], "batch")
    job.transfer.event = _Event()
    return job


def _event(job: TransferJob) -> _Event:
    event = job.transfer.event
    assert isinstance(event, _Event)
    return event


def _delays(engine: CudaTransferEngine) -> list[float]:
    assert isinstance(engine._loop, _Loop)
    return engine._loop.delays


async def test_an_unreported_completion_is_finished_at_the_next_sweep() -> None:
    engine, job = _engine(), _job()
    engine._watch(job)
    engine._sweep()  # still copying
    _event(job).complete = True
    engine._sweep()  # complete: its waiter gets one more sweep to report it
    assert not job.transfer.done() and not engine._starved()
    job.keep.append(object())
    engine._sweep()  # not reported: finished here, and the loop is marked as starving
    assert job.transfer.done() and job.transfer.error is None and job.keep == []
    assert engine._starved()
    assert not engine._outstanding["load"] and not engine._sweeping
    # Scheduled at watch and after each of the first two sweeps, at the idle period.
    assert _delays(engine) == [0.02, 0.02, 0.02]
    engine._watch(_job())  # while the loop counts as starving, sweeps come every 2 ms
    assert _delays(engine)[-1] == 0.002


async def test_a_reported_completion_is_only_dropped() -> None:
    engine, job = _engine(), _job()
    engine._watch(job)
    _event(job).complete = True
    engine._sweep()
    CudaTransferEngine._finish(job, None)  # the waiter thread's report arrives
    engine._sweep()
    assert not engine._starved() and not engine._outstanding["load"]
    assert not engine._sweeping


async def test_jobs_of_a_direction_finish_in_order_directions_apart() -> None:
    engine = _engine()
    first, second, store = _job(), _job(), _job("store")
    for job in (first, second, store):
        engine._watch(job)
    _event(second).complete = _event(store).complete = True
    for _ in range(3):
        engine._sweep()
    assert not first.transfer.done() and not second.transfer.done()
    assert store.transfer.done()
    _event(first).complete = True
    engine._sweep()
    engine._sweep()
    assert first.transfer.done() and second.transfer.done()


async def test_a_job_still_being_queued_holds_back_the_ones_after_it() -> None:
    engine = _engine()
    queuing, after = _job("store"), _job("store")
    queuing.transfer.event = None  # the submitter thread has not queued it yet
    engine._watch(queuing)
    engine._watch(after)
    _event(after).complete = True
    for _ in range(3):
        engine._sweep()
    assert not after.transfer.done()


async def test_no_query_while_a_capture_holds_the_gate() -> None:
    engine, job = _engine(), _job()
    engine._watch(job)
    _event(job).complete = True
    with capture_gate():
        for _ in range(3):
            engine._sweep()
    assert _event(job).queries == 0 and not job.transfer.done()
    engine._sweep()
    engine._sweep()
    assert job.transfer.done()


async def test_the_failure_of_a_partly_queued_job_is_what_it_finishes_with() -> None:
    engine, job = _engine(), _job()
    job.failure = RuntimeError("the second piece could not be queued")
    engine._watch(job)
    _event(job).complete = True
    engine._sweep()
    engine._sweep()
    # The raw error: the manager's router names it as a TransferError.
    assert job.transfer.error is job.failure


async def test_a_device_error_is_left_to_the_waiter() -> None:
    engine, job = _engine(), _job()

    class Failing(_Event):
        def query(self) -> bool:
            raise RuntimeError("an illegal address was encountered")

    job.transfer.event = Failing()
    engine._watch(job)
    for _ in range(3):
        engine._sweep()
    assert not job.transfer.done() and not engine._starved()


async def test_a_raising_callback_does_not_end_the_sweeping() -> None:
    engine, job, later = _engine(), _job(), _job()

    def fail(transfer: Transfer) -> None:
        raise RuntimeError("an observer's bug")

    job.transfer._callbacks.append(fail)
    engine._watch(job)
    engine._watch(later)
    _event(job).complete = True
    engine._sweep()
    with pytest.raises(RuntimeError, match="observer"):
        engine._sweep()
    assert job.transfer.done() and engine._sweeping
    assert len(_delays(engine)) == 3  # at watch, and after both sweeps
    _event(later).complete = True
    engine._sweep()
    engine._sweep()
    assert later.transfer.done() and not engine._outstanding["load"]


def _submitting(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[CudaTransferEngine, list[TransferJob], list[TransferJob]]:
    """An engine whose submit() runs for real down to where a job is queued: the jobs
    the submitter thread gets, and the ones queued on the loop, are recorded."""
    engine = _engine()
    engine._kernel = None
    engine._layout = SimpleNamespace(num_arrays=64)  # type: ignore[assignment]
    threaded: list[TransferJob] = []
    on_loop: list[TransferJob] = []
    engine._submitter = SimpleNamespace(  # type: ignore[assignment]
        busy=lambda: False, submit=lambda job, method: threaded.append(job)
    )
    monkeypatch.setattr(engine, "_enqueue", lambda job, method: on_loop.append(job))
    monkeypatch.setattr(engine, "record_ready", lambda: None)
    monkeypatch.setattr(engine, "_start_soon", lambda *args: None, raising=False)
    return engine, threaded, on_loop


async def test_submit_watches_every_job_queued_for_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, _, _ = _submitting(monkeypatch)
    load, store = _job("load"), _job("store", blocks=10)
    engine.submit(load, pageable=False)
    engine.submit(store, pageable=False)
    engine.submit(_job("load"), pageable=True)  # pageable: its worker thread reports it
    assert list(engine._outstanding["load"]) == [load]
    assert list(engine._outstanding["store"]) == [store]
    assert engine._sweeping and _delays(engine) == [0.02]


async def test_stores_stay_on_the_loop_while_threads_starve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, threaded, on_loop = _submitting(monkeypatch)
    large = _job("store", blocks=10)  # 640 segments: the submitter's, normally
    engine.submit(large, pageable=False)
    assert threaded == [large] and on_loop == []
    engine._starved_until = time.monotonic() + 60
    starved = _job("store", blocks=10)
    engine.submit(starved, pageable=False)
    assert threaded == [large] and on_loop == [starved]


def test_a_waiter_skips_what_the_loop_has_finished() -> None:
    waiter = _Waiter("test-waiter")
    try:
        waited, reported, done = threading.Event(), threading.Event(), threading.Event()

        class Settled:
            def synchronize(self) -> None:
                waited.set()

        class Last:
            def synchronize(self) -> None:
                done.set()

        waiter.submit(Settled(), lambda error: reported.set(), lambda: True)
        waiter.submit(Last(), lambda error: None)
        assert done.wait(10)  # the queue is handled in order: the first item is behind us
        assert not waited.is_set() and not reported.is_set()
    finally:
        waiter.close()


def _trio_engine() -> CudaTransferEngine:
    engine = _engine()
    engine._loop = None  # not asyncio: the sweep runs as a task
    return engine


@asynccontextmanager
async def _task_group(engine: CudaTransferEngine) -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group standing in for the manager's, where the engine starts its tasks."""
    async with anyio.create_task_group() as tg:
        engine._start_soon = tg.start_soon
        yield tg


def test_on_trio_a_task_sweeps_while_jobs_are_outstanding() -> None:
    """trio has no timers: the sweep runs as a task in the manager's task group, started
    by the first job watched and ended by the first sweep that finds nothing left."""
    pytest.importorskip("trio")
    finished: list[TransferJob] = []

    async def main() -> None:
        engine = _trio_engine()
        async with _task_group(engine):
            first, second = _job(), _job("store")
            engine._watch(first)
            engine._watch(second)
            assert engine._sweeping
            _event(first).complete = _event(second).complete = True
            with anyio.fail_after(10):
                await first.transfer  # no waiter thread reports it: only the task can
                await second.transfer
            finished.extend((first, second))
            assert engine._starved()
        # The group's exit waited for the task, which ended with nothing outstanding.
        assert not engine._sweeping and not any(engine._outstanding.values())
        later = _job()
        async with _task_group(engine):
            engine._watch(later)  # a new burst starts a new task
            _event(later).complete = True
            with anyio.fail_after(10):
                await later.transfer
        finished.append(later)

    anyio.run(main, backend="trio")
    assert [job.transfer.error for job in finished] == [None, None, None]


def test_on_trio_a_raising_callback_is_logged_and_the_task_goes_on() -> None:
    pytest.importorskip("trio")

    async def main() -> None:
        engine = _trio_engine()
        async with _task_group(engine):
            job, later = _job(), _job()

            def fail(transfer: Transfer) -> None:
                raise RuntimeError("an observer's bug")

            job.transfer._callbacks.append(fail)
            engine._watch(job)
            engine._watch(later)
            _event(job).complete = _event(later).complete = True
            with anyio.fail_after(10):
                await job.transfer
                await later.transfer  # finished by a later sweep of the same task

    with capture_logs() as logs:
        anyio.run(main, backend="trio")
    failed = [e for e in logs if e["event"] == "transfer.sweep_failed"]
    assert len(failed) == 1 and "observer's bug" in failed[0]["error"]


def test_a_waiter_outlives_a_report_that_raises() -> None:
    waiter = _Waiter("test-waiter")
    try:
        reported = threading.Event()

        class Done:
            def synchronize(self) -> None:
                pass

        def fail(error: BaseException | None) -> None:
            raise RuntimeError("the loop's callback failed")

        with capture_logs() as logs:
            waiter.submit(Done(), fail)
            waiter.submit(Done(), lambda error: reported.set())
            assert reported.wait(10)  # the thread went on to the next transfer
        assert [e["event"] for e in logs] == ["transfer.report_failed"]
    finally:
        waiter.close()


def test_on_trio_a_cancelled_sweep_task_is_restarted_by_the_next_job() -> None:
    pytest.importorskip("trio")

    async def main() -> None:
        engine = _trio_engine()
        async with _task_group(engine) as tg:
            engine._watch(_job())  # never completes
            await anyio.lowlevel.checkpoint()  # the task is sleeping until its first sweep
            tg.cancel_scope.cancel()
        assert not engine._sweeping  # cleared by the cancelled task
        later = _job()
        async with _task_group(engine):
            engine._outstanding["load"].clear()
            engine._watch(later)
            assert engine._sweeping
            _event(later).complete = True
            with anyio.fail_after(10):
                await later.transfer

    anyio.run(main, backend="trio")


def test_a_job_watched_when_no_task_can_start_leaves_the_sweep_unscheduled() -> None:
    engine = _trio_engine()

    def closed(*args: Any) -> None:
        raise RuntimeError("This task group is not active; no new tasks can be started.")

    engine._start_soon = closed
    with pytest.raises(RuntimeError, match="not active"):
        engine._watch(_job())
    assert not engine._sweeping
