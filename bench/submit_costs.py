"""Where a small transfer's time goes on CUDA: per-call costs of the host-side operations a
submission can use, and the completion paths of a single 32 KiB copy, one by one.

    python3 bench/submit_costs.py --json-out costs.json

Each figure is the median (and p99) of many repetitions, in microseconds, wall clock.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import ctypes
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin._cudart import Runtime as _Runtime
from bench._gpu import require_gpu

REPS = 2000


def cost(
    fn: Callable[[], Any], reps: int = REPS, between: Callable[[], Any] | None = None
) -> dict[str, float]:
    samples = []
    for _ in range(reps):
        if between is not None:
            between()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return {
        "p50_us": samples[len(samples) // 2] * 1e6,
        "p99_us": samples[int(len(samples) * 0.99)] * 1e6,
    }


def host_costs() -> dict[str, Any]:
    rt = _Runtime()
    lib = rt.lib
    dev = torch.device("cuda", 0)
    stream = torch.cuda.Stream(dev)
    s = stream.cuda_stream
    src = torch.randn(64, 16384, device=dev)  # 64 segments of 64 KiB
    host = torch.empty(64, 16384).pin_memory()
    out: dict[str, Any] = {}
    out["current_stream(dev)"] = cost(lambda: torch.cuda.current_stream(dev))
    out["current_stream()"] = cost(lambda: torch.cuda.current_stream())
    out["_cuda_getCurrentRawStream"] = cost(lambda: torch._C._cuda_getCurrentRawStream(0))
    out["Event(blocking)+record"] = cost(lambda: torch.cuda.Event(blocking=True).record(stream))
    ev = torch.cuda.Event()
    ev.record(stream)
    out["Event.record(stream)"] = cost(lambda: ev.record(stream))
    out["stream.wait_event"] = cost(lambda: stream.wait_event(ev))
    raw = ctypes.c_void_p()
    lib.cudaEventCreateWithFlags(ctypes.byref(raw), ctypes.c_uint(2 | 1))  # no timing, blocking
    lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    out["ctypes cudaEventRecord"] = cost(lambda: lib.cudaEventRecord(raw, s))
    out["ctypes cudaStreamWaitEvent"] = cost(lambda: lib.cudaStreamWaitEvent(s, raw, 0))
    out["ctypes cudaEventCreate+Destroy"] = cost(
        lambda: lib.cudaEventCreateWithFlags(ctypes.byref(ctypes.c_void_p()), 3)
    )
    out["device+stream context"] = cost(lambda: torch.cuda.device(dev).__enter__())

    def ctx() -> None:
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            pass

    out["with device, stream"] = cost(ctx)
    ids64 = list(range(64))
    out["torch.tensor([1])"] = cost(lambda: torch.tensor([5], dtype=torch.int64))
    out["torch.tensor(64 ids)"] = cost(lambda: torch.tensor(ids64, dtype=torch.int64))
    t = torch.tensor(ids64)
    out["tensor.unique"] = cost(lambda: torch.unique(t))
    out["tensor.min"] = cost(lambda: int(t.min()))
    out["array('Q', 64)"] = cost(lambda: array.array("Q", ids64))
    out["python addresses 1 block x 64 arrays"] = cost(
        lambda: [p + 3 * st for p, st in zip(ids64, ids64, strict=True)]
    )
    out["pin_memory(2 ids)"] = cost(lambda: torch.tensor([[1], [2]]).pin_memory())
    pinned = torch.tensor([[1], [2]]).pin_memory()
    out["pinned ids .to(dev, non_blocking)"] = cost(lambda: pinned.to(dev, non_blocking=True))
    seg = src.stride(0) * 4
    for n in (1, 64):
        dsts = array.array("Q", [host.data_ptr() + i * seg for i in range(n)])
        srcs = array.array("Q", [src.data_ptr() + i * seg for i in range(n)])
        sizes = array.array("Q", [seg] * n)

        def batch(dsts: Any = dsts, srcs: Any = srcs, sizes: Any = sizes) -> None:
            rt.copy_segments(dsts, srcs, sizes, s)

        out[f"cudaMemcpyBatchAsync {n} seg"] = cost(batch, 500, between=stream.synchronize)
    out["ctypes cudaMemcpyAsync 1 seg"] = cost(
        lambda: lib.cudaMemcpyAsync(host.data_ptr(), src.data_ptr(), seg, 4, s),
        500,
        between=stream.synchronize,
    )
    out["torch copy_ 1 seg non_blocking"] = cost(
        lambda: host[0].copy_(src[0], non_blocking=True), 500, between=stream.synchronize
    )
    try:
        from asyncpin._kernels import kv_copy

        ptrs = torch.tensor([src.data_ptr()], device=dev)
        strides = torch.tensor([seg], device=dev)
        gids = torch.zeros(1, dtype=torch.int64, device=dev)

        def launch() -> None:
            kv_copy[(1,)](
                gids, gids, ptrs, strides, host.data_ptr(), 1, 1, seg // 8, TO_HOST=True, BLOCK=512
            )

        launch()
        torch.cuda.synchronize()
        out["triton kv_copy launch"] = cost(launch, 500, between=stream.synchronize)
    except ImportError:
        pass
    torch.cuda.synchronize()
    return out


def completion_costs(samples: int) -> dict[str, Any]:
    """One 32 KiB D2H copy, submitted then awaited different ways; t0 is just before the
    copy is enqueued."""
    dev = torch.device("cuda", 0)
    stream = torch.cuda.Stream(dev)
    src = torch.randn(8192, device=dev)
    host = torch.empty(8192).pin_memory()
    out: dict[str, Any] = {}

    def pct(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"p50_us": xs[len(xs) // 2] * 1e6, "p99_us": xs[int(len(xs) * 0.99)] * 1e6}

    def enqueue(blocking: bool) -> Any:
        with torch.cuda.stream(stream):
            host.copy_(src, non_blocking=True)
        ev = torch.cuda.Event(blocking=blocking)
        ev.record(stream)
        return ev

    lat = []
    for _ in range(samples):
        t0 = time.perf_counter()
        enqueue(False)
        stream.synchronize()
        lat.append(time.perf_counter() - t0)
    out["stream.synchronize (spins)"] = pct(lat)

    for blocking in (True, False):
        lat = []
        for _ in range(samples):
            t0 = time.perf_counter()
            enqueue(blocking).synchronize()
            lat.append(time.perf_counter() - t0)
        out[f"event.synchronize same thread blocking={blocking}"] = pct(lat)

    async def via_thread(blocking: bool) -> tuple[list[float], list[float]]:
        """A persistent waiter thread fed through a queue, as the engine does."""
        import queue

        loop = asyncio.get_running_loop()
        jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        wake: list[float] = []

        def waiter() -> None:
            while (item := jobs.get()) is not None:
                ev, fut, t0 = item
                ev.synchronize()
                wake.append(time.perf_counter() - t0)
                loop.call_soon_threadsafe(fut.set_result, None)

        th = threading.Thread(target=waiter)
        th.start()
        resume = []
        for _ in range(samples):
            fut = loop.create_future()
            t0 = time.perf_counter()
            jobs.put((enqueue(blocking), fut, t0))
            await fut
            resume.append(time.perf_counter() - t0)
        jobs.put(None)
        th.join()
        return wake, resume

    async def to_thread_peer() -> list[float]:
        lat = []
        for _ in range(samples):
            t0 = time.perf_counter()
            ev = enqueue(False)
            await asyncio.to_thread(ev.synchronize)
            lat.append(time.perf_counter() - t0)
        return lat

    for blocking in (True, False):
        wake, resume = asyncio.run(via_thread(blocking))
        out[f"waiter thread wakes blocking={blocking}"] = pct(wake)
        out[f"loop resumes blocking={blocking}"] = pct(resume)
    out["peer await to_thread(event.synchronize)"] = pct(asyncio.run(to_thread_peer()))
    return out


async def both_directions(repeats: int) -> dict[str, Any]:
    """1 GiB each way at once: contiguous torch pinned buffers, then the manager's region
    (2 MiB blocks, batch and pack) at two registration sizes."""
    from asyncpin import KVLayout, OffloadManager

    GB = 1e9
    dev = torch.device("cuda", 0)
    out: dict[str, Any] = {}
    n = 1 << 30
    d_src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    d_dst = torch.empty(n, dtype=torch.uint8, device=dev)
    h_dst = torch.empty(n, dtype=torch.uint8).pin_memory()
    h_src = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory()
    s1, s2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def run_both() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s1):
            h_dst.copy_(d_src, non_blocking=True)
        with torch.cuda.stream(s2):
            d_dst.copy_(h_src, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def run_one(dst: torch.Tensor, src: torch.Tensor) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run_both()
    out["contiguous torch pinned both GB/s"] = (
        2 * n / statistics.median([run_both() for _ in range(repeats)]) / GB
    )
    out["contiguous torch pinned D2H GB/s"] = (
        n / statistics.median([run_one(h_dst, d_src) for _ in range(repeats)]) / GB
    )
    out["contiguous torch pinned H2D GB/s"] = (
        n / statistics.median([run_one(d_dst, h_src) for _ in range(repeats)]) / GB
    )
    half, other = list(range(512)), list(range(512, 1024))
    for block_kib, arrays in ((2048, 1), (32, 64)):
        per = block_kib << 10
        tensors = [
            torch.randn(1024 * per // 4, device=dev).view(1024, per // 4) for _ in range(arrays)
        ]
        layout = KVLayout.from_tensors(tensors)
        for chunk in (16 << 20, 256 << 20):
            async with OffloadManager.for_kv(
                layout, 1024, backend="cuda", chunk_bytes=chunk
            ) as mgr:
                await mgr.pinned
                for method in ("batch", "pack"):

                    async def both(method: Any = method) -> float:
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        s = mgr.store(half, half, method=method)
                        ld = mgr.load(other, other, method=method)
                        await s
                        await ld
                        return time.perf_counter() - t0

                    async def one(direction: str, method: Any = method) -> float:
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        if direction == "store":
                            await mgr.store(half, half, method=method)
                        else:
                            await mgr.load(other, other, method=method)
                        return time.perf_counter() - t0

                    nbytes = 512 * layout.host_block_bytes
                    await both()
                    key = f"{arrays}x{block_kib}KiB chunk {chunk >> 20}MiB {method}"
                    out[f"{key} both GB/s"] = (
                        2 * nbytes / statistics.median([await both() for _ in range(repeats)]) / GB
                    )
                    for d in ("store", "load"):
                        out[f"{key} {d} GB/s"] = (
                            nbytes / statistics.median([await one(d) for _ in range(repeats)]) / GB
                        )
        del tensors, layout
    return out


def dma_streams(repeats: int) -> dict[str, Any]:
    """512 random 2 MiB DMAs each way through one batched call per stream, spread over 1, 2
    or 4 streams per direction; and DMA size against speed on one stream."""
    GB = 1e9
    rt = _Runtime()
    dev = torch.device("cuda", 0)
    seg, n = 2 << 20, 512
    dbuf = torch.randint(0, 255, (2 * n * seg,), dtype=torch.uint8, device=dev)
    hbuf = torch.randint(0, 255, (2 * n * seg,), dtype=torch.uint8).pin_memory()
    streams = [torch.cuda.Stream(dev) for _ in range(8)]
    out: dict[str, Any] = {}

    def plan(lo: int, count: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        perm = torch.randperm(count) + lo
        host = hbuf.data_ptr() + perm * size
        device = dbuf.data_ptr() + (torch.arange(count) + lo) * size
        return host, device, torch.full((count,), size, dtype=torch.int64)

    def run(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, (host, device, sizes, to_host) in enumerate(parts):
            s = streams[k].cuda_stream
            if to_host:
                rt.copy_segments(host, device, sizes, s)
            else:
                rt.copy_segments(device, host, sizes, s)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def split(
        host: torch.Tensor, device: torch.Tensor, sizes: torch.Tensor, k: int, to_host: bool
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
        return [(host[i::k], device[i::k], sizes[i::k], to_host) for i in range(k)]

    for size in (2 << 20, 8 << 20, 32 << 20):
        count = n * seg // size
        h, d, z = plan(0, count, size)
        parts = split(h, d, z, 1, True)
        run(parts)
        out[f"D2H {size >> 20} MiB DMAs 1 stream GB/s"] = (
            n * seg / statistics.median([run(parts) for _ in range(repeats)]) / GB
        )
    for k in (1, 2, 4):
        h, d, z = plan(0, n, seg)
        h2, d2, z2 = plan(n, n, seg)
        for name, parts in (
            ("D2H", split(h, d, z, k, True)),
            ("H2D", split(h2, d2, z2, k, False)),
            ("both", split(h, d, z, k, True) + split(h2, d2, z2, k, False)),
        ):
            run(parts)
            total = n * seg * (2 if name == "both" else 1)
            out[f"{name} 2 MiB DMAs {k} streams/direction GB/s"] = (
                total / statistics.median([run(parts) for _ in range(repeats)]) / GB
            )
    return out


async def pack_variants(repeats: int) -> dict[str, Any]:
    """Both directions at once with pack at 32 KiB blocks (64 arrays, random ids),
    varying the gather kernel's CTAs and the staging size."""
    import asyncpin.engines.cuda.lanes as lanes
    import asyncpin.engines.cuda.methods as methods
    from asyncpin import KVLayout, OffloadManager

    dev = torch.device("cuda", 0)
    out: dict[str, Any] = {}
    tensors = [torch.randn(2048, 8192, device=dev) for _ in range(64)]  # 32 KiB blocks
    layout = KVLayout.from_tensors(tensors)
    defaults = methods._PACK_CTAS, lanes.STAGING_BYTES
    try:
        for ctas, staging in ((132, 256 << 20), (32, 256 << 20), (132, 1 << 30)):
            methods._PACK_CTAS, lanes.STAGING_BYTES = ctas, staging
            async with OffloadManager.for_kv(layout, 2048, backend="cuda") as mgr:
                await mgr.pinned

                key = f"ctas {ctas} staging {staging >> 20} MiB"

                async def both(key: str = key) -> float:
                    g = torch.randperm(2048).tolist()
                    c = torch.randperm(2048).tolist()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    s = mgr.store(g[:1024], c[:1024])
                    ld = mgr.load(c[1024:], g[1024:])
                    t1 = time.perf_counter()
                    await s
                    await ld
                    out.setdefault(f"{key} submit ms", []).append((t1 - t0) * 1e3)
                    return time.perf_counter() - t0

                await both()
                nbytes = 2048 * layout.host_block_bytes
                out[f"{key} both GB/s"] = (
                    nbytes / statistics.median([await both() for _ in range(repeats)]) / 1e9
                )
    finally:
        methods._PACK_CTAS, lanes.STAGING_BYTES = defaults
    for key in [k for k in out if k.endswith("submit ms")]:
        out[key] = statistics.median(out[key])
    return out


