"""Lifecycle and fault tests for OffloadManager.

Every scenario checks the close contract on the recorded backend calls: each pin call
precedes each unpin call, exactly the spans that were pinned are unpinned (once each, on
memory that is still mapped), the region is unmapped afterwards and the state is CLOSED.

Synchronisation is on events only: ``FakeBackend.stalled`` (a pin call is held),
``anyio.wait_all_tasks_blocked()`` (every task is parked) and :class:`ProbeCondition`,
which reports that a thread has started waiting inside the pause gate. Every test runs
under ``anyio.fail_after``, and every stall is released in a ``finally`` so that a broken
assertion fails the test instead of hanging its shielded close. Every test runs on asyncio
and on trio.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections import Counter
from collections.abc import Iterable, MutableMapping, Sequence
from typing import Any

import anyio
import anyio.to_thread
import pytest
import sniffio
from structlog.testing import capture_logs

import asyncpin.gate
from asyncpin import (
    BackendCallError,
    HostBackend,
    ManagerState,
    OffloadManager,
    PinBackend,
    PinError,
    _sys,
)
from asyncpin.chunks import ChunkState, ChunkTable
from asyncpin.testing import FakeBackend, is_mapped
from tests.helpers import TIMEOUT_S, releasing, wait_thread_event

pytestmark = pytest.mark.anyio

CHUNK = 64 << 10
NCHUNKS = 16
NBYTES = CHUNK * NCHUNKS


# -- helpers ----------------------------------------------------------------------------


def make(backend: str | PinBackend) -> OffloadManager:
    """A small manager whose pipeline pins chunks one at a time, in index order."""
    return OffloadManager(
        NBYTES, backend=backend, chunk_bytes=CHUNK, prefault_threads=1, pin_threads=1
    )


def span(address: int, index: int) -> tuple[int, int]:
    return address + index * CHUNK, CHUNK


def assert_closed_cleanly(
    mgr: OffloadManager,
    fake: FakeBackend,
    address: int,
    pinned_chunks: Iterable[int] | None,
) -> None:
    """The close contract, read off the recorded backend calls and the process's maps.

    ``pinned_chunks`` is the exact list of chunks expected to be pinned (in order), or
    None where the scenario leaves the count open (the invariants still hold).
    """
    if pinned_chunks is not None:
        assert fake.pinned_spans() == [span(address, i) for i in pinned_chunks]
    ops = [call.op for call in fake.calls]
    first_unpin = ops.index("unpin") if "unpin" in ops else len(ops)
    assert "pin" not in ops[first_unpin:], f"a pin call came after an unpin call: {ops}"
    unpinned = fake.unpinned_spans()
    assert Counter(unpinned) == Counter(fake.pinned_spans())
    assert len(set(unpinned)) == len(unpinned), "a span was unpinned twice"
    assert all(call.mapped for call in fake.calls), "a backend call ran on unmapped memory"
    # before_unpin: once, after the last pin and before the first unpin; only when
    # something was pinned.
    assert fake.before_unpin_at == ([first_unpin] if fake.pinned_spans() else [])
    assert not is_mapped(address, NBYTES), "the region is still mapped after close"
    assert mgr.state is ManagerState.CLOSED
    assert mgr.stats().chunks_pinned == 0


def events(logs: Sequence[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


class ProbeCondition(threading.Condition):
    """A Condition that reports which gate function (``hold`` or ``enter_call``) has
    started to wait on it: the deterministic proof that a thread is held at the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = {"hold": threading.Event(), "enter_call": threading.Event()}

    def wait(self, timeout: float | None = None) -> bool:
        caller = sys._getframe(1).f_code.co_name
        caller = {"_enter": "enter_call"}.get(caller, caller)  # enter_call's wait
        if caller in self.waiting:
            self.waiting[caller].set()
        return super().wait(timeout)


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> ProbeCondition:
    """Swap the pause gates' shared condition variable for a probe."""
    condition = ProbeCondition()
    monkeypatch.setattr(asyncpin.gate, "_cond", condition)
    return condition


class HolderThread(threading.Thread):
    """Holds ``mgr.pinning_paused()`` from plain sync code until :meth:`let_go`."""

    def __init__(self, mgr: OffloadManager) -> None:
        super().__init__(daemon=True)
        self._mgr = mgr
        self.holding = threading.Event()
        self._let_go = threading.Event()
        self.pins_at_entry: int | None = None
        self.fake: FakeBackend | None = None

    def run(self) -> None:
        with self._mgr.pinning_paused():
            if self.fake is not None:
                self.pins_at_entry = len(self.fake.pinned_spans())
            self.holding.set()
            self._let_go.wait(TIMEOUT_S)

    def let_go(self) -> None:
        self._let_go.set()

    async def finish(self) -> None:
        self.let_go()
        await anyio.to_thread.run_sync(self.join, TIMEOUT_S)
        assert not self.is_alive()


