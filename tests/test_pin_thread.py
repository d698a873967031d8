"""The pin thread pins chunk after chunk without going back to the event loop.

A round trip to the loop between two pin calls cost about 0.27 ms per chunk on the H200
beside a model (bench/RESULTS.md#startup): the pin worker is one thread that takes the
chunks faulted in from a queue, once the whole region is, and tells the loop of its
progress without waiting for it. A close still waits for the pin call under way, and a
stop ends the thread.
"""

from __future__ import annotations

import threading

import anyio
import pytest

from asyncpin import OffloadManager, pinning
from asyncpin.chunks import ChunkState, ChunkTable
from asyncpin.errors import PinError
from asyncpin.gate import PauseGate
from asyncpin.pinning import PinScheduler
from asyncpin.region import Chunk, HostRegion
from asyncpin.testing import FakeBackend, is_mapped
from tests.helpers import TIMEOUT_S, MadeRegions, wait_thread_event

pytestmark = pytest.mark.anyio
CHUNK = 8192


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _scheduler(mgr: OffloadManager) -> PinScheduler:
    opened = mgr._opened
    assert opened is not None
    return opened.scheduler


async def _all_faulted_in_and_queued(scheduler: PinScheduler, queued: int) -> None:
    while scheduler._faulted.qsize() < queued:
        await anyio.lowlevel.checkpoint()


async def test_chunks_are_pinned_while_the_loop_is_held(made_regions: MadeRegions) -> None:
    fourth = threading.Event()

    def before_pin(n: int, address: int, nbytes: int) -> None:
        if n == 3:
            fourth.set()

    backend = FakeBackend(stall_pin_at=0, before_pin=before_pin)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager(4 * CHUNK, chunk_bytes=CHUNK, backend=backend) as mgr:
            await wait_thread_event(backend.stalled)
            await _all_faulted_in_and_queued(_scheduler(mgr), 3)
            backend.release()
            # The loop is held here: chunks 1-3 must be pinned without it.
            assert fourth.wait(TIMEOUT_S)
            await mgr.pinned
            assert mgr.stats().chunks_pinned == 4
    assert not is_mapped(*made_regions.spans[0])
    assert backend.pinned_spans() == backend.unpinned_spans()


async def test_stats_count_the_bytes_faulted_in_before_any_is_pinned(
    made_regions: MadeRegions,
) -> None:
    # With pinning after faulting, pinned_bytes stays 0 until every chunk is faulted in;
    # faulted_bytes shows the progress meanwhile (the demo's first bar, a probe's).
    backend = FakeBackend(stall_pin_at=0)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager(4 * CHUNK, chunk_bytes=CHUNK, backend=backend) as mgr:
            before = mgr.stats()
            await wait_thread_event(backend.stalled)
            stalled = mgr.stats()
            backend.release()
            await mgr.pinned
            pinned = mgr.stats()
    assert before.pinned_bytes == 0 and before.faulted_bytes <= 4 * CHUNK
    assert (stalled.faulted_bytes, stalled.pinned_bytes) == (4 * CHUNK, 0)
    assert (pinned.faulted_bytes, pinned.pinned_bytes) == (4 * CHUNK, 4 * CHUNK)
    closed = mgr.stats()
    assert (closed.faulted_bytes, closed.pinned_bytes) == (4 * CHUNK, 0)
    assert not is_mapped(*made_regions.spans[0])


def test_the_chunk_table_counts_each_chunk_faulted_in_once() -> None:
    chunks = [Chunk(i, i * CHUNK, CHUNK) for i in range(3)]
    table = ChunkTable(chunks)
    table.mark(0, ChunkState.PREFAULTED)
    table.mark(0, ChunkState.PINNED)
    table.mark(0, ChunkState.UNPINNED)
    table.mark(1, ChunkState.PINNED)  # pinned with no prefault of its own (old kernels)
    table.fail(2, PinError(2, 2 * CHUNK, CHUNK, None, None, "prefault: no memory"))
    assert table.faulted_bytes == 2 * CHUNK
    assert table.pinned_bytes == CHUNK


