"""An engine's work in worker threads, whatever the event loop does meanwhile: a copy is
waited for to its end even through asyncio's own ``Task.cancel()``; an engine prepared
at entry is closed only once its ``prepare()`` is over, in a thread of the manager's own;
and an engine whose ``close()`` raises still leaves nothing pinned or mapped."""

from __future__ import annotations

import asyncio
import threading
from typing import ClassVar, cast

import anyio
import anyio.to_thread
import pytest
import torch
from structlog.testing import capture_logs

from asyncpin import KVLayout, OffloadManager
from asyncpin.abc import EngineSetup
from asyncpin.engines.host import HostTransferEngine
from asyncpin.testing import FakeBackend, is_mapped
from tests.helpers import TIMEOUT_S, releasing, wait_thread_event
from tests.kit import CopyGate

pytestmark = pytest.mark.anyio

BLOCKS = 4


def layout_of(device: torch.Tensor | None = None) -> KVLayout:
    return KVLayout.from_tensors([device if device is not None else torch.ones(BLOCKS, 1024)])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_native_cancel_of_a_copy_waits_for_the_copy(copy_gate: CopyGate) -> None:
    """``Task.cancel()`` of the task that drives a host copy (a shutdown that cancels
    every task) ended its wait for the copy's thread at once: the store was settled as
    interrupted while its copy went on, and a later store to the same host block was
    overwritten by it. The store is settled once its copy is over, as done."""
    device = torch.ones(BLOCKS, 1024)
    layout = layout_of(device)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            with releasing(copy_gate):
                old = mgr.store([0], [3])
                await copy_gate.wait_entered()
                drains = [t for t in asyncio.all_tasks() if t.get_name().endswith("._drain")]
                assert len(drains) == 1, drains
                drains[0].cancel()
                await anyio.wait_all_tasks_blocked()  # the cancel was delivered
                assert not old.done(), "settled while its copy is still in its thread"
                copy_gate.release()
                await old
            device[0].fill_(2.0)
            await mgr.store([0], [3])
            assert bool((mgr.host_bytes()[3].view(torch.float32) == 2.0).all())


class GatedPrepare(HostTransferEngine):
    """A host engine whose ``prepare()`` waits for ``go`` and which records its calls."""

    calls: ClassVar[list[str]]
    started: ClassVar[threading.Event]
    go: ClassVar[threading.Event]

    def __init__(self, setup: EngineSetup) -> None:
        super().__init__(setup)
        self.address = setup.host_blocks.data_ptr()
        self.nbytes = setup.host_blocks.numel()

    def prepare(self) -> None:
        self.calls.append("prepare")
        self.started.set()
        if not self.go.wait(TIMEOUT_S):
            raise TimeoutError("prepare was never let go")
        self.calls.append(f"prepared, mapped: {is_mapped(self.address, self.nbytes)}")

    def close(self) -> None:
        self.calls.append("close")
        super().close()


def gated_engine() -> type[GatedPrepare]:
    """A GatedPrepare class of its own (the manager makes the engine from it)."""

    class Engine(GatedPrepare):
        calls: ClassVar[list[str]] = []
        started = threading.Event()
        go = threading.Event()

    return Engine


async def cancel_the_entry_in_prepare(
    mgr: OffloadManager, engine: type[GatedPrepare]
) -> tuple[list[str], BaseException]:
    """Enter ``mgr`` in a task, ``Task.cancel()`` it once ``prepare()`` began, let
    ``prepare()`` go once the cancel was delivered: the engine's calls by then, and the
    CancelledError the entry ended with."""

    async def enter() -> None:
        async with mgr:
            raise AssertionError("the entry is cancelled")

    with anyio.fail_after(TIMEOUT_S):
        task = asyncio.ensure_future(enter())
        await wait_thread_event(engine.started)
        task.cancel()
        try:
            await anyio.wait_all_tasks_blocked()  # the cancel was delivered
            calls = list(engine.calls)
        finally:
            engine.go.set()
        with pytest.raises(asyncio.CancelledError) as info:
            await task
    return calls, info.value


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_native_cancel_of_the_entry_closes_the_engine_after_its_prepare() -> None:
    """``Task.cancel()`` of a KV manager's entry while its engine's ``prepare()`` runs:
    the engine was closed and the region unmapped while ``prepare()`` still ran. The
    entry now waits for ``prepare()`` to end, then closes the engine and releases."""
    engine = gated_engine()
    mgr = OffloadManager.for_kv(layout_of(), BLOCKS, backend=FakeBackend(), engine=engine)
    calls_at_cancel, _ = await cancel_the_entry_in_prepare(mgr, engine)
    assert calls_at_cancel == ["prepare"], calls_at_cancel
    assert engine.calls == ["prepare", "prepared, mapped: True", "close"], engine.calls
    assert mgr.stats().state == "closed" and mgr.stats().pinned_bytes == 0


