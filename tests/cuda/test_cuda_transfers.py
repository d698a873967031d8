"""KV transfers on a real GPU, every method and both directions (`pytest -m cuda`)."""

from __future__ import annotations

import random
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from asyncpin import (
    KVLayout,
    LifecycleError,
    OffloadManager,
    Transfer,
    TransferError,
    capture_gate,
)
from asyncpin.engines.cuda.plan import is_run

pytestmark = pytest.mark.cuda

MiB = 1 << 20
LAYERS, BLOCKS, HOST_BLOCKS = 8, 1024, 1024
METHODS = ["batch", "pack", "kernel"]


def _kv(dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    # Per layer [2, blocks, 16 tokens, 8 heads, 128]: K and V joined, 32 KiB per block.
    return [torch.randn(2, BLOCKS, 16, 8, 128, device="cuda").to(dtype) for _ in range(LAYERS)]


@asynccontextmanager
async def kv_manager(**kwargs: Any) -> AsyncIterator[tuple[OffloadManager, KVLayout]]:
    # Entered in the test's own task: the manager's task group must open and close there.
    layout = KVLayout.from_tensors(_kv(), block_dim=1)
    async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend="cuda", **kwargs) as mgr:
        await mgr.pinned
        yield mgr, layout


def _ids(n: int, limit: int) -> list[int]:
    return random.sample(range(limit), n)


def _check_host(mgr: OffloadManager, layout: KVLayout, gpu: list[int], cpu: list[int]) -> None:
    host = mgr.host_blocks()[cpu].to("cuda")
    for a, array in enumerate(layout.arrays):
        assert torch.equal(host[:, a], array[gpu]), f"array {a} differs after store"