class Boom(Exception):
    """Raised in a manager's body by the tests."""


# -- close order ------------------------------------------------------------------------


class TestEventLoops:
    """Each test runs on the event loop that ``anyio_backend`` names, and on no other."""

    async def test_runs_on_the_loop_it_is_given(self, anyio_backend: str) -> None:
        assert sniffio.current_async_library() == anyio_backend


class TestCloseOrder:
    """aclose from any point of the pipeline unpins exactly what was pinned, then unmaps."""

    async def test_close_before_pinning_starts(self) -> None:
        fake = FakeBackend()
        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                await mgr.aclose()
                assert mgr.state is ManagerState.CLOSED
        assert fake.calls == []
        assert_closed_cleanly(mgr, fake, address, [])
        with pytest.raises(anyio.ClosedResourceError):
            await mgr.pinned

    @pytest.mark.parametrize("stall_at", [0, 5, NCHUNKS - 1])
    async def test_close_waits_for_a_stalled_pin(self, stall_at: int) -> None:
        fake = FakeBackend(stall_pin_at=stall_at)
        closed = anyio.Event()

        async def close(mgr: OffloadManager) -> None:
            await mgr.aclose()
            closed.set()

        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                async with anyio.create_task_group() as tg:
                    with releasing(fake):
                        await wait_thread_event(fake.stalled)
                        tg.start_soon(close, mgr)
                        await anyio.wait_all_tasks_blocked()
                        # Close has stopped the pipeline and is waiting for the pin call.
                        assert not closed.is_set()
                        assert mgr.state is ManagerState.CLOSING
                        assert is_mapped(*span(address, stall_at))
                        assert fake.unpinned_spans() == []
                        with pytest.raises(anyio.ClosedResourceError):
                            mgr.host_view()
                assert closed.is_set()
        # The stalled pin succeeded once released, so it is unpinned too, while mapped.
        assert_closed_cleanly(mgr, fake, address, range(stall_at + 1))

    async def test_close_during_a_prefault_waits_for_one_piece(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A chunk is faulted in a piece at a time, and a close stops the pipeline between
        # two pieces: it waits for one piece, not for a whole chunk (chunk_bytes has no
        # upper bound; a GiB of cold memory takes most of a second to fault).
        piece = asyncpin.region.PREFAULT_PIECE_BYTES
        entered, release = threading.Event(), threading.Event()
        pieces: list[int] = []
        real = _sys.libc_madvise

        def madvise(address: int, nbytes: int, advice: int) -> None:
            if advice == _sys.MADV_POPULATE_WRITE:
                pieces.append(nbytes)
                if len(pieces) == 1:
                    entered.set()
                    release.wait(TIMEOUT_S)
            real(address, nbytes, advice)

        marks: list[tuple[int, ChunkState]] = []
        real_mark = ChunkTable.mark

        def mark(table: ChunkTable, index: int, state: ChunkState) -> None:
            marks.append((index, state))
            real_mark(table, index, state)

        monkeypatch.setattr(_sys, "libc_madvise", madvise)
        monkeypatch.setattr(ChunkTable, "mark", mark)
        monkeypatch.setattr(asyncpin.region, "next_prefault_piece", lambda p, w, c, n: p)
        fake = FakeBackend()
        mgr = OffloadManager(8 * piece, backend=fake, chunk_bytes=8 * piece, prefault_threads=1)
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                address = mgr.host_view().data_ptr()
                async with anyio.create_task_group() as tg:
                    try:
                        await wait_thread_event(entered)
                        tg.start_soon(mgr.aclose)
                        await anyio.wait_all_tasks_blocked()
                        assert mgr.state is ManagerState.CLOSING
                    finally:
                        release.set()
        assert pieces == [piece]
        assert marks == []  # the chunk, faulted in part, never counted as prefaulted
        assert fake.calls == []
        assert not is_mapped(address, 8 * piece)
        assert mgr.state is ManagerState.CLOSED

    async def test_close_after_pinned(self) -> None:
        fake = FakeBackend()
        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                await mgr.pinned
                assert mgr.is_pinned()
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))
        # Unpins go in chunk order, once pinning is over.
        assert fake.unpinned_spans() == [span(address, i) for i in range(NCHUNKS)]

    async def test_a_failing_before_unpin_is_logged_and_every_chunk_unpinned(self) -> None:
        fake = FakeBackend(fail_before_unpin=True)
        with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                await mgr.pinned
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))
        (failed,) = events(logs, "unpin.wait_failed")
        assert "injected failure in before_unpin" in failed["error"]

    async def test_aclose_is_idempotent(self) -> None:
        fake = FakeBackend()
        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                await mgr.pinned
                await mgr.aclose()
                calls = list(fake.calls)
                await mgr.aclose()
            await mgr.aclose()
        assert fake.calls == calls
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))