@pytest.mark.parametrize("beside", [False, True], ids=["after-faulting", "beside-faulting"])
async def test_pinning_begins_once_the_whole_region_is_faulted_in(
    made_regions: MadeRegions, monkeypatch: pytest.MonkeyPatch, beside: bool
) -> None:
    # Pin calls made beside faulting slowed both down on the H200 (bench/RESULTS.md
    # #startup): the first pin call comes after the last chunk is faulted in. The last
    # chunk's faulting waits for a pin call to begin: in vain, for half a second, when
    # the order holds (before the change the first chunk's pin call began meanwhile);
    # with PIN_BESIDE_FAULTING, the previous order kept for the start-up bench, until
    # the first chunk's pin call begins.
    monkeypatch.setattr(pinning, "PIN_BESIDE_FAULTING", beside)
    hold_s = TIMEOUT_S if beside else 0.5
    pin_began = threading.Event()
    states_at_first_pin: list[list[ChunkState]] = []
    prefault = HostRegion.prefault

    def slow_last(
        region: HostRegion, offset: int, nbytes: int, stop: threading.Event | None = None
    ) -> bool:
        if offset == 3 * CHUNK:
            pin_began.wait(hold_s)
        return prefault(region, offset, nbytes, stop)

    def before_pin(n: int, address: int, nbytes: int) -> None:
        if n == 0:
            states_at_first_pin.append(scheduler.states())
            pin_began.set()

    monkeypatch.setattr(HostRegion, "prefault", slow_last)
    backend = FakeBackend(before_pin=before_pin)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager(
            4 * CHUNK, chunk_bytes=CHUNK, backend=backend, prefault_threads=2
        ) as mgr:
            scheduler = _scheduler(mgr)
            await mgr.pinned
    (states,) = states_at_first_pin
    if beside:
        assert states[3] is ChunkState.PENDING
    else:
        assert states == [ChunkState.PREFAULTED] * 4
    assert len(backend.pinned_spans()) == 4
    assert sorted(backend.pinned_spans()) == sorted(backend.unpinned_spans())
    assert not is_mapped(*made_regions.spans[0])


