"""Closing from anywhere, stored errors raised many times, and the uses a manager refuses.

- ``aclose()`` (and ``__aexit__``) from any task of the loop that opened the manager runs
  the whole close order: entered without ``async with``, closed by a task other than the
  one that entered (still running or finished), by several at once; the loop is healthy
  afterwards (no task of the manager left, no corrupted nursery).
- A close that could only hang or break is refused with LifecycleError, changing nothing:
  inside ``pinning_paused()`` or ``capture_gate()``, or from another event loop.
- A stored error (``pinned``, a transfer, use after close) raised again and again keeps
  the same traceback.
- ``pin_interval_s`` never delays a close; thread counts are bounded.
- A forked child refuses every use of its parent's manager and never unpins or unmaps.

Every scenario runs on asyncio and on trio (the ``anyio_backend`` fixture in
``conftest.py``), synchronised on events: the FakeBackend's stalled pin call,
``anyio.wait_all_tasks_blocked()``, and ``await`` on transfers. A stall is released in
``finally`` so a failed check cannot hang a close.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import pytest
import torch
from structlog.testing import capture_logs

import asyncpin.gate
from asyncpin import (
    KVLayout,
    ManagerState,
    OffloadManager,
    PinError,
    TransferError,
    capture_gate,
)
from asyncpin._config import MAX_THREADS
from asyncpin._opened import Opened
from asyncpin._tasks import OwnedTasks
from asyncpin.engines.host import HostTransferEngine
from asyncpin.errors import ConfigError, ForkedManagerError, LifecycleError
from asyncpin.region import HostRegion
from asyncpin.shm import SHM_DIR
from asyncpin.testing import FakeBackend, is_mapped
from asyncpin.transfers import TransferJob
from tests.helpers import TIMEOUT_S, MadeRegions, releasing, wait_child, wait_thread_event

pytestmark = pytest.mark.anyio

BLOCK = 4096  # one host block per chunk
HOST_BLOCKS = 8
STALL_AT = 1  # chunk 0 pins, chunk 1's pin call is held


def kv_layout() -> KVLayout:
    return KVLayout.from_tensors([torch.randint(1, 255, (16, BLOCK), dtype=torch.uint8)])


def make(fake: FakeBackend, **kwargs: Any) -> OffloadManager:
    return OffloadManager.for_kv(
        kv_layout(),
        HOST_BLOCKS,
        backend=fake,
        chunk_bytes=BLOCK,
        prefault_threads=1,
        pin_threads=1,
        **kwargs,
    )


def live_tasks() -> int:
    """Tasks alive on the running loop (trio's count includes its system tasks)."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:  # trio
        import trio

        return trio.lowlevel.current_statistics().tasks_living


def assert_closed_cleanly(mgr: OffloadManager, fake: FakeBackend, address: int) -> None:
    assert mgr.state is ManagerState.CLOSED
    assert sorted(fake.unpinned_spans()) == sorted(fake.pinned_spans())
    assert len(set(fake.unpinned_spans())) == len(fake.unpinned_spans())
    assert all(call.mapped for call in fake.calls), "a backend call ran on unmapped memory"
    assert not is_mapped(address, mgr.nbytes), "the region is still mapped after close"
    assert mgr.stats().chunks_pinned == 0


async def assert_loop_healthy(baseline: int) -> None:
    """No task of the manager is left, and the loop still runs task groups."""
    await anyio.lowlevel.checkpoint()
    assert live_tasks() == baseline, "a task of the manager outlived its close"
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.lowlevel.checkpoint)


class Mid:
    """A manager caught mid-pinning: chunk 0 pinned, chunk 1's pin call held, one store
    done and one waiting for chunk 3 (a task of the manager)."""

    def __init__(self) -> None:
        self.fake = FakeBackend(stall_pin_at=STALL_AT)
        self.mgr = make(self.fake)
        self.address = 0
        self.waiting: Any = None

    async def reach(self) -> None:
        mgr = self.mgr
        self.address = mgr.host_view().data_ptr()
        await wait_thread_event(self.fake.stalled)
        await mgr.store([0], [0])  # chunk 0 is pinned: the fast path
        self.waiting = mgr.store([1], [3])
        await anyio.wait_all_tasks_blocked()
        assert not self.waiting.done()

    async def release_once_closing(self) -> None:
        """Let the held pin call return once a close has stopped the pipeline (so chunk 3
        is never pinned) and waits for that call."""
        await anyio.wait_all_tasks_blocked()
        assert self.mgr.state is ManagerState.CLOSING
        assert self.fake.unpinned_spans() == []
        self.fake.release()

    async def check_closed(self, baseline: int) -> None:
        assert_closed_cleanly(self.mgr, self.fake, self.address)
        assert self.waiting.done()
        with pytest.raises(TransferError, match="closed"):
            await self.waiting
        with pytest.raises(anyio.ClosedResourceError):
            self.mgr.store([0], [0])
        await assert_loop_healthy(baseline)