class TestConcurrentClose:
    """Concurrent aclose calls do the work once; each returns only when it is done."""

    async def test_two_concurrent_acloses(self) -> None:
        fake = FakeBackend(stall_pin_at=3)
        returned: list[ManagerState] = []

        async def close(mgr: OffloadManager) -> None:
            await mgr.aclose()
            returned.append(mgr.state)

        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                async with anyio.create_task_group() as tg:
                    with releasing(fake):
                        await wait_thread_event(fake.stalled)
                        tg.start_soon(close, mgr)
                        tg.start_soon(close, mgr)
                        await anyio.wait_all_tasks_blocked()
                        assert returned == []
                        assert mgr.state is ManagerState.CLOSING
        assert returned == [ManagerState.CLOSED, ManagerState.CLOSED]
        assert_closed_cleanly(mgr, fake, address, range(4))

    async def test_close_finishes_when_its_caller_is_cancelled(self) -> None:
        fake = FakeBackend(stall_pin_at=2)
        scope = anyio.CancelScope()

        async def close(mgr: OffloadManager) -> None:
            with scope:
                await mgr.aclose()

        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                async with anyio.create_task_group() as tg:
                    with releasing(fake):
                        await wait_thread_event(fake.stalled)
                        tg.start_soon(close, mgr)
                        await anyio.wait_all_tasks_blocked()
                        scope.cancel()
                        await anyio.wait_all_tasks_blocked()
                        # Shielded: the cancelled caller is still inside the close.
                        assert mgr.state is ManagerState.CLOSING
                        assert fake.unpinned_spans() == []
                # The caller's task ended only after the close completed.
                assert mgr.state is ManagerState.CLOSED
        assert_closed_cleanly(mgr, fake, address, range(3))


# -- cancellation -----------------------------------------------------------------------


class TestCancellation:
    """Cancelling a waiter or the owning task never skips, reorders or breaks the close."""

    async def test_cancelled_pinned_waiter_leaves_manager_usable(self) -> None:
        fake = FakeBackend(stall_pin_at=4)
        waiter_scope = anyio.CancelScope()

        async def waiter(mgr: OffloadManager) -> None:
            with waiter_scope:
                await mgr.pinned

        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                with releasing(fake):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(waiter, mgr)
                        await wait_thread_event(fake.stalled)
                        await anyio.wait_all_tasks_blocked()
                        waiter_scope.cancel()
                    assert waiter_scope.cancelled_caught
                    assert mgr.state is ManagerState.OPEN
                    assert not mgr.is_pinned()
                    assert mgr.host_view(0, CHUNK).numel() == CHUNK
                # Pinning carries on past the stall once released.
                await mgr.pinned
                assert mgr.is_pinned()
                assert mgr.stats().pinned_bytes == NBYTES
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))

    async def test_failed_entry_settles_pinned_and_closes(self) -> None:
        """An entry that fails (here: no shared region of that name to attach to) wakes
        whoever awaits ``pinned`` with its error, and leaves the manager closed: a
        readiness probe waiting on ``pinned`` must not wait without end."""
        mgr = OffloadManager.attached(f"asyncpin-test-missing-{id(self)}", backend=FakeBackend())
        seen: list[BaseException] = []

        async def waiter() -> None:
            try:
                await mgr.pinned
            except Exception as exc:
                seen.append(exc)

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                with pytest.raises(Exception) as entry:
                    await mgr.__aenter__()
        assert [type(e) for e in seen] == [type(entry.value)]
        assert seen[0] is entry.value
        assert mgr.state is ManagerState.CLOSED
        with pytest.raises(RuntimeError, match="only once"):
            await mgr.__aenter__()

    async def test_cancel_owner_while_a_pin_is_stalled(self) -> None:
        fake = FakeBackend(stall_pin_at=6)
        owner_scope = anyio.CancelScope()
        opened = anyio.Event()
        owner_done = anyio.Event()
        box: list[OffloadManager] = []

        async def owner() -> None:
            with owner_scope:
                async with make(fake) as mgr:
                    box.append(mgr)
                    opened.set()
                    await anyio.sleep_forever()
            owner_done.set()

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                with releasing(fake):
                    tg.start_soon(owner)
                    await opened.wait()
                    mgr = box[0]
                    address = mgr.host_view().data_ptr()
                    await wait_thread_event(fake.stalled)
                    owner_scope.cancel()
                    await anyio.wait_all_tasks_blocked()
                    # __aexit__ is closing, shielded, and waits for the stalled pin.
                    assert not owner_done.is_set()
                    assert mgr.state is ManagerState.CLOSING
                    assert is_mapped(*span(address, 6))
                    assert fake.unpinned_spans() == []
        assert owner_scope.cancelled_caught
        assert owner_done.is_set()
        assert_closed_cleanly(mgr, fake, address, range(7))
        with pytest.raises(anyio.ClosedResourceError):
            await mgr.pinned

    @pytest.mark.parametrize("checkpoints", [0, 1, 10])
    async def test_cancel_owner_while_pinning(self, checkpoints: int) -> None:
        # How far pinning got is left open; the close invariants must hold regardless.
        fake = FakeBackend()
        with anyio.fail_after(TIMEOUT_S), anyio.CancelScope() as scope:
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                for _ in range(checkpoints):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert_closed_cleanly(mgr, fake, address, None)

    async def test_cancel_owner_after_pinned(self) -> None:
        fake = FakeBackend()
        with anyio.fail_after(TIMEOUT_S), anyio.CancelScope() as scope:
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                await mgr.pinned
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))


