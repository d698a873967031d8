"""The CUDA backend registers from a context of its own (run with `pytest -m cuda` on the
GPU machine): the application's kernels are not waited for at unpin, the calling
thread's current context never changes, and a driver that refuses the context leaves
the runtime's registration, as before."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator

import pytest
import torch
from structlog.testing import capture_logs

import asyncpin.cuda
from asyncpin.cuda import CudaBackend
from asyncpin.errors import BackendCallError
from asyncpin.region import HostRegion

pytestmark = pytest.mark.cuda

MiB = 1 << 20
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered
# About a second of device time at the H200's clock (torch.cuda._sleep counts cycles).
LONG_KERNEL_CYCLES = 2_000_000_000


@pytest.fixture
def region() -> Iterator[HostRegion]:
    region = HostRegion.create(16 * MiB)
    yield region
    region.release()


def _queue_long_kernel() -> torch.cuda.Event:
    """A kernel of about a second on a stream of torch's context; its end event."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(LONG_KERNEL_CYCLES)
        done = torch.cuda.Event()
        done.record(stream)
    return done


def _registered(address: int) -> bool:
    """Whether torch's context sees ``address`` as registered host memory."""
    from asyncpin._cudart import cudart

    lib = cudart()
    assert lib is not None
    flags = ctypes.c_uint(0)
    code = lib.cudaHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(address))
    lib.cudaGetLastError()
    return int(code) == 0


def _refuse_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver refuses asyncpin's own context from now on."""

    def refuse(device: int) -> None:
        raise BackendCallError("cuCtxCreate", 2, "cudaErrorMemoryAllocation", "no memory")

    monkeypatch.setattr(asyncpin.cuda, "pin_context", refuse)


def _current_context() -> int:
    lib = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_void_p()
    assert lib.cuCtxGetCurrent(ctypes.byref(handle)) == 0
    return handle.value or 0