# -- aclose from any task ---------------------------------------------------------------


class TestCloseFromAnyTask:
    async def test_enter_then_aclose_in_one_task(self) -> None:
        baseline = live_tasks()
        mid = Mid()
        with anyio.fail_after(TIMEOUT_S), releasing(mid.fake):
            async with anyio.create_task_group() as tg:  # the test's, around both calls
                await mid.mgr.__aenter__()
                await mid.reach()
                tg.start_soon(mid.release_once_closing)
                await mid.mgr.aclose()
        await mid.check_closed(baseline)

    @pytest.mark.parametrize("entry", ["aenter", "async-with"])
    async def test_close_while_the_entering_task_runs(self, entry: str) -> None:
        baseline = live_tasks()
        mid = Mid()
        entered, leave, left = anyio.Event(), anyio.Event(), anyio.Event()

        async def owner() -> None:
            if entry == "aenter":
                await mid.mgr.__aenter__()
                entered.set()
                await leave.wait()
            else:
                async with mid.mgr:
                    entered.set()
                    await leave.wait()
            left.set()

        closed = anyio.Event()

        async def closer() -> None:
            await mid.mgr.aclose()
            closed.set()

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                with releasing(mid.fake):
                    tg.start_soon(owner)
                    await entered.wait()
                    await mid.reach()
                    tg.start_soon(closer)
                    await mid.release_once_closing()
                    await closed.wait()
                    # Closed by the other task while the entering one still runs.
                    assert not left.is_set()
                    assert mid.mgr.state is ManagerState.CLOSED
                    leave.set()
        assert left.is_set()
        await mid.check_closed(baseline)

    @pytest.mark.parametrize("how", ["aclose", "aexit"])
    async def test_close_after_the_entering_task_finished(self, how: str) -> None:
        baseline = live_tasks()
        mid = Mid()

        async def owner() -> None:
            await mid.mgr.__aenter__()
            await mid.reach()

        with anyio.fail_after(TIMEOUT_S), releasing(mid.fake):
            async with anyio.create_task_group() as tg:
                tg.start_soon(owner)
            assert mid.mgr.state is ManagerState.OPEN
            async with anyio.create_task_group() as tg:
                if how == "aclose":
                    tg.start_soon(mid.mgr.aclose)
                else:
                    tg.start_soon(mid.mgr.__aexit__, None, None, None)
                await mid.release_once_closing()
        await mid.check_closed(baseline)

    async def test_concurrent_closes_from_several_tasks(self) -> None:
        baseline = live_tasks()
        mid = Mid()
        returned: list[ManagerState] = []

        async def owner() -> None:
            await mid.mgr.__aenter__()

        async def closer(close: Callable[[], Awaitable[Any]]) -> None:
            await close()
            returned.append(mid.mgr.state)

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(owner)
            await mid.reach()
            async with anyio.create_task_group() as tg:
                with releasing(mid.fake):
                    for close in (
                        mid.mgr.aclose,
                        lambda: mid.mgr.__aexit__(None, None, None),
                        mid.mgr.aclose,
                    ):
                        tg.start_soon(closer, close)
                    await anyio.wait_all_tasks_blocked()
                    assert returned == []
                    assert mid.mgr.state is ManagerState.CLOSING
        assert returned == [ManagerState.CLOSED] * 3
        await mid.check_closed(baseline)

    async def test_close_from_another_event_loop_is_refused(self) -> None:
        baseline = live_tasks()
        fake = FakeBackend()
        mgr = make(fake)
        refused: list[BaseException] = []

        def close_on_a_new_loop() -> None:
            try:
                anyio.run(mgr.aclose)
            except BaseException as exc:
                refused.append(exc)

        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                address = mgr.host_view().data_ptr()
                await mgr.pinned
                thread = threading.Thread(target=close_on_a_new_loop, daemon=True)
                thread.start()
                await anyio.to_thread.run_sync(thread.join, TIMEOUT_S)
                assert not thread.is_alive()
                assert len(refused) == 1 and isinstance(refused[0], LifecycleError)
                assert "another event loop" in str(refused[0])
                # Nothing changed: still open and usable.
                assert mgr.state is ManagerState.OPEN and mgr.is_pinned()
                await mgr.store([0], [0])
        assert_closed_cleanly(mgr, fake, address)
        await assert_loop_healthy(baseline)


