"""Transfers while the buffer is still being pinned: blocks in pinned chunks take the fast
path at once; a block in an unpinned chunk waits for its chunk's pin ("wait", the
default) or goes through pageable memory ("pageable"), counted in stats either way; a
failed pin fails exactly the transfers that need its chunk.

Synchronisation is on events only: ``FakeBackend.stalled`` (a pin call is held), the
:class:`~tests.kit.CopyGate` (a copy is held in its worker thread) and
``anyio.wait_all_tasks_blocked()``. Every wait is bounded by ``anyio.fail_after`` and
every hold is released in a ``finally``, so a failed check fails the test instead of
hanging a shielded close. Every test runs on asyncio and on trio.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
import torch

from asyncpin import (
    HostBackend,
    PinError,
    TransferError,
    _sys,
)
from asyncpin.chunks import ChunkState, ChunkTable
from asyncpin.engines.host import HostTransferEngine
from asyncpin.testing import FakeBackend
from asyncpin.transfers import Transfer, TransferJob
from tests.helpers import TIMEOUT_S, releasing, wait_thread_event
from tests.kit import (
    PAGE,
    SMALL_BLOCKS,
    STALL_AT,
    Direction,
    KVModel,
    chunk_ids,
    randomize_host,
    small_kv,
    small_manager,
    submit,
    transfer_counters,
)

pytestmark = pytest.mark.anyio
ROUNDS = 6  # managers, each with its transfers waiting for one chunk
WAITERS = 6  # transfers waiting for that chunk
J_GPU = 20  # the device block of the transfer handed to the engine while a chunk pins
MANY_TRIES = 50  # resubmissions a callback makes at most while another task waits to run
CLIENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("CLIENT", default=None)


class Interrupt(BaseException):
    """Not an Exception: what a done callback may raise that is not caught as one."""


class TestTransfersDuringPinning:
    """Pinned chunks take the fast path at once; an unpinned chunk waits or goes pageable."""

    @pytest.mark.parametrize("direction", ["store", "load"])
    async def test_pinned_chunks_take_the_fast_path(
        self, direction: Direction, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(inner=HostBackend(), stall_pin_at=STALL_AT)
        baseline = _sys.vm_locked_bytes()
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    assert _sys.vm_locked_bytes() == baseline + STALL_AT * PAGE
                    randomize_host(mgr, gen)
                    model = KVModel(mgr, layout)
                    # Host blocks in every pinned chunk (0 .. STALL_AT-1), none beyond.
                    cpu = [c for i in range(STALL_AT) for c in chunk_ids(layout, i, 3)]
                    gpu = torch.randperm(SMALL_BLOCKS, generator=gen)[: len(cpu)].tolist()
                    transfer = submit(mgr, direction, gpu, cpu)
                    await transfer
                    assert transfer.path == "pinned"
                    assert not mgr.is_pinned()
                    assert mgr.stats().chunks_pinned == STALL_AT
                    assert transfer_counters(mgr.stats())[4:6] == (0, 0)  # waited, pageable
                    model.apply(direction, gpu, cpu)
                    model.check()
                await mgr.pinned
        assert _sys.vm_locked_bytes() == baseline

    @pytest.mark.parametrize("chunk", [STALL_AT, STALL_AT + 2])
    @pytest.mark.parametrize("direction", ["store", "load"])
    async def test_unpinned_chunk_waits_for_its_pin(
        self, direction: Direction, chunk: int, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(inner=HostBackend(), stall_pin_at=STALL_AT)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    randomize_host(mgr, gen)
                    model = KVModel(mgr, layout)
                    # One host block in a pinned chunk, one in the chunk waited for.
                    slow_cpu = [chunk_ids(layout, 0)[-1], chunk_ids(layout, chunk)[1]]
                    slow_gpu = [5, 9]
                    fast_cpu, fast_gpu = chunk_ids(layout, 1, 2), [20, 21]
                    slow = submit(mgr, direction, slow_gpu, slow_cpu)
                    fast = submit(mgr, direction, fast_gpu, fast_cpu)
                    assert mgr.stats().transfers_waited_for_pinning == 1
                    await fast
                    await anyio.wait_all_tasks_blocked()
                    assert not slow.done()
                    assert "in flight" in repr(slow)
                    assert mgr.stats().transfers_in_flight == 1
                    backend.release()
                    await slow
                assert slow.path == "pinned"
                stats = mgr.stats()
                assert stats.transfers_waited_for_pinning == 1
                assert stats.transfers_pageable == 0
                assert stats.transfers_failed == 0
                model.apply(direction, fast_gpu, fast_cpu)
                model.apply(direction, slow_gpu, slow_cpu)
                model.check()

    @pytest.mark.parametrize("direction", ["store", "load"])
    async def test_pageable_policy_does_not_wait(
        self, direction: Direction, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend, unpinned_policy="pageable") as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    randomize_host(mgr, gen)
                    model = KVModel(mgr, layout)
                    cpu = chunk_ids(layout, STALL_AT + 2) + chunk_ids(layout, 0, 2)
                    gpu = torch.randperm(SMALL_BLOCKS, generator=gen)[: len(cpu)].tolist()
                    transfer = submit(mgr, direction, gpu, cpu)
                    await transfer
                    assert transfer.path == "pageable"
                    assert "pageable" in repr(transfer)
                    assert not mgr.is_pinned()
                    stats = mgr.stats()
                    assert stats.transfers_pageable == 1
                    assert stats.transfers_waited_for_pinning == 0
                    model.apply(direction, gpu, cpu)
                    model.check()
                    # Blocks wholly in pinned chunks still take the pinned path.
                    fast = submit(mgr, direction, [1], chunk_ids(layout, 1, 1))
                    await fast
                    assert fast.path == "pinned"
                    assert mgr.stats().transfers_pageable == 1

    async def test_empty_transfer_does_not_wait(self, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=0)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    await mgr.store([], [])
                    await mgr.load([], [])
                    stats = mgr.stats()
                    assert stats.transfers_waited_for_pinning == 0
                    assert stats.chunks_pinned == 0

    @pytest.mark.parametrize("direction", ["store", "load"])
    async def test_transfers_waiting_for_one_chunk_go_in_submission_order(
        self, direction: Direction, gen: torch.Generator
    ) -> None:
        """Transfers of one direction that wait for the same chunk are queued when it pins
        in submission order, so the last one to a block wins, whatever order the event
        loop wakes its tasks in (trio reverses a batch of woken tasks half of the time,
        so each of the rounds would fail with even odds if they waited one task each)."""
        layout = small_kv(gen)
        for _ in range(ROUNDS):
            backend = FakeBackend(inner=HostBackend(), stall_pin_at=STALL_AT)
            with anyio.fail_after(TIMEOUT_S):
                async with small_manager(layout, backend) as mgr:
                    with releasing(backend):
                        await wait_thread_event(backend.stalled)
                        randomize_host(mgr, gen)
                        model = KVModel(mgr, layout)
                        # Each one copies a block of its own to the same destination.
                        many = chunk_ids(layout, STALL_AT, WAITERS)
                        one = [many[0]] if direction == "store" else [7]
                        sources = many if direction == "load" else [7 + i for i in range(WAITERS)]
                        transfers = []
                        for source in sources:
                            gpu, cpu = ([source], one) if direction == "store" else (one, [source])
                            transfers.append(submit(mgr, direction, gpu, cpu))
                            model.apply(direction, gpu, cpu)
                        assert mgr.stats().transfers_waited_for_pinning == WAITERS
                        backend.release()
                        for transfer in transfers:
                            await transfer
                        model.check()


class TestWaitingQueue:
    """The transfers that wait for pinning are queued by one task, in submission order,
    each in its submitter's context; whatever happens meanwhile, each is finished."""

    async def test_a_chunk_pinned_while_a_batch_is_queued_keeps_the_order(
        self, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Stores A and B to one block wait for chunk X, J between them for another chunk.
        J's chunk pins first; while J is handed to the engine, X pins (forced: X's pin
        waits for J's submit, which waits for X to be marked). B must not go before A."""
        layout = small_kv(gen)
        x = STALL_AT + 1
        j_submitting, x_pinned = threading.Event(), threading.Event()

        def before_pin(n: int, address: int, nbytes: int) -> None:
            if n == x:  # one pin thread, chunks in index order: the n-th pin is chunk n
                assert j_submitting.wait(TIMEOUT_S)

        mark = ChunkTable.mark

        def marked(table: ChunkTable, index: int, state: ChunkState) -> None:
            mark(table, index, state)
            if index == x and state is ChunkState.PINNED:
                x_pinned.set()

        submit_to_engine = HostTransferEngine.submit

        def held(engine: HostTransferEngine, job: TransferJob, *, pageable: bool) -> None:
            if job.gpu_ids == [J_GPU]:
                j_submitting.set()
                assert x_pinned.wait(TIMEOUT_S)
            submit_to_engine(engine, job, pageable=pageable)

        monkeypatch.setattr(ChunkTable, "mark", marked)
        monkeypatch.setattr(HostTransferEngine, "submit", held)
        backend = FakeBackend(inner=HostBackend(), stall_pin_at=STALL_AT, before_pin=before_pin)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    randomize_host(mgr, gen)
                    model = KVModel(mgr, layout)
                    block = chunk_ids(layout, x, 1)
                    transfers = []
                    for gpu, cpu in (
                        ([7], block),
                        ([J_GPU], chunk_ids(layout, STALL_AT, 1)),
                        ([8], block),
                    ):
                        transfers.append(mgr.store(gpu, cpu))
                        model.store(gpu, cpu)
                    assert mgr.stats().transfers_waited_for_pinning == 3
                    backend.release()
                    for transfer in transfers:
                        await transfer
                    assert j_submitting.is_set() and x_pinned.is_set()
                    model.check()  # B, submitted last, won

    async def test_a_callback_that_raises_leaves_no_transfer_unfinished(
        self, gen: torch.Generator, anyio_backend: str
    ) -> None:
        """A done callback that raises a BaseException (not caught for it, as for an
        Exception) ends the queuing task: the transfers of its batch still finish."""
        if anyio_backend == "trio":
            pytest.skip("a BaseException out of one of trio's system tasks ends the run")
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT, fail_pin_at=STALL_AT)

        def raising(_: Transfer) -> None:
            raise Interrupt("raised by a done callback")

        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    ids = chunk_ids(layout, STALL_AT, 3)
                    first, *others = (mgr.store([i], [h]) for i, h in enumerate(ids))
                    first.add_done_callback(raising)
                    backend.release()
                    with pytest.raises(TransferError):
                        await first
                    with anyio.move_on_after(TIMEOUT_S / 3):  # a bound: they finish at once
                        for transfer in others:
                            with contextlib.suppress(anyio.ClosedResourceError):
                                await transfer  # interrupted by the raise
                    stranded = [transfer for transfer in others if not transfer.done()]
                    for transfer in stranded:  # else the close would wait for them
                        transfer._finish(RuntimeError("never finished"))
                    assert not stranded, f"{len(stranded)} of {len(others)} never finished"
                    for transfer in others:
                        assert isinstance(transfer.error, anyio.ClosedResourceError)
                assert mgr.stats().transfers_in_flight == 0

    async def test_a_callback_that_resubmits_lets_the_loop_run(self, gen: torch.Generator) -> None:
        """A done callback that submits again a transfer failed by a pin that failed: each
        new one fails in turn, and the event loop runs other tasks in between."""
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT, fail_pin_at=STALL_AT)
        failed, other_ran = anyio.Event(), anyio.Event()
        tries = 0

        def again(transfer: Transfer) -> None:
            nonlocal tries
            tries += 1
            failed.set()
            if transfer.error is not None and not other_ran.is_set() and tries < MANY_TRIES:
                mgr.store([0], block).add_done_callback(again)

        async def other() -> None:
            await failed.wait()
            other_ran.set()

        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    block = chunk_ids(layout, STALL_AT, 1)
                    mgr.store([0], block).add_done_callback(again)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(other)  # runs once the first has failed
                        backend.release()
                assert tries < MANY_TRIES, "the loop ran nothing else while they failed"

    async def test_each_waiting_transfer_is_queued_in_its_submitters_context(
        self, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT, fail_pin_at=STALL_AT)
        seen: dict[str, str | None] = {}
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    ids = chunk_ids(layout, STALL_AT, 2)
                    transfers: list[Transfer] = []

                    async def client(name: str, i: int) -> None:
                        CLIENT.set(name)
                        transfer = mgr.store([i], [ids[i]])
                        transfer.add_done_callback(lambda _: seen.__setitem__(name, CLIENT.get()))
                        transfers.append(transfer)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(client, "a", 0)
                        tg.start_soon(client, "b", 1)
                    backend.release()
                    for transfer in transfers:
                        with pytest.raises(TransferError):
                            await transfer
        assert seen == {"a": "a", "b": "b"}