class TestBodyException:
    """An exception in the body propagates unchanged, and the close still runs in order."""

    async def test_exception_before_pinning_starts(self) -> None:
        fake = FakeBackend()
        boom = Boom("raised in the body")
        with anyio.fail_after(TIMEOUT_S), pytest.raises(Boom) as info:
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                raise boom
        assert info.value is boom
        assert fake.calls == []
        assert_closed_cleanly(mgr, fake, address, [])

    async def test_exception_after_pinned(self) -> None:
        fake = FakeBackend()
        boom = Boom("raised in the body")
        with anyio.fail_after(TIMEOUT_S), pytest.raises(Boom) as info:
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                await mgr.pinned
                raise boom
        assert info.value is boom
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))

    async def test_exception_while_a_pin_is_stalled(self) -> None:
        fake = FakeBackend(stall_pin_at=2)
        boom = Boom("raised in the body")
        raising = anyio.Event()
        raised: list[BaseException] = []
        box: list[tuple[OffloadManager, int]] = []

        async def owner() -> None:
            try:
                async with make(fake) as mgr:
                    box.append((mgr, mgr.host_view().data_ptr()))
                    await wait_thread_event(fake.stalled)
                    raising.set()
                    raise boom
            except BaseException as exc:
                raised.append(exc)

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                with releasing(fake):
                    tg.start_soon(owner)
                    await raising.wait()
                    await anyio.wait_all_tasks_blocked()
                    mgr, address = box[0]
                    # The body has raised; __aexit__ is closing and waits for the stall.
                    assert raised == []
                    assert mgr.state is ManagerState.CLOSING
                    assert is_mapped(*span(address, 2))
                    assert fake.unpinned_spans() == []
        assert raised == [boom]
        assert_closed_cleanly(mgr, fake, address, range(3))


# -- faults -----------------------------------------------------------------------------


class TestPinFailure:
    """A failed pin is raised (not only logged) as a PinError; close unpins what came before."""

    @pytest.mark.parametrize("fail_at", [0, 5, NCHUNKS - 1])
    async def test_pinned_raises_pin_error(self, fail_at: int) -> None:
        fake = FakeBackend(fail_pin_at=fail_at)
        with capture_logs() as logs, anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                with pytest.raises(PinError) as info:
                    await mgr.pinned
                error = info.value
                assert error.chunk_index == fail_at
                assert error.offset == fail_at * CHUNK
                assert error.nbytes == CHUNK
                assert error.code == FakeBackend.FAKE_CODE == 9999
                assert error.code_name == "EFAKE"
                assert isinstance(error.__cause__, BackendCallError)
                assert error.__cause__.code == 9999
                assert mgr.pin_error is error
                stats = mgr.stats()
                assert stats.error == str(error)
                assert f"chunk {fail_at}" in stats.error and "EFAKE" in stats.error
                assert stats.chunks_pinned == fail_at
                assert not mgr.is_pinned()
                # Every later waiter gets the same error, not a hang.
                with pytest.raises(PinError) as again:
                    await mgr.pinned.wait()
                assert again.value is error
        # The failed call was the last pin call: the pipeline stopped at the failure.
        pins = [call for call in fake.calls if call.op == "pin"]
        assert len(pins) == fail_at + 1
        assert not pins[-1].ok and (pins[-1].address, pins[-1].nbytes) == span(address, fail_at)
        assert_closed_cleanly(mgr, fake, address, range(fail_at))
        # The error survives the close (it is not replaced by ClosedResourceError).
        assert mgr.pin_error is error
        with pytest.raises(PinError):
            await mgr.pinned
        (failed,) = events(logs, "pin.failed")
        assert failed["log_level"] == "error"
        assert failed["chunk"] == fail_at
        assert failed["offset"] == fail_at * CHUNK
        assert failed["code"] == 9999 and failed["code_name"] == "EFAKE"
        assert events(logs, "pin.complete") == []

    async def test_pin_error_propagates_out_of_the_body_unchanged(self) -> None:
        fake = FakeBackend(fail_pin_at=3)
        with anyio.fail_after(TIMEOUT_S), pytest.raises(PinError) as info:
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                await mgr.pinned
        assert info.value is mgr.pin_error
        assert info.value.chunk_index == 3
        assert_closed_cleanly(mgr, fake, address, range(3))