class TestRoundTrips:
    """Every method stores and loads random blocks byte for byte."""

    @pytest.mark.parametrize("method", METHODS)
    async def test_store_then_load(self, method: str) -> None:
        async with kv_manager() as (mgr, layout):
            gpu, cpu = _ids(700, BLOCKS), _ids(700, HOST_BLOCKS)
            with anyio.fail_after(60):
                await mgr.store(gpu, cpu, method=method)  # type: ignore[arg-type]
            _check_host(mgr, layout, gpu, cpu)
            before = [a.clone() for a in layout.arrays]
            for array in layout.arrays:
                array[gpu] = torch.randn_like(array[gpu])
            dest = _ids(700, BLOCKS)
            with anyio.fail_after(60):
                transfer = mgr.load(cpu, dest, method=method)  # type: ignore[arg-type]
                await transfer
            assert transfer.method == method and transfer.path == "pinned"
            untouched = sorted(set(range(BLOCKS)) - set(dest))
            for a, array in enumerate(layout.arrays):
                assert torch.equal(array[dest], before[a][gpu]), f"array {a} differs after load"
                changed_by_test = set(gpu) - set(dest)
                keep = [b for b in untouched if b not in changed_by_test]
                assert torch.equal(array[keep], before[a][keep]), "load wrote outside its blocks"

    @pytest.mark.parametrize("runs", [False, True])
    @pytest.mark.parametrize("n", [1, 31, 32, 33, 288, 289, 700])
    async def test_pack_pieces_of_every_size(self, n: int, runs: bool) -> None:
        """Pack moves a job in pieces of 256 blocks here (128 MiB of staging, 512 KiB
        blocks), the first of a store and the last of a load 32 (16 MiB), byte for byte;
        with ids that are runs of consecutive ids (read from the table on the device:
        tests/test_cuda_plan.py checks that they are not uploaded) and with others."""
        async with kv_manager() as (mgr, layout):
            gpu = list(range(100, 100 + n)) if runs else _ids(n, BLOCKS)
            cpu = list(range(300 - n // 3, 300 - n // 3 + n)) if runs else _ids(n, HOST_BLOCKS)
            with anyio.fail_after(60):
                stored = mgr.store(gpu, cpu, method="pack")
                await stored
            assert stored.method == "pack"
            _check_host(mgr, layout, gpu, cpu)
            stored_blocks = [a[gpu].clone() for a in layout.arrays]
            for array in layout.arrays:  # a block the load skipped cannot pass
                array[gpu] = torch.randn_like(array[gpu])
            before = [a.clone() for a in layout.arrays]
            dest = list(range(BLOCKS - n, BLOCKS)) if runs else _ids(n, BLOCKS)
            with anyio.fail_after(60):
                loaded = mgr.load(cpu, dest, method="pack")
                await loaded
            assert loaded.method == "pack"
            untouched = sorted(set(range(BLOCKS)) - set(dest))
            for a, array in enumerate(layout.arrays):
                assert torch.equal(array[dest], stored_blocks[a]), f"array {a} differs after load"
                assert torch.equal(array[untouched], before[a][untouched])

    async def test_methods_at_once_both_directions(self) -> None:
        async with kv_manager() as (mgr, layout):
            cpu_a, cpu_b = _ids(400, HOST_BLOCKS // 2), _ids(400, HOST_BLOCKS // 2)
            cpu_b = [c + HOST_BLOCKS // 2 for c in cpu_b]
            gpu_a = _ids(400, BLOCKS // 2)
            await mgr.store(gpu_a, cpu_b)
            snapshot = mgr.host_blocks()[cpu_b].clone()
            gpu_dst = [g + BLOCKS // 2 for g in _ids(400, BLOCKS // 2)]
            # A store into one half of the host while a load reads the other half.
            with anyio.fail_after(60):
                store = mgr.store(_ids(400, BLOCKS // 2), cpu_a)
                load = mgr.load(cpu_b, gpu_dst)
                await store
                await load
            for a, array in enumerate(layout.arrays):
                assert torch.equal(array[gpu_dst].cpu(), snapshot[:, a])


class TestRegistrationBoundaries:
    """Runs of consecutive host blocks that span several registrations still copy."""

    @pytest.mark.parametrize("method", METHODS)
    async def test_consecutive_blocks_across_chunks(self, method: str) -> None:
        # 512 KiB host blocks, 1.5 MiB chunks: blocks and runs straddle registrations.
        async with kv_manager(chunk_bytes=3 * 512 * 1024 // 2) as (mgr, layout):
            gpu, cpu = _ids(300, BLOCKS), list(range(101, 401))
            with anyio.fail_after(60):
                await mgr.store(gpu, cpu, method=method)  # type: ignore[arg-type]
            _check_host(mgr, layout, gpu, cpu)
            dest = _ids(300, BLOCKS)
            with anyio.fail_after(60):
                await mgr.load(cpu, dest, method=method)  # type: ignore[arg-type]
            for a, array in enumerate(layout.arrays):
                assert torch.equal(array[dest].cpu(), mgr.host_blocks()[cpu, a])


class TestSmallTransfers:
    """One to four blocks (up to 64 segments) take the small path, byte for byte."""

    @pytest.mark.parametrize("chunk_bytes", [None, 3 * 512 * 1024 // 2])
    async def test_round_trip_block_by_block(self, chunk_bytes: int | None) -> None:
        # With 1.5 MiB chunks, 512 KiB host blocks straddle registrations: cut in Python.
        kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
        async with kv_manager(**kwargs) as (mgr, layout):
            for n in (1, 2, 3, 4):
                gpu, cpu = _ids(n, BLOCKS), _ids(n, HOST_BLOCKS)
                with anyio.fail_after(60):
                    store = mgr.store(gpu, cpu)
                    await store
                # One block (or a run of ids on both sides) by the copy kernel.
                runs = is_run(gpu) and is_run(cpu)
                assert store.method == ("kernel" if runs else "batch")
                _check_host(mgr, layout, gpu, cpu)
                dest = _ids(n, BLOCKS)
                with anyio.fail_after(60):
                    await mgr.load(cpu, dest)
                for a, array in enumerate(layout.arrays):
                    assert torch.equal(array[dest].cpu(), mgr.host_blocks()[cpu, a])


class TestKernelOnRuns:
    """The kernel method takes the ids of a job whose blocks are runs of consecutive ids
    (one block always is) from a table on the device, with no upload: byte for byte, both
    directions, up to the last block of either side."""

    @pytest.mark.parametrize(
        ("gpu", "cpu"),
        [
            ([0], [HOST_BLOCKS - 1]),
            ([BLOCKS - 1], [0]),
            ([5, 6, 7], [900, 901, 902]),
            (list(range(BLOCKS - 40, BLOCKS)), list(range(100, 140))),
            ([3, 9, 4], [10, 11, 12]),  # not a run: uploaded
        ],
    )
    async def test_round_trip(self, gpu: list[int], cpu: list[int]) -> None:
        async with kv_manager() as (mgr, layout):
            with anyio.fail_after(60):
                store = mgr.store(gpu, cpu, method="kernel")
                await store
            assert store.method == "kernel"
            _check_host(mgr, layout, gpu, cpu)
            before = [a.clone() for a in layout.arrays]
            dest = [(g + 17) % BLOCKS for g in gpu]
            with anyio.fail_after(60):
                await mgr.load(cpu, dest, method="kernel")
            torch.cuda.synchronize()
            others = sorted(set(range(BLOCKS)) - set(dest))
            for a, array in enumerate(layout.arrays):
                assert torch.equal(array[dest].cpu(), mgr.host_blocks()[cpu, a])
                assert torch.equal(array[others], before[a][others]), "load wrote elsewhere"


class TestStoreSubmitter:
    """Large stores are queued by a thread of their own; order and failures still hold."""

    async def test_a_small_store_after_a_large_one_lands_last(self) -> None:
        # The large store goes to the submitter thread; the small one, submitted while that
        # thread is (most likely) still queuing it, must follow it there, not overtake it.
        async with kv_manager() as (mgr, layout):
            cpu = _ids(400, HOST_BLOCKS)
            gpu = _ids(402, BLOCKS)
            large, small = gpu[:400], gpu[400:]
            torch.cuda._sleep(100_000_000)  # the device is busy: nothing lands early
            with anyio.fail_after(60):
                one = mgr.store(large, cpu)
                two = mgr.store(small, cpu[:2])
                await two
                await one
            _check_host(mgr, layout, small, cpu[:2])
            _check_host(mgr, layout, large[2:], cpu[2:])

    async def test_a_failure_while_queuing_reaches_the_handle(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        async with kv_manager() as (mgr, layout):
            engine: Any = mgr._engine

            def refuse(*args: Any) -> Any:
                raise RuntimeError("refused while queuing")

            gpu, cpu = _ids(400, BLOCKS), _ids(400, HOST_BLOCKS)
            with monkeypatch.context() as patch:
                patch.setattr(engine._copies, "pack", refuse)
                failed = mgr.store(gpu, cpu, method="pack")
                with anyio.fail_after(60), pytest.raises(TransferError, match="refused"):
                    await failed
            with anyio.fail_after(60):  # the thread goes on with the next store
                await mgr.store(gpu, cpu, method="pack")
            _check_host(mgr, layout, gpu, cpu)
            assert mgr.stats().transfers_in_flight == 0


class TestPageable:
    """With pinning held back, transfers copy from pageable memory, byte for byte."""

    async def test_round_trip_while_nothing_is_pinned(self) -> None:
        layout = KVLayout.from_tensors(_kv(), block_dim=1)
        mgr = OffloadManager.for_kv(layout, HOST_BLOCKS, backend="cuda", unpinned_policy="pageable")
        pause = mgr.pinning_paused()
        held = True

        def release() -> None:  # before close: close's unpins wait for the pause
            nonlocal held
            if held:
                held = False
                pause.__exit__(None, None, None)

        pause.__enter__()  # before entry: no chunk gets pinned
        try:
            async with mgr:
                try:
                    gpu, cpu = _ids(300, BLOCKS), _ids(300, HOST_BLOCKS)
                    with anyio.fail_after(60):
                        store = mgr.store(gpu, cpu)
                        await store
                    _check_host(mgr, layout, gpu, cpu)
                    dest = _ids(300, BLOCKS)
                    with anyio.fail_after(60):
                        load = mgr.load(cpu, dest)
                        await load
                    for a, array in enumerate(layout.arrays):
                        assert torch.equal(array[dest].cpu(), mgr.host_blocks()[cpu, a])
                    assert (store.path, load.path) == ("pageable", "pageable")
                    assert mgr.stats().chunks_pinned == 0
                finally:
                    release()
        finally:
            release()


class TestStreamOrder:
    """Store waits for the producer's stream; load hands the consumer an event."""

    async def test_store_waits_for_the_compute_stream(self) -> None:
        async with kv_manager() as (mgr, layout):
            gpu, cpu = _ids(64, BLOCKS), _ids(64, HOST_BLOCKS)
            torch.cuda._sleep(200_000_000)  # the producer is still busy...
            for array in layout.arrays:
                array[gpu] = 7  # ...when it writes the blocks
            await mgr.store(gpu, cpu)
            host = mgr.host_blocks()[cpu]
            assert bool((host == 7).all()), "the store copied blocks before they were produced"

    @pytest.mark.parametrize(
        ("method", "n"), [("batch", 64), ("pack", 64), ("kernel", 64), ("auto", 1)]
    )
    async def test_load_reads_host_blocks_after_the_caller_stream(
        self, method: str, n: int
    ) -> None:
        async with kv_manager() as (mgr, layout):
            cpu, gpu = _ids(n, HOST_BLOCKS), _ids(n, BLOCKS)
            with anyio.fail_after(60):
                # A load of the same method first: a pack lane's staging buffer then exists,
                # and only the caller's stream can hold the DMAs back (a first pack load's
                # staging allocation orders them after the caller's stream by itself).
                await mgr.load(_ids(n, HOST_BLOCKS), _ids(n, BLOCKS), method=method)  # type: ignore[arg-type]
            host = mgr.host_blocks()
            host[cpu] = 1
            fresh = torch.full_like(host[0], 9, device="cuda")
            torch.cuda._sleep(200_000_000)  # the caller's stream is still busy...
            for c in cpu:
                host[c].copy_(fresh, non_blocking=True)  # ...when it writes the host blocks
            with anyio.fail_after(60):
                await mgr.load(cpu, gpu, method=method)  # type: ignore[arg-type]
            for a, array in enumerate(layout.arrays):
                assert bool((array[gpu] == 9).all()), f"array {a}: the load read stale blocks"

    async def test_compute_stream_waits_on_the_load_event(self) -> None:
        async with kv_manager() as (mgr, layout):
            cpu, gpu = _ids(64, HOST_BLOCKS), _ids(64, BLOCKS)
            mgr.host_blocks()[cpu] = 3
            transfer = mgr.load(cpu, gpu)
            torch.cuda.current_stream().wait_event(transfer.event)
            sums = torch.stack([array[gpu].float().sum() for array in layout.arrays])
            expected = 3.0 * layout.arrays[0][gpu].numel()
            assert torch.all(sums == expected).item()
            await transfer

    async def test_an_empty_transfer_has_an_event_too(self) -> None:
        """A step with nothing to load still orders its compute after the load's event
        (it had none: the README's wait_event(t.event) raised)."""
        async with kv_manager() as (mgr, _):
            for transfer in (mgr.load([], []), mgr.store([], [])):
                assert isinstance(transfer.event, torch.cuda.Event)
                torch.cuda.current_stream().wait_event(transfer.event)
                with anyio.fail_after(60):
                    await transfer
                assert transfer.done() and transfer.nbytes == 0
            torch.cuda.current_stream().synchronize()


class TestAwaiting:
    """The awaiting coroutine is woken without polling and may be cancelled safely."""

    async def test_other_coroutines_run_while_awaiting(self) -> None:
        async with kv_manager() as (mgr, _):
            ticks = 0
            done = anyio.Event()

            async def ticker() -> None:
                nonlocal ticks
                while not done.is_set():
                    ticks += 1
                    await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                torch.cuda._sleep(
                    500_000_000,
                )
                await mgr.store(_ids(800, BLOCKS), _ids(800, HOST_BLOCKS))
                done.set()
            assert ticks > 10

    async def test_cancelled_waiter_leaves_the_copy_alone(self) -> None:
        async with kv_manager() as (mgr, layout):
            gpu, cpu = _ids(500, BLOCKS), _ids(500, HOST_BLOCKS)
            torch.cuda._sleep(300_000_000)
            transfer: Transfer = mgr.store(gpu, cpu)
            with anyio.move_on_after(0) as scope:
                await transfer
            assert scope.cancelled_caught and not transfer.done()
            with anyio.fail_after(60):
                await transfer
            _check_host(mgr, layout, gpu, cpu)
            assert mgr.stats().transfers_in_flight == 0


class TestTrio:
    """Under trio (no asyncio loop: completions go through anyio's portal, and the sweep
    is a task), every method moves the right bytes both ways, and closing ends the
    sweep's task."""

    def test_round_trips(self) -> None:
        pytest.importorskip("trio")

        async def main() -> None:
            async with kv_manager() as (mgr, layout):
                with anyio.fail_after(60):
                    for method in ("batch", "pack", "kernel"):
                        for n in (1, 300):
                            gpu, cpu = _ids(n, BLOCKS), _ids(n, HOST_BLOCKS)
                            await mgr.store(gpu, cpu, method=method)
                            _check_host(mgr, layout, gpu, cpu)
                            expected = mgr.host_blocks()[cpu].to("cuda")
                            dest = _ids(n, BLOCKS)
                            await mgr.load(cpu, dest, method=method)
                            for a, array in enumerate(layout.arrays):
                                assert torch.equal(array[dest], expected[:, a]), f"array {a}"
                assert mgr.stats().transfers_failed == 0

        anyio.run(main, backend="trio")


class TestGraphCaptures:
    """Transfers run while another thread captures CUDA graphs through the capture gate:
    no capture fails, no transfer fails, every block arrives (bench/capture_probe.py:
    without the gate, the completion waiters and pinned id buffers broke nearly every
    capture)."""

    async def test_captures_on_another_thread_while_transferring(self) -> None:
        async with kv_manager() as (mgr, layout):
            half = BLOCKS // 2
            methods: list[Any] = METHODS  # no warm-up: the kernel is loaded at open
            source = [a[:half].clone() for a in layout.arrays]  # never written below
            torch.cuda.synchronize()

            stop, counts, errors = threading.Event(), {"captures": 0}, []

            def capture() -> None:
                x = torch.ones(1 << 16, device="cuda")
                while not stop.is_set():
                    graph = torch.cuda.CUDAGraph()
                    try:
                        with capture_gate(), torch.cuda.graph(graph):
                            y = x * 2
                            for _ in range(20):
                                y = y + 1
                        graph.replay()
                        torch.cuda.current_stream().synchronize()
                        if not bool((y == 22).all()):
                            errors.append("a replay computed something else")
                    except Exception as exc:
                        errors.append(f"capture: {exc}")
                    counts["captures"] += 1

            thread = threading.Thread(target=capture)
            thread.start()
            final: dict[int, int] = {}  # device block -> the source block it holds
            try:
                with anyio.fail_after(120):
                    for r in range(24):
                        m = methods[r % len(methods)]
                        gpu, cpu = _ids(64, half), _ids(64, HOST_BLOCKS)
                        dest = [half + b for b in _ids(64, half)]
                        await mgr.store(gpu, cpu, method=m)
                        await mgr.load(cpu, dest, method=m)
                        final.update(zip(dest, gpu, strict=True))
                    captures_meanwhile = counts["captures"]
            finally:
                stop.set()
                thread.join(60)
            assert errors == [] and captures_meanwhile > 0
            assert mgr.stats().transfers_failed == 0
            dest, src = list(final), list(final.values())
            for a, array in enumerate(layout.arrays):
                assert torch.equal(array[dest], source[a][src]), f"array {a} differs"

    async def test_a_call_inside_a_capture_on_its_own_stream_is_refused(self) -> None:
        """store() or load() on the thread that captures, its current stream capturing:
        refused with LifecycleError before anything touches the stream; the capture goes
        on and replays (the copy's wait on the captured stream broke it before)."""
        async with kv_manager() as (mgr, layout):
            x = torch.ones(1 << 16, device="cuda")
            graph = torch.cuda.CUDAGraph()
            refused: list[str] = []
            before = mgr.stats()
            torch.cuda.synchronize()
            calls: list[Callable[[], Transfer]] = [
                lambda: mgr.store([0, 1], [0, 1]),
                lambda: mgr.load([0], [2]),
                lambda: mgr.load([], []),
            ]
            with torch.cuda.graph(graph):
                y = x * 2
                for call in calls:
                    try:
                        call()
                    except LifecycleError as exc:
                        refused.append(str(exc))
                y = y + 1
            graph.replay()
            torch.cuda.current_stream().synchronize()
            assert len(refused) == 3 and all("captures a CUDA graph" in r for r in refused)
            assert bool((y == 3).all())
            after = mgr.stats()
            assert (after.transfers_stored, after.transfers_loaded) == (
                before.transfers_stored,
                before.transfers_loaded,
            )
            with anyio.fail_after(60):
                await mgr.store([0, 1], [0, 1])  # the manager moves blocks after it
            _check_host(mgr, layout, [0, 1], [0, 1])


class TestPackStagingOnFirstUse:
    """With 1 MiB blocks pack is not the default: its staging is allocated by the first
    pack transfer, never while the capture gate is held (that transfer uses batch)."""

    async def test_not_allocated_during_a_capture(self) -> None:
        # Eight layers, K and V joined (16 arrays, as _kv(): no new kernel variant for
        # TestKernelVariants to miss), 1 MiB per block per array (512 tokens x 8 x 128).
        kv = [torch.randn(2, 16, 512, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(8)]
        layout = KVLayout.from_tensors(kv, block_dim=1)
        async with OffloadManager.for_kv(layout, 16, backend="cuda") as mgr:
            await mgr.pinned
            lanes = mgr._engine._lanes  # type: ignore[union-attr]
            assert lanes["store"].staging is None
            gpu, cpu = _ids(16, 16), _ids(16, 16)
            with capture_gate():
                held = mgr.store(gpu[:8], cpu[:8], method="pack")
            assert held.method == "batch" and lanes["store"].staging is None
            with anyio.fail_after(60):
                await held
                packed = mgr.store(gpu[8:], cpu[8:], method="pack")
                await packed
            assert packed.method == "pack" and lanes["store"].staging is not None
            _check_host(mgr, layout, gpu, cpu)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
class TestSecondGpu:
    """A layout on GPU 1 while GPU 0 is current: the region is pinned for GPU 1, the
    engine's streams, buffers and kernels live there, and every method moves the right
    bytes both ways (the kernel method reads the host through GPU 1's mapping)."""

    async def test_round_trips(self) -> None:
        torch.cuda.set_device(0)
        kv = [torch.randn(2, 256, 16, 8, 128, device="cuda:1").to(torch.bfloat16) for _ in range(4)]
        layout = KVLayout.from_tensors(kv, block_dim=1)
        async with OffloadManager.for_kv(layout, 256, backend="cuda") as mgr:
            await mgr.pinned
            with anyio.fail_after(60):
                for method, n in (("batch", 1), ("batch", 100), ("pack", 100), ("kernel", 100)):
                    gpu, cpu = _ids(n, 256), _ids(n, 256)
                    await mgr.store(gpu, cpu, method=method)  # type: ignore[arg-type]
                    host = mgr.host_blocks()[cpu].to("cuda:1")
                    for a, array in enumerate(layout.arrays):
                        assert torch.equal(host[:, a], array[gpu]), f"{method}: store, array {a}"
                    dest = _ids(n, 256)
                    load = mgr.load(cpu, dest, method=method)  # type: ignore[arg-type]
                    with torch.cuda.device(1):
                        torch.cuda.current_stream().wait_event(load.event)
                        moved = [array[dest].clone() for array in layout.arrays]
                    await load
                    for a, array in enumerate(moved):
                        assert torch.equal(array, host[:, a]), f"{method}: load, array {a}"
            assert mgr.stats().transfers_failed == 0
        assert torch.cuda.current_device() == 0

    async def test_pack_staging_on_first_use(self) -> None:
        torch.cuda.set_device(0)
        kv = [torch.randn(2, 16, 512, 8, 128, device="cuda:1").to(torch.bfloat16) for _ in range(8)]
        layout = KVLayout.from_tensors(kv, block_dim=1)  # 1 MiB blocks: batch by default
        async with OffloadManager.for_kv(layout, 16, backend="cuda") as mgr:
            await mgr.pinned
            gpu, cpu = _ids(16, 16), _ids(16, 16)
            with anyio.fail_after(60):
                packed = mgr.store(gpu, cpu, method="pack")
                await packed
            assert packed.method == "pack"
            staging = mgr._engine._lanes["store"].staging  # type: ignore[union-attr]
            assert staging is not None and staging.device == torch.device("cuda", 1)
            host = mgr.host_blocks()[cpu].to("cuda:1")
            for a, array in enumerate(layout.arrays):
                assert torch.equal(host[:, a], array[gpu]), f"array {a}"
        assert torch.cuda.current_device() == 0


class TestCopyKernel:
    """The copy kernel is loaded once per process, in the engine's prepare() (a worker
    thread, before the manager is ready), and transfers of any size, method and range
    never load another: a load mid-serving would stall the submitting thread, and would
    break a graph capture under way on another thread."""

    async def test_loaded_before_ready_and_never_after(
        self,
        kernel_loads: list[threading.Thread],
        kernel_launches: list[tuple[threading.Thread, int]],
    ) -> None:
        kv = [torch.randn(2, 256, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(3)]
        layout = KVLayout.from_tensors(kv, block_dim=1)
        expected = [k.clone() for k in kv]
        methods: list[Any] = ["pack", "kernel"]
        loop = threading.current_thread()
        for _ in range(2):  # a second manager in the process loads nothing
            kernel_launches.clear()
            async with OffloadManager.for_kv(layout, 256, backend="cuda") as mgr:
                await mgr.pinned  # ready: the engine prepared (in the background) too
                assert len(kernel_loads) == 1 and kernel_loads[0] is not loop
                # One launch over no segment per direction, in the set-up's thread: it
                # loads the kernel onto the device (lazy loading) before anything runs.
                assert [n for _, n in kernel_launches] == [0, 0]
                assert all(thread is not loop for thread, _ in kernel_launches)
                for n in (1, 2, 3, 16, 17, 33, 64, 65, 255):
                    for m in methods:
                        gpu, cpu = _ids(n, 256), _ids(n, 256)
                        await mgr.store(gpu, cpu, method=m)
                        for k in kv:
                            k[:, gpu] = 0  # blocks are dimension 1
                        await mgr.load(cpu, gpu, method=m)
                        for k, e in zip(kv, expected, strict=True):
                            assert torch.equal(k, e), (n, m)
                assert len(kernel_loads) == 1