async def test_the_entry_does_not_wait_for_the_applications_thread_pool() -> None:
    """With every thread of the application's default pool taken, a KV manager's entry
    (its engine's ``prepare()``) waited for one; a plain manager's did not."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    holders = [object() for _ in range(int(limiter.total_tokens))]
    for holder in holders:
        await limiter.acquire_on_behalf_of(holder)
    try:
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout_of(), BLOCKS, backend=FakeBackend()) as mgr:
                await mgr.pinned
    finally:
        for holder in holders:
            limiter.release_on_behalf_of(holder)
    assert mgr.stats().state == "closed"


class FailingClose(HostTransferEngine):
    def close(self) -> None:
        super().close()
        raise RuntimeError("the engine's close failed")


async def test_an_engine_whose_close_raises_is_still_unpinned_and_released(shm_name: str) -> None:
    """An engine's ``close()`` that raised ended the manager's close there: nothing was
    unpinned, unmapped or unlinked, though the manager said closed. The rest of the
    close runs (every transfer is over by then), and the failure is logged."""
    fake = FakeBackend()
    name = shm_name
    mgr = OffloadManager.for_kv(
        layout_of(), BLOCKS, backend=fake, engine=FailingClose, backing="shared", name=name
    )
    with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
        async with mgr:
            await mgr.pinned
            address, nbytes = mgr.host_view().data_ptr(), mgr.nbytes
            assert fake.pinned_spans()
    assert [e for e in logs if e["event"] == "engine.close_failed"], logs
    assert mgr.stats().pinned_bytes == 0 and fake.unpinned_spans() == fake.pinned_spans()
    assert not is_mapped(address, nbytes)
    assert not await anyio.Path(f"/dev/shm/{name}").exists()


class _Job:
    """What ``copy_in_thread`` needs of a job: how it was finished."""

    reserve = None

    def __init__(self) -> None:
        self.finished: list[BaseException | None] = []

    def finish(self, error: BaseException | None = None) -> None:
        self.finished.append(error)


@pytest.mark.parametrize("how", ["anyio", "native"])
async def test_a_copy_cancelled_while_it_waits_for_a_thread_never_runs(
    how: str, anyio_backend: str
) -> None:
    """A review: with the copy's limiter full (the CUDA engine's pageable copies use the
    application's default pool), a cancellation before the copy began was held until a
    slot freed, and the copy then ran. It is interrupted at once, the copy never run."""
    if how == "native" and anyio_backend != "asyncio":
        pytest.skip("Task.cancel() is asyncio's")
    from asyncpin.transfers import TransferInterrupted, TransferJob, copy_in_thread

    limiter, holder = anyio.CapacityLimiter(1), object()
    await limiter.acquire_on_behalf_of(holder)  # every slot taken
    copied: list[str] = []
    job = _Job()

    def copy(_: TransferJob) -> None:
        copied.append("copied")

    async def drive() -> None:
        await copy_in_thread(cast(TransferJob, job), copy, limiter=limiter)

    try:
        with anyio.fail_after(TIMEOUT_S):
            if how == "anyio":
                async with anyio.create_task_group() as tg:
                    tg.start_soon(drive)
                    await anyio.wait_all_tasks_blocked()
                    tg.cancel_scope.cancel()
            else:
                task = asyncio.ensure_future(drive())
                await anyio.wait_all_tasks_blocked()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
    finally:
        limiter.release_on_behalf_of(holder)
    assert copied == []
    assert len(job.finished) == 1 and isinstance(job.finished[0], TransferInterrupted)
    assert limiter.borrowed_tokens == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_native_cancel_of_an_entry_whose_prepare_fails_ends_it_cancelled() -> None:
    """A review: an entry cancelled by ``Task.cancel()`` while ``prepare()`` ran, which
    then failed, ended with the engine's error, not cancelled: code catching that error
    went on in a cancelled task. It ends cancelled, the error chained."""
    engine = gated_engine()

    class Failing(engine):  # type: ignore[valid-type,misc]
        def prepare(self) -> None:
            super().prepare()
            raise RuntimeError("prepare failed")

    mgr = OffloadManager.for_kv(layout_of(), BLOCKS, backend=FakeBackend(), engine=Failing)
    _, cancelled = await cancel_the_entry_in_prepare(mgr, engine)
    assert isinstance(cancelled.__cause__, RuntimeError)
    assert mgr.stats().state == "closed"