class TestUnpinFailure:
    """A failed unpin leaks that chunk mapped and logs it; the rest is unpinned and unmapped."""

    async def test_failed_unpin_leaks_that_chunk_only(self) -> None:
        leaked_index = 3
        fake = FakeBackend(fail_unpin_at=leaked_index)  # unpins go in chunk order
        with capture_logs() as logs, anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                address = mgr.host_view().data_ptr()
                await mgr.pinned
        leaked = span(address, leaked_index)
        try:
            assert mgr.state is ManagerState.CLOSED
            assert mgr.stats().chunks_leaked == 1
            assert is_mapped(*leaked), "a chunk whose unpin failed was unmapped"
            assert not is_mapped(address, leaked_index * CHUNK)
            after = (leaked_index + 1) * CHUNK
            assert not is_mapped(address + after, NBYTES - after)
            unpins = [call for call in fake.calls if call.op == "unpin"]
            assert [(c.address, c.nbytes) for c in unpins] == [
                span(address, i) for i in range(NCHUNKS)
            ]
            assert [c.ok for c in unpins] == [i != leaked_index for i in range(NCHUNKS)]
            assert all(c.mapped for c in fake.calls)
            ops = [call.op for call in fake.calls]
            assert ops == ["pin"] * NCHUNKS + ["unpin"] * NCHUNKS
            (failed,) = events(logs, "unpin.failed")
            assert failed["log_level"] == "error"
            assert failed["chunk"] == leaked_index
            assert failed["offset"] == leaked_index * CHUNK
            assert "EFAKE" in failed["error"]
            assert events(logs, "manager.closed")[0]["leaked_chunks"] == 1
            # A second close neither retries the unpin nor frees the leaked chunk.
            calls = list(fake.calls)
            await mgr.aclose()
            assert fake.calls == calls
            assert is_mapped(*leaked)
        finally:
            if mgr.stats().chunks_leaked == 1 and is_mapped(*leaked):
                _sys.libc_munmap(*leaked)


# -- pause gate -------------------------------------------------------------------------


