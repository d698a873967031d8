"""The CUDA engine's loop-side sweep, without a GPU: what finishes a transfer whose waiter
thread cannot report it (an event loop busy in Python starves threads of the GIL).

The sweep is called by hand here, standing in for the loop's timer, and events are
stand-ins whose completion the test sets; on trio, where the sweep is a task, it runs for
real.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from structlog.testing import capture_logs

from asyncpin import capture_gate
from asyncpin.engines.cuda import CudaTransferEngine
from asyncpin.engines.cuda.completion import Completion, LoopHooks, TrioHooks, Waiter
from asyncpin.transfers import Direction, Transfer, TransferJob
from tests.cuda_engine_cpu import cpu_engine, offset_layout


class _Event:
    def __init__(self) -> None:
        self.complete = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.complete


class _Hooks(LoopHooks):
    """Records the sweeps scheduled (their delays) instead of running them."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    def call_soon(self, fn: Any, *args: Any) -> None:
        fn(*args)

    def start_sweeping(self, completion: Completion) -> None:
        self.delays.append(completion.period())

    sweep_again = start_sweeping


@pytest.fixture
def completion() -> Iterator[Completion]:
    made = Completion(_Hooks())
    made.start()
    yield made
    made.close()


def _job(direction: Direction = "load", blocks: int = 1) -> TransferJob:
    job = TransferJob(Transfer(direction, blocks, 4096 * blocks), [0], [0], "batch")
    job.transfer.event = _Event()
    return job


def _event(job: TransferJob) -> _Event:
    event = job.transfer.event
    assert isinstance(event, _Event)
    return event


def _delays(completion: Completion) -> list[float]:
    assert isinstance(completion.hooks, _Hooks)
    return completion.hooks.delays


async def test_an_unreported_completion_is_finished_at_the_next_sweep(
    completion: Completion,
) -> None:
    job = _job()
    completion.watch(job)
    completion.sweep()  # still copying
    _event(job).complete = True
    completion.sweep()  # complete: its waiter gets one more sweep to report it
    assert not job.transfer.done() and not completion.starved()
    job.keep.append(object())
    completion.sweep()  # not reported: finished here, and the loop is marked as starving
    assert job.transfer.done() and job.transfer.error is None and job.keep == []
    assert completion.starved()
    assert not completion.outstanding["load"] and not completion.sweeping
    # Scheduled at watch and after each of the first two sweeps, at the idle period.
    assert _delays(completion) == [0.02, 0.02, 0.02]
    completion.watch(_job())  # while the loop counts as starving, sweeps come every 2 ms
    assert _delays(completion)[-1] == 0.002


async def test_a_reported_completion_is_only_dropped(completion: Completion) -> None:
    job = _job()
    completion.watch(job)
    _event(job).complete = True
    completion.sweep()
    job.finish(None)  # the waiter thread's report arrives
    completion.sweep()
    assert not completion.starved() and not completion.outstanding["load"]
    assert not completion.sweeping


async def test_jobs_of_a_direction_finish_in_order_directions_apart(completion: Completion) -> None:
    first, second, store = _job(), _job(), _job("store")
    for job in (first, second, store):
        completion.watch(job)
    _event(second).complete = _event(store).complete = True
    for _ in range(3):
        completion.sweep()
    assert not first.transfer.done() and not second.transfer.done()
    assert store.transfer.done()
    _event(first).complete = True
    completion.sweep()
    completion.sweep()
    assert first.transfer.done() and second.transfer.done()


async def test_a_job_still_being_queued_holds_back_the_ones_after_it(
    completion: Completion,
) -> None:
    queuing, after = _job("store"), _job("store")
    queuing.transfer.event = None  # the submitter thread has not queued it yet
    completion.watch(queuing)
    completion.watch(after)
    _event(after).complete = True
    for _ in range(3):
        completion.sweep()
    assert not after.transfer.done()


async def test_no_query_while_a_capture_holds_the_gate(completion: Completion) -> None:
    job = _job()
    completion.watch(job)
    _event(job).complete = True
    with capture_gate():
        for _ in range(3):
            completion.sweep()
    assert _event(job).queries == 0 and not job.transfer.done()
    completion.sweep()
    completion.sweep()
    assert job.transfer.done()


