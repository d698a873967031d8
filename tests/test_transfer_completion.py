"""A transfer handle from submission to completion: awaiting it (any number of times), its
state and repr, the stats it counts, a failed copy reported as a TransferError, and
cancellation of a waiter, which stops the waiting and never the copy.

Synchronisation is on events only: ``FakeBackend.stalled`` (a pin call is held), the
:class:`~tests.kit.CopyGate` (a copy is held in its worker thread) and
``anyio.wait_all_tasks_blocked()``. Every wait is bounded by ``anyio.fail_after`` and
every hold is released in a ``finally``, so a failed check fails the test instead of
hanging a shielded close. Every test runs on asyncio and on trio.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
import torch
from structlog.testing import capture_logs

from asyncpin import (
    KVLayout,
    OffloadManager,
    Transfer,
    TransferError,
)
from asyncpin.engines.host import HostTransferEngine
from asyncpin.testing import FakeBackend
from asyncpin.transfers import TransferJob
from tests.helpers import TIMEOUT_S, releasing, wait_thread_event
from tests.kit import (
    STALL_AT,
    CopyGate,
    Direction,
    KVModel,
    check_stored,
    chunk_ids,
    randomize_host,
    small_kv,
    small_manager,
    submit,
    transfer_counters,
)

pytestmark = pytest.mark.anyio


class TestTransferHandle:
    """A Transfer reports its state, size and time, and can be awaited any number of times."""

    @pytest.mark.parametrize("direction", ["store", "load"])
    async def test_handle_before_and_after(
        self, direction: Direction, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                gpu, cpu = [4, 0, 63], [7, 2, 40]
                transfer = submit(mgr, direction, gpu, cpu)
                assert isinstance(transfer, Transfer)
                assert transfer.direction == direction
                assert not transfer.done()
                assert transfer.elapsed_s is None
                assert transfer.error is None
                assert transfer.num_blocks == 3
                assert transfer.nbytes == 3 * layout.host_block_bytes
                text = repr(transfer)
                assert direction in text and "in flight" in text
                assert f"3 blocks {transfer.nbytes} bytes" in text
                if direction == "store":
                    await transfer
                    await transfer.wait()
                else:
                    await transfer.wait()
                    await transfer
                await transfer  # a third time
                assert transfer.done()
                elapsed = transfer.elapsed_s
                assert isinstance(elapsed, float) and elapsed > 0
                assert transfer.elapsed_s == elapsed  # fixed once done
                text = repr(transfer)
                assert direction in text and "done" in text and "in flight" not in text
                assert "host/pinned" in text


class TestStats:
    """stats() counts transfers and bytes per direction."""

    async def test_counters(self, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        size = layout.host_block_bytes
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                assert transfer_counters(mgr.stats()) == (0,) * 8
                await mgr.store([1, 2, 3], [1, 2, 3])
                await mgr.store([4], [4])
                await mgr.store(list(range(10)), list(range(20, 30)))
                await mgr.load([1, 2], [50, 51])
                await mgr.load(list(range(20, 27)), list(range(30, 37)))
                stats = mgr.stats()
                assert stats.transfers_stored == 3
                assert stats.transfers_loaded == 2
                assert stats.bytes_stored == 14 * size
                assert stats.bytes_loaded == 9 * size
                assert stats.transfers_waited_for_pinning == 0
                assert stats.transfers_pageable == 0
                assert stats.transfers_failed == 0
                assert stats.transfers_in_flight == 0
        assert mgr.stats().bytes_stored == 14 * size  # kept after close


class TestCopyFailure:
    """A copy that fails is reported as a TransferError with the cause chained."""

    async def test_failed_copy_is_a_transfer_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def broken(self: HostTransferEngine, job: TransferJob) -> None:
            raise RuntimeError("injected copy failure")

        monkeypatch.setattr(HostTransferEngine, "_copy", broken)
        layout = KVLayout.from_tensors([torch.randint(1, 255, (8, 64), dtype=torch.uint8)])
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, 8, backend=FakeBackend()) as mgr:
                await mgr.pinned
                with pytest.raises(TransferError, match="injected copy failure") as info:
                    await mgr.store([0], [0])
                assert isinstance(info.value.__cause__, RuntimeError)
                assert mgr.stats().transfers_failed == 1


class TestCancellation:
    """Cancelling the task that awaits a transfer stops the waiting, never the copy."""

    async def test_cancelled_waiter_leaves_the_copy_running(
        self, copy_gate: CopyGate, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        scope = anyio.CancelScope()
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                gpu, cpu = [60, 0, 33], chunk_ids(layout, 4, 3)
                transfer = mgr.store(gpu, cpu)

                async def waiter() -> None:
                    with scope:
                        await transfer

                with releasing(copy_gate):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(waiter)
                        await copy_gate.wait_entered()
                        await anyio.wait_all_tasks_blocked()
                        scope.cancel()
                    assert scope.cancelled_caught
                    assert not transfer.done()
                    assert mgr.stats().transfers_in_flight == 1
                await transfer
                assert transfer.error is None
                check_stored(mgr, layout, gpu, cpu)
                stats = mgr.stats()
                assert stats.transfers_in_flight == 0
                assert stats.bytes_stored == 3 * layout.host_block_bytes

    async def test_cancelled_waiter_of_a_transfer_waiting_for_pinning(
        self, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT)
        scope = anyio.CancelScope()
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    randomize_host(mgr, gen)
                    model = KVModel(mgr, layout)
                    cpu, gpu = chunk_ids(layout, STALL_AT + 1, 4), [12, 13, 14, 15]
                    transfer = mgr.load(cpu, gpu)

                    async def waiter() -> None:
                        with scope:
                            await transfer

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(waiter)
                        await anyio.wait_all_tasks_blocked()
                        scope.cancel()
                    assert scope.cancelled_caught
                    assert not transfer.done()
                    backend.release()
                    await transfer
                model.load(cpu, gpu)
                model.check()
                assert mgr.stats().transfers_in_flight == 0


class TestDoneCallbacks:
    """A done callback that raises is logged; the other callbacks run, the other transfers
    finish and the close completes (it waits for every transfer)."""

    async def test_raising_callbacks_settle_every_transfer(
        self, copy_gate: CopyGate, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        ran: list[str] = []

        def broken(transfer: Transfer) -> None:
            raise ValueError("callback bug")

        with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                pairs = [([g], chunk_ids(layout, 4 + g, 1)) for g in range(3)]
                with releasing(copy_gate):
                    transfers = [mgr.store(g, c) for g, c in pairs]
                    await copy_gate.wait_entered()  # the engine's jobs are under way
                    for i, t in enumerate(transfers[:2]):

                        def after(transfer: Transfer, i: int = i) -> None:
                            ran.append(f"after {i}")

                        t.add_done_callback(broken)
                        t.add_done_callback(after)
                for transfer in transfers:
                    await transfer
                    assert transfer.error is None
                for g, c in pairs:
                    check_stored(mgr, layout, g, c)
                assert ran == ["after 0", "after 1"]
        assert mgr.state.value == "closed"
        failed = [e for e in logs if e["event"] == "transfer.callback_failed"]
        assert len(failed) == 2
        assert "callback bug" in failed[0]["error"]

    async def test_callback_on_a_finished_transfer_raises_to_its_caller(
        self, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                transfer = mgr.store([0], chunk_ids(layout, 4, 1))
                await transfer

                def broken(transfer: Transfer) -> None:
                    raise ValueError("callback bug")

                with pytest.raises(ValueError, match="callback bug"):
                    transfer.add_done_callback(broken)

    @pytest.mark.parametrize("sink", ["records", "fails"])
    async def test_callback_errors_go_to_the_managers_logger_whatever_it_does(
        self, sink: str, copy_gate: CopyGate, gen: torch.Generator
    ) -> None:
        """The manager's ``logger=`` gets the error; one whose every line fails (a closed
        stdout) changes nothing either (a review: an unshielded log line raised in place of
        the callback's error, and the jobs after it were failed as interrupted)."""
        layout = small_kv(gen)
        lines: list[str] = []

        class Log:
            def bind(self, **_: object) -> Log:
                return self

            def __getattr__(self, level: str) -> Callable[..., None]:
                def write(event: str, **_: object) -> None:
                    if sink == "fails":
                        raise BrokenPipeError(32, "Broken pipe")
                    lines.append(event)

                return write

        ran: list[int] = []

        def broken(transfer: Transfer) -> None:
            raise ValueError("callback bug")

        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend(), logger=Log()) as mgr:
                await mgr.pinned
                with releasing(copy_gate):
                    transfers = [mgr.store([g], chunk_ids(layout, 4 + g, 1)) for g in range(2)]
                    await copy_gate.wait_entered()
                    transfers[0].add_done_callback(broken)
                    for t in transfers:
                        t.add_done_callback(lambda t: ran.append(len(ran)))
                for transfer in transfers:
                    await transfer
                    assert transfer.error is None
                assert ran == [0, 1]
        assert mgr.state.value == "closed"
        assert lines.count("transfer.callback_failed") == (1 if sink == "records" else 0)