class TestPinningPaused:
    """pinning_paused(), sync or async, waits for the pin in flight and holds new ones."""

    async def test_pause_held_from_a_thread_before_entry_holds_every_pin(
        self, probe: ProbeCondition
    ) -> None:
        fake = FakeBackend()
        mgr = make(fake)
        holder = HolderThread(mgr)
        holder.start()
        try:
            with anyio.fail_after(TIMEOUT_S):
                await wait_thread_event(holder.holding)
                async with mgr:
                    address = mgr.host_view().data_ptr()
                    # The pin worker has reached the gate and waits there, with the
                    # backend's warm-up (which goes through the gate too).
                    await wait_thread_event(probe.waiting["enter_call"])
                    assert fake.calls == [] and fake.warm_up_at == []
                    assert mgr.stats().chunks_pinned == 0
                    assert not mgr.is_pinned()
                    await holder.finish()
                    await mgr.pinned
                    assert mgr.stats().pinned_bytes == NBYTES
                    assert fake.warm_up_at == [0]
        finally:
            holder.let_go()
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))

    async def test_pause_from_a_thread_waits_for_the_pin_in_flight(
        self, probe: ProbeCondition
    ) -> None:
        stall_at = 2
        fake = FakeBackend(stall_pin_at=stall_at)
        mgr = make(fake)
        holder = HolderThread(mgr)
        holder.fake = fake
        try:
            with anyio.fail_after(TIMEOUT_S):
                async with mgr:
                    address = mgr.host_view().data_ptr()
                    with releasing(fake):
                        await wait_thread_event(fake.stalled)
                        holder.start()
                        # Entering the pause blocks on the stalled pin call.
                        await wait_thread_event(probe.waiting["hold"])
                        assert not holder.holding.is_set()
                    await wait_thread_event(holder.holding)
                    # It got the pause only after the stalled pin returned...
                    assert holder.pins_at_entry == stall_at + 1
                    # ...and while it holds it, the next pin waits at the gate.
                    await wait_thread_event(probe.waiting["enter_call"])
                    assert fake.pinned_spans() == [span(address, i) for i in range(stall_at + 1)]
                    assert not mgr.is_pinned()
                    await holder.finish()
                    await mgr.pinned
        finally:
            holder.let_go()
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))

    @pytest.mark.parametrize("how", ["anyio", "native"])
    async def test_a_pause_cancelled_while_it_waits_is_given_back(
        self, how: str, anyio_backend: str, probe: ProbeCondition
    ) -> None:
        # Cancelled while it waits for the pin call in flight, the pause is taken in the
        # end (in its thread) and must be given back: else pinning never resumes.
        if how == "native" and anyio_backend != "asyncio":
            pytest.skip("Task.cancel() is asyncio's")
        import asyncio

        fake = FakeBackend(stall_pin_at=1)
        mgr = make(fake)
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                address = mgr.host_view().data_ptr()
                with releasing(fake):
                    await wait_thread_event(fake.stalled)
                    if how == "anyio":
                        async with anyio.create_task_group() as tg:

                            async def pause() -> None:
                                async with mgr.pinning_paused():
                                    await anyio.sleep_forever()  # cancelled here, or before

                            tg.start_soon(pause)
                            await wait_thread_event(probe.waiting["hold"])
                            tg.cancel_scope.cancel()
                            fake.release()
                    else:

                        async def paused() -> None:
                            async with mgr.pinning_paused():
                                raise AssertionError("a native cancel comes in the entry")

                        task = asyncio.ensure_future(paused())
                        await wait_thread_event(probe.waiting["hold"])
                        task.cancel()
                        fake.release()
                        with pytest.raises(asyncio.CancelledError):
                            await task
                await mgr.pinned  # pinning resumed: the pause was given back
                assert not mgr._gate.is_paused()
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))

    async def test_async_pause_waits_for_the_pin_in_flight(self, probe: ProbeCondition) -> None:
        stall_at = 5
        fake = FakeBackend(stall_pin_at=stall_at)
        mgr = make(fake)
        entered = anyio.Event()
        leave = anyio.Event()
        pins_at_entry: list[int] = []

        async def pauser() -> None:
            async with mgr.pinning_paused():
                pins_at_entry.append(len(fake.pinned_spans()))
                entered.set()
                await leave.wait()

        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                address = mgr.host_view().data_ptr()
                async with anyio.create_task_group() as tg:
                    with releasing(fake):
                        await wait_thread_event(fake.stalled)
                        tg.start_soon(pauser)
                        await wait_thread_event(probe.waiting["hold"])
                        assert not entered.is_set()
                    await entered.wait()
                    assert pins_at_entry == [stall_at + 1]
                    await wait_thread_event(probe.waiting["enter_call"])
                    assert len(fake.pinned_spans()) == stall_at + 1
                    leave.set()
                await mgr.pinned
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))

    async def test_cancelled_async_pause_entry_does_not_hold_pins(
        self, probe: ProbeCondition
    ) -> None:
        fake = FakeBackend(stall_pin_at=2)
        mgr = make(fake)
        scope = anyio.CancelScope()

        async def pauser() -> None:
            with scope:
                async with mgr.pinning_paused():
                    await anyio.sleep_forever()

        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                address = mgr.host_view().data_ptr()
                async with anyio.create_task_group() as tg:
                    with releasing(fake):
                        await wait_thread_event(fake.stalled)
                        tg.start_soon(pauser)
                        await wait_thread_event(probe.waiting["hold"])
                        scope.cancel()
                gate = mgr._gate
                leaked_hold = gate.is_paused()
                if leaked_hold:  # undo it, so the failure below does not hang the close
                    gate.unhold()
                assert not leaked_hold, "a cancelled pinning_paused() entry left pins held"
                await mgr.pinned
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))

    async def test_close_unpins_wait_for_the_pause(self, probe: ProbeCondition) -> None:
        fake = FakeBackend()
        mgr = make(fake)
        holder = HolderThread(mgr)
        closed = anyio.Event()

        async def close() -> None:
            await mgr.aclose()
            closed.set()

        try:
            with anyio.fail_after(TIMEOUT_S):
                async with mgr:
                    address = mgr.host_view().data_ptr()
                    await mgr.pinned
                    holder.start()
                    await wait_thread_event(holder.holding)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(close)
                        await wait_thread_event(probe.waiting["enter_call"])
                        assert not closed.is_set()
                        assert mgr.state is ManagerState.CLOSING
                        assert fake.unpinned_spans() == []
                        assert is_mapped(address, NBYTES)
                        await holder.finish()
        finally:
            holder.let_go()
        assert_closed_cleanly(mgr, fake, address, range(NCHUNKS))


# -- use after close --------------------------------------------------------------------


