"""Pinning on a CUDA GPU: asyncpin against the one-call recipe, in one run.

    python3 bench/cuda_pinning.py --size 16GiB --big 64GiB --json-out $OUT/cuda_pinning.json

Peer ("zeros+register"): a constructor that does torch.zeros(size) then one
cudaHostRegister of the whole buffer, on the event-loop thread. asyncpin: the manager
with the configuration under test. For each, the run records entry latency, time to
pinned, the event loop's worst heartbeat lag, and the step times of a ~20 ms GPU loop
(matmuls + synchronize) running in an engine thread meanwhile. Ratios are peer/asyncpin.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin import OffloadManager
from asyncpin._cudart import cudart as _cudart
from asyncpin.cli import parse_size
from bench._gpu import require_gpu

MiB, GiB = 1 << 20, 1 << 30


class GpuLoop:
    """An engine stand-in: a loop of matmuls + synchronize in its own thread."""

    def __init__(self, target_ms: float = 20.0) -> None:
        self.a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        self.b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            self._matmuls(2)
        t0 = time.perf_counter()
        self._matmuls(10)
        one = (time.perf_counter() - t0) / 10
        self.count = max(1, round(target_ms / 1e3 / one))
        self.steps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _matmuls(self, n: int) -> None:
        for _ in range(n):
            torch.mm(self.a, self.b)
        torch.cuda.synchronize()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self._matmuls(self.count)
            self.steps.append((t0, time.perf_counter() - t0))

    def start(self) -> None:
        self.steps = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        while len(self.steps) < 3:
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def window(self, t_from: float, t_to: float) -> list[float]:
        """Durations of steps that overlapped [t_from, t_to]."""
        return [d for t0, d in self.steps if t0 < t_to and t0 + d > t_from]


class Heartbeat:
    """Worst lateness of a 1 ms sleep loop on the event loop."""

    def __init__(self) -> None:
        self.max_lag_s = 0.0

    async def run(self, stop: anyio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(0.001)
            self.max_lag_s = max(self.max_lag_s, time.perf_counter() - t0 - 0.001)


@dataclass
class Result:
    name: str
    config: dict[str, Any]
    enter_s: float
    pinned_s: float
    gib_per_s: float
    loop_lag_max_ms: float
    step_max_ms: float | None = None
    step_p50_ms: float | None = None
    steps_overlapping: int | None = None
    slowest_pin_call_ms: float | None = None
    unpin_s: float | None = None
    close_s: float | None = None
    hugepage_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _register(ptr: int, nbytes: int) -> None:
    lib = _cudart()
    assert lib is not None
    code = lib.cudaHostRegister(ctypes.c_void_p(ptr), nbytes, 0)
    assert code == 0, f"cudaHostRegister failed: {code}"


def _unregister(ptr: int) -> None:
    lib = _cudart()
    assert lib is not None
    assert lib.cudaHostUnregister(ctypes.c_void_p(ptr)) == 0


async def run_peer(nbytes: int, gpu: GpuLoop | None) -> Result:
    """torch.zeros + one cudaHostRegister, in a constructor on the event loop."""
    stop = anyio.Event()
    beat = Heartbeat()
    async with anyio.create_task_group() as tg:
        tg.start_soon(beat.run, stop)
        await anyio.sleep(0.01)
        t0 = time.perf_counter()
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        _register(buf.data_ptr(), nbytes)
        t1 = time.perf_counter()
        await anyio.sleep(0.01)
        stop.set()
    steps = gpu.window(t0, t1) if gpu else []
    t2 = time.perf_counter()
    _unregister(buf.data_ptr())
    unpin = time.perf_counter() - t2
    del buf
    return Result(
        name="peer: torch.zeros + one cudaHostRegister",
        config={},
        enter_s=t1 - t0,
        pinned_s=t1 - t0,
        gib_per_s=nbytes / GiB / (t1 - t0),
        loop_lag_max_ms=beat.max_lag_s * 1e3,
        step_max_ms=max(steps) * 1e3 if steps else None,
        step_p50_ms=statistics.median(steps) * 1e3 if steps else None,
        steps_overlapping=len(steps),
        unpin_s=unpin,
    )


async def run_asyncpin(nbytes: int, config: dict[str, Any], gpu: GpuLoop | None) -> Result:
    stop = anyio.Event()
    beat = Heartbeat()
    async with anyio.create_task_group() as tg:
        tg.start_soon(beat.run, stop)
        await anyio.sleep(0.01)
        t0 = time.perf_counter()
        async with OffloadManager(nbytes, backend="cuda", **config) as mgr:
            t_body = time.perf_counter()
            await mgr.pinned
            t1 = time.perf_counter()
        stats = mgr.stats()
        stop.set()
    steps = gpu.window(t0, t1) if gpu else []
    return Result(
        name="asyncpin",
        config=config,
        enter_s=t_body - t0,
        pinned_s=t1 - t0,
        gib_per_s=nbytes / GiB / (t1 - t0),
        loop_lag_max_ms=beat.max_lag_s * 1e3,
        step_max_ms=max(steps) * 1e3 if steps else None,
        step_p50_ms=statistics.median(steps) * 1e3 if steps else None,
        steps_overlapping=len(steps),
        slowest_pin_call_ms=stats.slowest_pin_seconds * 1e3,
        unpin_s=stats.unpin_seconds,
        close_s=stats.close_seconds,
        hugepage_bytes=stats.hugepage_bytes,
    )


async def run_close_mid_pinning(nbytes: int, config: dict[str, Any]) -> dict[str, Any]:
    async with OffloadManager(nbytes, backend="cuda", **config) as mgr:
        total = mgr.stats().chunks_total
        while mgr.stats().chunks_pinned < total // 2:  # noqa: ASYNC110 (a bench may poll)
            await anyio.sleep(0.001)
        t0 = time.perf_counter()
        await mgr.aclose()
        close_s = time.perf_counter() - t0
    stats = mgr.stats()
    return {
        "close_s": close_s,
        "chunks_pinned_at_close": total // 2,
        "chunks_total": total,
        "slowest_pin_call_s": stats.slowest_pin_seconds,
        "unpin_s": stats.unpin_seconds,
        "bound_s": stats.slowest_pin_seconds + (stats.unpin_seconds or 0.0),
    }


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = parse_size(args.size)
    torch.cuda.init()
    gpu = GpuLoop()
    # Baseline step time, nothing pinning.
    gpu.start()
    t0 = time.perf_counter()
    await anyio.sleep(1.0)
    base = gpu.window(t0, time.perf_counter())
    gpu.stop()
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
        "driver": _driver_version(),
        "size_bytes": nbytes,
        "repeats": args.repeats,
        "gpu_step": {
            "matmuls": gpu.count,
            "p50_ms": statistics.median(base) * 1e3,
            "max_ms": max(base) * 1e3,
        },
        "runs": [],
    }
    sweep: list[dict[str, Any]] = [
        {"chunk_bytes": 16 * MiB, "prefault_threads": 8, "pin_threads": 1},
        {"chunk_bytes": 32 * MiB, "prefault_threads": 8, "pin_threads": 1},
        {"chunk_bytes": 16 * MiB, "prefault_threads": 8, "pin_threads": 2},
        {"chunk_bytes": 64 * MiB, "prefault_threads": 8, "pin_threads": 1, "pin_interval_s": 0.002},
        {"chunk_bytes": 256 * MiB, "prefault_threads": 8, "pin_threads": 1},
    ]
    recipes: list[tuple[str, dict[str, Any] | None]] = [("peer", None)] + [
        (label(cfg), cfg) for cfg in sweep[: args.configs]
    ]
    runs: list[dict[str, Any]] = report["runs"]
    for gpu_on in (False, True):
        if gpu_on:
            gpu.start()
        for rep in range(args.repeats):
            shift = rep % len(recipes)  # rotate the order so no recipe always goes first
            for name, cfg in recipes[shift:] + recipes[:shift]:
                prime(nbytes)
                loop = gpu if gpu_on else None
                r = await (
                    run_peer(nbytes, loop) if cfg is None else run_asyncpin(nbytes, cfg, loop)
                )
                runs.append(asdict(r) | {"label": name, "gpu_loop": gpu_on, "repeat": rep})
        if gpu_on:
            gpu.stop()
    report["summary"] = summarise(runs)
    report["close_mid_pinning"] = []
    for cfg in sweep[: min(args.configs, 3)] + sweep[4:5]:
        prime(nbytes)
        report["close_mid_pinning"].append(
            {"label": label(cfg)} | await run_close_mid_pinning(nbytes, cfg)
        )
    if args.big:
        big = parse_size(args.big)
        prime(big)
        peer_big = asdict(await run_peer(big, None))
        prime(big)
        ours_big = asdict(await run_asyncpin(big, sweep[0], None))
        report["big"] = {"size_bytes": big, "peer": peer_big, "asyncpin": ours_big}
    return report


def label(cfg: dict[str, Any]) -> str:
    gap = cfg.get("pin_interval_s", 0) * 1e3
    return (
        f"asyncpin {cfg['chunk_bytes'] // MiB}MiB pf{cfg['prefault_threads']} "
        f"pin{cfg['pin_threads']}" + (f" gap{gap:.0f}ms" if gap else "")
    )


def prime(nbytes: int) -> None:
    """Fault ``nbytes`` in and free it, so every run starts from memory the VM backs."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)
    del buf


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over repeats per (recipe, gpu loop); worst step over all repeats."""
    out = []
    keys = sorted({(r["label"], r["gpu_loop"]) for r in runs}, key=lambda k: (k[1], k[0] != "peer"))
    for name, gpu_on in keys:
        group = [r for r in runs if r["label"] == name and r["gpu_loop"] == gpu_on]

        def med(key: str, group: list[dict[str, Any]] = group) -> float | None:
            values = [r[key] for r in group if r[key] is not None]
            return statistics.median(values) if values else None

        steps = [r["step_max_ms"] for r in group if r["step_max_ms"] is not None]
        out.append(
            {
                "label": name,
                "gpu_loop": gpu_on,
                "repeats": len(group),
                "enter_s": med("enter_s"),
                "pinned_s": med("pinned_s"),
                "gib_per_s": med("gib_per_s"),
                "loop_lag_max_ms": med("loop_lag_max_ms"),
                "loop_lag_worst_ms": max(r["loop_lag_max_ms"] for r in group),
                "step_max_ms": max(steps) if steps else None,
                "step_p50_ms": med("step_p50_ms"),
                "slowest_pin_call_ms": med("slowest_pin_call_ms"),
            }
        )
    return out


def _driver_version() -> str:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        return out.stdout.strip()
    except OSError:
        return "unknown"


def print_table(report: dict[str, Any]) -> None:
    size = report["size_bytes"] / GiB
    step = report["gpu_step"]
    print(
        f"\n{report['device']} torch {report['torch']} cuda {report['cuda_runtime']} "
        f"driver {report['driver']}; {size:.0f} GiB; medians of {report['repeats']}; "
        f"GPU step alone p50 {step['p50_ms']:.1f} ms, max {step['max_ms']:.1f} ms "
        f"({step['matmuls']} bf16 8192^3 matmuls)"
    )
    print(
        f"{'recipe':<34} {'gpu':>3} {'enter ms':>9} {'pinned s':>8} {'GiB/s':>6} "
        f"{'lag ms':>7} {'lag max':>7} {'step max':>8} {'p50':>6} {'pin call':>8}"
    )
    peer = {r["gpu_loop"]: r for r in report["summary"] if r["label"] == "peer"}
    for r in report["summary"]:
        print(
            f"{r['label']:<34} {'yes' if r['gpu_loop'] else 'no':>3} {r['enter_s'] * 1e3:>9.2f} "
            f"{r['pinned_s']:>8.2f} {r['gib_per_s']:>6.1f} {r['loop_lag_max_ms']:>7.1f} "
            f"{r['loop_lag_worst_ms']:>7.1f} {fmt(r['step_max_ms']):>8} "
            f"{fmt(r['step_p50_ms']):>6} {fmt(r['slowest_pin_call_ms']):>8}"
        )
    for r in report["summary"]:
        if r["label"] != "peer":
            p = peer[r["gpu_loop"]]
            step_ratio = (
                f", step max / step alone {r['step_max_ms'] / step['p50_ms']:.2f}x "
                f"(peer {p['step_max_ms'] / step['p50_ms']:.1f}x)"
                if r["step_max_ms"]
                else ""
            )
            print(
                f"  {r['label']:<32} gpu={'yes' if r['gpu_loop'] else 'no':<3} enter "
                f"{p['enter_s'] / r['enter_s']:,.0f}x faster, pinned "
                f"{p['pinned_s'] / r['pinned_s']:.2f}x faster{step_ratio}"
            )
    for c in report["close_mid_pinning"]:
        print(
            f"close mid-pinning {c['label']}: {c['close_s'] * 1e3:.1f} ms (slowest pin "
            f"{c['slowest_pin_call_s'] * 1e3:.1f} ms + unpin {c['unpin_s'] * 1e3:.1f} ms "
            f"= {c['bound_s'] * 1e3:.1f} ms)"
        )
    if "big" in report:
        b = report["big"]
        peer_s, ours = b["peer"]["pinned_s"], b["asyncpin"]
        print(
            f"{b['size_bytes'] / GiB:.0f} GiB: peer {peer_s:.2f} s, "
            f"asyncpin {ours['pinned_s']:.2f} s "
            f"({peer_s / ours['pinned_s']:.2f}x, {ours['gib_per_s']:.1f} GiB/s), "
            f"enter {ours['enter_s'] * 1e3:.2f} ms, lag {ours['loop_lag_max_ms']:.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="16GiB")
    parser.add_argument("--big", default=None, help="also run one size more, e.g. 64GiB")
    parser.add_argument("--configs", type=int, default=5, help="how many configs to sweep")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    require_gpu()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    report = anyio.run(main_async, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    print_table(report)


if __name__ == "__main__":
    main()