class TestOwnContext:
    def test_unpin_does_not_wait_for_the_applications_kernels(self, region: HostRegion) -> None:
        backend = CudaBackend()
        backend.pin(region.address, region.nbytes)
        assert backend.own_context
        assert _registered(region.address)
        done = _queue_long_kernel()
        backend.unpin(region.address, region.nbytes)
        assert not done.query(), "the unpin waited for a kernel of torch's context"
        assert not _registered(region.address)
        done.synchronize()

    def test_in_the_runtimes_context_unpin_waits_for_the_device(self, region: HostRegion) -> None:
        # What the own context spares: the same unpin from torch's context waits for
        # every kernel queued on the device.
        backend = CudaBackend(own_context=False)
        backend.pin(region.address, region.nbytes)
        assert not backend.own_context
        done = _queue_long_kernel()
        backend.unpin(region.address, region.nbytes)
        assert done.query()
        assert not _registered(region.address)

    def test_before_unpin_waits_for_the_device(self, region: HostRegion) -> None:
        backend = CudaBackend()
        backend.pin(region.address, region.nbytes)
        try:
            done = _queue_long_kernel()
            backend.before_unpin()
            assert done.query()
        finally:
            backend.unpin(region.address, region.nbytes)

    def test_registered_memory_is_pinned_for_torch_copies(self, region: HostRegion) -> None:
        backend = CudaBackend()
        backend.pin(region.address, region.nbytes)
        try:
            view = region.view()
            assert view.is_pinned()
            src = torch.randint(0, 256, (region.nbytes,), dtype=torch.uint8, device="cuda")
            view.copy_(src, non_blocking=True)
            back = torch.empty_like(src)
            back.copy_(view, non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(back, src)
            del view
        finally:
            backend.unpin(region.address, region.nbytes)

    def test_the_calling_threads_context_is_unchanged(self, region: HostRegion) -> None:
        backend = CudaBackend()
        seen: dict[str, int] = {}
        failures: list[BaseException] = []

        def worker() -> None:
            try:
                torch.cuda.set_device(backend.device)
                torch.cuda.current_stream().synchronize()  # torch's context bound here
                seen["before"] = _current_context()
                backend.pin(region.address, region.nbytes)
                seen["after_pin"] = _current_context()
                backend.unpin(region.address, region.nbytes)
                seen["after_unpin"] = _current_context()
                # Memory allocated in this thread afterwards is torch's as before.
                torch.ones(4, device="cuda").sum().item()
            except BaseException as exc:  # reported to the test's thread
                failures.append(exc)

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join(60)
        assert not failures, failures
        assert seen["before"] != 0
        assert seen["after_pin"] == seen["before"] == seen["after_unpin"]

    def test_a_refused_context_falls_back_to_the_runtime(
        self, region: HostRegion, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _refuse_the_context(monkeypatch)
        backend = CudaBackend()
        with capture_logs() as logs:
            backend.pin(region.address, region.nbytes)
        assert not backend.own_context
        (warning,) = [e for e in logs if e["event"] == "pin.own_context_unavailable"]
        assert "no memory" in warning["error"]
        assert _registered(region.address)
        backend.unpin(region.address, region.nbytes)
        assert not _registered(region.address)
        # Once refused, the backend does not ask again.
        backend.pin(region.address, region.nbytes)
        backend.unpin(region.address, region.nbytes)
        assert [e["event"] for e in logs].count("pin.own_context_unavailable") == 1


class TestWarmUp:
    def test_warm_up_makes_the_context_before_any_pin(self, region: HostRegion) -> None:
        backend = CudaBackend()
        assert "runtime context" in repr(backend)
        backend.warm_up()
        assert "own context" in repr(backend) and backend.own_context
        backend.pin(region.address, region.nbytes)
        try:
            done = _queue_long_kernel()
            backend.unpin(region.address, region.nbytes)
            assert not done.query(), "registered in torch's context, not the backend's own"
        finally:
            assert not _registered(region.address)

    def test_a_refused_context_at_warm_up_falls_back_without_raising(
        self, region: HostRegion, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        _refuse_the_context(monkeypatch)
        backend = CudaBackend()
        with capture_logs() as logs:
            backend.warm_up()
        assert not backend.own_context
        assert [e["event"] for e in logs] == ["pin.own_context_unavailable"]
        backend.pin(region.address, region.nbytes)
        assert _registered(region.address)
        backend.unpin(region.address, region.nbytes)


@pytest.mark.anyio
async def test_a_kv_manager_warms_the_backend_up_before_the_engines_set_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The CUDA engine's set-up runs in the background; the backend's context is made
    # before it begins, not beside it (beside it, a process's first pin call took
    # 0.3-1.5 s on the H200: bench/probes/first_pin.py).
    import anyio

    from asyncpin import KVLayout, OffloadManager
    from asyncpin.engines.cuda import CudaTransferEngine

    order: list[str] = []

    class Recorded(CudaBackend):
        __slots__ = ()

        def warm_up(self) -> None:
            super().warm_up()
            order.append("warmed up" if self.own_context else "no own context")

        def pin(self, address: int, nbytes: int) -> None:
            order.append("pin")
            super().pin(address, nbytes)

    prepare = CudaTransferEngine.prepare

    def recorded_prepare(self: CudaTransferEngine) -> None:
        order.append("set-up")
        prepare(self)

    monkeypatch.setattr(CudaTransferEngine, "prepare", recorded_prepare)
    layout = KVLayout.from_tensors([torch.zeros(16, 4096, dtype=torch.uint8, device="cuda")])
    with anyio.fail_after(120):
        async with OffloadManager.for_kv(
            layout, 64, backend=Recorded(), chunk_bytes=64 << 10
        ) as mgr:
            await mgr.pinned
            assert mgr.stats().chunks_pinned == 4
    assert order[0] == "warmed up", order
    assert order.count("warmed up") == 1 and order.count("set-up") == 1
    assert order.count("pin") == 4