class TestFailedPin:
    """A chunk whose pin failed fails every transfer that needs it, and only those."""

    async def test_failed_pin_fails_the_transfers_that_need_its_chunk(
        self, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT, fail_pin_at=STALL_AT)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    doomed = mgr.store(
                        [1, 2], chunk_ids(layout, 0, 1) + chunk_ids(layout, STALL_AT, 1)
                    )
                    await mgr.store([3], chunk_ids(layout, 1, 1))
                    await anyio.wait_all_tasks_blocked()
                    assert not doomed.done()
                    backend.release()
                    with pytest.raises(TransferError) as info:
                        await doomed
                cause = info.value.__cause__
                assert isinstance(cause, PinError)
                assert cause.chunk_index == STALL_AT
                assert cause.code == FakeBackend.FAKE_CODE
                with pytest.raises(PinError) as pinned:
                    await mgr.pinned
                assert pinned.value is cause
                # Later transfers into a chunk that will never be pinned fail the same way,
                # loads included; the pinned chunks keep working.
                for late in (
                    mgr.store([4], chunk_ids(layout, STALL_AT + 2, 1)),
                    mgr.load(chunk_ids(layout, STALL_AT, 1), [4]),
                ):
                    with pytest.raises(TransferError) as info:
                        await late
                    assert info.value.__cause__ is cause
                model = KVModel(mgr, layout)
                await mgr.load(chunk_ids(layout, 2, 2), [10, 11])
                model.load(chunk_ids(layout, 2, 2), [10, 11])
                model.check()
                stats = mgr.stats()
                assert stats.transfers_failed == 3
                assert stats.transfers_waited_for_pinning == 3
                assert stats.transfers_in_flight == 0
