"""Does registering host memory from a CUDA context of its own spare the application's
context? (Issue 17: the GPU step stretches while pinning and far more while closing,
because each cudaHostUnregister waits for the device to go idle and both calls hold up
other threads' launches; see register_sync.py.)

    python3 bench/probes/register_context.py [--chunk-mib 64] [--chunks 32]

For each mode, chunks of ``--chunk-mib``:

- ``primary``: cudaHostRegister(flags 0) in torch's context (what the backend does);
- ``primary-portable``: the same with cudaHostRegisterPortable;
- ``private-portable``: cuMemHostRegister(PORTABLE) with a context of its own made
  current for the call only (pushed, then popped);
- ``private``: the same without PORTABLE.

it prints: register / unregister times with the GPU idle; an unregister with a 200 ms
kernel queued on torch's context (does it wait for that context's work?); the longest
launch of a thread launching small kernels on torch's context while the chunks are
registered then unregistered; and whether a copy in torch's context treats the memory
as pinned (``is_pinned`` and the copy's speed, against a pageable copy of the same bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import threading
import time
from collections.abc import Callable, Iterator

import torch

from asyncpin._cudactx import _load_driver

CU_MEMHOSTREGISTER_PORTABLE = 1


def _ok(code: int, what: str) -> None:
    if int(code) != 0:
        raise RuntimeError(f"{what} returned {int(code)}")


@contextlib.contextmanager
def _launching(x: torch.Tensor) -> Iterator[list[float]]:
    """A thread launching small kernels on torch's context; yields their launch times."""
    launches: list[float] = []
    stop = threading.Event()

    def run() -> None:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            while not stop.is_set():
                t0 = time.perf_counter()
                x.add_(1)
                launches.append(time.perf_counter() - t0)
                if len(launches) % 64 == 0:
                    s.synchronize()

    th = threading.Thread(target=run)
    th.start()
    time.sleep(0.1)
    n0 = len(launches)
    try:
        yield launches
    finally:
        stop.set()
        th.join()
        del launches[:n0]


