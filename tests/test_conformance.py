"""The conformance checks of ``asyncpin.testing`` against every real backend and engine,
on asyncio and on trio; the same checks against broken implementations, to show that
they fail; and the FakeEngine.

Each test is a plain function that runs its scenario with ``anyio.run(...,
backend=anyio_backend)``. anyio's pytest plugin (``@pytest.mark.anyio`` on an ``async
def`` test) does not work here: with ``asyncio_mode = "auto"`` pytest-asyncio claims every
``async def`` test first and runs the trio case on asyncio, silently. Every scenario
checks that it runs on the library it was given.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import gc
import threading
from collections.abc import Awaitable, Callable
from typing import Any, cast

import anyio
import anyio.to_thread
import pytest
import sniffio
import torch

from asyncpin import KVLayout
from asyncpin.abc import EngineSetup
from asyncpin.backends import HostBackend
from asyncpin.engines.host import HostTransferEngine
from asyncpin.errors import BackendCallError
from asyncpin.region import round_to_pages
from asyncpin.testing import (
    FakeBackend,
    FakeEngine,
    check_pin_backend,
    check_transfer_engine,
)
from asyncpin.transfers import Direction, Method, Transfer, TransferJob, host_blocks_view
from tests.layouts import CASES, build

ROUNDS = 6  # checks run again, for an order that would hold by chance


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def run(scenario: Callable[..., Awaitable[None]], anyio_backend: str, *args: Any) -> None:
    async def checked() -> None:
        assert sniffio.current_async_library() == anyio_backend
        await scenario(*args)

    anyio.run(checked, backend=anyio_backend)


def cpu_layout(num_blocks: int = 16) -> KVLayout:
    """Two layers of K and V on the CPU, standing in for device KV arrays."""
    return KVLayout.from_tensors(
        [torch.zeros(2, num_blocks, 8, 64, dtype=torch.bfloat16) for _ in range(2)], block_dim=1
    )


def cuda_layout(num_blocks: int = 16) -> KVLayout:
    return KVLayout.from_tensors(
        [
            torch.zeros(2, num_blocks, 16, 8, 64, dtype=torch.float16, device="cuda")
            for _ in range(2)
        ],
        block_dim=1,
    )


def host_blocks_for(layout: KVLayout, pageable_blocks: int = 4) -> int:
    """Enough host blocks of ``layout`` for the check: whole pinned chunks (a page or more)
    holding the blocks the pinned jobs need, with rows shared by two ranks too."""
    hbb = layout.host_block_bytes
    return max(16, pageable_blocks + 10 + -(-round_to_pages(hbb) // hbb))


def cuda_registered(address: int, nbytes: int) -> bool:
    """Whether CUDA counts ``address`` as registered host memory (cudaHostGetFlags)."""
    from asyncpin._cudart import cudart

    lib = cudart()
    assert lib is not None
    flags = ctypes.c_uint()
    code = int(lib.cudaHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(address)))
    if code:
        lib.cudaGetLastError()  # not registered: leave no error behind for torch to find
    return code == 0


class TestPinBackendConformance:
    """Every real backend passes check_pin_backend, on asyncio and trio."""

    def test_host_backend(self, anyio_backend: str) -> None:
        run(check_pin_backend, anyio_backend, HostBackend())

    def test_fake_backend_around_the_host_backend(self, anyio_backend: str) -> None:
        fake = FakeBackend(inner=HostBackend())
        run(check_pin_backend, anyio_backend, fake)
        pins = [c for c in fake.calls if c.op == "pin" and c.ok]
        assert sorted(fake.unpinned_spans()) == sorted((c.address, c.nbytes) for c in pins)
        assert all(c.mapped for c in fake.calls if c.ok)

    def test_spans_are_cut_to_max_pin_bytes(self, anyio_backend: str) -> None:
        fake = FakeBackend(inner=HostBackend(), max_pin_bytes=64 << 10)
        run(functools.partial(check_pin_backend, nbytes=1 << 20), anyio_backend, fake)
        spans = fake.pinned_spans()
        assert len(spans) == 16 and all(n == 64 << 10 for _, n in spans)

    @pytest.mark.cuda
    def test_cuda_backend(self, anyio_backend: str) -> None:
        from asyncpin._cudart import cudart
        from asyncpin.cuda import CudaBackend

        probe = cuda_registered if cudart() is not None else None
        check = functools.partial(check_pin_backend, is_pinned=probe)
        run(check, anyio_backend, CudaBackend())


class UnpinDoesNothing(HostBackend):
    __slots__ = ()

    def unpin(self, address: int, nbytes: int) -> None:
        pass


class PinDoesNothing(HostBackend):
    __slots__ = ()

    def pin(self, address: int, nbytes: int) -> None:
        pass

    def unpin(self, address: int, nbytes: int) -> None:
        pass


class SilentFailures(HostBackend):
    __slots__ = ()

    def pin(self, address: int, nbytes: int) -> None:
        with contextlib.suppress(OSError):
            super().pin(address, nbytes)


class PlainOSErrors(HostBackend):
    __slots__ = ()

    def pin(self, address: int, nbytes: int) -> None:
        try:
            super().pin(address, nbytes)
        except OSError as exc:
            raise OSError(exc.errno, "mlock failed") from None


class RecordsPins(HostBackend):
    __slots__ = ("addresses",)

    def __init__(self) -> None:
        super().__init__()
        self.addresses: list[int] = []

    def pin(self, address: int, nbytes: int) -> None:
        self.addresses.append(address)
        super().pin(address, nbytes)


class RefusesEveryPin(HostBackend):
    __slots__ = ()

    def pin(self, address: int, nbytes: int) -> None:
        raise BackendCallError("pin", errno.ENOMEM, "ENOMEM", "refused")


class TestPinBackendCheckFails:
    """check_pin_backend raises AssertionError on a backend that breaks the contract."""

    @pytest.mark.parametrize(
        ("backend", "match"),
        [
            (UnpinDoesNothing(), "still locked"),
            (PinDoesNothing(), "grew by 0"),
            (SilentFailures(), "unmapped page returned"),
            (PlainOSErrors(), "not BackendCallError"),
        ],
        ids=["unpin-does-nothing", "pin-does-nothing", "silent-failure", "plain-oserror"],
    )
    def test_broken_backend(self, anyio_backend: str, backend: HostBackend, match: str) -> None:
        with pytest.raises(AssertionError, match=match):
            run(check_pin_backend, anyio_backend, backend)

    def test_a_probe_that_sees_no_pin(self, anyio_backend: str) -> None:
        check = functools.partial(check_pin_backend, is_pinned=lambda address, nbytes: False)
        with pytest.raises(AssertionError, match="is not pinned"):
            run(check, anyio_backend, HostBackend())

    def test_the_same_span_is_named_and_pins_go_in_order(self, anyio_backend: str) -> None:
        """With one pin thread the spans are pinned in address order, and of spans that
        all fail the first is named, on every loop (trio runs a batch of woken tasks in
        reversed order half of the time: each round would fail with even odds if the
        order were the tasks')."""
        check = functools.partial(check_pin_backend, pin_threads=1, nbytes=1 << 20)
        for _ in range(ROUNDS):
            recording = RecordsPins()
            in_quarters = functools.partial(check, chunk_bytes=1 << 18, unmapped_fails=False)
            run(in_quarters, anyio_backend, recording)
            assert len(recording.addresses) == 4
            assert recording.addresses == sorted(recording.addresses)
            with pytest.raises(AssertionError, match=r"\(offset 0, "):
                run(check, anyio_backend, RefusesEveryPin())


class TestTransferEngineConformance:
    """Every real engine passes check_transfer_engine, on asyncio and trio."""

    def test_host_engine(self, anyio_backend: str) -> None:
        run(check_transfer_engine, anyio_backend, HostTransferEngine, cpu_layout())

    def test_host_engine_over_pinned_chunks(self, anyio_backend: str) -> None:
        check = functools.partial(check_transfer_engine, backend=HostBackend(), method="host")
        run(check, anyio_backend, HostTransferEngine, cpu_layout())

    def test_host_engine_blocks_across_chunks(self, anyio_backend: str) -> None:
        """Host blocks of 3 KiB: chunks (one page each) cut through blocks."""
        layout = KVLayout.from_tensors([torch.zeros(16, 3, 512, dtype=torch.int8)])
        check = functools.partial(check_transfer_engine, num_host_blocks=20, pageable_blocks=6)
        run(check, anyio_backend, HostTransferEngine, layout)

    def test_blocks_under_a_page_need_no_host_block_count(self, anyio_backend: str) -> None:
        """Host blocks of 256 bytes, 16 to a one-page chunk: the default number of host
        blocks leaves enough pinned and pageable ones (a hostile trial: the defaults
        raised ValueError, asking for more host blocks)."""
        layout = KVLayout.from_tensors([torch.zeros(12, 4, 8) for _ in range(2)])
        run(check_transfer_engine, anyio_backend, HostTransferEngine, layout)

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_host_engine_every_layout(self, anyio_backend: str, name: str) -> None:
        """Mixed block shapes and dtypes, dense permuted (HND) blocks, odd sizes."""
        layout = build(name, 16, "cpu")
        check = functools.partial(check_transfer_engine, num_host_blocks=host_blocks_for(layout))
        run(check, anyio_backend, HostTransferEngine, layout)

    def test_fake_engine_that_copies(self, anyio_backend: str) -> None:
        factory = functools.partial(FakeEngine, auto=True, copy=True)
        run(check_transfer_engine, anyio_backend, factory, cpu_layout())

    def test_a_pageable_job_before_prepare_is_checked(self, anyio_backend: str) -> None:
        # An engine that says it takes pageable jobs before prepare() gets one then
        # (FakeEngine in the background says so and does).
        factory = functools.partial(FakeEngine, auto=True, copy=True, background=True)
        run(check_transfer_engine, anyio_backend, factory, cpu_layout())

        # Engines that say so but refuse pageable jobs before prepare(): every one, or
        # loads only. The check fails them.
        for refused in (("store", "load"), ("load",)):

            class Refuses(FakeEngine):
                directions = refused

                def submit(self, job: Any, *, pageable: bool) -> None:
                    if not self.prepared and job.transfer.direction in self.directions:
                        raise RuntimeError(f"no {job.transfer.direction} before prepare")
                    super().submit(job, pageable=pageable)

            refusing = functools.partial(Refuses, auto=True, copy=True, background=True)
            with pytest.raises(Exception, match=f"no {refused[0]} before prepare"):
                run(check_transfer_engine, anyio_backend, refusing, cpu_layout())
            # The error's frames hold the engine, whose view of the region defers the
            # region's unmapping: collected now, not in a later test that counts mappings.
            gc.collect()

    @pytest.mark.cuda
    def test_cuda_engine_every_method(self, anyio_backend: str) -> None:
        from asyncpin.cuda import CudaBackend
        from asyncpin.engines.cuda import CudaTransferEngine

        made: list[CudaTransferEngine] = []

        def factory(setup: EngineSetup) -> CudaTransferEngine:
            made.append(CudaTransferEngine(setup))
            return made[-1]

        check = functools.partial(check_transfer_engine, backend=CudaBackend())
        run(check, anyio_backend, factory, cuda_layout())
        methods = made[0].methods()
        assert "batch" in methods
        for method in methods:
            check = functools.partial(
                check_transfer_engine, backend=CudaBackend(), method=cast(Method, method)
            )
            run(check, anyio_backend, factory, cuda_layout())

    @pytest.mark.cuda
    @pytest.mark.parametrize("name", ["flashinfer_hnd", "mla_indexer"])
    def test_cuda_engine_mixed_and_hnd_layouts(self, anyio_backend: str, name: str) -> None:
        from asyncpin.cuda import CudaBackend
        from asyncpin.engines.cuda import CudaTransferEngine

        made: list[CudaTransferEngine] = []

        def factory(setup: EngineSetup) -> CudaTransferEngine:
            made.append(CudaTransferEngine(setup))
            return made[-1]

        layout = build(name, 16, "cuda")
        blocks = host_blocks_for(layout)
        check = functools.partial(
            check_transfer_engine, backend=CudaBackend(), num_host_blocks=blocks
        )
        run(check, anyio_backend, factory, layout)
        for method in made[0].methods():
            check = functools.partial(
                check_transfer_engine,
                backend=CudaBackend(),
                num_host_blocks=blocks,
                method=cast(Method, method),
            )
            run(check, anyio_backend, factory, layout)


class BrokenEngine:
    """A host engine whose reports of jobs go through :meth:`report` (override it)."""

    name = "broken"

    def __init__(self, setup: EngineSetup) -> None:
        self.inner = HostTransferEngine(setup)

    def methods(self) -> tuple[str, ...]:
        return self.inner.methods()

    def prepare(self) -> None:
        self.inner.prepare()

    def record_ready(self) -> None:
        return None

    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        original = job.on_finish
        assert original is not None

        def report(finished: TransferJob, error: BaseException | None) -> None:
            self.report(finished, error, original)

        job.on_finish = report
        self.inner.submit(job, pageable=pageable)

    def report(self, job: TransferJob, error: BaseException | None, original: Any) -> None:
        original(job, error)

    def close(self) -> None:
        self.inner.close()


class ReportsTwice(BrokenEngine):
    def report(self, job: TransferJob, error: BaseException | None, original: Any) -> None:
        original(job, error)
        original(job, error)


class ReportsOffTheLoop(BrokenEngine):
    def report(self, job: TransferJob, error: BaseException | None, original: Any) -> None:
        threading.Thread(target=original, args=(job, error)).start()


class ReportsOutOfOrder(BrokenEngine):
    """Holds each direction's reports until its last copy is over, then reports them
    newest first (the bytes are all right)."""

    def __init__(self, setup: EngineSetup) -> None:
        super().__init__(setup)
        self.pending: dict[str, int] = {"store": 0, "load": 0}
        self.held: dict[str, list[tuple[TransferJob, Any, Any]]] = {"store": [], "load": []}

    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        self.pending[job.transfer.direction] += 1
        super().submit(job, pageable=pageable)

    def report(self, job: TransferJob, error: BaseException | None, original: Any) -> None:
        direction = job.transfer.direction
        self.pending[direction] -= 1
        self.held[direction].append((job, error, original))
        if not self.pending[direction]:
            held, self.held[direction] = self.held[direction], []
            for args in reversed(held):
                args[2](args[0], args[1])


class DropsLoads(BrokenEngine):
    def report(self, job: TransferJob, error: BaseException | None, original: Any) -> None:
        if job.transfer.direction == "store":
            original(job, error)


class KeepsTheView(BrokenEngine):
    def close(self) -> None:
        pass


class CopiesOnTheLoop(BrokenEngine):
    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        job.transfer.method = "host"
        job.transfer.path = "pageable" if pageable else "pinned"
        if pageable and job.reserve is not None:
            job.reserve()
        self.inner._copy(job)
        job.finish()


class WrongPath(BrokenEngine):
    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        super().submit(job, pageable=pageable)
        job.transfer.path = "pinned"


class IgnoresArrays(HostTransferEngine):
    """Copies every array of a job, whatever ``job.arrays`` says."""

    name = "ignores-arrays"

    def _copy(self, job: TransferJob) -> None:
        super()._copy(dataclasses.replace(job, arrays=None))


class IgnoresRowStride(HostTransferEngine):
    """Takes host blocks to lie ``host_block_bytes`` apart, not ``host_blocks.stride(0)``
    (right only while no ranks share the rows)."""

    name = "ignores-row-stride"

    def __init__(self, setup: EngineSetup) -> None:
        super().__init__(setup)
        host = setup.host_blocks
        self._host = host.as_strided(tuple(host.shape), (setup.layout.host_block_bytes, 1))


class CopiesLogicalOrder(HostTransferEngine):
    """Copies each block's elements in logical order (``array[g].reshape(-1)``), not as
    they lie in memory: right for contiguous blocks, wrong for permuted (HND) ones."""

    name = "logical-order"

    def _copy(self, job: TransferJob) -> None:
        host, layout = self._host, self._layout
        assert host is not None
        for a in job.arrays or range(layout.num_arrays):
            array, start = layout.arrays[a], layout.array_offsets[a]
            for g, c in zip(job.gpu_ids, job.cpu_ids, strict=True):
                part = host[c, start : start + layout.array_block_bytes[a]]
                if job.transfer.direction == "store":
                    part.copy_(array[g].reshape(-1).view(torch.uint8))
                else:
                    array[g].copy_(part.view(array.dtype).view(array[g].shape))


class TestTransferEngineCheckFails:
    """check_transfer_engine raises AssertionError on an engine that breaks the contract."""

    @pytest.mark.parametrize(
        ("engine", "match"),
        [
            (ReportsTwice, "reported 2 times"),
            (ReportsOffTheLoop, "not on the event loop thread"),
            (ReportsOutOfOrder, "not in submission order"),
            (KeepsTheView, "outlives close"),
            (CopiesOnTheLoop, "ran on the event loop"),
            (WrongPath, "not 'pageable'"),
            (
                IgnoresArrays,
                r"after a store of arrays 1 to 3 \(only those arrays move\), host block \d+ "
                "holds wrong bytes: .* in array 0 ",
            ),
            (
                IgnoresRowStride,
                r"\(host rows shared by ranks: host_slice=\(1, 2\)\): after a store, the "
                "engine wrote outside its host blocks",
            ),
        ],
        ids=lambda v: v if isinstance(v, str) else v.__name__,
    )
    def test_broken_engine(self, anyio_backend: str, engine: Any, match: str) -> None:
        with pytest.raises(AssertionError, match=match):
            run(check_transfer_engine, anyio_backend, engine, cpu_layout())

    def test_logical_order_on_permuted_blocks(self, anyio_backend: str) -> None:
        """Right on contiguous blocks; caught on FlashInfer's HND blocks, whose bytes lie
        heads first."""
        for name in ("joined", "flashinfer_hnd"):
            layout = build(name, 16, "cpu")
            blocks = host_blocks_for(layout)
            check = functools.partial(check_transfer_engine, num_host_blocks=blocks)
            if name == "joined":
                run(check, anyio_backend, CopiesLogicalOrder, layout)
                continue
            with pytest.raises(AssertionError, match=r"after a store, host block \d+ holds wrong"):
                run(check, anyio_backend, CopiesLogicalOrder, layout)

    def test_a_job_never_reported(self, anyio_backend: str) -> None:
        check = functools.partial(check_transfer_engine, timeout_s=0.5)
        with pytest.raises(AssertionError, match="not reported within"):
            run(check, anyio_backend, DropsLoads, cpu_layout())


# -- FakeEngine -----------------------------------------------------------------------


def job(direction: Direction, gpu: list[int], cpu: list[int]) -> TransferJob:
    return TransferJob(Transfer(direction, len(gpu), 0), gpu, cpu, "auto")


def host_blocks(layout: KVLayout, num: int = 8) -> torch.Tensor:
    return torch.zeros(num, layout.host_block_bytes, dtype=torch.uint8)


class TestFakeEngine:
    """FakeEngine records jobs and reports each once, in order, as the test commands."""

    def test_finish_next_in_order(self, anyio_backend: str) -> None:
        run(self._finish_next_in_order, anyio_backend)

    async def _finish_next_in_order(self) -> None:
        layout = cpu_layout()
        async with anyio.create_task_group() as tg:
            engine = FakeEngine(EngineSetup(layout, host_blocks(layout), 4096, tg.start_soon))
            engine.prepare()
            jobs = [job("store", [i], [i]) for i in range(3)]
            for j in jobs:
                engine.submit(j, pageable=j is jobs[2])
            assert [s.pageable for s in engine.submitted] == [False, False, True]
            assert [j.transfer.method for j in jobs] == ["fake"] * 3
            assert jobs[2].transfer.path == "pageable"
            assert engine.held("store") == jobs and engine.held("load") == []
            assert engine.finish_next("store") is jobs[0]
            assert jobs[0].transfer.done() and not jobs[1].transfer.done()
            error = OSError("injected")
            engine.finish_next("store", error)
            assert jobs[1].transfer.error is error
            with pytest.raises(LookupError):
                engine.finish_next("load")
            engine.finish_next("store")
            await jobs[2].transfer
            engine.close()

    def test_fail_submit_queues_nothing(self, anyio_backend: str) -> None:
        run(self._fail_submit_queues_nothing, anyio_backend)

    async def _fail_submit_queues_nothing(self) -> None:
        layout = cpu_layout()
        async with anyio.create_task_group() as tg:
            engine = FakeEngine(EngineSetup(layout, host_blocks(layout), 4096, tg.start_soon))
            engine.prepare()
            error = RuntimeError("no room")
            engine.fail_submit(error)
            refused, taken = job("load", [0], [0]), job("load", [1], [1])
            with pytest.raises(RuntimeError) as caught:
                engine.submit(refused, pageable=False)
            assert caught.value is error
            assert engine.submitted == [] and engine.held("load") == []
            engine.submit(taken, pageable=False)
            assert engine.held("load") == [taken]
            engine.finish_next("load")
            assert not refused.transfer.done()
            engine.close()

    def test_auto_reports_in_order_and_fails_copies(self, anyio_backend: str) -> None:
        run(self._auto_reports_in_order_and_fails_copies, anyio_backend)

    async def _auto_reports_in_order_and_fails_copies(self) -> None:
        layout = cpu_layout()
        order: list[TransferJob] = []
        async with anyio.create_task_group() as tg:
            engine = FakeEngine(
                EngineSetup(layout, host_blocks(layout), 4096, tg.start_soon), auto=True
            )
            engine.prepare()
            error = OSError("copy failed")
            engine.fail_copy(error, direction="load")
            jobs = [job(d, [i], [i]) for i in range(3) for d in ("store", "load")]

            def record(finished: TransferJob, e: BaseException | None) -> None:
                order.append(finished)
                finished.transfer._finish(e)

            for j in jobs:
                j.on_finish = record
                engine.submit(j, pageable=False)
            with anyio.fail_after(10):
                for j in jobs:
                    with contextlib.suppress(OSError):
                        await j.transfer
            assert jobs[1].transfer.error is error
            assert [j.transfer.error for j in jobs if j is not jobs[1]] == [None] * 5
            for d in ("store", "load"):
                assert [j for j in order if j.transfer.direction == d] == [
                    j for j in jobs if j.transfer.direction == d
                ]
            assert all(s.finished for s in engine.submitted)
            engine.close()

    def test_copy_moves_bytes_in_order(self, anyio_backend: str) -> None:
        run(self._copy_moves_bytes_in_order, anyio_backend)

    async def _copy_moves_bytes_in_order(self) -> None:
        layout = cpu_layout()
        for g, array in enumerate(layout.arrays):
            array.copy_(torch.arange(array.numel()).reshape(array.shape).to(array.dtype) + g)
        host = host_blocks(layout)
        async with anyio.create_task_group() as tg:
            engine = FakeEngine(EngineSetup(layout, host, 4096, tg.start_soon), copy=True)
            await anyio.to_thread.run_sync(engine.prepare)
            store, failed = job("store", [0, 1], [5, 6]), job("store", [2], [7])
            engine.submit(store, pageable=False)
            engine.submit(failed, pageable=False)
            engine.finish_next("store")
            error = OSError("injected")
            engine.finish_next("store", error)
            with anyio.fail_after(10):
                await store.transfer
                with pytest.raises(OSError) as caught:
                    await failed.transfer
            assert caught.value is error
            typed = host_blocks_view(host, layout)
            for a, array in enumerate(layout.arrays):
                assert torch.equal(typed[5:7, a], array[0:2])
            await anyio.to_thread.run_sync(engine.close)

    def test_refuses_what_the_contract_forbids(self, anyio_backend: str) -> None:
        run(self._refuses_what_the_contract_forbids, anyio_backend)

    async def _refuses_what_the_contract_forbids(self) -> None:
        layout = cpu_layout()
        async with anyio.create_task_group() as tg:
            engine = FakeEngine(EngineSetup(layout, host_blocks(layout), 4096, tg.start_soon))
            with pytest.raises(RuntimeError, match="before prepare"):
                engine.submit(job("store", [0], [0]), pageable=False)
            engine.prepare()
            with pytest.raises(RuntimeError, match="event loop thread"):
                await anyio.to_thread.run_sync(
                    functools.partial(engine.submit, job("store", [0], [0]), pageable=False)
                )
            engine.submit(job("store", [0], [0]), pageable=False)
            with pytest.raises(RuntimeError, match="not finished"):
                engine.close()
            engine.finish_next("store")
            engine.close()
            with pytest.raises(RuntimeError, match="after close"):
                engine.submit(job("store", [0], [0]), pageable=False)

    def test_pageable_calls_reserve(self, anyio_backend: str) -> None:
        run(self._pageable_calls_reserve, anyio_backend)

    async def _pageable_calls_reserve(self) -> None:
        layout = cpu_layout()
        async with anyio.create_task_group() as tg:
            engine = FakeEngine(EngineSetup(layout, host_blocks(layout), 4096, tg.start_soon))
            engine.prepare()
            calls: list[int] = []
            reserved = job("store", [0], [0])
            reserved.reserve = lambda: calls.append(1)
            engine.submit(reserved, pageable=True)
            engine.finish_next("store")
            assert calls == [1] and reserved.transfer.done()
            engine.close()
