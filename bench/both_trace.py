"""Where the time goes when a store and a load run at once: a GPU trace of each.

    python3 bench/both_trace.py --json-out $OUT/both_trace.json

Llama-8B-like layout (64 arrays, 32 KiB blocks), 2 GiB stored and 2 GiB loaded at once
with random ids, as in bench/transfers.py. Each run is traced with torch.profiler (CUPTI)
and reduced to: when each direction's DMAs start and end on the GPU, how long the bus
carried one direction only, the gaps in each direction's DMAs, and when the driver calls
that queue them ran, per thread. Two ways to start:

- ``free``: store() then load() as an application would;
- ``held``: a sleep kernel on the caller's stream holds both back until both are queued,
  so the GPU timeline shows the copies alone, without the submission's pace.

Contiguous DMAs both ways (2 GiB each way in 16 MiB pieces, two streams per direction)
are traced the same way in the same run, as the ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin import KVLayout, OffloadManager
from asyncpin.engines.cuda import CudaTransferEngine
from bench._gpu import require_gpu

GB = 1e9


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def total(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    i = j = 0
    out = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        out += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def reduce_trace(path: str) -> dict[str, Any]:
    """Times in ms from the first GPU copy or copy kernel of the run."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    dma: dict[str, list[dict[str, Any]]] = {"store": [], "load": []}
    kernels: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for e in events:
        name, cat = e.get("name", ""), e.get("cat", "")
        if cat == "gpu_memcpy":
            if "DtoH" in name:
                dma["store"].append(e)
            elif "HtoD" in name:
                dma["load"].append(e)
        elif cat == "kernel" and "kv_copy" in name:
            kernels.append(e)
        elif cat in ("cuda_runtime", "cuda_driver") and "Memcpy" in name:
            calls.append(e)
    gpu = [e for d in dma.values() for e in d] + kernels
    if not gpu:
        return {"error": "no GPU copies in the trace"}
    t0 = min(e["ts"] for e in gpu)
    submits = [e["ts"] for e in events if e.get("name") == "both:submit"]
    finished = {
        e["name"].split(":")[1]: (e["ts"] - t0) / 1e3
        for e in events
        if e.get("name", "").startswith("finish:") and e.get("cat") == "user_annotation"
    }
    queued: dict[str, list[float]] = {}  # per thread: when each batched DMA call began
    for e in events:
        if e.get("name") == "copy_segments" and e.get("cat") == "user_annotation":
            queued.setdefault(str(e.get("tid")), []).append((e["ts"] - t0) / 1e3)

    def rel(e: dict[str, Any]) -> tuple[float, float]:
        return ((e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3)

    out: dict[str, Any] = {"end_ms": max(rel(e)[1] for e in gpu)}
    out["finished_ms"] = finished  # when the loop learned of each direction's end
    if submits:  # from store() being called to the first GPU copy
        out["submit_to_gpu_ms"] = (t0 - min(submits)) / 1e3
    out["dma_calls"] = {
        tid: {
            "n": len(v),
            "first_ms": round(min(v), 3),
            "second_ms": round(sorted(v)[1], 3) if len(v) > 1 else None,
            "last_ms": round(max(v), 3),
        }
        for tid, v in queued.items()
    }
    spans = {}
    for direction, evs in dma.items():
        if not evs:
            continue
        u = union([rel(e) for e in evs])
        spans[direction] = u
        gaps = sorted(((u[i + 1][0] - u[i][1], u[i][1]) for i in range(len(u) - 1)), reverse=True)
        streams: dict[str, list[tuple[float, float]]] = {}
        for e in evs:
            streams.setdefault(str(e.get("args", {}).get("stream")), []).append(rel(e))
        out[direction] = {
            "bytes": sum(int(e.get("args", {}).get("bytes", 0)) for e in evs),
            "copies": len(evs),
            "first_ms": u[0][0],
            "last_ms": u[-1][1],
            "busy_ms": total(u),
            "gaps_ms": sum(g for g, _ in gaps),
            "largest_gaps": [(round(g, 3), round(at, 3)) for g, at in gaps[:5]],
            "per_stream_busy_ms": {k: round(total(union(v)), 3) for k, v in streams.items()},
        }
    if len(spans) == 2:
        both = intersect(spans["store"], spans["load"])
        out["both_active_ms"] = both
        out["one_only_ms"] = total(spans["store"]) + total(spans["load"]) - 2 * both
        moved = sum(out[d]["bytes"] for d in spans)
        out["gpu_gbps"] = moved / (out["end_ms"] * 1e-3) / GB
    kt = [rel(e) for e in kernels]
    out["kernel_ms"] = total(union(kt))
    out["kernels"] = len(kt)
    per_thread: dict[str, list[tuple[float, float]]] = {}
    for e in calls:
        per_thread.setdefault(str(e.get("tid")), []).append(rel(e))
    out["driver_calls"] = {
        tid: {
            "n": len(v),
            "first_ms": round(min(a for a, _ in v), 3),
            "last_end_ms": round(max(b for _, b in v), 3),
            "in_calls_ms": round(sum(b - a for a, b in v), 3),
        }
        for tid, v in per_thread.items()
    }
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    n = 2048  # blocks per side; 1024 each way at once
    tensors = [torch.randn(n, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(64)]
    layout = KVLayout.from_tensors(tensors)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "runs": {}}
    tmp = tempfile.mkdtemp()
    async with OffloadManager.for_kv(layout, n, backend="cuda") as mgr:
        await mgr.pinned
        engine = mgr._engine
        assert isinstance(engine, CudaTransferEngine)

        async def both(held: bool) -> float:
            g = torch.randperm(n)[:n].tolist()
            c = torch.randperm(n)[:n].tolist()
            half = n // 2
            torch.cuda.synchronize()
            if held:
                torch.cuda._sleep(60_000_000)  # ~30 ms on the caller's stream
            t0 = time.perf_counter()
            with record_function("both:submit"):
                s = mgr.store(g[:half], c[:half])
                ld = mgr.load(c[half:], g[half:])
            await s
            await ld
            return time.perf_counter() - t0

        span = 4 << 30  # 2 GiB each way, as the KV transfers move
        dev = torch.empty(span, dtype=torch.uint8, device="cuda")
        host = torch.tensor([mgr.host_blocks().data_ptr()], dtype=torch.int64)
        devp = torch.tensor([dev.data_ptr()], dtype=torch.int64)
        size = torch.tensor([span // 2], dtype=torch.int64)
        streams = [torch.cuda.Stream() for _ in range(4)]

        async def contiguous(held: bool) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine._copies.copy_host(host, devp, size, to_host=True, streams=streams[:2])
            hi_host, hi_dev = host + span // 2, devp + span // 2
            engine._copies.copy_host(hi_host, hi_dev, size, to_host=False, streams=streams[2:])
            for st in streams:
                st.synchronize()
            return time.perf_counter() - t0

        rt = engine._rt
        copy_segments = rt.copy_segments

        def traced(*a: Any) -> None:
            with record_function("copy_segments"):
                copy_segments(*a)

        rt.copy_segments = traced  # type: ignore[method-assign,assignment]
        completion = engine._completion

        def traced_report(job: Any, error: BaseException | None) -> None:
            def finish(err: BaseException | None) -> None:
                with record_function(f"finish:{job.transfer.direction}"):
                    job.finish(err)

            completion.hooks.call_soon(finish, error)

        completion.report = traced_report  # type: ignore[method-assign]
        for name, fn, held in (
            ("free", both, False),
            ("held", both, True),
            ("contiguous", contiguous, False),
        ):
            await fn(held)  # warm-up
            runs = []
            for i in range(args.repeats):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    wall = await fn(held)
                path = os.path.join(args.trace_dir or tmp, f"{name}-{i}.json")
                prof.export_chrome_trace(path)
                r = reduce_trace(path)
                r["wall_ms"] = wall * 1e3
                runs.append(r)
            report["runs"][name] = runs
        del dev
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out")
    parser.add_argument("--trace-dir", help="keep the raw traces here")
    args = parser.parse_args()
    require_gpu()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    report = anyio.run(main_async, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    print(
        f"{'run':<16} {'wall':>7} {'gpu':>6} {'GB/s':>6} {'store first-last':>17} "
        f"{'load first-last':>16} {'1-way':>6} {'gaps s/l':>11} {'kern':>5}"
    )
    for name, runs in report["runs"].items():
        for r in runs:
            if "store" not in r or "load" not in r:
                print(name, r)
                continue
            s, ld = r["store"], r["load"]
            spans = f"{s['first_ms']:7.2f}-{s['last_ms']:<7.2f}  {ld['first_ms']:6.2f}-"
            spans += f"{ld['last_ms']:<7.2f}"
            gaps = f"{s['gaps_ms']:5.2f}/{ld['gaps_ms']:<5.2f}"
            print(
                f"{name:<16} {r['wall_ms']:7.2f} {r['end_ms']:6.2f} {r.get('gpu_gbps', 0):6.1f} "
                f"{spans} {r['one_only_ms']:6.2f} {gaps} {r['kernel_ms']:5.2f}"
            )
        med = statistics.median(r.get("gpu_gbps", 0) for r in runs)
        print(f"{name:<16} median GPU-window GB/s {med:.1f}")
    for name, runs in report["runs"].items():
        r = runs[-1]
        print(
            name,
            "gaps store",
            r.get("store", {}).get("largest_gaps"),
            "load",
            r.get("load", {}).get("largest_gaps"),
        )
        print(
            name,
            "store() to first GPU copy",
            r.get("submit_to_gpu_ms"),
            "ms; finished at",
            r.get("finished_ms"),
            "; DMA calls",
        )
        print("   ", r.get("dma_calls"))


if __name__ == "__main__":
    main()