def _timed(fn: Callable[..., None], *args: int) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def _copy_gbps(dst: torch.Tensor, host: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return host.numel() / (time.perf_counter() - t0) / 1e9


def _uva_read(cu: ctypes.CDLL, ctx: ctypes.c_void_p, in_private: Callable[..., None]) -> bool:
    """Device code in torch's context reads memory registered (PORTABLE) by the private
    context through its host address, as the engine's copy kernel does."""
    from asyncpin._cudart import Runtime
    from asyncpin.engines.cuda.kernel import CopyKernel

    n = 1 << 20
    host = torch.arange(n, dtype=torch.int64)
    addr = host.data_ptr()
    in_private(lambda: cu.cuMemHostRegister_v2(addr, n * 8, 3), "reg")
    try:
        dst = torch.zeros(n, dtype=torch.int64, device="cuda")
        ids = torch.zeros(1, dtype=torch.int64, device="cuda")

        def table(v: int) -> torch.Tensor:
            return torch.tensor([v], dtype=torch.int64, device="cuda")

        tables = [table(dst.data_ptr()), table(0), table(n), table(0)]
        args = (ids.data_ptr(), ids.data_ptr(), *(t.data_ptr() for t in tables), addr, 0, 0, 1, 1)
        stream = torch.cuda.current_stream().cuda_stream
        CopyKernel(Runtime()).launch(stream, 1, args, to_host=False)
        torch.cuda.synchronize()
        return bool(torch.equal(dst.cpu(), host))
    finally:
        in_private(lambda: cu.cuMemHostUnregister(addr), "unreg")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--chunk-mib", type=int, default=64)
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--mode", action="append")
    p.add_argument("--uva-check", action="store_true", help="device code reads the memory")
    args = p.parse_args()
    torch.cuda.init()
    x = torch.ones(1 << 20, device="cuda")
    rt = torch.cuda.cudart()
    cu = _load_driver()
    _ok(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    _ok(cu.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    free_before_ctx = torch.cuda.mem_get_info()[0]
    with _launching(x) as during_create:
        t0 = time.perf_counter()
        _ok(cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
        ctx_create_ms = (time.perf_counter() - t0) * 1e3
        popped = ctypes.c_void_p()
        _ok(cu.cuCtxPopCurrent_v2(ctypes.byref(popped)), "cuCtxPopCurrent")
    free_after_ctx = torch.cuda.mem_get_info()[0]
    # A device-wide synchronize from this thread with a 200 ms kernel queued on another
    # stream: does it hold up another thread's launches while it waits?
    side0 = torch.cuda.Stream()
    with _launching(x) as during_sync:
        with torch.cuda.stream(side0):
            torch.cuda._sleep(int(1.98e9 * 0.2))
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        sync_ms = (time.perf_counter() - t0) * 1e3

    def in_private(fn: Callable[[], int], what: str) -> None:
        _ok(cu.cuCtxPushCurrent_v2(ctx), "push")
        try:
            _ok(fn(), what)
        finally:
            out = ctypes.c_void_p()
            _ok(cu.cuCtxPopCurrent_v2(ctypes.byref(out)), "pop")

    modes: dict[str, tuple[Callable[[int, int], None], Callable[[int], None]]] = {
        "primary": (
            lambda a, n: _ok(rt.cudaHostRegister(a, n, 0), "cudaHostRegister"),
            lambda a: _ok(rt.cudaHostUnregister(a), "cudaHostUnregister"),
        ),
        "primary-portable": (
            lambda a, n: _ok(rt.cudaHostRegister(a, n, 1), "cudaHostRegister"),
            lambda a: _ok(rt.cudaHostUnregister(a), "cudaHostUnregister"),
        ),
        "private-portable": (
            lambda a, n: in_private(
                lambda: cu.cuMemHostRegister_v2(a, n, CU_MEMHOSTREGISTER_PORTABLE), "reg"
            ),
            lambda a: in_private(lambda: cu.cuMemHostUnregister(a), "unreg"),
        ),
        "private": (
            lambda a, n: in_private(lambda: cu.cuMemHostRegister_v2(a, n, 0), "reg"),
            lambda a: in_private(lambda: cu.cuMemHostUnregister(a), "unreg"),
        ),
    }
    size = args.chunk_mib << 20
    out: dict[str, object] = {"ctx_create_ms": ctx_create_ms, "chunk_mib": args.chunk_mib}
    out["ctx_device_mib"] = (free_before_ctx - free_after_ctx) / (1 << 20)
    out["launch_max_ms_during_ctx_create"] = max(during_create, default=0.0) * 1e3
    out["device_sync_ms"] = sync_ms
    out["launch_max_ms_during_device_sync"] = max(during_sync, default=0.0) * 1e3
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    for mode in args.mode or list(modes):
        register, unregister = modes[mode]
        buf = torch.ones(size * args.chunks, dtype=torch.uint8)
        base = buf.data_ptr()
        addrs = [base + i * size for i in range(args.chunks)]

        res: dict[str, object] = {}
        # Pageable copy speed of these bytes, for comparison.
        host = buf[:size]
        res["pageable_copy_gbps"] = _copy_gbps(dst, host)
        res["idle_reg_ms"] = [round(_timed(register, a, size), 3) for a in addrs[:8]]
        res["is_pinned"] = bool(host.is_pinned())
        _copy_gbps(dst, host)
        res["registered_copy_gbps"] = _copy_gbps(dst, host)
        res["idle_unreg_ms"] = [round(_timed(unregister, a), 3) for a in addrs[:8]]
        side = torch.cuda.Stream()
        register(addrs[0], size)
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(1.98e9 * 0.2))  # ~200 ms at 1.98 GHz
        res["unreg_with_200ms_kernel_queued_ms"] = _timed(unregister, addrs[0])
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(1.98e9 * 0.2))
        res["reg_with_200ms_kernel_queued_ms"] = _timed(register, addrs[0], size)
        unregister(addrs[0])
        torch.cuda.synchronize()

        with _launching(x) as launches:
            res["launch_max_ms_alone"] = max(launches, default=0.0) * 1e3
            n0 = len(launches)
            t0 = time.perf_counter()
            for a in addrs:
                register(a, size)
            t1 = time.perf_counter()
            n1 = len(launches)
            res["launch_max_ms_during_reg"] = max(launches[n0:n1], default=0.0) * 1e3
            for a in addrs:
                unregister(a)
            t2 = time.perf_counter()
            n2 = len(launches)
            res["launch_max_ms_during_unreg"] = max(launches[n1:n2], default=0.0) * 1e3
        res["reg_total_ms"] = (t1 - t0) * 1e3
        res["unreg_total_ms"] = (t2 - t1) * 1e3
        res["launches_during_reg"] = n1 - n0
        res["launches_during_unreg"] = n2 - n1
        out[mode] = res
        del buf, host
    if args.uva_check:
        out["uva_read_ok"] = _uva_read(cu, ctx, in_private)
    t0 = time.perf_counter()
    _ok(cu.cuCtxDestroy_v2(ctx), "cuCtxDestroy")
    out["ctx_destroy_ms"] = (time.perf_counter() - t0) * 1e3
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
