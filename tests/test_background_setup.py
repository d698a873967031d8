"""An engine prepared in the background (the CUDA engine's way: ``prepare_in_background``)
and the pin pipeline's threads, started before it faults anything.

- Entry returns before the engine is prepared; ``pinned`` and ``is_pinned()`` wait for the
  preparation as well as for the chunks. The region is faulted in and pinned once the
  preparation is over (after the pin backend's warm-up, before the chunks), or after
  ``SET_UP_WAIT_S`` if it is held back.
- Transfers submitted meanwhile reach the engine only once it is prepared, in submission
  order (a pageable one at once, if the engine takes it before: ``pageable_before_prepare``);
  bad input is refused at once, with nothing queued.
- A preparation that fails: ``pinned`` raises its error, the waiting transfers fail with a
  TransferError that chains it, later ones are refused, and the close still releases
  everything (the engine closed in a worker thread).
- A close while the engine prepares waits for the preparation's thread, then closes in
  order.
- The pin pipeline starts every thread it uses before the first chunk is faulted in:
  starting a thread maps its stack, which waits for the memory-map lock that faulting and
  pinning hold (a loop that started one meanwhile stalled 25 ms on the H200).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import pytest
import torch

import asyncpin._opened as opened
from asyncpin import InvalidTransferError, KVLayout, OffloadManager, TransferError
from asyncpin.abc import EngineSetup
from asyncpin.region import HostRegion
from asyncpin.testing import FakeBackend, FakeEngine, is_mapped
from tests.helpers import TIMEOUT_S, MadeRegions, pause_held_elsewhere, wait_thread_event

pytestmark = pytest.mark.anyio
NEGATIVE_S = 0.2  # how long a thing that must not happen is given to happen


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _layout() -> KVLayout:
    return KVLayout.from_tensors([torch.arange(8 * 4096, dtype=torch.uint8).view(8, 4096)])


class Made:
    """The engines a manager made (FakeEngine in the background, held at prepare)."""

    def __init__(self, *, fail: BaseException | None = None, pageable_early: bool = True) -> None:
        self.engines: list[FakeEngine] = []
        self.fail = fail
        self.pageable_early = pageable_early
        self.entered_prepare = threading.Event()
        #: Called in the set-up's thread once the engine's prepare() returned.
        self.after: Callable[[], None] | None = None

    def __call__(self, setup: EngineSetup) -> FakeEngine:
        engine = FakeEngine(setup, auto=True, background=True)
        engine.hold_prepare()
        engine.pageable_before_prepare = self.pageable_early
        inner_prepare, fail, entered = engine.prepare, self.fail, self.entered_prepare

        def prepare() -> None:
            entered.set()
            inner_prepare()
            if self.after is not None:
                self.after()
            if fail is not None:
                raise fail

        engine.prepare = prepare  # type: ignore[method-assign]
        self.engines.append(engine)
        return engine

    @property
    def engine(self) -> FakeEngine:
        assert len(self.engines) == 1
        return self.engines[0]


def _released(made_regions: MadeRegions, backend: FakeBackend) -> bool:
    """The region unmapped, and every pinned chunk unpinned."""
    unmapped = not is_mapped(*made_regions.spans[0])
    return unmapped and backend.pinned_spans() == backend.unpinned_spans()


def _manager(made: Made, backend: FakeBackend) -> OffloadManager:
    return OffloadManager.for_kv(_layout(), 8, backend=backend, engine=made, chunk_bytes=8192)


async def test_entry_does_not_wait_and_pinned_includes_the_engine(
    made_regions: MadeRegions,
) -> None:
    made, backend = Made(), FakeBackend()
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(made, backend) as mgr:
            await wait_thread_event(made.entered_prepare)
            assert not made.engine.prepared
            assert not mgr.is_pinned() and not mgr.pinned.is_set()
            made.engine.let_prepare()
            await mgr.pinned
            assert mgr.is_pinned() and made.engine.prepared
            assert mgr.stats().chunks_pinned == mgr.stats().chunks_total == 4
    assert made.engine.closed
    assert _released(made_regions, backend)


async def test_nothing_is_faulted_in_or_pinned_while_the_engine_is_set_up(
    made_regions: MadeRegions, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Beside 100 GiB faulting in, the CUDA engine's set-up took 128-155 ms against 14-21
    # ms alone, and a model's step stretched in it (bench/RESULTS.md#startup): the
    # pipeline starts faulting once the set-up is over.
    faulted = threading.Event()
    prefault = HostRegion.prefault

    def mark(self: HostRegion, offset: int, nbytes: int, *args: Any) -> bool:
        faulted.set()
        return prefault(self, offset, nbytes, *args)

    monkeypatch.setattr(HostRegion, "prefault", mark)
    monkeypatch.setattr(opened, "SET_UP_WAIT_S", TIMEOUT_S)
    made, backend = Made(), FakeBackend()
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(made, backend) as mgr:
            try:
                await wait_thread_event(made.entered_prepare)
                assert backend.warm_up_at == [0]  # the warm-up came first
                # Room for the pipeline to fault in, were it not waiting.
                assert not await anyio.to_thread.run_sync(faulted.wait, NEGATIVE_S)
                assert backend.calls == [] and mgr.stats().chunks_pinned == 0
            finally:
                made.engine.let_prepare()  # a close waits for the set-up
            await mgr.pinned
            assert faulted.is_set() and mgr.stats().chunks_pinned == 4
    assert _released(made_regions, backend)


async def test_transfers_wait_for_the_engine_in_order() -> None:
    made = Made()
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(made, FakeBackend()) as mgr:
            first = mgr.store([0, 1], [2, 3])
            second = mgr.load([2], [5])
            third = mgr.store([4], [6])
            with pytest.raises(InvalidTransferError):
                mgr.store([0], [99])  # bad input: refused now, nothing queued
            assert mgr.stats().transfers_in_flight == 3
            assert made.engine.submitted == []  # nothing reached the engine yet
            made.engine.let_prepare()
            await first
            await second
            await third
            jobs = [entry.job.transfer for entry in made.engine.submitted]
            # In submission order per direction (a store and a load may overlap).
            assert [t for t in jobs if t.direction == "store"] == [first, third]
            assert [t for t in jobs if t.direction == "load"] == [second]
            stats = mgr.stats()
            assert stats.transfers_stored == 2 and stats.transfers_loaded == 1
            assert stats.transfers_failed == 0


async def test_a_failed_preparation_fails_pinned_and_the_transfers(
    made_regions: MadeRegions,
) -> None:
    made, backend = Made(fail=RuntimeError("no room for the staging buffers")), FakeBackend()
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(made, backend) as mgr:
            waiting = mgr.store([0], [0])
            made.engine.let_prepare()
            with pytest.raises(RuntimeError, match="no room"):
                await mgr.pinned
            assert not mgr.is_pinned()
            with pytest.raises(TransferError, match="could not be set up") as caught:
                await waiting
            assert isinstance(caught.value.__cause__, RuntimeError)
            with pytest.raises(TransferError, match="could not be set up"):
                mgr.load([0], [0])
            assert made.engine.submitted == []
            assert mgr.stats().transfers_in_flight == 0
    assert made.engine.closed
    assert _released(made_regions, backend)


async def test_a_set_up_held_back_holds_faulting_in_for_a_while_only(
    made_regions: MadeRegions, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A set-up held back (at the capture gate a server holds through its graph capture,
    # say) lets the region be faulted in and pinned after SET_UP_WAIT_S.
    monkeypatch.setattr(opened, "SET_UP_WAIT_S", 0.01)
    made, backend = Made(), FakeBackend()
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(made, backend) as mgr:
            try:
                await wait_thread_event(made.entered_prepare)
                await mgr._opened.scheduler.pinned  # type: ignore[union-attr]
                assert mgr.stats().chunks_pinned == 4 and not made.engine.prepared
                assert not mgr.pinned.is_set()
            finally:
                made.engine.let_prepare()  # a close waits for the set-up
            await mgr.pinned
    assert _released(made_regions, backend)


async def test_a_close_while_the_engine_prepares_waits_for_it(
    made_regions: MadeRegions,
) -> None:
    made, backend = Made(), FakeBackend()
    mgr = _manager(made, backend)
    with anyio.fail_after(TIMEOUT_S):
        await mgr.__aenter__()
        transfer = mgr.store([1], [1])
        await wait_thread_event(made.entered_prepare)
        async with anyio.create_task_group() as tg:
            tg.start_soon(mgr.aclose)
            await anyio.wait_all_tasks_blocked()
            assert mgr.state.value == "closing" and not made.engine.closed
            made.engine.let_prepare()
        assert mgr.state.value == "closed"
        # It waited for the engine, then for its chunk, which the close left unpinned.
        with pytest.raises(TransferError, match="the manager closed"):
            await transfer
        assert made.engine.prepared and made.engine.submitted == []
        with pytest.raises(anyio.ClosedResourceError):
            await mgr.pinned
    assert made.engine.closed and backend.calls == []
    assert _released(made_regions, backend)


def test_the_pipeline_starts_its_threads_before_it_faults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No thread starts while chunks are faulted in or pinned: before faulting, or
    # between the last chunk faulted in and the first pin call.
    # A fresh asyncio loop: its worker-thread pool starts empty (trio's is process-wide,
    # and earlier tests leave idle threads in it).
    started: list[str] = []
    faulting, pinning_began = threading.Event(), threading.Event()
    faulted, counting = [0], threading.Lock()
    start = threading.Thread.start
    loop_thread = threading.get_ident()

    def phase() -> str:
        if pinning_began.is_set():
            return "pinning"
        if faulting.is_set():
            return "faulting" if faulted[0] < 64 else "between"
        return "before"

    def record_start(self: threading.Thread) -> None:
        if threading.get_ident() == loop_thread:  # a stray start elsewhere is not ours
            started.append(phase())
        start(self)

    prefault = HostRegion.prefault

    def mark(self: HostRegion, offset: int, nbytes: int, *args: Any) -> bool:
        faulting.set()
        try:
            return prefault(self, offset, nbytes, *args)
        finally:
            with counting:
                faulted[0] += 1

    monkeypatch.setattr(threading.Thread, "start", record_start)
    monkeypatch.setattr(HostRegion, "prefault", mark)

    async def main() -> None:
        with anyio.fail_after(TIMEOUT_S):
            mgr = OffloadManager(
                64 * 4096,
                backend=FakeBackend(before_pin=lambda *_: pinning_began.set()),
                chunk_bytes=4096,
                prefault_threads=2,
                pin_threads=3,
            )
            async with mgr:
                await mgr.pinned

    anyio.run(main, backend="asyncio")
    assert faulting.is_set() and pinning_began.is_set() and started.count("before") >= 2
    assert "faulting" not in started and "pinning" not in started, started


def test_no_thread_starts_while_the_engine_prepares(monkeypatch: pytest.MonkeyPatch) -> None:
    # The set-up (torch's calls) holds the GIL for stretches, and the loop's every
    # thread start waits for the new thread to take it: the set-up's thread and the
    # pipeline's are started together, before the set-up runs (a fresh asyncio loop:
    # its worker-thread pool starts empty).
    made, backend = Made(), FakeBackend()
    started: list[str] = []
    start = threading.Thread.start
    loop_thread = threading.get_ident()

    def record_start(self: threading.Thread) -> None:
        if threading.get_ident() == loop_thread:
            started.append("during" if made.entered_prepare.is_set() else "before")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", record_start)

    async def main() -> None:
        with anyio.fail_after(TIMEOUT_S):
            mgr = OffloadManager.for_kv(
                _layout(), 8, backend=backend, engine=made, chunk_bytes=8192,
                prefault_threads=2, pin_threads=1,
            )  # fmt: skip
            async with mgr:
                await wait_thread_event(made.entered_prepare)
                made.engine.let_prepare()
                await mgr.pinned

    anyio.run(main, backend="asyncio")
    assert started.count("before") >= 4, started  # 2 + 1 for pinning, 1 for the set-up
    assert "during" not in started, started


async def test_an_engine_prepared_at_entry_is_ready_with_the_chunks() -> None:
    # The default (the host engine, FakeEngine): entry prepares it, as before.
    made: list[FakeEngine] = []
    factory = partial(FakeEngine, auto=True)

    def make(setup: EngineSetup) -> FakeEngine:
        made.append(factory(setup))
        return made[-1]

    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), 8, backend=FakeBackend(), engine=make) as mgr:
            assert made[0].prepared
            await mgr.pinned
            mgr.store([0], [0])
            assert len(made[0].submitted) == 1  # straight to the engine


async def test_a_failed_preparation_is_reported_at_once(
    made_regions: MadeRegions,
) -> None:
    # Before the chunks are pinned (one stalls), a failed set-up settles `pinned` now
    # and says why in stats() (and so in the metrics' pin_failed and readiness).
    made = Made(fail=RuntimeError("no room for the staging buffers"))
    backend = FakeBackend(stall_pin_at=1)
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(made, backend) as mgr:
            made.engine.let_prepare()
            with pytest.raises(RuntimeError, match="no room"):
                await mgr.pinned
            await wait_thread_event(backend.stalled)  # pinning goes on all the same
            assert mgr.stats().chunks_pinned < mgr.stats().chunks_total
            error = mgr.stats().error
            assert error is not None and "no room" in error
            assert mgr.pin_error is None  # not a pinning failure
            backend.release()
    assert _released(made_regions, backend)


async def test_the_set_up_waits_while_pinning_is_paused() -> None:
    # A capture wrapped in pinning_paused() must not see the set-up's device calls. (The
    # pause is taken before entry, so that the set-up cannot have begun.)
    made = Made()
    mgr = _manager(made, FakeBackend())
    with anyio.fail_after(TIMEOUT_S):
        async with mgr.pinning_paused():
            await mgr.__aenter__()
            try:
                made.engine.let_prepare()
                # Room for the set-up to begin, were it not held.
                began = await anyio.to_thread.run_sync(made.entered_prepare.wait, NEGATIVE_S)
                assert not began
            except BaseException:
                await mgr.aclose()
                raise
        await mgr.pinned
        assert made.engine.prepared
        await mgr.aclose()


async def test_a_pageable_transfer_does_not_wait_for_a_set_up_held_by_a_pause(
    made_regions: MadeRegions,
) -> None:
    # pinning_paused() holds pin and unpin calls and the set-up. With the "pageable" policy, a
    # transfer whose chunks are not pinned copies through pageable memory at once, even
    # while the pause holds the engine's set-up back (it waited for the pause until the
    # pause ended). A transfer over pinned chunks would still wait for the set-up.
    made, backend = Made(), FakeBackend()
    mgr = OffloadManager.for_kv(
        _layout(), 8, backend=backend, engine=made, chunk_bytes=8192, unpinned_policy="pageable"
    )
    with anyio.fail_after(TIMEOUT_S):
        try:
            async with mgr.pinning_paused():
                await mgr.__aenter__()
                made.engine.let_prepare()
                store = mgr.store([0, 1], [2, 3])
                load = mgr.load([4], [5])
                # Routed at once, not queued behind the set-up.
                assert [e.job.transfer for e in made.engine.submitted] == [store, load]
                assert all(e.pageable for e in made.engine.submitted)
                await store
                await load
                assert (store.path, load.path) == ("pageable", "pageable")
                assert not made.engine.prepared and mgr.stats().chunks_pinned == 0
                assert mgr.stats().transfers_pageable == 2
            await mgr.pinned
            assert made.engine.prepared
        finally:
            await mgr.aclose()  # after the pause: a close inside it is refused
    assert _released(made_regions, backend)


async def test_an_engine_that_takes_no_early_pageable_job_gets_it_after_its_set_up() -> None:
    # Without pageable_before_prepare (an engine class of its own, say), a pageable
    # transfer waits for the set-up like any other.
    made = Made(pageable_early=False)
    mgr = OffloadManager.for_kv(
        _layout(),
        8,
        backend=FakeBackend(),
        engine=made,
        chunk_bytes=8192,
        unpinned_policy="pageable",
    )
    with anyio.fail_after(TIMEOUT_S):
        try:
            async with mgr.pinning_paused():
                await mgr.__aenter__()
                store = mgr.store([0], [2])
                assert made.engine.submitted == []  # waits for the set-up
                made.engine.let_prepare()
            await store
            assert store.path == "pageable" and made.engine.prepared
        finally:
            await mgr.aclose()


@pytest.mark.parametrize(
    ("name", "says", "registered"),
    [("cuda", True, True), ("cuda", False, False), ("host", False, False), ("fake", True, True)],
)
async def test_the_engine_knows_whether_cuda_registered_the_host_blocks(
    name: str, says: bool, registered: bool
) -> None:
    # Only a backend that says so (registers_with_cuda, as CudaBackend) makes host blocks
    # addressable by device code: a name proves nothing.
    seen: list[EngineSetup] = []

    def factory(setup: EngineSetup) -> FakeEngine:
        seen.append(setup)
        return FakeEngine(setup, auto=True)

    backend = FakeBackend()
    backend.name = name
    if says:
        backend.registers_with_cuda = True  # type: ignore[attr-defined]
    async with OffloadManager.for_kv(_layout(), 8, backend=backend, engine=factory) as mgr:
        await mgr.pinned
    assert [s.host_registered for s in seen] == [registered]


async def test_a_close_aborts_a_set_up_held_by_a_pause(
    made_regions: MadeRegions,
) -> None:
    # The set-up waits at the pause (held by another task); a close aborts that wait at
    # once instead of waiting for the pause to end (its unpins do wait for it).
    made, backend = Made(), FakeBackend()
    mgr = _manager(made, backend)
    with anyio.fail_after(TIMEOUT_S):
        # Taken before entry: the set-up cannot have begun.
        async with pause_held_elsewhere(mgr), anyio.create_task_group() as tg:
            await mgr.__aenter__()
            waiting = mgr.store([0], [0])
            made.engine.let_prepare()
            tg.start_soon(mgr.aclose)
            with pytest.raises(anyio.ClosedResourceError):
                await mgr.pinned  # the set-up gave up: the pause is still held
            assert not made.engine.prepared
            # Said as what happened, not as a set-up that failed.
            with pytest.raises(TransferError, match="manager closed before the transfer engine"):
                await waiting
    assert mgr.state.value == "closed" and made.engine.closed
    assert _released(made_regions, backend)


async def test_an_attacher_sizes_default_chunks_from_the_region(
    monkeypatch: pytest.MonkeyPatch, shm_name: str
) -> None:
    # The region's size is known only once attached: the default comes from it.
    import asyncpin._opened as opened_module

    sizes: list[int] = []

    def default(nbytes: int) -> int:
        sizes.append(nbytes)
        return 8192

    monkeypatch.setattr(opened_module, "default_chunk_bytes", default)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager(
            64 * 4096, backend=FakeBackend(), backing="shared", name=shm_name
        ) as owner:
            async with OffloadManager.attached(shm_name, backend=FakeBackend()) as other:
                await other.pinned
                assert sizes == [other.nbytes] == [owner.nbytes]
                assert other.stats().chunk_bytes == 8192
                assert other.stats().chunks_total == 64 * 4096 // 8192
            async with OffloadManager.attached(
                shm_name, backend=FakeBackend(), chunk_bytes=4096
            ) as given:
                assert given.stats().chunk_bytes == 4096 and len(sizes) == 1


async def test_a_capture_that_begins_during_the_set_up_does_not_deadlock() -> None:
    # The set-up is in flight for the manager's pause, and inside it waits for the
    # process-wide gate itself (the CUDA engine's outside_captures()): a capture taking
    # that gate meanwhile must not wait for the set-up, which waits for the capture.
    from asyncpin import capture_gate
    from asyncpin.gate import outside_captures

    made = Made()
    inside, captured = threading.Event(), threading.Event()
    mgr = _manager(made, FakeBackend())
    with anyio.fail_after(TIMEOUT_S):
        async with mgr:
            await wait_thread_event(made.entered_prepare)  # in flight, held by the test

            def capture() -> None:
                with capture_gate():  # as a capture_begin patched by the gate would
                    captured.set()
                    made.engine.let_prepare()
                    assert inside.wait(NEGATIVE_S) is False  # the set-up waits for us

            def set_up_device_work() -> None:
                with outside_captures():
                    inside.set()

            made.after = set_up_device_work
            await anyio.to_thread.run_sync(capture)
            assert captured.is_set()
            await mgr.pinned
            assert inside.is_set()


async def test_a_pipeline_that_fails_before_its_warm_up_still_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its threads could not start, and what beside() starts is refused too (the
    # manager's tasks closed): the pipeline still ends, and says why, so that a close
    # waiting for it returns.
    import asyncpin.pinning as pinning
    from asyncpin.gate import PauseGate

    async def no_threads(count: int) -> None:
        raise RuntimeError("can't start new thread")

    def refused() -> None:
        raise RuntimeError("no task may start now")

    monkeypatch.setattr(pinning, "_start_threads", no_threads)
    region = HostRegion.create(8 << 16)
    backend = FakeBackend()
    scheduler = pinning.PinScheduler(
        region, backend, region.chunks(1 << 16), prefault_threads=1, pin_threads=1,
        pin_interval_s=0, gate=PauseGate(),
    )  # fmt: skip
    try:
        with anyio.fail_after(TIMEOUT_S):
            await scheduler.run(refused)
        assert scheduler.done.is_set() and scheduler.pinned.is_set()
        assert scheduler.error is not None and "no task may start now" in str(scheduler.error)
        assert backend.warm_up_at == [] and backend.calls == []
    finally:
        region.release()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("cancelled", ["_prepare_engine", "PinScheduler.run"])
async def test_a_native_cancel_during_the_set_up_does_not_let_a_close_free_it_early(
    made_regions: MadeRegions, cancelled: str
) -> None:
    # Task.cancel() ends a wait for a worker thread at once (asyncio.run does it to every
    # task left at its end): the set-up's thread went on with the host blocks while the
    # close closed the engine, unpinned and unmapped them. The pipeline, cancelled while it
    # waits for the set-up, must not let the close go on either.
    import asyncio

    made, backend = Made(), FakeBackend()
    mgr = _manager(made, backend)
    with anyio.fail_after(TIMEOUT_S):
        await mgr.__aenter__()
        await wait_thread_event(made.entered_prepare)
        (task,) = [t for t in asyncio.all_tasks() if cancelled in t.get_name()]
        task.cancel()
        async with anyio.create_task_group() as tg:
            tg.start_soon(mgr.aclose)
            await anyio.wait_all_tasks_blocked()
            assert not made.engine.closed and is_mapped(*made_regions.spans[0])
            made.engine.let_prepare()
        assert mgr.state.value == "closed"
    assert made.engine.closed
    assert _released(made_regions, backend)