# -- aclose inside a hold ---------------------------------------------------------------


class Watchdog:
    """If every task blocks while the close attempt has not returned, the close is stuck
    at the hold: release the hold so the test fails instead of hanging (and take it back
    once the close is over, so that the block's own release stays balanced)."""

    def __init__(self, release: Callable[[], None], retake: Callable[[], None]) -> None:
        self._release = release
        self._retake = retake
        self.returned = False
        self.fired = False

    async def watch(self) -> None:
        await anyio.wait_all_tasks_blocked()
        if not self.returned:
            self.fired = True
            self._release()

    def check(self) -> None:
        if self.fired:
            self._retake()
            raise AssertionError("aclose() inside the hold waited for it to end")


class TestCloseInsideAHold:
    @pytest.mark.parametrize("hold", ["pinning_paused", "capture_gate"])
    @pytest.mark.parametrize("form", ["with", "async-with", "child-task", "thread"])
    async def test_aclose_inside_a_hold_is_refused(self, hold: str, form: str) -> None:
        baseline = live_tasks()
        fake = FakeBackend()
        mgr = make(fake)
        refusals: list[BaseException] = []

        async def try_close() -> None:
            try:
                await mgr.aclose()
            except LifecycleError as exc:
                refusals.append(exc)
            finally:
                watchdog.returned = True

        with anyio.fail_after(TIMEOUT_S):
            await mgr.__aenter__()
            address = mgr.host_view().data_ptr()
            await mgr.pinned
            if hold == "pinning_paused":
                context = mgr.pinning_paused()
                watchdog = Watchdog(mgr._gate.unhold, mgr._gate.hold)
            else:
                context = capture_gate()
                watchdog = Watchdog(asyncpin.gate._unhold_all, asyncpin.gate._hold_all)
            async with anyio.create_task_group() as tg:

                async def attempt() -> None:
                    tg.start_soon(watchdog.watch)  # runs once this task yields
                    await try_close()
                    watchdog.check()

                def in_a_thread() -> None:
                    with context:  # a thread that holds it, closing through the loop
                        anyio.from_thread.run(attempt)

                if form == "async-with":
                    async with context:
                        await attempt()
                elif form == "thread":
                    await anyio.to_thread.run_sync(in_a_thread)
                else:
                    with context:
                        if form == "with":
                            await attempt()
                        else:  # a task started inside the block, which waits for it
                            async with anyio.create_task_group() as inner:
                                inner.start_soon(attempt)
            assert len(refusals) == 1
            assert f"{hold}()" in str(refusals[0])
            assert isinstance(refusals[0], RuntimeError)
            # Nothing changed, and once the hold is released the close runs.
            assert mgr.state is ManagerState.OPEN and mgr.is_pinned()
            assert fake.unpinned_spans() == []
            await mgr.aclose()
        assert_closed_cleanly(mgr, fake, address)
        await assert_loop_healthy(baseline)


# -- stored errors raised again and again ----------------------------------------------


def tb_length(exc: BaseException) -> int:
    n, tb = 0, exc.__traceback__
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


def context_length(exc: BaseException) -> int:
    n, ctx = 0, exc.__context__
    while ctx is not None:
        n, ctx = n + 1, ctx.__context__
    return n


async def raise_repeatedly(
    awaitable: Callable[[], Awaitable[Any]], kind: type[BaseException], times: int = 50
) -> BaseException:
    """Await a settled failure ``times`` times (half of them inside an except block);
    the error's traceback and context chain must come out the same each time."""
    lengths: set[tuple[int, int]] = set()
    error: BaseException | None = None
    for i in range(times):
        try:
            if i % 2:
                try:
                    raise KeyError("a waiter's own exception")
                except KeyError:
                    await awaitable()
            else:
                await awaitable()
        except kind as exc:
            assert error is None or exc is error
            error = exc
        else:
            raise AssertionError("the failure was not raised")
        assert error is not None
        if not i % 2:
            lengths.add((tb_length(error), context_length(error)))
    assert error is not None
    assert len(lengths) == 1, f"the stored error grew as it was raised: {sorted(lengths)}"
    return error


