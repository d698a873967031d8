"""Where a KV transfer's wall time goes (issue 17: 32 KiB blocks reach 27 GB/s at 32 MiB a
transfer, the bus 52; a one-block await takes 216 us at p50).

    python3 bench/probes/transfer_timeline.py [--json-out F] [--trace-dir D]

Llama-8B layout (64 arrays of 32 KiB blocks). For each case (one block; 16 blocks = 32 MiB;
128 blocks = 256 MiB; store and load), ``--repeats`` transfers one after another, the
device idle before each, and the median of each step's time from the ``store()`` /
``load()`` call:

- ``returned``: the call returned on the event loop;
- ``enqueue_start`` / ``enqueue_end``: the engine's ``_enqueue`` (in the submitter thread
  for large stores) began and ended queuing the device work;
- ``gpu_start`` / ``gpu_end``: the device began and ended the job's work (timing events
  recorded on the job's streams, placed on the host clock through one reference pair);
- ``reported``: the waiter thread learned of the end;
- ``resumed``: the awaiting coroutine ran again.

Then a cProfile of ``--profile-calls`` one-block store() calls (submission only: the
top functions by own time), and, with ``--trace-dir``, a torch.profiler trace of a few
transfers of each case (kernels and memcopies on the device timeline).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))

from asyncpin import KVLayout, OffloadManager
from asyncpin.engines.cuda import CudaTransferEngine
from asyncpin.engines.cuda.completion import Completion
from bench._common import kv_tensors, median

_marks: dict[int, dict[str, Any]] = {}


def _mark(job: Any, key: str, value: Any = None) -> None:
    _marks.setdefault(id(job.transfer), {})[key] = time.perf_counter() if value is None else value


def _instrument() -> None:
    """Wrap the engine's steps to record when each ran (class-level patches)."""
    enqueue = CudaTransferEngine._enqueue

    def timed_enqueue(self: Any, job: Any, method: str) -> None:
        _mark(job, "enqueue_start")
        start = torch.cuda.Event(enable_timing=True)
        lane = self._lanes[job.transfer.direction]
        start.record(lane.kernel)
        for stream in lane.dma:  # whichever stream the method begins on
            stream.wait_event(start)
        _mark(job, "gpu_start_event", start)
        enqueue(self, job, method)
        end = torch.cuda.Event(enable_timing=True)
        for stream in lane.dma:
            lane.kernel.wait_stream(stream)
        end.record(lane.kernel)
        _mark(job, "gpu_end_event", end)
        _mark(job, "enqueue_end")

    CudaTransferEngine._enqueue = timed_enqueue  # type: ignore[method-assign]

    report = Completion.report

    def timed_report(self: Any, job: Any, error: Any) -> None:
        _mark(job, "reported")
        report(self, job, error)

    Completion.report = timed_report  # type: ignore[method-assign]


def _host_clock() -> tuple[Any, float]:
    """A timing event and the host time at which the idle device passed it."""
    torch.cuda.synchronize()
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    ref.synchronize()
    return ref, time.perf_counter()


async def _case(
    mgr: Any, layout: KVLayout, blocks: int, n: int, direction: str, repeats: int
) -> dict[str, Any]:
    rng = random.Random(n)
    steps: dict[str, list[float]] = {}
    methods: set[str] = set()
    for i in range(repeats + 3):
        gpu, cpu = rng.sample(range(blocks), n), rng.sample(range(blocks), n)
        ref, ref_t = _host_clock()
        t0 = time.perf_counter()
        transfer = mgr.store(gpu, cpu) if direction == "store" else mgr.load(cpu, gpu)
        t_ret = time.perf_counter()
        await transfer
        t_res = time.perf_counter()
        torch.cuda.synchronize()
        marks = _marks.pop(id(transfer), {})
        methods.add(str(transfer.method))
        if i < 3 or "gpu_start_event" not in marks:
            continue
        row = {
            "returned": t_ret - t0,
            "enqueue_start": marks["enqueue_start"] - t0,
            "enqueue_end": marks["enqueue_end"] - t0,
            "gpu_start": ref_t + ref.elapsed_time(marks["gpu_start_event"]) / 1e3 - t0,
            "gpu_end": ref_t + ref.elapsed_time(marks["gpu_end_event"]) / 1e3 - t0,
            "reported": marks.get("reported", float("nan")) - t0,
            "resumed": t_res - t0,
        }
        for k, v in row.items():
            steps.setdefault(k, []).append(v * 1e6)
    out: dict[str, Any] = {k: median(v) for k, v in steps.items()}
    out["gpu_us"] = median(
        [e - s for s, e in zip(steps["gpu_start"], steps["gpu_end"], strict=True)]
    )
    nbytes = n * layout.host_block_bytes
    out["gbps"] = nbytes / (out["resumed"] / 1e6) / 1e9
    out["gpu_gbps"] = nbytes / (out["gpu_us"] / 1e6) / 1e9
    out["method"] = ",".join(sorted(methods))
    return out


async def main_async(args: Any) -> dict[str, Any]:
    _instrument()
    blocks = 512
    layout = KVLayout.from_tensors(kv_tensors("cuda", blocks))
    doc: dict[str, Any] = {"cases": {}}
    async with OffloadManager.for_kv(layout, blocks) as mgr:
        await mgr.pinned
        for n in (1, 16, 128):
            for direction in ("store", "load"):
                key = f"{direction}_{n}"
                doc["cases"][key] = row = await _case(
                    mgr, layout, blocks, n, direction, args.repeats
                )
                print(
                    key,
                    {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()},
                    file=sys.stderr,
                )
        prof = cProfile.Profile()
        for i in range(args.profile_calls):
            prof.enable()
            transfer = mgr.store([i % blocks], [(i * 7) % blocks])
            prof.disable()
            await transfer
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        doc["profile_one_block_store"] = text.getvalue()
        if args.trace_dir:
            from torch.profiler import ProfilerActivity, profile

            rng = random.Random(0)
            for n in (1, 16, 128):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                    for direction in ("store", "load", "both"):
                        for _ in range(3):
                            torch.cuda.synchronize()
                            g, c = (
                                rng.sample(range(blocks), 2 * n),
                                rng.sample(range(blocks), 2 * n),
                            )
                            if direction == "store":
                                await mgr.store(g[:n], c[:n])
                            elif direction == "load":
                                await mgr.load(c[:n], g[:n])
                            else:
                                s, ld = mgr.store(g[:n], c[:n]), mgr.load(c[n:], g[n:])
                                await s
                                await ld
                p.export_chrome_trace(str(Path(args.trace_dir) / f"trace-{n}.json"))
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--profile-calls", type=int, default=300)
    p.add_argument("--trace-dir")
    p.add_argument("--json-out")
    args = p.parse_args()
    if args.trace_dir:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    doc = anyio.run(main_async, args)
    print(
        doc.pop("profile_one_block_store") if not args.json_out else doc["profile_one_block_store"]
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    cols = [
        "returned",
        "enqueue_start",
        "enqueue_end",
        "gpu_start",
        "gpu_end",
        "reported",
        "resumed",
    ]
    print("case          method  " + " ".join(f"{c[:9]:>9}" for c in cols) + "   GB/s  gpuGB/s")
    for key, row in doc["cases"].items():
        print(
            f"{key:13} {row['method']:7} "
            + " ".join(f"{row[c]:9.0f}" for c in cols)
            + f" {row['gbps']:6.1f} {row['gpu_gbps']:6.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
