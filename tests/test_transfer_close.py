"""Closing with transfers in flight: close refuses new transfers, waits for copies in
flight before unpinning and unmapping, completes a transfer whose chunk is being pinned,
fails one it strands; cancelling the manager's owner never cancels a transfer's copy.

Synchronisation is on events only: ``FakeBackend.stalled`` (a pin call is held), the
:class:`~tests.kit.CopyGate` (a copy is held in its worker thread) and
``anyio.wait_all_tasks_blocked()``. Every wait is bounded by ``anyio.fail_after`` and
every hold is released in a ``finally``, so a failed check fails the test instead of
hanging a shielded close. Every test runs on asyncio and on trio.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
import torch

from asyncpin import (
    InvalidTransferError,
    KVLayout,
    ManagerState,
    OffloadManager,
    TransferError,
)
from asyncpin.region import HostRegion
from asyncpin.testing import FakeBackend, is_mapped
from asyncpin.transfers import TransferJob
from tests.helpers import TIMEOUT_S, MadeRegions, releasing, wait_thread_event
from tests.kit import (
    SMALL_CHUNKS,
    STALL_AT,
    CopyGate,
    KVModel,
    assert_same_bytes,
    chunk_ids,
    gather,
    randomize,
    small_kv,
    small_manager,
)

pytestmark = pytest.mark.anyio


class TestCloseWithTransfers:
    """Close waits for copies in flight, fails transfers it strands, then refuses new ones."""

    async def test_close_waits_for_copies_in_flight(
        self, copy_gate: CopyGate, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        fake = FakeBackend()
        mgr = small_manager(layout, fake)
        seen: list[tuple[str, int, bool, torch.Tensor]] = []
        closed = anyio.Event()

        async def close() -> None:
            await mgr.aclose()
            closed.set()

        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                address, nbytes = mgr.host_view().data_ptr(), mgr.nbytes
                await mgr.pinned
                host = mgr.host_blocks()
                randomize(host, gen)

                def on_copied(job: TransferJob) -> None:
                    # In the copy's thread, as it ends: nothing unpinned or unmapped yet.
                    seen.append(
                        (
                            job.transfer.direction,
                            len(fake.unpinned_spans()),
                            is_mapped(address, nbytes),
                            host[job.cpu_ids].clone(),
                        )
                    )

                copy_gate.on_copied = on_copied
                model = KVModel(mgr, layout)
                store_gpu, store_cpu = [3, 1, 4, 15], chunk_ids(layout, 2, 4)
                load_cpu, load_gpu = chunk_ids(layout, 5, 5), [9, 2, 6, 5, 35]
                with releasing(copy_gate):
                    stored = mgr.store(store_gpu, store_cpu)
                    loaded = mgr.load(load_cpu, load_gpu)
                    await copy_gate.wait_entered(2)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(close)
                        await anyio.wait_all_tasks_blocked()
                        assert not closed.is_set()
                        assert mgr.state is ManagerState.CLOSING
                        assert not stored.done() and not loaded.done()
                        assert mgr.stats().transfers_in_flight == 2
                        assert fake.unpinned_spans() == []
                        with pytest.raises(anyio.ClosedResourceError):
                            mgr.store([0], [0])
                        with pytest.raises(anyio.ClosedResourceError):
                            mgr.load([0], [0])
                        copy_gate.release()
                    assert closed.is_set()
        assert stored.done() and stored.error is None
        assert loaded.done() and loaded.error is None
        await stored
        await loaded
        assert sorted((d, u, m) for d, u, m, _ in seen) == [("load", 0, True), ("store", 0, True)]
        # Then every pinned chunk was unpinned, once, and the region unmapped.
        assert sorted(fake.unpinned_spans()) == sorted(fake.pinned_spans())
        assert len(fake.pinned_spans()) == SMALL_CHUNKS
        # The test's own views hold the range past close; with them gone, it is unmapped.
        host = torch.empty(0)
        copy_gate.on_copied = None
        assert mgr.stats().mapped_by_views_bytes == 0
        assert not is_mapped(address, nbytes)
        # The copies moved the right bytes: the store's host blocks as they were when it
        # ended, the load's device blocks now.
        (stored_host,) = [snapshot for d, _, _, snapshot in seen if d == "store"]
        assert_same_bytes(stored_host, gather(layout, store_gpu), "stored blocks")
        model.load(load_cpu, load_gpu)
        for a, (array, expected) in enumerate(zip(layout.arrays, model.arrays, strict=True)):
            assert_same_bytes(array, expected, f"device array {a}")
        stats = mgr.stats()
        assert stats.transfers_in_flight == 0 and stats.transfers_failed == 0
        assert stats.bytes_stored == 4 * layout.host_block_bytes
        assert stats.bytes_loaded == 5 * layout.host_block_bytes

    @pytest.mark.parametrize(
        ("chunk", "completes"),
        [(STALL_AT, True), (STALL_AT + 1, False)],
        ids=["stalled-chunk-pins", "later-chunk-never-pins"],
    )
    async def test_transfer_waiting_for_a_chunk_at_close(
        self, chunk: int, completes: bool, gen: torch.Generator
    ) -> None:
        """The chunk whose pin is in flight still pins (close waits for that call), so a
        transfer waiting for it completes; one waiting for a later chunk fails."""
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT)
        mgr = small_manager(layout, backend)
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                address, nbytes = mgr.host_view().data_ptr(), mgr.nbytes
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    gpu, cpu = [7, 8], chunk_ids(layout, chunk, 2)
                    transfer = mgr.store(gpu, cpu)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(mgr.aclose)
                        await anyio.wait_all_tasks_blocked()
                        assert mgr.state is ManagerState.CLOSING
                        assert not transfer.done()
                        backend.release()
        assert mgr.state is ManagerState.CLOSED
        assert transfer.done()
        assert not is_mapped(address, nbytes)
        assert sorted(backend.unpinned_spans()) == sorted(backend.pinned_spans())
        stats = mgr.stats()
        assert stats.transfers_in_flight == 0
        if completes:
            await transfer
            assert stats.bytes_stored == 2 * layout.host_block_bytes
        else:
            with pytest.raises(TransferError, match="closed") as info:
                await transfer
            assert not isinstance(info.value, InvalidTransferError)
            assert stats.transfers_failed == 1
            assert stats.bytes_stored == 0


class TestCancelledManager:
    """Cancelling the task that owns the manager never hands the cancellation to a transfer."""

    async def test_waiting_transfer_is_settled_with_a_closed_error(self) -> None:
        fake = FakeBackend(stall_pin_at=0)
        layout = KVLayout.from_tensors([torch.randint(1, 255, (8, 4096), dtype=torch.uint8)])
        transfer = None
        with anyio.fail_after(TIMEOUT_S):
            with anyio.CancelScope() as scope:
                async with OffloadManager.for_kv(
                    layout, 8, backend=fake, chunk_bytes=4096, prefault_threads=1
                ) as mgr:
                    transfer = mgr.store([0], [5])  # chunk 5 waits: the first pin is stalled
                    await anyio.to_thread.run_sync(fake.stalled.wait)
                    assert not transfer.done()
                    scope.cancel()
                    fake.release()
                    await anyio.sleep_forever()
            assert transfer is not None and transfer.done()
            assert isinstance(transfer.error, anyio.ClosedResourceError | TransferError)
            with pytest.raises((anyio.ClosedResourceError, TransferError)):
                await transfer

    async def test_cancelled_while_the_engine_prepares_releases_everything(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Entering a KV manager prepares the engine in a worker thread, a point where a
        # cancellation is delivered: the region, mapped just before (in a worker thread
        # too, whose end this cancellation waits for), must still be released.
        created: list[tuple[int, int]] = []
        create = HostRegion.create
        scope = anyio.CancelScope()

        def record(*args: Any, **kwargs: Any) -> HostRegion:
            region = create(*args, **kwargs)
            created.append((region.address, region.nbytes))
            anyio.from_thread.run_sync(scope.cancel)  # delivered at the next checkpoint
            return region

        monkeypatch.setattr(HostRegion, "create", record)
        fake = FakeBackend()
        layout = KVLayout.from_tensors([torch.randint(1, 255, (8, 4096), dtype=torch.uint8)])
        mgr = OffloadManager.for_kv(layout, 8, backend=fake, chunk_bytes=4096)
        with anyio.fail_after(TIMEOUT_S):
            with scope:
                async with mgr:
                    raise AssertionError("entered a cancelled scope")
        assert scope.cancelled_caught and len(created) == 1
        assert not is_mapped(*created[0])
        assert mgr.state is ManagerState.CLOSED
        assert fake.pinned_spans() == []

    async def test_cancelled_before_entry_maps_nothing(self, made_regions: MadeRegions) -> None:
        fake = FakeBackend()
        mgr = OffloadManager(1 << 20, backend=fake, chunk_bytes=4096)
        with anyio.fail_after(TIMEOUT_S):
            with anyio.CancelScope() as scope:
                scope.cancel()
                async with mgr:
                    raise AssertionError("entered a cancelled scope")
        assert scope.cancelled_caught and made_regions.made == []
        assert mgr.state is ManagerState.CLOSED and fake.calls == []
        with pytest.raises(anyio.ClosedResourceError):
            await mgr.pinned