async def test_the_failure_of_a_partly_queued_job_is_what_it_finishes_with(
    completion: Completion,
) -> None:
    job = _job()
    job.failure = RuntimeError("the second piece could not be queued")
    completion.watch(job)
    _event(job).complete = True
    completion.sweep()
    completion.sweep()
    # The raw error: the manager's router names it as a TransferError.
    assert job.transfer.error is job.failure


async def test_a_device_error_is_left_to_the_waiter(completion: Completion) -> None:
    job = _job()

    class Failing(_Event):
        def query(self) -> bool:
            raise RuntimeError("an illegal address was encountered")

    job.transfer.event = Failing()
    completion.watch(job)
    for _ in range(3):
        completion.sweep()
    assert not job.transfer.done() and not completion.starved()


def _raising_finish(job: TransferJob) -> None:
    """The job's report settles its transfer, then raises (a bug in whatever the engine
    reports to: done callbacks themselves are logged where they raise)."""

    def fail(job: TransferJob, error: BaseException | None) -> None:
        job.transfer._finish(error)
        raise RuntimeError("an observer's bug")

    job.on_finish = fail


async def test_a_raising_finish_does_not_end_the_sweeping(completion: Completion) -> None:
    job, later = _job(), _job()
    _raising_finish(job)
    completion.watch(job)
    completion.watch(later)
    _event(job).complete = True
    completion.sweep()
    with pytest.raises(RuntimeError, match="observer"):
        completion.sweep()
    assert job.transfer.done() and completion.sweeping
    assert len(_delays(completion)) == 3  # at watch, and after both sweeps
    _event(later).complete = True
    completion.sweep()
    completion.sweep()
    assert later.transfer.done() and not completion.outstanding["load"]


@contextmanager
def _submitting(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[CudaTransferEngine, list[TransferJob], list[TransferJob]]]:
    """An engine (no copy kernel, 16 arrays) whose submit() runs for real down to where a
    job is queued: the jobs the submitter thread gets, and the ones queued on the loop,
    are recorded; its sweeps are recorded, not run."""
    threaded: list[TransferJob] = []
    on_loop: list[TransferJob] = []
    with cpu_engine(monkeypatch, offset_layout(0, 64, blocks=16, arrays=16)) as engine:
        monkeypatch.setattr(engine._completion, "hooks", _Hooks())
        monkeypatch.setattr(
            engine,
            "_submitter",
            SimpleNamespace(busy=lambda: False, submit=lambda job, method: threaded.append(job)),
        )
        monkeypatch.setattr(engine, "_enqueue", lambda job, method: on_loop.append(job))
        monkeypatch.setattr(engine, "record_ready", lambda: None)
        yield engine, threaded, on_loop


async def test_submit_watches_every_job_queued_for_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _submitting(monkeypatch) as (engine, _, _):
        load, store = _job("load"), _job("store", blocks=10)
        engine.submit(load, pageable=False)
        engine.submit(store, pageable=False)
        engine.submit(_job("load"), pageable=True)  # pageable: its worker thread reports it
        completion = engine._completion
        assert list(completion.outstanding["load"]) == [load]
        assert list(completion.outstanding["store"]) == [store]
        assert completion.sweeping and _delays(completion) == [0.02]


async def test_stores_stay_on_the_loop_while_threads_starve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _submitting(monkeypatch) as (engine, threaded, on_loop):
        engine.loop_store_max_bytes = 0  # as a store over 64 MiB
        large = _job("store", blocks=10)  # 160 segments: the submitter's, normally
        engine.submit(large, pageable=False)
        assert threaded == [large] and on_loop == []
        engine._completion._starved_until = time.monotonic() + 60
        starved = _job("store", blocks=10)
        engine.submit(starved, pageable=False)
        assert threaded == [large] and on_loop == [starved]


async def test_stores_up_to_the_loop_limits_are_queued_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Small stores, and stores of up to 64 blocks and loop_store_max_bytes by pack or
    # kernel (whose queuing does not grow with the segments); not batch ones beyond 64
    # segments: one DMA each, queued in the driver at about 0.8 us apiece.
    with _submitting(monkeypatch) as (engine, threaded, on_loop):
        engine.loop_store_max_bytes = 4096 * 1000  # the block limit decides here
        assert engine._queued_on_loop(_job("store", blocks=4), "batch")  # 64 segments
        assert not engine._queued_on_loop(_job("store", blocks=5), "batch")
        for method in ("pack", "kernel"):
            assert engine._queued_on_loop(_job("store", blocks=64), method)
            assert not engine._queued_on_loop(_job("store", blocks=65), method)
        engine.loop_store_max_bytes = 4096 * 10
        assert engine._queued_on_loop(_job("store", blocks=10), "pack")
        assert not engine._queued_on_loop(_job("store", blocks=11), "pack")
        many = _job("store", blocks=10)  # 160 segments, 40 KiB: batch (no copy kernel)
        engine.submit(many, pageable=False)
        assert threaded == [many] and on_loop == []


