"""Transfers of one direction queued at once run in submission order, on every engine.

The same cases run on the host engine (CPU tensors stand in for the device arrays; under
asyncio and trio) and on the CUDA engine (``pytest -m cuda``; every copy method). Each
case queues several stores, or several loads, whose destinations overlap; once all have
run, every host block and every device block must hold what copying them one after the
other in submission order gives: a later store to a host block wins, and so does a later
load to a device block, whatever the sizes.

Everything is queued while the engine is busy with the first transfer, so that the later
ones find it still running:

- CUDA: the caller's stream sleeps in a kernel; every copy waits for it.
- host: the first copy is held in its worker thread (a threading.Event) until every copy
  the engine has already handed to a thread has finished; an engine that copies one
  direction's jobs one at a time has handed none, one that lets a later copy run beside
  (or before) an earlier one has, and the earlier copy then lands last. No timing is
  involved: the engine's copy threads are seen on the event loop, where
  ``copy_in_thread`` is called.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import anyio
import anyio.to_thread
import pytest
import torch

import asyncpin.engines.host
from asyncpin import KVLayout, OffloadManager, Transfer, TransferError
from asyncpin.abc import EngineSetup
from asyncpin.engines.host import HostTransferEngine
from asyncpin.testing import FakeBackend
from asyncpin.transfers import TransferJob, copy_in_thread
from tests.helpers import wait_thread_event

pytestmark = pytest.mark.anyio

Direction = Literal["store", "load"]
TIMEOUT_S = 60.0
HOLD_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Engine:
    device: Literal["cpu", "cuda"]
    layers: int
    blocks: int
    host_blocks: int
    block_shape: tuple[int, ...]

    def __str__(self) -> str:
        return "host" if self.device == "cpu" else "cuda"


# 4 KiB host blocks (two layers, K and V of 1 KiB), 4 MiB of host region.
HOST = Engine("cpu", 2, 1024, 1024, (8, 64))
# The CUDA tests' layout: 32 KiB per block per array, 16 arrays, 512 MiB of host region.
CUDA = Engine("cuda", 8, 1024, 1024, (16, 8, 128))


# -- holding the engine busy while transfers are queued ---------------------------------


class Hold(Protocol):
    """Keeps the engine busy with the first transfer while the others are queued."""

    async def first_copy_started(self) -> None: ...

    async def release(self) -> None: ...

    def let_go(self) -> None: ...


class HostHold:
    """Holds the first host-engine copy in its worker thread; logs on the event loop each
    job the engine hands to a thread (``copy_in_thread``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._lock = threading.Lock()
        self._entered = threading.Event()
        self._released = threading.Event()
        self.held: TransferJob | None = None
        self.dispatched: list[TransferJob] = []
        real_copy = HostTransferEngine._copy

        def copy(engine: HostTransferEngine, job: TransferJob) -> None:
            with self._lock:
                first, self.held = self.held is None, self.held or job
            if first:
                self._entered.set()
                if not self._released.wait(HOLD_TIMEOUT_S):
                    raise TimeoutError("the held copy was never released")
            real_copy(engine, job)

        async def logged(
            job: TransferJob,
            copy: Callable[[TransferJob], None],
            *,
            limiter: anyio.CapacityLimiter | None = None,
        ) -> None:
            self.dispatched.append(job)
            await copy_in_thread(job, copy, limiter=limiter)

        monkeypatch.setattr(HostTransferEngine, "_copy", copy)
        monkeypatch.setattr(asyncpin.engines.host, "copy_in_thread", logged)

    async def first_copy_started(self) -> None:
        await wait_thread_event(self._entered)

    async def release(self) -> None:
        """Let the held copy go once every other copy already in a thread has finished."""
        await anyio.wait_all_tasks_blocked()
        for job in list(self.dispatched):
            if job is not self.held:
                with contextlib.suppress(Exception):  # a failure is the test's to check
                    await job.transfer
        self.let_go()

    def let_go(self) -> None:
        self._released.set()


class CudaHold:
    """The caller's stream sleeps for about 0.1 s; every copy queued now waits for it."""

    def __init__(self) -> None:
        torch.cuda._sleep(200_000_000)

    async def first_copy_started(self) -> None:
        return None  # queued already; no checkpoint, so the queue is built at once

    async def release(self) -> None:
        return None

    def let_go(self) -> None:
        return None


@asynccontextmanager
async def kv_manager(engine: Engine) -> AsyncIterator[tuple[OffloadManager, KVLayout]]:
    gen = torch.Generator(device=engine.device).manual_seed(20240611)
    shape = (2, engine.blocks, *engine.block_shape)
    arrays = [
        torch.randn(shape, generator=gen, device=engine.device).to(torch.bfloat16)
        for _ in range(engine.layers)
    ]
    layout = KVLayout.from_tensors(arrays, block_dim=1)
    backend: Any = FakeBackend() if engine.device == "cpu" else "cuda"
    async with OffloadManager.for_kv(layout, engine.host_blocks, backend=backend) as mgr:
        with anyio.fail_after(TIMEOUT_S):
            await mgr.pinned
        host = mgr.host_blocks()
        host.copy_(torch.randn(host.shape, generator=torch.Generator().manual_seed(5)))
        yield mgr, layout


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# -- the shared body --------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    blocks: int
    method: str = "auto"


async def queued_in_order(
    engine: Engine,
    direction: Direction,
    jobs: list[Job],
    *,
    overlap: bool,
    make_hold: Callable[[], Hold],
) -> None:
    """Queue ``jobs`` of one direction behind a busy engine and check that the result is
    theirs applied in submission order. ``overlap``: every job writes a prefix of the same
    destination blocks (else each job has destinations of its own); sources never repeat."""
    rng = random.Random(f"{direction}{jobs}{overlap}")
    async with kv_manager(engine) as (mgr, layout):
        src_limit, dst_limit = (
            (engine.blocks, engine.host_blocks)
            if direction == "store"
            else (engine.host_blocks, engine.blocks)
        )
        total = sum(job.blocks for job in jobs)
        sources = rng.sample(range(src_limit), total)
        if overlap:
            dests = rng.sample(range(dst_limit), max(job.blocks for job in jobs))
        else:
            dests = rng.sample(range(dst_limit), total)
        plan: list[tuple[list[int], list[int], str]] = []
        start = 0
        for job in jobs:
            src = sources[start : start + job.blocks]
            dst = dests[: job.blocks] if overlap else dests[start : start + job.blocks]
            plan.append((src, dst, job.method))
            start += job.blocks
        # The model: the host blocks and device arrays after the jobs, one after the other.
        host_model = mgr.host_blocks().clone()
        arrays_model = [array.clone() for array in layout.arrays]
        for src, dst, _ in plan:
            for a, array in enumerate(arrays_model):
                if direction == "store":
                    host_model[dst, a] = array[src].to("cpu")
                else:
                    array[dst] = host_model[src, a].to(array.device)

        def queue(src: list[int], dst: list[int], method: str) -> Transfer:
            if direction == "store":
                return mgr.store(src, dst, method=method)  # type: ignore[arg-type]
            return mgr.load(src, dst, method=method)  # type: ignore[arg-type]

        with anyio.fail_after(TIMEOUT_S):
            hold = make_hold()
            try:
                transfers = [queue(*plan[0])]
                await hold.first_copy_started()
                transfers += [queue(*job) for job in plan[1:]]
                assert not transfers[0].done(), "the first transfer was not held back"
                await hold.release()
            finally:
                hold.let_go()
            for transfer in transfers:
                await transfer
        assert same_bytes(mgr.host_blocks(), host_model), "host blocks differ from in-order"
        for a, (array, expected) in enumerate(zip(layout.arrays, arrays_model, strict=True)):
            assert same_bytes(array, expected), f"device array {a} differs from in-order"
        assert mgr.stats().transfers_failed == 0


def hold_for(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Callable[[], Hold]:
    """What keeps ``engine`` busy, made when the first transfer is queued."""

    def make_hold() -> Hold:
        return HostHold(monkeypatch) if engine.device == "cpu" else CudaHold()

    return make_hold


def cases(host: list[list[Job]], cuda: list[list[Job]]) -> pytest.MarkDecorator:
    params = [pytest.param(HOST, jobs, id=f"{HOST}-{ids(jobs)}") for jobs in host]
    params += [
        pytest.param(CUDA, jobs, id=f"{CUDA}-{ids(jobs)}", marks=pytest.mark.cuda) for jobs in cuda
    ]
    return pytest.mark.parametrize(("engine", "jobs"), params)


def ids(jobs: list[Job]) -> str:
    return "+".join(f"{job.blocks}{'' if job.method == 'auto' else job.method}" for job in jobs)


# Pairs of one direction to the same blocks: a large transfer then a small one (the
# small one must not overtake it), and the other way round. On CUDA, every pair of copy
# methods (400 blocks: two staging pieces per pack job, so both halves turn over).
CUDA_PAIRS = [
    [Job(2 if second == "auto" else 400, first), Job(2 if second == "auto" else 400, second)]
    for first, second in [
        ("pack", "pack"),
        ("pack", "batch"),
        ("batch", "pack"),
        ("kernel", "pack"),
        ("pack", "auto"),
    ]
]
LATER_WINS = cases(
    host=[[Job(400), Job(2)], [Job(2), Job(400)], [Job(400), Job(400)]],
    cuda=[*CUDA_PAIRS, [Job(400), Job(2)]],
)
# Five back to back, of mixed sizes, every one writing the first destination block.
FIVE = [Job(300), Job(1), Job(64), Job(2), Job(17)]
BACK_TO_BACK = cases(host=[FIVE], cuda=[FIVE, [Job(n, "pack") for n in (300, 1, 64, 2, 17)]])
# Two jobs with destinations of their own (on CUDA they share the device id buffer,
# rewritten in stream order after the first job's kernels have read it).
OWN_BLOCKS = cases(
    host=[[Job(300), Job(300)]],
    cuda=[[Job(300, "pack"), Job(300, "pack")], [Job(300, "kernel"), Job(300, "kernel")]],
)


class TestSubmissionOrder:
    """Jobs of one direction run in submission order, on every engine, whatever their
    sizes and methods."""

    @LATER_WINS
    async def test_the_later_store_wins(
        self, engine: Engine, jobs: list[Job], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        make_hold = hold_for(engine, monkeypatch)
        await queued_in_order(engine, "store", jobs, overlap=True, make_hold=make_hold)

    @LATER_WINS
    async def test_the_later_load_wins(
        self, engine: Engine, jobs: list[Job], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        make_hold = hold_for(engine, monkeypatch)
        await queued_in_order(engine, "load", jobs, overlap=True, make_hold=make_hold)

    @BACK_TO_BACK
    async def test_stores_back_to_back_to_one_block(
        self, engine: Engine, jobs: list[Job], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        make_hold = hold_for(engine, monkeypatch)
        await queued_in_order(engine, "store", jobs, overlap=True, make_hold=make_hold)

    @BACK_TO_BACK
    async def test_loads_back_to_back_to_one_block(
        self, engine: Engine, jobs: list[Job], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        make_hold = hold_for(engine, monkeypatch)
        await queued_in_order(engine, "load", jobs, overlap=True, make_hold=make_hold)


class TestQueuedBackToBack:
    """Two jobs of one direction queued before either runs move their own blocks."""

    @OWN_BLOCKS
    async def test_two_stores(
        self, engine: Engine, jobs: list[Job], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        make_hold = hold_for(engine, monkeypatch)
        await queued_in_order(engine, "store", jobs, overlap=False, make_hold=make_hold)

    @OWN_BLOCKS
    async def test_two_loads(
        self, engine: Engine, jobs: list[Job], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        make_hold = hold_for(engine, monkeypatch)
        await queued_in_order(engine, "load", jobs, overlap=False, make_hold=make_hold)


# -- the host engine's queues -----------------------------------------------------------


class TestHostEngineQueues:
    """One FIFO per direction: a store and a load still run at once, a failed copy fails
    its own transfer only, and closing settles what never started."""

    async def test_a_load_runs_while_a_store_is_held(self, monkeypatch: pytest.MonkeyPatch) -> None:
        hold = HostHold(monkeypatch)
        async with kv_manager(HOST) as (mgr, layout):
            with anyio.fail_after(TIMEOUT_S):
                try:
                    store = mgr.store([0, 1], [0, 1])
                    await hold.first_copy_started()
                    expected = mgr.host_blocks()[[5, 6]].clone()
                    await mgr.load([5, 6], [10, 11])  # the store's copy is still held
                    assert not store.done()
                finally:
                    hold.let_go()
                await store
            for a, array in enumerate(layout.arrays):
                assert same_bytes(array[[10, 11]], expected[:, a])

    async def test_a_failed_copy_fails_its_transfer_only(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        real_copy = HostTransferEngine._copy

        def copy(self: HostTransferEngine, job: TransferJob) -> None:
            if job.gpu_ids == [7]:
                raise RuntimeError("injected copy failure")
            real_copy(self, job)

        monkeypatch.setattr(HostTransferEngine, "_copy", copy)
        hold = HostHold(monkeypatch)  # holds the first copy, then calls `copy`
        async with kv_manager(HOST) as (mgr, layout):
            with anyio.fail_after(TIMEOUT_S):
                try:
                    first = mgr.store([3], [0])
                    await hold.first_copy_started()
                    failing = mgr.store([7], [0])
                    last = mgr.store([9], [0])
                    await hold.release()
                finally:
                    hold.let_go()
                await first
                with pytest.raises(TransferError, match="injected copy failure"):
                    await failing
                await last
            for a, array in enumerate(layout.arrays):
                assert same_bytes(mgr.host_blocks()[0, a], array[9])
            assert mgr.stats().transfers_failed == 1

    async def test_cancelled_drain_settles_the_queued_jobs(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Cancelled while copying, the engine's task lets the copy in flight end and settles
        the jobs behind it, which never start, with ClosedResourceError."""

        hold = HostHold(monkeypatch)
        layout = KVLayout.from_tensors([torch.arange(4 * 16, dtype=torch.uint8).view(4, 16)])
        host = torch.zeros(2, 1, 16, dtype=torch.uint8)
        jobs = [TransferJob(Transfer("store", 1, 16), [g], [0], "auto") for g in (1, 2, 3)]
        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                engine = HostTransferEngine(EngineSetup(layout, host, 1 << 30, tg.start_soon))
                try:
                    engine.submit(jobs[0], pageable=False)
                    await hold.first_copy_started()
                    engine.submit(jobs[1], pageable=False)
                    engine.submit(jobs[2], pageable=False)
                    tg.cancel_scope.cancel()
                finally:
                    hold.let_go()
        # The copy in flight ran to its end (reported done, or interrupted by the
        # cancellation); the ones behind it never ran.
        assert jobs[0].transfer.done()
        assert jobs[0].transfer.error is None or isinstance(
            jobs[0].transfer.error, anyio.ClosedResourceError
        )
        for job in jobs[1:]:
            assert job.transfer.done()
            assert isinstance(job.transfer.error, anyio.ClosedResourceError)
        assert torch.equal(host[0, 0], layout.arrays[0][1]), "a queued job ran"
