"""What holds a process's other threads up while its first KV manager opens? (Issue 17:
the first manager of a process stalled the event loop 51-244 ms and stretched a model's
step up to 20x; 100 GiB, run 89: 181 ms and a 217 ms step early in the opening.)

    python3 bench/probes/first_manager.py [--no-jit-cache]

In a fresh process, with a model's step running in a thread (8 bf16 matmuls of 8192,
then a wait for its stream) and a GIL meter (a thread sleeping 0.5 ms in a loop: each
wake's overshoot is how long it waited for the GIL, or the CPU), runs one after another
what a first ``OffloadManager.for_kv`` does in the background, each a phase:

- ``own-context``: the CUDA backend's first pin call, which makes its context;
- ``load-kernel``: the copy kernel's PTX loaded (``cudaLibraryLoadData``: the driver
  translates it, or takes it from its cache on disk; ``--no-jit-cache`` sets
  ``CUDA_CACHE_DISABLE=1`` so that it translates);
- ``manager``: a 1 GiB ``OffloadManager.for_kv`` entered, ``pinned`` awaited, closed
  (the engine's set-up: streams, buffers, the kernel's load onto the device); its
  construction and entry are timed and profiled (``JSON_OUT.entry-profile.txt``).

(Until the copy kernel was PTX, this probe also timed Triton's import and the kernel's
compile: 0.2-0.27 s and 0.8-1.0 s, holding the GIL 32-56 ms at a time; run 90.)

For each phase: its time, the meter's longest wait, the longest step over the step alone.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))

import asyncpin
from asyncpin._cudart import Runtime
from asyncpin.cuda import CudaBackend
from asyncpin.engines.cuda.kernel import CopyKernel
from asyncpin.region import HostRegion
from bench._common import StreamSteps


class Meter:
    """Sleeps 0.5 ms in a loop; records (wake, overshoot)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.0005)
            now = time.perf_counter()
            self.samples.append((now, now - t0 - 0.0005))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def worst(self, start: float, end: float) -> float:
        return max((late for t, late in self.samples if start <= t <= end), default=0.0)


def longest(spans: list[tuple[float, float, float]]) -> float:
    return max((e - s for s, _, e in spans), default=0.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--no-jit-cache", action="store_true")
    p.add_argument("--json-out")
    args = p.parse_args()
    if args.no_jit_cache:
        os.environ["CUDA_CACHE_DISABLE"] = "1"  # read when CUDA initialises, below
    steps, meter = StreamSteps(), Meter()
    steps.start()
    meter.start()
    time.sleep(1.0)
    phases: dict[str, tuple[float, float]] = {}
    info: dict[str, object] = {}

    def phase(name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        info[name] = fn()
        phases[name] = (t0, time.perf_counter())
        time.sleep(0.3)

    phase("idle", lambda: time.sleep(0.5))
    region = HostRegion.create(2 << 20)
    backend = CudaBackend(0)

    def own_context() -> None:
        backend.pin(region.address, 2 << 20)
        backend.unpin(region.address, 2 << 20)

    phase("own-context", own_context)
    region.release()

    def load_kernel() -> None:
        CopyKernel(Runtime())

    phase("load-kernel", load_kernel)
    # The Llama-3.1-8B layout of the start-up bench: 64 arrays of 32 KiB blocks.
    arrays = [torch.zeros(512, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(64)]
    layout = asyncpin.KVLayout.from_tensors(arrays)

    profiles: list[str] = []

    async def manager() -> dict[str, float]:
        # The construction and entry (on the event loop) profiled, the rest not.
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.enable()
        mgr = asyncpin.OffloadManager.for_kv(layout, num_host_blocks=512)
        t1 = time.perf_counter()
        async with mgr:
            t2 = time.perf_counter()
            profile.disable()
            await mgr.pinned
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
        profiles.append(text.getvalue())
        return {"construct_ms": round((t1 - t0) * 1e3, 2), "enter_ms": round((t2 - t1) * 1e3, 2)}

    phase("manager", lambda: anyio.run(manager))
    steps.stop()
    meter.stop()
    alone = statistics.median(e - s for s, _, e in steps.during(*phases["idle"]))
    out = {
        "no_jit_cache": args.no_jit_cache,
        "step_alone_ms": round(alone * 1e3, 2),
        "info": {k: v for k, v in info.items() if v is not None},
        "phases": {
            name: {
                "seconds": round(b - a, 3),
                "meter_worst_ms": round(meter.worst(a, b) * 1e3, 2),
                "step_x": round(longest(steps.overlapping(a, b)) / alone, 2),
            }
            for name, (a, b) in phases.items()
        },
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
        with open(args.json_out + ".entry-profile.txt", "w") as f:
            f.write("".join(profiles))
    print(f"no_jit_cache={args.no_jit_cache} step alone {out['step_alone_ms']} ms {out['info']}")
    for name, row in out["phases"].items():
        print(
            f"  {name:14} {row['seconds']:8.3f} s  meter {row['meter_worst_ms']:8.2f} ms"
            f"  step x{row['step_x']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