class TestUseAfterClose:
    """After close every use raises ClosedResourceError; a manager is entered at most once."""

    async def test_is_pinned_is_false_after_close(self) -> None:
        with anyio.fail_after(TIMEOUT_S):
            async with make(FakeBackend()) as mgr:
                await mgr.pinned
                assert mgr.is_pinned()
        assert not mgr.is_pinned()

    async def test_host_view_after_close(self) -> None:
        async with make(FakeBackend()) as mgr:
            assert mgr.host_view().numel() == NBYTES
        with pytest.raises(anyio.ClosedResourceError):
            mgr.host_view()

    async def test_host_view_before_entry(self) -> None:
        with pytest.raises(anyio.ClosedResourceError):
            make(FakeBackend()).host_view()

    async def test_pinned_after_close_mid_pinning(self) -> None:
        fake = FakeBackend(stall_pin_at=4)
        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr, anyio.create_task_group() as tg:
                with releasing(fake):
                    await wait_thread_event(fake.stalled)
                    tg.start_soon(mgr.aclose)
                    await anyio.wait_all_tasks_blocked()
            with pytest.raises(anyio.ClosedResourceError):
                await mgr.pinned
        assert not mgr.is_pinned()
        assert mgr.pin_error is None
        assert mgr.stats().error is None

    async def test_waiter_during_close_gets_closed_resource_error(self) -> None:
        fake = FakeBackend(stall_pin_at=1)
        outcome: list[BaseException] = []

        async def waiter(mgr: OffloadManager) -> None:
            try:
                await mgr.pinned
            except anyio.ClosedResourceError as exc:
                outcome.append(exc)

        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr, anyio.create_task_group() as tg:
                with releasing(fake):
                    tg.start_soon(waiter, mgr)
                    await wait_thread_event(fake.stalled)
                    tg.start_soon(mgr.aclose)
                    await anyio.wait_all_tasks_blocked()
                    assert outcome == []
        assert len(outcome) == 1

    async def test_entering_twice_raises(self) -> None:
        fake = FakeBackend()
        mgr = make(fake)
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                with pytest.raises(RuntimeError, match="only once"):
                    async with mgr:
                        pass  # pragma: no cover
                assert mgr.state is ManagerState.OPEN
                await mgr.pinned
            with pytest.raises(RuntimeError, match="only once"):
                await mgr.__aenter__()
        assert mgr.stats().state == "closed"  # (mypy keeps mgr.state narrowed to OPEN)

    async def test_aclose_never_entered(self) -> None:
        fake = FakeBackend()
        mgr = make(fake)
        with anyio.fail_after(TIMEOUT_S):
            await mgr.aclose()
            await mgr.aclose()
            assert mgr.state is ManagerState.CLOSED
            with pytest.raises(anyio.ClosedResourceError):
                await mgr.pinned
            with pytest.raises(RuntimeError):
                await mgr.__aenter__()
        assert fake.calls == []
        assert mgr.stats().state == "closed"


# -- observability ----------------------------------------------------------------------


class TestObservability:
    """stats(), repr() and structlog events report the lifecycle as it happens."""

    async def test_stats_is_a_frozen_snapshot_that_progresses(self) -> None:
        stall_at = 4
        fake = FakeBackend(stall_pin_at=stall_at)
        with anyio.fail_after(TIMEOUT_S):
            async with make(fake) as mgr:
                with releasing(fake):
                    await wait_thread_event(fake.stalled)
                    during = mgr.stats()
                with pytest.raises(dataclasses.FrozenInstanceError):
                    during.pinned_bytes = 0  # type: ignore[misc]
                assert during.state == "open"
                assert during.backend == "fake"
                assert (during.nbytes, during.chunk_bytes, during.chunks_total) == (
                    NBYTES,
                    CHUNK,
                    NCHUNKS,
                )
                assert during.chunks_pinned == stall_at
                assert during.pinned_bytes == stall_at * CHUNK
                assert during.pinned_fraction == stall_at / NCHUNKS
                assert during.seconds_to_pinned is None and during.error is None
                assert during.seconds_to_enter is not None
                await mgr.pinned
                done = mgr.stats()
                assert during.pinned_bytes == stall_at * CHUNK  # the old snapshot is unchanged
                assert done.pinned_bytes == NBYTES
                assert done.chunks_pinned == NCHUNKS
                assert done.pinned_fraction == 1.0
                assert done.seconds_to_pinned is not None
                assert done.close_seconds is None
        closed = mgr.stats()
        assert closed.state == "closed"
        assert closed.pinned_bytes == 0
        assert closed.close_seconds is not None
        assert closed.chunks_leaked == 0

    async def test_repr_shows_state_and_pinned_bytes(self) -> None:
        with anyio.fail_after(TIMEOUT_S):
            async with make(FakeBackend()) as mgr:
                await mgr.pinned
                text = repr(mgr)
                assert " open " in text
                assert f"pinned={NBYTES}/{NBYTES}" in text
                assert f"chunks={NCHUNKS}/{NCHUNKS}" in text
        text = repr(mgr)
        assert " closed " in text
        assert f"pinned=0/{NBYTES}" in text

    async def test_events_in_order_with_manager_bound(self) -> None:
        with capture_logs() as logs, anyio.fail_after(TIMEOUT_S):
            async with make(FakeBackend()) as first:
                await first.pinned
            async with make(FakeBackend()) as second:
                await second.pinned
        ids = {entry["manager"] for entry in logs}
        assert len(ids) == 2, "each manager binds its own id"
        for manager_id in ids:
            mine = [entry for entry in logs if entry["manager"] == manager_id]
            assert [entry["event"] for entry in mine] == [
                "manager.opened",
                "pin.started",
                "pin.complete",
                "manager.closing",
                "manager.closed",
            ]
            assert all(entry["backend"] == "fake" for entry in mine)
            assert all(entry["log_level"] == "info" for entry in mine)
        assert f"#{logs[0]['manager']} " in repr(first)