def memory_kinds(repeats: int) -> dict[str, Any]:
    """Does the kind of pinned host memory set the DMA speed? 1 GiB each way, contiguous
    and as 512 random 2 MiB DMAs over two streams per direction, into host memory from
    cudaHostAlloc (torch) and from mmap + cudaHostRegister with huge or 4 KiB pages."""
    import mmap

    from asyncpin import _sys
    from asyncpin.cuda import CudaBackend

    GB, n, seg = 1e9, 1 << 30, 2 << 20
    rt = _Runtime()
    backend = CudaBackend(0)
    dev = torch.device("cuda", 0)
    d_src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=dev)
    d_dst = torch.empty(n, dtype=torch.uint8, device=dev)
    streams = [torch.cuda.Stream(dev) for _ in range(4)]
    out: dict[str, Any] = {}

    def mapped(advice: int | None, extra_flags: int = 0) -> tuple[int, Callable[[], None]]:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | extra_flags
        addr = _sys.libc_mmap(2 * n, mmap.PROT_READ | mmap.PROT_WRITE, flags)
        if advice is not None:
            _sys.libc_madvise(addr, 2 * n, advice)
        _sys.libc_madvise(addr, 2 * n, _sys.MADV_POPULATE_WRITE)
        return addr, lambda: _sys.libc_munmap(addr, 2 * n)

    def reserve_hugetlb() -> Callable[[], None]:
        """Reserve 2 GiB of 2 MiB pages if this process may (root), for the hugetlb row."""
        knob = Path("/proc/sys/vm/nr_hugepages")
        try:
            before = knob.read_text()
            knob.write_text(str(int(before) + (2 * n >> 21)))
        except OSError:
            return lambda: None

        def restore() -> None:
            knob.write_text(before)

        return restore

    def kinds() -> Any:
        t = torch.empty(2 * n, dtype=torch.uint8).pin_memory()
        yield "cudaHostAlloc (torch pin_memory)", t.data_ptr(), lambda: None
        del t
        for name, advice, extra, chunk in (
            ("mmap THP, one registration", _sys.MADV_HUGEPAGE, 0, 2 * n),
            ("mmap THP, 16 MiB registrations", _sys.MADV_HUGEPAGE, 0, 16 << 20),
            ("mmap 4 KiB pages, one registration", 15, 0, 2 * n),  # MADV_NOHUGEPAGE
            ("mmap hugetlb, one registration", None, 0x40000, 2 * n),  # MAP_HUGETLB
        ):
            try:
                addr, unmap = mapped(advice, extra)
            except OSError as exc:
                out[f"{name}: skipped"] = str(exc)
                continue
            spans = [(a, min(chunk, 2 * n - (a - addr))) for a in range(addr, addr + 2 * n, chunk)]
            for a, z in spans:
                backend.pin(a, z)

            def release(spans: Any = spans, unmap: Any = unmap) -> None:
                for a, _ in spans:
                    backend.unpin(a, 0)
                unmap()

            yield name, addr, release

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    perm = torch.randperm(n // seg)
    host_off = (perm * seg).tolist()
    dev_off = [i * seg for i in range(n // seg)]
    sizes = array.array("Q", [seg] * (n // seg // 2))

    def one(dst: int, src: int, stream: torch.cuda.Stream, size: int = n) -> None:
        # One plain copy: cudaMemcpyBatchAsync refuses a 1 GiB copy (cudaErrorInvalidValue).
        code = rt.lib.cudaMemcpyAsync(dst, src, size, 4, stream.cuda_stream)  # 4: default
        if code != 0:
            rt.lib.cudaGetLastError()  # consume it, or torch's next call reports it
            raise RuntimeError(f"cudaMemcpyAsync returned {code}")

    def scattered(h_dst: int, h_src: int, both: bool) -> None:
        for k in (0, 1):
            hs = array.array("Q", [h_dst + o for o in host_off[k::2]])
            ds = array.array("Q", [d_src.data_ptr() + o for o in dev_off[k::2]])
            rt.copy_segments(hs, ds, sizes, streams[k].cuda_stream)
            if both:
                hs = array.array("Q", [h_src + o for o in host_off[k::2]])
                ds = array.array("Q", [d_dst.data_ptr() + o for o in dev_off[k::2]])
                rt.copy_segments(ds, hs, sizes, streams[2 + k].cuda_stream)

    def row(key: str, nbytes: int, fn: Callable[[], Any]) -> None:
        try:
            out[key] = nbytes / timed(fn) / GB
        except Exception as exc:  # a refused copy is a finding, not the end of the run
            out[key] = f"failed: {exc}"
            torch.cuda.synchronize()

    def measure(name: str, h_dst: int, h_src: int) -> None:
        def d2h() -> None:
            one(h_dst, d_src.data_ptr(), streams[0])

        def h2d() -> None:
            one(d_dst.data_ptr(), h_src, streams[2])

        row(f"{name}: contiguous D2H GB/s", n, d2h)
        row(f"{name}: contiguous H2D GB/s", n, h2d)
        row(f"{name}: contiguous both GB/s", 2 * n, lambda: [f() for f in (d2h, h2d)])
        row(f"{name}: 2 MiB DMAs D2H GB/s", n, lambda: scattered(h_dst, h_src, False))
        row(f"{name}: 2 MiB DMAs both GB/s", 2 * n, lambda: scattered(h_dst, h_src, True))

    def largest_copies() -> None:
        """Which single-copy sizes each call accepts, into torch pinned memory."""
        probe = torch.empty(n, dtype=torch.uint8).pin_memory()
        dst, src = probe.data_ptr(), d_src.data_ptr()
        row("torch copy_ D2H into pin_memory GB/s", n, lambda: probe.copy_(d_src, True))
        for shift in range(24, 31):  # 16 MiB .. 1 GiB
            size = 1 << shift
            for how in ("batched", "plain"):
                try:
                    if how == "batched":
                        sz = array.array("Q", [size])
                        rt.copy_segments(
                            array.array("Q", [dst]),
                            array.array("Q", [src]),
                            sz,
                            streams[0].cuda_stream,
                        )
                    else:
                        one(dst, src, streams[0], size)
                    torch.cuda.synchronize()
                    out[f"{how} copy of {size >> 20} MiB"] = "accepted"
                except Exception as exc:
                    out[f"{how} copy of {size >> 20} MiB"] = str(exc)

    largest_copies()
    unreserve = reserve_hugetlb()
    try:
        for name, base, release in kinds():
            try:
                measure(name, base, base + n)
            finally:
                torch.cuda.synchronize()
                release()
    finally:
        unreserve()
    return out


def wake_hops(samples: int) -> dict[str, Any]:
    """The two hand-offs between a finished copy and a resumed coroutine, apart and
    together, with the loop thread and the waiter thread free, or both on one CPU (the
    CPU taking the GPU's interrupts, and another one)."""
    import os
    import queue

    out: dict[str, Any] = {}
    dev = torch.device("cuda", 0)
    stream = torch.cuda.Stream(dev)
    src = torch.randn(8192, device=dev)
    host = torch.empty(8192).pin_memory()
    irq_cpu = None
    try:
        for line in Path("/proc/interrupts").read_text().splitlines():
            if "nvidia" in line:
                counts = [
                    int(x) for x in line.split()[1 : 1 + (os.cpu_count() or 1)] if x.isdigit()
                ]
                irq_cpu = max(range(len(counts)), key=counts.__getitem__)
                out["nvidia irq line"] = " ".join(line.split())[:200]
    except OSError:
        pass
    every = os.sched_getaffinity(0)

    def pct(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"p50_us": xs[len(xs) // 2] * 1e6, "p99_us": xs[int(len(xs) * 0.99)] * 1e6}

    async def run(cpus: set[int] | None, gpu: bool) -> tuple[list[float], list[float]]:
        loop = asyncio.get_running_loop()
        jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        wake: list[float] = []

        def waiter() -> None:
            if cpus is not None:
                os.sched_setaffinity(0, cpus)
            while (item := jobs.get()) is not None:
                ev, fut, t0 = item
                if ev is not None:
                    ev.synchronize()
                wake.append(time.perf_counter() - t0)
                loop.call_soon_threadsafe(fut.set_result, None)

        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        th = threading.Thread(target=waiter)
        th.start()
        resume = []
        try:
            for _ in range(samples):
                fut = loop.create_future()
                t0 = time.perf_counter()
                ev = None
                if gpu:
                    with torch.cuda.stream(stream):
                        host.copy_(src, non_blocking=True)
                    ev = torch.cuda.Event(blocking=True)
                    ev.record(stream)
                jobs.put((ev, fut, t0))
                await fut
                resume.append(time.perf_counter() - t0)
                await asyncio.sleep(0.0002)  # let both threads go idle, as between requests
        finally:
            jobs.put(None)
            th.join()
            os.sched_setaffinity(0, every)
        return wake, resume

    placements: list[tuple[str, set[int] | None]] = [("free", None)]
    if irq_cpu is not None:
        placements.append((f"both on CPU {irq_cpu} (GPU irq)", {irq_cpu}))
    other = next(c for c in sorted(every) if c != irq_cpu)
    placements.append((f"both on CPU {other}", {other}))
    for label, cpus in placements:
        for gpu in (False, True):
            wake, resume = asyncio.run(run(cpus, gpu))
            what = "32 KiB copy" if gpu else "no copy"
            out[f"{what}, {label}: waiter wakes"] = pct(wake)
            out[f"{what}, {label}: loop resumes"] = pct(resume)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--only", default="costs,streams,both")
    args = parser.parse_args()
    require_gpu()
    import anyio

    report: dict[str, Any] = {
        "host_costs": host_costs() if "costs" in args.only else {},
        "completion": completion_costs(args.samples) if "costs" in args.only else {},
    }
    if "streams" in args.only:
        report["streams"] = dma_streams(5)
    if "variants" in args.only:
        report["variants"] = anyio.run(pack_variants, 5)
    if "both" in args.only:
        report["both"] = anyio.run(both_directions, 5)
    if "memkind" in args.only:
        report["memkind"] = memory_kinds(5)
        for name, r in report["memkind"].items():
            print(f"  {name:48} {r}", flush=True)
    if "hops" in args.only:
        report["hops"] = wake_hops(args.samples)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    for part, rows in report.items():
        print(f"\n{part}: p50 / p99 us")
        for name, r in rows.items():
            if isinstance(r, str):
                print(f"  {name:48} {r}")
            elif isinstance(r, dict):
                print(f"  {name:48} {r['p50_us']:8.1f} {r['p99_us']:8.1f}")
            else:
                print(f"  {name:48} {r:8.1f}")


if __name__ == "__main__":
    main()