@pytest.mark.parametrize("beside", [False, True], ids=["after-faulting", "beside-faulting"])
async def test_the_pin_threads_are_started_before_pinning_begins(
    made_regions: MadeRegions, monkeypatch: pytest.MonkeyPatch, beside: bool
) -> None:
    # Threads are started where nothing faults or pins (a thread's start waits for the
    # memory-map lock they hold). Pin threads started with the faulting ones idled
    # through it, and the pool lets a thread go after 10 s idle: a pipeline that pins
    # once faulting is over starts its pin threads then, at a barrier, before any pin.
    monkeypatch.setattr(pinning, "PIN_BESIDE_FAULTING", beside)
    events: list[tuple[str, int]] = []
    start_threads = pinning._start_threads
    prefault = HostRegion.prefault

    async def recorded_start(count: int) -> None:
        events.append(("start", count))
        await start_threads(count)

    def recorded_prefault(
        region: HostRegion, offset: int, nbytes: int, stop: threading.Event | None = None
    ) -> bool:
        events.append(("fault", offset // CHUNK))
        return prefault(region, offset, nbytes, stop)

    def before_pin(n: int, address: int, nbytes: int) -> None:
        events.append(("pin", n))

    monkeypatch.setattr(pinning, "_start_threads", recorded_start)
    monkeypatch.setattr(HostRegion, "prefault", recorded_prefault)
    backend = FakeBackend(before_pin=before_pin)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager(
            4 * CHUNK, chunk_bytes=CHUNK, backend=backend, prefault_threads=1, pin_threads=2
        ) as mgr:
            await mgr.pinned
    kinds = [kind for kind, _ in events]
    starts = [count for kind, count in events if kind == "start"]
    if beside:
        assert kinds.index("fault") > kinds.index("start") == 0
        assert starts == [1 + 2]  # the faulting thread and both pin threads
    else:
        last_fault = len(kinds) - 1 - kinds[::-1].index("fault")
        assert kinds[last_fault + 1] == "start" and kinds.index("pin") == last_fault + 2
        assert starts == [1, 2]
    assert kinds.count("pin") == 4
    assert sorted(backend.pinned_spans()) == sorted(backend.unpinned_spans())
    assert not is_mapped(*made_regions.spans[0])


@pytest.mark.parametrize("cancel", [False, True], ids=["close", "native-cancel-then-close"])
async def test_a_close_waits_for_the_pin_call_and_stops_the_thread(
    made_regions: MadeRegions, anyio_backend: str, cancel: bool
) -> None:
    # With cancel, the pipeline's task gets a Task.cancel() first (asyncio.run gives one
    # to every task left at its end): the close must still wait for the pin call.
    if cancel and anyio_backend != "asyncio":
        pytest.skip("Task.cancel() is asyncio's")
    import asyncio

    backend = FakeBackend(stall_pin_at=1)
    mgr = OffloadManager(4 * CHUNK, chunk_bytes=CHUNK, backend=backend)
    with anyio.fail_after(TIMEOUT_S):
        await mgr.__aenter__()
        await wait_thread_event(backend.stalled)
        if cancel:
            (task,) = [t for t in asyncio.all_tasks() if "PinScheduler.run" in t.get_name()]
            task.cancel()
        async with anyio.create_task_group() as tg:
            tg.start_soon(mgr.aclose)
            await anyio.wait_all_tasks_blocked()
            # The second pin call is under way: nothing is unpinned or unmapped yet.
            assert mgr.state.value == "closing"
            assert backend.unpinned_spans() == [] and is_mapped(*made_regions.spans[0])
            backend.release()
        assert mgr.state.value == "closed"
    # The two chunks pinned are unpinned; the two left were never pinned.
    assert len(backend.pinned_spans()) == 2
    assert backend.pinned_spans() == backend.unpinned_spans()
    assert not is_mapped(*made_regions.spans[0])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_native_cancel_after_faulting_stops_the_pin_thread(
    made_regions: MadeRegions,
) -> None:
    # asyncio.run gives Task.cancel() to every task left at its end. Once faulting was
    # over, the cancel reached no pin thread: it pinned the whole queue, pausing
    # pin_interval_s after each chunk, before the pipeline ended.
    import asyncio

    backend = FakeBackend(stall_pin_at=0)
    mgr = OffloadManager(4 * CHUNK, chunk_bytes=CHUNK, backend=backend, pin_interval_s=3600)
    with anyio.fail_after(TIMEOUT_S):
        await mgr.__aenter__()
        scheduler = _scheduler(mgr)
        await wait_thread_event(backend.stalled)
        await _all_faulted_in_and_queued(scheduler, 4)  # chunks 1-3, and the end
        (task,) = [t for t in asyncio.all_tasks() if "PinScheduler.run" in t.get_name()]
        task.cancel()
        await anyio.wait_all_tasks_blocked()
        backend.release()
        await scheduler.done.wait()
        assert scheduler.stopping and scheduler.chunks_pinned == 1
        await mgr.aclose()
    assert backend.pinned_spans() == backend.unpinned_spans()
    assert not is_mapped(*made_regions.spans[0])


def test_the_pause_after_a_pin_call_waits_in_slices() -> None:
    # A pin_interval_s over threading.TIMEOUT_MAX (about 292 years) made Event.wait raise
    # OverflowError in the pin thread: the pipeline crashed.
    region = HostRegion.create(CHUNK)
    try:
        scheduler = PinScheduler(
            region,
            FakeBackend(),
            region.chunks(CHUNK),
            prefault_threads=1,
            pin_threads=1,
            pin_interval_s=1e10,
            gate=PauseGate(),
        )
        asked: list[float] = []

        class Stopping(threading.Event):
            def wait(self, timeout: float | None = None) -> bool:
                asked.append(-1.0 if timeout is None else timeout)
                self.set()
                return True

        scheduler._stop = Stopping()
        scheduler._pause()
        assert asked == [1.0]
    finally:
        region.release()