class TestStoredErrorsDoNotGrow:
    async def test_pinned_after_a_failure(self) -> None:
        with anyio.fail_after(TIMEOUT_S):
            async with make(FakeBackend(fail_pin_at=2)) as mgr:
                error = await raise_repeatedly(lambda: mgr.pinned, PinError)
                assert error is mgr.pin_error
                # Raised last inside an except block; raised again outside one, it carries
                # no context from that waiter.
                with pytest.raises(PinError):
                    await mgr.pinned
                assert error.__context__ is None

    async def test_a_failed_transfer(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def fail(engine: HostTransferEngine, job: TransferJob) -> None:
            raise RuntimeError("copy failed")

        monkeypatch.setattr(HostTransferEngine, "_copy", fail)
        with anyio.fail_after(TIMEOUT_S):
            async with make(FakeBackend()) as mgr:
                await mgr.pinned
                transfer = mgr.store([0], [0])
                await raise_repeatedly(lambda: transfer, TransferError)

    async def test_pinned_after_close(self) -> None:
        fake = FakeBackend(stall_pin_at=STALL_AT)
        mgr = make(fake)
        with anyio.fail_after(TIMEOUT_S):
            async with mgr, anyio.create_task_group() as tg:
                with releasing(fake):
                    await wait_thread_event(fake.stalled)
                    tg.start_soon(mgr.aclose)
                    await anyio.wait_all_tasks_blocked()
        await raise_repeatedly(lambda: mgr.pinned, anyio.ClosedResourceError)


# -- pacing and thread counts -----------------------------------------------------------


class TestPacing:
    async def test_close_does_not_wait_out_the_pin_interval(self) -> None:
        fake = FakeBackend(stall_pin_at=0)
        with anyio.fail_after(TIMEOUT_S):
            async with make(fake, pin_interval_s=3600) as mgr:
                address = mgr.host_view().data_ptr()
                with releasing(fake):
                    await wait_thread_event(fake.stalled)
                    transfer = mgr.store([0], [0])  # waits for chunk 0's pin
                # The store went once the pin worker reported chunk 0, and in the same
                # step the worker began its hour-long pause before chunk 1.
                await transfer
                assert mgr.stats().chunks_pinned == 1
            # Reached at all (under fail_after): the close ended the pause.
        assert fake.pinned_spans() == [(address, BLOCK)]
        assert_closed_cleanly(mgr, fake, address)

    @pytest.mark.parametrize("knob", ["prefault_threads", "pin_threads"])
    @pytest.mark.parametrize("value", [MAX_THREADS + 1, 5000])
    def test_thread_counts_are_bounded(self, knob: str, value: int) -> None:
        too_many: dict[str, Any] = {knob: value}
        with pytest.raises(ConfigError, match=f"{knob} must be an int >= 1 and <= {MAX_THREADS}"):
            OffloadManager(1 << 20, backend=FakeBackend(), **too_many)
        most: dict[str, Any] = {knob: MAX_THREADS}
        OffloadManager(1 << 20, backend=FakeBackend(), **most)


# -- background tasks -------------------------------------------------------------------


class TestOwnedTasks:
    async def test_a_raising_task_is_logged_and_close_cancels_the_rest(self) -> None:
        baseline = live_tasks()
        import structlog

        tasks = OwnedTasks(structlog.get_logger("test"))
        tasks.bind()
        started, cancelled = anyio.Event(), anyio.Event()

        async def boom() -> None:
            raise ValueError("boom")

        async def forever() -> None:
            try:
                started.set()
                await anyio.sleep_forever()
            finally:
                cancelled.set()

        with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
            tasks.start_soon(boom)
            tasks.start_soon(forever)
            await started.wait()
            await anyio.wait_all_tasks_blocked()
            await tasks.aclose()
        assert cancelled.is_set()
        assert [entry["error"] for entry in logs if entry["event"] == "task.failed"] == [
            "ValueError('boom')"
        ]
        with pytest.raises(RuntimeError, match="closed"):
            tasks.start_soon(forever)
        await assert_loop_healthy(baseline)


# -- fork -------------------------------------------------------------------------------


def child_checks(mgr: OffloadManager, fake: FakeBackend, address: int) -> list[str]:
    """Run in the forked child, synchronously (it never returns to the loop)."""
    failures: list[str] = []
    if mgr.state is not ManagerState.CLOSED:
        failures.append(f"state {mgr.state}")
    if mgr.is_pinned():
        failures.append("is_pinned() True")
    stats = mgr.stats()
    if stats.state != "closed" or stats.pinned_bytes:
        failures.append(f"stats {stats.state} {stats.pinned_bytes}")
    uses: dict[str, Callable[[], object]] = {
        "host_view": mgr.host_view,
        "host_blocks": mgr.host_blocks,
        "store": lambda: mgr.store([0], [0]),
        "load": lambda: mgr.load([0], [0]),
        "pinning_paused": mgr.pinning_paused,
        "pinned": lambda: mgr.pinned,
    }
    for name, use in uses.items():
        try:
            use()
        except ForkedManagerError as exc:
            if str(os.getppid()) not in str(exc) or "forked" not in str(exc):
                failures.append(f"{name}: unclear message {exc}")
        except BaseException as exc:
            failures.append(f"{name} raised {exc!r}")
        else:
            failures.append(f"{name} did not raise")
    # Not inherited (MADV_DONTFORK): the child's own placeholder of zeros covers the range.
    nbytes = mgr.nbytes
    if ctypes.string_at(address, nbytes) != bytes(nbytes):
        failures.append("the child sees the parent's bytes, not its own placeholder")
    ctypes.memset(address, 0x5A, nbytes)  # the child's memory: the parent never sees it
    calls = len(fake.calls)
    close = mgr.aclose()
    try:
        close.send(None)
    except StopIteration:
        pass
    except BaseException as exc:
        failures.append(f"aclose raised {exc!r}")
    else:
        failures.append("aclose() waited on the parent's loop")
        try:
            close.close()
        except BaseException as exc:  # pragma: no cover - only on failure
            failures.append(f"closing aclose() raised {exc!r}")
    gc.collect()
    if len(fake.calls) != calls:
        failures.append(f"backend calls in the child: {fake.calls[calls:]}")
    if not is_mapped(address, nbytes) or ctypes.string_at(address, 1) != b"\x5a":
        failures.append("the child's own mapping at the region's address was unmapped")
    return failures


class TestFork:
    async def test_a_forked_child_refuses_the_parents_manager(self) -> None:
        fake = FakeBackend()
        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                await mgr.pinned
                read_end, write_end = os.pipe()
                pid = os.fork()
                if pid == 0:  # pragma: no cover - runs in the child
                    code = 3
                    try:
                        os.close(read_end)
                        report = json.dumps(child_checks(mgr, fake, address)).encode()
                        os.write(write_end, report)
                        code = 0
                    except BaseException as exc:
                        os.write(write_end, json.dumps([f"child crashed: {exc!r}"]).encode())
                    finally:
                        os._exit(code)
                os.close(write_end)
                with os.fdopen(read_end, "rb") as pipe:
                    report = await anyio.to_thread.run_sync(pipe.read)
                assert wait_child(pid) == 0
                assert json.loads(report) == []
                # The parent's manager is untouched.
                assert mgr.state is ManagerState.OPEN and mgr.is_pinned()
                assert fake.unpinned_spans() == []
                await mgr.store([0], [0])
        assert_closed_cleanly(mgr, fake, address)


@pytest.fixture
def held_prepare(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """The host engine's ``prepare`` held mid-entry: (``entered``, set once it runs;
    ``go_on``, which lets it return; set at the test's end at the latest)."""
    entered, go_on = threading.Event(), threading.Event()

    def prepare(self: HostTransferEngine) -> None:
        entered.set()
        assert go_on.wait(TIMEOUT_S)

    monkeypatch.setattr(HostTransferEngine, "prepare", prepare)
    yield entered, go_on
    go_on.set()


class HeldPreflight(FakeBackend):
    """A FakeBackend whose pre-flight (the first step of mapping the region) records the
    thread it runs in and is held until ``go_on`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.reached, self.go_on = threading.Event(), threading.Event()
        self.thread: int | None = None

    def preflight(self, nbytes: int) -> None:
        self.thread = threading.get_ident()
        self.reached.set()
        assert self.go_on.wait(TIMEOUT_S), "the pre-flight was never let go on"


def assert_unmapped(made_regions: MadeRegions) -> None:
    [region] = made_regions.made
    [(address, nbytes)] = made_regions.spans
    assert region.closed and not is_mapped(address, nbytes)


@contextlib.asynccontextmanager
async def held_in_preflight(
    backend: HeldPreflight, enter: Callable[[], Coroutine[Any, Any, Any]]
) -> AsyncIterator[anyio.abc.TaskGroup]:
    """``enter()`` started in a task group and held in its pre-flight while the block
    runs (given the group); let go on however the block ends."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(enter)
        try:
            await wait_thread_event(backend.reached)
            yield tg
        finally:
            backend.go_on.set()


class TestEntryOffTheLoop:
    """The region is mapped (pre-flight, mmap, madvise) in a worker thread: with many GiB
    and busy CUDA threads that held the loop 10-13 ms (issue 17). A cancelled entry
    leaves nothing mapped, however it is cancelled."""

    async def test_the_loop_runs_while_the_region_is_mapped(
        self, made_regions: MadeRegions
    ) -> None:
        backend = HeldPreflight()
        mgr = make(backend)
        with anyio.fail_after(TIMEOUT_S):
            async with held_in_preflight(backend, mgr.__aenter__):
                # The loop serves this task while the entry's pre-flight is held.
                assert mgr.state is ManagerState.NEW and made_regions.made == []
                with pytest.raises(anyio.ClosedResourceError, match="entry is under way"):
                    mgr.host_view()
            assert backend.thread not in (None, threading.get_ident())
            await mgr.pinned
            await mgr.aclose()
        assert_unmapped(made_regions)

    async def test_a_cancelled_entry_waits_for_the_mapping_then_releases_it(
        self, made_regions: MadeRegions
    ) -> None:
        backend = HeldPreflight()
        mgr = make(backend)
        entered: list[bool] = []
        scope = anyio.CancelScope()

        async def enter() -> None:
            with scope:
                await mgr.__aenter__()
                entered.append(True)

        with anyio.fail_after(TIMEOUT_S):
            async with held_in_preflight(backend, enter):
                scope.cancel()
        assert entered == [] and scope.cancelled_caught
        assert mgr.state is ManagerState.CLOSED
        assert backend.calls == []  # nothing pinned
        assert_unmapped(made_regions)
        with pytest.raises(anyio.ClosedResourceError):
            await mgr.pinned

    @pytest.mark.parametrize("cancels", [1, 2])
    def test_a_natively_cancelled_entry_returns_with_the_region_released(
        self, made_regions: MadeRegions, cancels: int
    ) -> None:
        """asyncio only: ``Task.cancel()`` ends the wait for the mapping thread; the
        entry still raises only once that thread is over and its region released (so
        that a restart can take the same shared name at once), through a second cancel
        too."""

        async def run() -> None:
            backend = HeldPreflight()
            mgr = make(backend)
            entry = asyncio.create_task(mgr.__aenter__())
            try:
                await wait_thread_event(backend.reached)
                for _ in range(cancels):
                    entry.cancel()
                    for _ in range(3):  # let the entry take it (either order is checked)
                        await asyncio.sleep(0)
                assert not entry.done()  # it waits for the thread
            finally:
                backend.go_on.set()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(entry, TIMEOUT_S)
            assert mgr.state is ManagerState.CLOSED
            assert_unmapped(made_regions)
            assert backend.calls == []

        asyncio.run(run())

    def test_a_native_cancel_as_the_mapping_ends_releases_the_region(
        self, made_regions: MadeRegions, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """asyncio only: the cancel is queued on the loop from the mapping thread as it
        returns the region, ahead of the thread's result (the region is then released by
        the entry, or by the thread if it had not handed it over yet)."""

        async def run() -> None:
            loop = asyncio.get_running_loop()
            mgr = make(FakeBackend())
            entry: asyncio.Task[OffloadManager] | None = None
            create = HostRegion.create

            def create_then_cancel(*args: Any, **kwargs: Any) -> HostRegion:
                region = create(*args, **kwargs)
                assert entry is not None
                loop.call_soon_threadsafe(entry.cancel)
                return region

            monkeypatch.setattr(HostRegion, "create", create_then_cancel)
            entry = asyncio.create_task(mgr.__aenter__())
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(entry, TIMEOUT_S)
            assert mgr.state is ManagerState.CLOSED
            assert_unmapped(made_regions)

        asyncio.run(run())

    async def test_a_close_during_the_mapping_ends_the_entry(
        self, made_regions: MadeRegions
    ) -> None:
        """A close from another task of the loop while the region is mapped (a review:
        it was refused as from another event loop, and the entry then opened)."""
        backend = HeldPreflight()
        mgr = make(backend)
        failure: list[BaseException] = []
        closed = anyio.Event()

        async def enter() -> None:
            try:
                await mgr.__aenter__()
            except anyio.ClosedResourceError as exc:
                failure.append(exc)

        async def close() -> None:
            await mgr.aclose()
            closed.set()

        with anyio.fail_after(TIMEOUT_S):
            async with held_in_preflight(backend, enter) as tg:
                tg.start_soon(close)
                await anyio.wait_all_tasks_blocked()
                assert not closed.is_set()  # it waits for the entry to let go
        assert closed.is_set() and len(failure) == 1
        assert "closed while it was entered" in str(failure[0])
        assert mgr.state is ManagerState.CLOSED and backend.calls == []
        assert_unmapped(made_regions)

    def test_a_native_cancel_while_a_closed_entry_lets_go_still_releases(
        self, made_regions: MadeRegions, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """asyncio only: closed during the mapping, the entry lets go of what it made in
        a worker thread; a ``Task.cancel()`` meanwhile ended that wait, or skipped the
        job, and the region stayed mapped for good (a hostile trial)."""
        reached, go_on = threading.Event(), threading.Event()
        abandon = Opened._abandon

        def held_abandon(self: Opened) -> None:
            reached.set()
            assert go_on.wait(TIMEOUT_S)
            abandon(self)

        monkeypatch.setattr(Opened, "_abandon", held_abandon)

        async def run() -> None:
            backend = HeldPreflight()
            mgr = make(backend)
            entry = asyncio.create_task(mgr.__aenter__())
            closer: asyncio.Task[None] | None = None
            try:
                await wait_thread_event(backend.reached)
                closer = asyncio.create_task(mgr.aclose())
                while mgr.state is not ManagerState.CLOSED:  # noqa: ASYNC110 - a state, no event
                    await asyncio.sleep(0)
                backend.go_on.set()
                await wait_thread_event(reached)
                entry.cancel()
                for _ in range(3):  # let the entry take it
                    await asyncio.sleep(0)
                assert not entry.done()  # it waits for the release
            finally:
                backend.go_on.set()
                go_on.set()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(entry, TIMEOUT_S)
            assert_unmapped(made_regions)
            assert closer is not None
            await asyncio.wait_for(closer, TIMEOUT_S)
            assert mgr.state is ManagerState.CLOSED

        asyncio.run(run())

    async def test_a_second_entry_during_the_mapping_is_refused(
        self, made_regions: MadeRegions
    ) -> None:
        """(A review: it mapped a second region, then failed as closed.)"""
        backend = HeldPreflight()
        mgr = make(backend)
        with anyio.fail_after(TIMEOUT_S):
            async with held_in_preflight(backend, mgr.__aenter__):
                with pytest.raises(RuntimeError, match="entered only once"):
                    await mgr.__aenter__()
            assert mgr.state is ManagerState.OPEN
            await mgr.aclose()
        assert_unmapped(made_regions)  # the one region made


class TestCloseRacesEntryAndCancellation:
    """A close during entry keeps the manager closed; a closer cancelled while it waits
    stops waiting, never the close; a waiter's `raise ... from` leaves the error intact."""

    async def test_close_while_the_engine_prepares(
        self, held_prepare: tuple[threading.Event, threading.Event], shm_name: str
    ) -> None:
        """The close returns once the entry has let go of all it opened (a hostile
        trial: aclose() returned at once, and the shared file, the mapping and the
        engine's thread outlived it: reopening the name then was refused)."""
        entered, go_on = held_prepare
        fake = FakeBackend()
        mgr = make(fake, backing="shared", name=shm_name)
        failure: list[BaseException] = []
        after_close: list[bool] = []

        async def enter() -> None:
            try:
                await mgr.__aenter__()
            except anyio.ClosedResourceError as exc:
                failure.append(exc)

        async def close() -> None:
            await mgr.aclose()
            after_close.append((SHM_DIR / shm_name).exists())

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(enter)
                try:
                    await wait_thread_event(entered)
                    assert (SHM_DIR / shm_name).exists()
                    tg.start_soon(close)
                    tg.start_soon(close)  # a second closer waits for the same close
                    await anyio.wait_all_tasks_blocked()
                    assert mgr.state is ManagerState.CLOSED and after_close == []
                finally:
                    go_on.set()
        assert after_close == [False, False]
        assert len(failure) == 1 and "closed while it was entered" in str(failure[0])
        assert mgr.state is ManagerState.CLOSED and not mgr.is_pinned()
        assert fake.calls == []  # nothing pinned
        with pytest.raises(anyio.ClosedResourceError):
            mgr.store([0], [0])

    async def test_a_close_inside_a_hold_during_entry_is_refused(
        self, held_prepare: tuple[threading.Event, threading.Event]
    ) -> None:
        """A close from NEW waits for the entry, whose set-up may wait for the hold: from
        inside ``pinning_paused()`` it is refused, changing nothing, as from OPEN."""
        entered, go_on = held_prepare
        mgr = make(FakeBackend())
        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(mgr.__aenter__)
                try:
                    await wait_thread_event(entered)
                    async with mgr.pinning_paused():
                        with pytest.raises(LifecycleError, match="inside pinning_paused"):
                            await mgr.aclose()
                    assert mgr.state is ManagerState.NEW
                finally:
                    go_on.set()
            assert mgr.state is ManagerState.OPEN
            await mgr.aclose()

    def test_a_natively_cancelled_closer_during_entry_loses_no_close(
        self, held_prepare: tuple[threading.Event, threading.Event]
    ) -> None:
        """asyncio only: a closer from NEW waiting for the entry, cancelled with asyncio's
        own ``Task.cancel()`` (a review: the close was then never marked over, and every
        later aclose() waited for ever)."""
        entered, go_on = held_prepare

        async def run() -> None:
            mgr = make(FakeBackend())
            entry = asyncio.create_task(mgr.__aenter__())
            try:
                await wait_thread_event(entered)
                closer = asyncio.create_task(mgr.aclose())
                while mgr.state is not ManagerState.CLOSED:  # noqa: ASYNC110 - a state, no event
                    await asyncio.sleep(0)
                closer.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await closer
            finally:
                go_on.set()
            with pytest.raises(anyio.ClosedResourceError, match="closed while it was entered"):
                await asyncio.wait_for(entry, TIMEOUT_S)
            await asyncio.wait_for(mgr.aclose(), TIMEOUT_S)

        asyncio.run(run())

    async def test_a_close_from_another_loop_during_entry_is_refused(
        self, held_prepare: tuple[threading.Event, threading.Event]
    ) -> None:
        """As from OPEN (a review: from NEW during an entry it waited on the entering
        loop's event from a foreign loop)."""
        entered, go_on = held_prepare
        mgr = make(FakeBackend())
        refused: list[BaseException] = []

        def close_elsewhere() -> None:
            try:
                asyncio.run(mgr.aclose())
            except LifecycleError as exc:
                refused.append(exc)

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(mgr.__aenter__)
                try:
                    await wait_thread_event(entered)
                    await anyio.to_thread.run_sync(close_elsewhere)
                finally:
                    go_on.set()
            assert len(refused) == 1 and "another event loop" in str(refused[0])
            assert mgr.state is ManagerState.OPEN
            await mgr.aclose()

    def test_a_natively_cancelled_closer_leaves_the_close_running(self) -> None:
        """asyncio only: the closer is cancelled with asyncio's own ``Task.cancel()``."""
        asyncio.run(self._natively_cancelled_closer())

    async def _natively_cancelled_closer(self) -> None:
        fake = FakeBackend(stall_pin_at=1)
        mgr = make(fake)
        await mgr.__aenter__()
        address = mgr.host_blocks().data_ptr()
        try:
            assert await anyio.to_thread.run_sync(fake.stalled.wait, TIMEOUT_S)
            closer = asyncio.create_task(mgr.aclose())
            while mgr.state is not ManagerState.CLOSING:  # noqa: ASYNC110 - a state, no event
                await asyncio.sleep(0)
            closer.cancel()  # asyncio's own cancel, as asyncio.wait_for or Ctrl-C deliver it
            with pytest.raises(asyncio.CancelledError):
                await closer
            still = mgr.state  # the close goes on
            assert still is ManagerState.CLOSING
        finally:
            fake.release()
        await asyncio.wait_for(mgr.aclose(), TIMEOUT_S)
        assert mgr.stats().state == "closed"
        assert sorted(fake.unpinned_spans()) == sorted(fake.pinned_spans()) != []
        assert not is_mapped(address, mgr.nbytes)

    async def test_a_waiters_raise_from_leaves_the_cause(self) -> None:
        with anyio.fail_after(TIMEOUT_S):
            async with make(FakeBackend(fail_pin_at=0)) as mgr:
                with pytest.raises(PinError) as first:
                    await mgr.pinned
                cause = first.value.__cause__
                assert cause is not None
                with pytest.raises(RuntimeError):
                    try:
                        await mgr.pinned
                    except PinError as exc:
                        raise RuntimeError("seen") from exc.with_traceback(None)
                first.value.__cause__ = None  # as `raise err from None` leaves it
                first.value.__suppress_context__ = True
                with pytest.raises(PinError) as again:
                    await mgr.pinned
                assert again.value.__cause__ is cause