def test_a_waiter_skips_what_the_loop_has_finished() -> None:
    waiter = Waiter("test-waiter")
    waiter.start()
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


@asynccontextmanager
async def _trio_completion() -> AsyncIterator[Completion]:
    """On trio: a completion whose sweep task starts in a task group standing in for the
    manager's (``_task_group``)."""
    completion = Completion(_Hooks())
    completion.start()
    try:
        yield completion
    finally:
        completion.close()


@asynccontextmanager
async def _task_group(completion: Completion) -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group standing in for the manager's, where the sweep task starts."""
    async with anyio.create_task_group() as tg:
        completion.hooks = TrioHooks(tg.start_soon, anyio.lowlevel.current_token())
        yield tg


def test_on_trio_a_task_sweeps_while_jobs_are_outstanding() -> None:
    """trio has no timers: the sweep runs as a task in the manager's task group, started
    by the first job watched and ended by the first sweep that finds nothing left."""
    pytest.importorskip("trio")
    finished: list[TransferJob] = []

    async def main() -> None:
        async with _trio_completion() as completion:
            async with _task_group(completion):
                first, second = _job(), _job("store")
                completion.watch(first)
                completion.watch(second)
                assert completion.sweeping
                _event(first).complete = _event(second).complete = True
                with anyio.fail_after(10):
                    await first.transfer  # no waiter thread reports it: only the task can
                    await second.transfer
                finished.extend((first, second))
                assert completion.starved()
            # The group's exit waited for the task, which ended with nothing outstanding.
            assert not completion.sweeping and not any(completion.outstanding.values())
            later = _job()
            async with _task_group(completion):
                completion.watch(later)  # a new burst starts a new task
                _event(later).complete = True
                with anyio.fail_after(10):
                    await later.transfer
            finished.append(later)

    anyio.run(main, backend="trio")
    assert [job.transfer.error for job in finished] == [None, None, None]


def test_on_trio_a_raising_finish_is_logged_and_the_task_goes_on() -> None:
    pytest.importorskip("trio")

    async def main() -> None:
        async with _trio_completion() as completion, _task_group(completion):
            job, later = _job(), _job()
            _raising_finish(job)
            completion.watch(job)
            completion.watch(later)
            _event(job).complete = _event(later).complete = True
            with anyio.fail_after(10):
                await job.transfer
                await later.transfer  # finished by a later sweep of the same task

    with capture_logs() as logs:
        anyio.run(main, backend="trio")
    failed = [e for e in logs if e["event"] == "transfer.sweep_failed"]
    assert len(failed) == 1 and "observer's bug" in failed[0]["error"]


def test_a_waiter_outlives_a_report_that_raises() -> None:
    waiter = Waiter("test-waiter")
    waiter.start()
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
        async with _trio_completion() as completion:
            async with _task_group(completion) as tg:
                completion.watch(_job())  # never completes
                await anyio.lowlevel.checkpoint()  # the task sleeps until its first sweep
                tg.cancel_scope.cancel()
            assert not completion.sweeping  # cleared by the cancelled task
            later = _job()
            async with _task_group(completion):
                completion.outstanding["load"].clear()
                completion.watch(later)
                assert completion.sweeping
                _event(later).complete = True
                with anyio.fail_after(10):
                    await later.transfer

    anyio.run(main, backend="trio")


def test_a_job_watched_when_no_task_can_start_leaves_the_sweep_unscheduled() -> None:
    pytest.importorskip("trio")

    def closed(*args: Any) -> None:
        raise RuntimeError("This task group is not active; no new tasks can be started.")

    async def main() -> None:
        async with _trio_completion() as completion:
            completion.hooks = TrioHooks(closed, anyio.lowlevel.current_token())
            with pytest.raises(RuntimeError, match="not active"):
                completion.watch(_job())
            assert not completion.sweeping

    anyio.run(main, backend="trio")
