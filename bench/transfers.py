"""KV block transfers on a CUDA GPU: asyncpin's methods against the peer recipes, one run.

    python3 bench/transfers.py --json-out $OUT/transfers.json --plot $OUT/transfers.png

Layout like Llama-3.1-8B: 32 layers, K and V split (64 arrays), blocks of 16 tokens x 8
heads x 128 bf16 = 32 KiB per array. 2048 random blocks (4 GiB) per transfer, random ids.
Peers in the same run: one cudaMemcpyBatchAsync call over the same segments (twice: with
the attributes vLLM passes, source order "stream" and no flag, and with the
prefer-overlap-with-compute flag asyncpin's own calls set), a python loop of
cudaMemcpyAsync per segment, and one contiguous DMA of the same bytes. GB/s count
bytes moved once (1e9 bytes per second); time is the wall time from submission until the
awaiting coroutine resumes (asyncpin) or until the stream is synchronized (peers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin import KVLayout, OffloadManager
from asyncpin._cudart import MemcpyAttributes as _MemcpyAttributes
from asyncpin._cudart import MemLocation as _MemLocation
from asyncpin._cudart import Runtime as _Runtime
from asyncpin.engines.cuda import CudaTransferEngine
from asyncpin.transfers import Direction, Method
from bench._gpu import require_gpu

GB = 1e9


def make_layout(layers: int, blocks: int, block_bytes: int) -> KVLayout:
    tokens = block_bytes // (8 * 128 * 2)
    shape = (blocks, tokens, 8, 128)
    tensors = [torch.randn(*shape, device="cuda").to(torch.bfloat16) for _ in range(2 * layers)]
    return KVLayout.from_tensors(tensors)


async def timed(fn: Any, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


async def bench_size(block_bytes: int, n: int, repeats: int, peers: bool) -> dict[str, Any]:
    layers = 32
    blocks = 2 * n
    layout = make_layout(layers, blocks, block_bytes)
    nbytes = n * layout.host_block_bytes
    rt = _Runtime()
    result: dict[str, Any] = {"block_bytes": block_bytes, "blocks": n, "bytes": nbytes}
    async with OffloadManager.for_kv(layout, 2 * n, backend="cuda") as mgr:
        await mgr.pinned
        stream = torch.cuda.Stream()

        def ids() -> tuple[list[int], list[int]]:
            g = torch.randperm(blocks)[:n].tolist()
            c = torch.randperm(2 * n)[:n].tolist()
            return g, c

        for method in ("pack", "kernel", "batch"):
            for direction in ("store", "load"):

                async def run(method: str = method, direction: str = direction) -> None:
                    g, c = ids()
                    if direction == "store":
                        await mgr.store(g, c, method=method)  # type: ignore[arg-type]
                    else:
                        await mgr.load(c, g, method=method)  # type: ignore[arg-type]

                try:
                    await run()  # warm-up (compiles the kernel once)
                    times = await timed(run, repeats)
                    result[f"{method}_{direction}_gbps"] = nbytes / statistics.median(times) / GB
                except Exception as exc:  # record, keep measuring the rest
                    result[f"{method}_{direction}_error"] = repr(exc)

        finish: dict[str, list[float]] = {"store": [], "load": []}

        async def both(method: Method = "auto") -> None:
            g1, c1 = ids()
            half = n // 2
            t0 = time.perf_counter()
            s = mgr.store(g1[:half], c1[:half], method=method)
            ld = mgr.load(c1[half:], g1[half:], method=method)
            finish.setdefault("submit", []).append((time.perf_counter() - t0) * 1e3)
            await s
            await ld
            for name, transfer in (("store", s), ("load", ld)):  # when each one ended
                assert transfer.t_done is not None
                finish[name].append((transfer.t_done - t0) * 1e3)

        both_methods: tuple[Method, ...] = ("auto", "pack", "kernel", "batch")
        for both_method in both_methods:
            await both(both_method)
            for samples in finish.values():
                samples.clear()
            times = await timed(lambda m=both_method: both(m), repeats)
            suffix = "" if both_method == "auto" else f"_{both_method}"
            result[f"both_at_once{suffix}_gbps"] = (nbytes // 2 * 2) / statistics.median(times) / GB
            if both_method == "auto":  # where each direction ends, from submission
                result["both_store_done_ms"] = statistics.median(finish["store"])
                result["both_load_done_ms"] = statistics.median(finish["load"])
                result["both_submit_ms"] = statistics.median(finish["submit"])

        # Peers: the same segments through one batched call / a per-segment loop.
        if peers:
            engine = mgr._engine
            assert isinstance(engine, CudaTransferEngine)
            peer_direction: Direction
            # vLLM's attributes: source order "stream", no location hints, no flags.
            vllm_attrs = _MemcpyAttributes(1, _MemLocation(0, 0), _MemLocation(0, 0), 0)
            for peer_direction in ("store", "load"):
                direction = peer_direction
                g, c = ids()
                device, host = engine._plan.segments(g, c)
                sizes = torch.full_like(device, layout.block_bytes)
                dst, src = (host, device) if direction == "store" else (device, host)

                batched = rt.batch is not None  # CUDA 12.8 and later
                peer_calls = (("peer_batch", vllm_attrs), ("peer_batch_overlap", rt.attrs))
                for key, attrs in peer_calls if batched else ():

                    async def batch_peer(
                        dst: torch.Tensor = dst,
                        src: torch.Tensor = src,
                        sizes: torch.Tensor = sizes,
                        attrs: _MemcpyAttributes = attrs,
                    ) -> None:
                        rt._batch_call(dst, src, sizes, attrs, stream.cuda_stream)  # one call
                        stream.synchronize()

                    await batch_peer()
                    times = await timed(batch_peer, repeats)
                    result[f"{key}_{direction}_gbps"] = nbytes / statistics.median(times) / GB
                if block_bytes == 32 << 10:
                    t0 = time.perf_counter()
                    for d, s_, z in zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True):
                        code = rt.lib.cudaMemcpyAsync(d, s_, z, 4, stream.cuda_stream)
                        if code:
                            rt._check("cudaMemcpyAsync", code)
                    stream.synchronize()
                    result[f"peer_loop_{direction}_gbps"] = nbytes / (time.perf_counter() - t0) / GB
        # Contiguous DMA of 1 GiB (the bus's ceiling), through the same runtime calls.
        span = min(nbytes, 1 << 30)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host_addr = torch.tensor([mgr.host_blocks().data_ptr()], dtype=torch.int64)
        dev_addr = torch.tensor([dev.data_ptr()], dtype=torch.int64)
        size = torch.tensor([span], dtype=torch.int64)
        engine = mgr._engine
        assert isinstance(engine, CudaTransferEngine)
        for direction in ("store", "load"):

            async def contiguous(direction: str = direction) -> None:
                # Cut at the region's registration boundaries (16 MiB pieces), as any DMA
                # into a chunked registration must be.
                engine._copies.copy_host(
                    host_addr, dev_addr, size, to_host=direction == "store", streams=[stream]
                )
                stream.synchronize()

            await contiguous()
            times = await timed(contiguous, repeats)
            result[f"contiguous_{direction}_gbps"] = span / statistics.median(times) / GB
        # Both at once: as many bytes each way as asyncpin moves both at once (nbytes / 2),
        # on one or two streams per direction (the bus's two-way ceiling; the engine
        # deals its DMAs over two streams).
        extra = [torch.cuda.Stream() for _ in range(3)]
        half = nbytes // 2
        hi_host = host_addr + half
        hi_dev = dev_addr + half
        half_size = torch.tensor([half], dtype=torch.int64)

        async def contiguous_both(k: int) -> None:
            ups, downs = [stream, extra[0]][:k], extra[1:][:k]
            engine._copies.copy_host(host_addr, dev_addr, half_size, to_host=True, streams=ups)
            engine._copies.copy_host(hi_host, hi_dev, half_size, to_host=False, streams=downs)
            for s_ in (*ups, *downs):
                s_.synchronize()

        for k, key in ((1, "contiguous_both_gbps"), (2, "contiguous_both_2streams_gbps")):
            await contiguous_both(k)
            times = await timed(lambda k=k: contiguous_both(k), repeats)
            result[key] = nbytes / statistics.median(times) / GB
        del dev
    del layout
    torch.cuda.empty_cache()
    return result


async def matmul_slowdown(repeats: int) -> dict[str, Any]:
    """bf16 matmul time alone, during back-to-back stores of each method, and during a
    contiguous DMA copy loop."""
    n = 2048
    layout = make_layout(32, 2 * n, 32 << 10)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def matmuls() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            torch.mm(a, b)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    matmuls()
    alone = statistics.median(matmuls() for _ in range(repeats))
    out: dict[str, Any] = {"matmul_alone_ms": alone}
    async with OffloadManager.for_kv(layout, 2 * n, backend="cuda") as mgr:
        await mgr.pinned
        for method in ("pack", "kernel", "batch", "contiguous"):
            stop = anyio.Event()

            async def traffic(method: str = method, stop: anyio.Event = stop) -> None:
                engine = mgr._engine
                assert isinstance(engine, CudaTransferEngine)
                dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
                host_addr = torch.tensor([mgr.host_blocks().data_ptr()], dtype=torch.int64)
                dev_addr = torch.tensor([dev.data_ptr()], dtype=torch.int64)
                size = torch.tensor([dev.numel()], dtype=torch.int64)
                side = torch.cuda.Stream()
                while not stop.is_set():
                    if method == "contiguous":
                        engine._copies.copy_host(
                            host_addr, dev_addr, size, to_host=True, streams=[side]
                        )
                        await anyio.to_thread.run_sync(side.synchronize)
                    else:
                        g = torch.randperm(2 * n)[:n].tolist()
                        c = torch.randperm(2 * n)[:n].tolist()
                        await mgr.store(g, c, method=method)  # type: ignore[arg-type]

            async with anyio.create_task_group() as tg:
                tg.start_soon(traffic)
                await anyio.sleep(0.2)
                times = []
                for _ in range(repeats):
                    times.append(await anyio.to_thread.run_sync(matmuls))
                stop.set()
            out[f"matmul_during_{method}_ms"] = statistics.median(times)
            out[f"slowdown_{method}_pct"] = (statistics.median(times) / alone - 1) * 100
    return out


async def await_latency(samples: int, cpu: int | None = None) -> dict[str, Any]:
    """One-block store, awaited: asyncpin (per method and completion mode) against the
    peer `await to_thread(event.synchronize)` on the same copies. One block is 64 arrays
    (the Llama-8B layout: 2 MiB) or 1 array (one 32 KiB segment). With ``cpu``, the event
    loop's thread is pinned to that CPU before the manager opens, so that the threads the
    manager starts (waiters included) inherit it, as in a server that pins its loop."""
    every = os.sched_getaffinity(0)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    try:
        return await _await_latency(samples)
    finally:
        os.sched_setaffinity(0, every)


async def _await_latency(samples: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arrays in (64, 1):
        layout = make_layout(arrays // 2 if arrays > 1 else 1, 64, 32 << 10)
        if arrays == 1:
            layout = KVLayout.from_tensors([layout.arrays[0]])
        async with OffloadManager.for_kv(layout, 64, backend="cuda") as mgr:
            await mgr.pinned
            engine = mgr._engine
            assert isinstance(engine, CudaTransferEngine)
            method: Method
            for completion in ("event",):
                for method in ("batch", "pack"):
                    lat, submit = [], []
                    for i in range(samples + 20):
                        t0 = time.perf_counter()
                        transfer = mgr.store([i % 64], [(i * 7) % 64], method=method)
                        submit.append(time.perf_counter() - t0)
                        await transfer
                        lat.append(time.perf_counter() - t0)
                    key = f"{arrays}arr_{method}_{completion}"
                    lat, submit = sorted(lat[20:]), sorted(submit[20:])
                    out[f"{key}_p50_us"] = lat[len(lat) // 2] * 1e6
                    out[f"{key}_p99_us"] = lat[int(len(lat) * 0.99)] * 1e6
                    out[f"{key}_submit_p50_us"] = submit[len(submit) // 2] * 1e6
            host = mgr.host_blocks()
            stream = torch.cuda.Stream()
            lat = []
            for i in range(samples + 20):
                t0 = time.perf_counter()
                with torch.cuda.stream(stream):
                    for a in range(layout.num_arrays):
                        host[(i * 7) % 64, a].copy_(layout.arrays[a][i % 64], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                await anyio.to_thread.run_sync(ev.synchronize)
                lat.append(time.perf_counter() - t0)
            lat = sorted(lat[20:])
            out[f"{arrays}arr_peer_to_thread_p50_us"] = lat[len(lat) // 2] * 1e6
            out[f"{arrays}arr_peer_to_thread_p99_us"] = lat[int(len(lat) * 0.99)] * 1e6
            if arrays == 64:
                g = list(range(64))
                torch.cuda._sleep(1_000_000_000)
                c0, t0 = time.process_time(), time.perf_counter()
                await mgr.store(g, g)
                wall = time.perf_counter() - t0
                out["await_cpu_over_wall"] = (time.process_time() - c0) / wall
        del layout
    return out


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, direction in zip(axes, ("store", "load"), strict=True):
        sizes = [r["block_bytes"] for r in report["sizes"]]
        for key, label in (
            ("pack", "asyncpin pack"),
            ("kernel", "asyncpin kernel (UVA)"),
            ("batch", "asyncpin batch"),
            ("peer_batch", "peer: cudaMemcpyBatchAsync"),
            ("peer_loop", "peer: cudaMemcpyAsync loop"),
            ("contiguous", "contiguous DMA"),
        ):
            ys = [r.get(f"{key}_{direction}_gbps") for r in report["sizes"]]
            pts = [(s, y) for s, y in zip(sizes, ys, strict=True) if y is not None]
            if pts:
                ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size per array (KiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{direction} ({'GPU→host' if direction == 'store' else 'host→GPU'}), H200")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
        "sizes": [],
    }
    total = 4 << 30
    block_sizes = [int(k) << 10 for k in args.block_kib.split(",")]
    for block_bytes in block_sizes if "sizes" in args.only else ():
        n = max(total // (64 * block_bytes), 16)
        try:
            report["sizes"].append(await bench_size(block_bytes, n, args.repeats, peers=True))
        except Exception as exc:  # keep the other sizes' figures
            report["sizes"].append({"block_bytes": block_bytes, "blocks": n, "error": repr(exc)})
            torch.cuda.synchronize()
        print(json.dumps(report["sizes"][-1]), flush=True)
    if "matmul" in args.only:
        report["matmul"] = await matmul_slowdown(args.repeats)
        print(json.dumps(report["matmul"]), flush=True)
    if "latency" in args.only:
        report["latency"] = await await_latency(args.samples)
        print(json.dumps(report["latency"]), flush=True)
        report["latency_one_cpu"] = await await_latency(args.samples, cpu=1)
        print(json.dumps(report["latency_one_cpu"]), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--only", default="sizes,matmul,latency", help="parts to run")
    parser.add_argument("--block-kib", default="8,32,256,2048", help="block sizes per array")
    args = parser.parse_args()
    require_gpu()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    report = anyio.run(main_async, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    if args.plot and report["sizes"]:
        plot(report, args.plot)
    print(f"\n{report['device']} torch {report['torch']} cuda {report['cuda_runtime']}")
    print(
        f"{'block/array':>11} {'dir':>5} {'pack':>6} {'kernel':>6} {'batch':>6} "
        f"{'peer bat':>8} {'+overlap':>8} {'peer loop':>9} {'contig':>6}  GB/s"
    )
    for r in report["sizes"]:
        for d in ("store", "load"):
            cells = [
                r.get(f"{k}_{d}_gbps")
                for k in (
                    "pack",
                    "kernel",
                    "batch",
                    "peer_batch",
                    "peer_batch_overlap",
                    "peer_loop",
                    "contiguous",
                )
            ]
            print(
                f"{r['block_bytes'] // 1024:>8} KiB {d:>5} "
                + " ".join(f"{c:>6.1f}" if c is not None else f"{'-':>6}" for c in cells)
            )
        if "both_at_once_gbps" in r:
            forced = ", ".join(
                f"{m} {r[f'both_at_once_{m}_gbps']:.1f}"
                for m in ("pack", "kernel", "batch")
                if f"both_at_once_{m}_gbps" in r
            )
            print(
                f"{'':>11} both at once: auto {r['both_at_once_gbps']:.1f} GB/s ({forced}); "
                f"store/load done at {r['both_store_done_ms']:.1f}/{r['both_load_done_ms']:.1f}"
                f" ms, both submitted by {r['both_submit_ms']:.1f} ms"
            )
            print(
                f"{'':>11} contiguous both {r.get('contiguous_both_gbps', 0):.1f} GB/s "
                f"(1 stream/dir), {r.get('contiguous_both_2streams_gbps', 0):.1f} (2)"
            )
        errors = {k: v for k, v in r.items() if k.endswith("_error")}
        if errors:
            print("   errors:", errors)
    if "matmul" in report:
        m = report["matmul"]
        print(
            "matmul slowdown %: "
            + ", ".join(
                f"{k}: {m[f'slowdown_{k}_pct']:.1f}"
                for k in ("pack", "kernel", "batch", "contiguous")
            )
        )
    for part, where in (("latency", "threads free"), ("latency_one_cpu", "loop on CPU 1")):
        if part in report:
            print_latency(report[part], where)


def print_latency(lat: dict[str, Any], where: str) -> None:
    print(where)
    for arrays in (64, 1):
        cells = []
        for c in ("event",):
            for m in ("batch", "pack"):
                key = f"{arrays}arr_{m}_{c}"
                cells.append(
                    f"{m}/{c} {lat[key + '_p50_us']:.0f}/{lat[key + '_p99_us']:.0f}"
                    f" (submit {lat[key + '_submit_p50_us']:.0f})"
                )
        peer = lat[f"{arrays}arr_peer_to_thread_p50_us"], lat[f"{arrays}arr_peer_to_thread_p99_us"]
        print(
            f"await one block of {arrays} arrays p50/p99 us: "
            + ", ".join(cells)
            + f"; peer to_thread(event.synchronize) {peer[0]:.0f}/{peer[1]:.0f}"
        )
    print(f"CPU/wall while awaiting: {lat['await_cpu_over_wall']:.3f}")


if __name__ == "__main__":
    main()
