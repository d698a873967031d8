"""The CUDA backend on a real GPU (run with `pytest -m cuda` on the GPU machine)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest
import torch

from asyncpin import OffloadManager, PinError, capture_gate
from asyncpin.errors import BackendCallError
from asyncpin.testing import FakeBackend

if TYPE_CHECKING:
    from asyncpin.cuda import CudaBackend

pytestmark = pytest.mark.cuda

MiB = 1 << 20
GiB = 1 << 30
NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered
ALREADY_REGISTERED = 712


def _cudart() -> ctypes.CDLL:
    from asyncpin._cudart import cudart

    lib = cudart()
    assert lib is not None, "libcudart must be loaded by torch on the GPU machine"
    return lib


def _cuda_backend() -> CudaBackend:
    from asyncpin.cuda import CudaBackend

    return CudaBackend()


def _chunk_addresses(fake: FakeBackend) -> list[int]:
    return [address for address, _ in fake.pinned_spans()]


def _assert_all_unregistered(addresses: list[int]) -> None:
    lib = _cudart()
    for address in addresses:
        code = lib.cudaHostUnregister(ctypes.c_void_p(address))
        lib.cudaGetLastError()
        assert code == NOT_REGISTERED, f"chunk at 0x{address:x} still registered ({code})"


class TestPinAndCopy:
    """Pinned chunks are pinned for torch, copy both ways, and are all unregistered at close."""

    async def test_pin_copy_close(self) -> None:
        fake = FakeBackend(inner=_cuda_backend())
        with anyio.fail_after(120):
            async with OffloadManager(1 * GiB, backend=fake, chunk_bytes=64 * MiB) as mgr:
                await mgr.pinned
                assert mgr.is_pinned()
                view = mgr.host_view(128 * MiB, 64 * MiB)
                assert view.is_pinned()

                src = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8, device="cuda")
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    # Keep the stream busy so an honest non_blocking copy cannot be done
                    # by the time copy_ returns to the host.
                    torch.cuda._sleep(2_000_000_000)
                    view.copy_(src, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                busy = not done.query()
                assert busy, "non_blocking D2H from a pinned chunk blocked the host"
                done.synchronize()
                assert torch.equal(view, src.cpu())

                host_src = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8)
                view.copy_(host_src)
                dst = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
                with torch.cuda.stream(stream):
                    dst.copy_(view, non_blocking=True)
                stream.synchronize()
                assert torch.equal(dst.cpu(), host_src)
                addresses = _chunk_addresses(fake)
        assert len(addresses) == 16
        assert sorted(fake.unpinned_spans()) == sorted(fake.pinned_spans())
        assert all(call.mapped for call in fake.calls)
        _assert_all_unregistered(addresses)

    async def test_chunks_respect_the_per_call_limit(self) -> None:
        from asyncpin.cuda import CUDA_MAX_PIN_BYTES

        mgr = OffloadManager(1 * GiB, backend="cuda", chunk_bytes=1 << 40)
        assert mgr.stats().chunk_bytes == CUDA_MAX_PIN_BYTES


def _capture_child(mode: str) -> dict[str, Any]:
    """Run tests/cuda/cuda_capture_child.py in its own process and return its report."""
    repo = str(Path(__file__).parents[2])
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("cuda_capture_child.py")), mode],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=path),
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


class TestCaptureGate:
    """Graph capture and registration never overlap under the gate; without it they do."""

    @pytest.mark.parametrize("mode", ["gated", "hook"])
    def test_100_captures_interleaved_with_pinning(self, mode: str) -> None:
        report = _capture_child(mode)
        print(f"{mode} capture report:", json.dumps(report))
        assert report["errors"] == []
        assert report["pin_error_code"] is None
        assert report["captures"] >= 100
        assert report["during_pinning"] > 0, "no capture overlapped pinning: proves nothing"
        assert report["chunks_pinned_at_end"] == report["chunks_total"]

    def test_without_the_gate_capture_and_registration_collide(self) -> None:
        # The collision is a race: it showed after 850 captures in one H200 run and not in
        # 1290 captures of another. Two attempts; if neither collides the negative control
        # is reported as not shown (skipped), never as passed.
        reports = []
        for _ in range(2):
            report = _capture_child("ungated")
            print("ungated capture report:", json.dumps(report))  # shown with `pytest -s`
            reports.append(report)
            if report["errors"] or report["pin_error_code"] in (900, 901):
                return
        pytest.skip(f"the ungated race did not occur in {len(reports)} runs: {reports}")

    async def test_process_wide_gate_as_a_context_manager(self) -> None:
        x = torch.randn(64, 64, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.relu(x @ x)
        torch.cuda.synchronize()
        with anyio.fail_after(300):
            async with OffloadManager(2 * GiB, backend="cuda", chunk_bytes=32 * MiB) as mgr:
                captures = 0
                while not mgr.pinned.is_set():
                    with capture_gate():
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph):
                            y = torch.relu(x @ x)
                        graph.replay()
                    captures += 1
                    await anyio.lowlevel.checkpoint()
                await mgr.pinned
                torch.cuda.synchronize()
                assert torch.allclose(y, torch.relu(x @ x))


class TestCudaFailures:
    """CUDA failures become typed errors naming the CUDA error, and close stays exact."""

    async def test_chunk_registered_twice(self) -> None:
        lib = _cudart()
        taken: list[int] = []

        def register_first(n: int, address: int, nbytes: int) -> None:
            if n == 3:
                assert lib.cudaHostRegister(ctypes.c_void_p(address), nbytes, 0) == 0
                taken.append(address)

        fake = FakeBackend(inner=_cuda_backend(), before_pin=register_first)
        with anyio.fail_after(120):
            async with OffloadManager(
                512 * MiB, backend=fake, chunk_bytes=64 * MiB, prefault_threads=1
            ) as mgr:
                with pytest.raises(PinError) as info:
                    await mgr.pinned
                assert lib.cudaHostUnregister(ctypes.c_void_p(taken[0])) == 0
        err = info.value
        assert err.code == ALREADY_REGISTERED
        assert err.code_name == "cudaErrorHostMemoryAlreadyRegistered"
        assert isinstance(err.__cause__, BackendCallError)
        assert (err.chunk_index, err.offset, err.nbytes) == (3, 3 * 64 * MiB, 64 * MiB)
        pinned = fake.pinned_spans()
        assert sorted(fake.unpinned_spans()) == sorted(pinned)
        assert taken[0] not in [a for a, _ in pinned]
        _assert_all_unregistered([a for a, _ in pinned])
        # The failure left no sticky error behind for torch to trip over.
        torch.ones(4, device="cuda").sum().item()

    def test_invalid_pointer_is_a_typed_error(self) -> None:
        backend = _cuda_backend()
        with pytest.raises(BackendCallError) as info:
            backend.unpin(0x1000, 4096)
        assert info.value.code != 0
        assert info.value.code_name.startswith("cudaError")
        torch.cuda.synchronize()
        assert torch.ones(4, device="cuda").sum().item() == 4


class TestDemoOnGpu:
    """`python -m asyncpin demo` picks the GPU when there is one."""

    def test_demo_uses_cuda(self) -> None:
        repo = str(Path(__file__).parents[2])
        path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path)
        out = subprocess.run(
            [sys.executable, "-m", "asyncpin", "demo", "--size", "1GiB", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["stats"]["backend"] == "cuda"
        assert report["stats"]["state"] == "closed"
        assert report["at_pinned"]["pinned_bytes"] == report["at_pinned"]["nbytes"]