# -- real host backend ------------------------------------------------------------------


class TestHostBackend:
    """With real mlock, VmLck rises by the pinned bytes and returns to baseline on any exit."""

    async def test_pinned_locks_the_region_and_close_unlocks_it(self) -> None:
        baseline = _sys.vm_locked_bytes()
        with anyio.fail_after(TIMEOUT_S):
            async with make("host") as mgr:
                assert mgr.backend.name == "host"
                address = mgr.host_view().data_ptr()
                await mgr.pinned
                assert _sys.vm_locked_bytes() == baseline + NBYTES
                assert mgr.stats().pinned_bytes == NBYTES
        assert _sys.vm_locked_bytes() == baseline
        assert not is_mapped(address, NBYTES)
        assert mgr.state is ManagerState.CLOSED

    async def test_cancel_mid_pinning_unlocks(self) -> None:
        stall_at = 5
        backend = FakeBackend(inner=HostBackend(), stall_pin_at=stall_at)
        baseline = _sys.vm_locked_bytes()
        owner_scope = anyio.CancelScope()
        opened = anyio.Event()
        box: list[OffloadManager] = []

        async def owner() -> None:
            with owner_scope:
                async with make(backend) as mgr:
                    box.append(mgr)
                    opened.set()
                    await anyio.sleep_forever()

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                with releasing(backend):
                    tg.start_soon(owner)
                    await opened.wait()
                    mgr = box[0]
                    address = mgr.host_view().data_ptr()
                    await wait_thread_event(backend.stalled)
                    assert _sys.vm_locked_bytes() == baseline + stall_at * CHUNK
                    owner_scope.cancel()
                    await anyio.wait_all_tasks_blocked()
                    assert mgr.state is ManagerState.CLOSING
                    assert _sys.vm_locked_bytes() == baseline + stall_at * CHUNK
        assert owner_scope.cancelled_caught
        assert _sys.vm_locked_bytes() == baseline
        assert_closed_cleanly(mgr, backend, address, range(stall_at + 1))

    async def test_cancel_after_pinned_unlocks(self) -> None:
        baseline = _sys.vm_locked_bytes()
        with anyio.fail_after(TIMEOUT_S), anyio.CancelScope() as scope:
            async with make("host") as mgr:
                await mgr.pinned
                assert _sys.vm_locked_bytes() == baseline + NBYTES
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert _sys.vm_locked_bytes() == baseline

    async def test_exception_in_body_unlocks(self) -> None:
        baseline = _sys.vm_locked_bytes()
        boom = Boom("raised in the body")
        with anyio.fail_after(TIMEOUT_S), pytest.raises(Boom) as info:
            async with make("host") as mgr:
                await mgr.pinned
                assert _sys.vm_locked_bytes() == baseline + NBYTES
                raise boom
        assert info.value is boom
        assert _sys.vm_locked_bytes() == baseline
        assert mgr.state is ManagerState.CLOSED

    async def test_exception_mid_pinning_unlocks(self) -> None:
        stall_at = 3
        backend = FakeBackend(inner=HostBackend(), stall_pin_at=stall_at)
        baseline = _sys.vm_locked_bytes()
        boom = Boom("raised in the body")
        with anyio.fail_after(TIMEOUT_S), pytest.raises(Boom) as info:
            async with make(backend) as mgr:
                address = mgr.host_view().data_ptr()
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    assert _sys.vm_locked_bytes() == baseline + stall_at * CHUNK
                raise boom  # pinning goes on past the stall: the close interrupts it
        assert info.value is boom
        assert _sys.vm_locked_bytes() == baseline
        assert_closed_cleanly(mgr, backend, address, None)


class _UnwritableLog:
    """A logger whose every line meets a closed pipe (``python app.py | head -1``)."""

    def bind(self, **_: Any) -> _UnwritableLog:
        return self

    def __getattr__(self, level: str) -> Any:
        def write(*_: Any, **__: Any) -> None:
            raise BrokenPipeError(32, "Broken pipe")

        return write


async def test_a_log_that_cannot_be_written_changes_nothing() -> None:
    """Every log line fails: the manager still pins, settles ``pinned``, moves a block
    and closes in order. (A newcomer's trial: ``pin.started`` met a closed stdout, the
    pipeline never settled ``pinned``, and the application waited without end.)"""
    fake = FakeBackend()
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager(
            4 << 20, backend=fake, chunk_bytes=1 << 20, logger=_UnwritableLog()
        ) as mgr:
            await mgr.pinned
            address = mgr.host_view().data_ptr()
            assert mgr.stats().chunks_pinned == 4
    assert mgr.state is ManagerState.CLOSED
    assert Counter(fake.unpinned_spans()) == Counter(fake.pinned_spans())
    assert not is_mapped(address, 4 << 20)
