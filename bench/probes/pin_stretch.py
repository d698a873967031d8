"""What stretches a model's GPU step while asyncpin pins? (Issue 17: at 64 GiB the step
stretched 2.7x while pinning, 16% of steps over 1.5x, run 88.)

    python3 bench/probes/pin_stretch.py [--gib 32] [--json-out FILE]

A thread runs the start-up bench's step (8 bf16 matmuls of 8192, then a wait for its
stream) the whole time, each step split into its launches and its wait. Then, one after
another, each phase below runs while the steps are recorded:

- ``idle``: nothing else;
- ``gil``: as many threads as the manager prefaults with, each calling a 0.8 ms
  ``usleep`` through ctypes in a loop (taking the GIL back ~1000 times a second each,
  as a prefault thread does, with no memory-map work);
- ``prefault-pieces``: those threads prefault a fresh region through
  ``HostRegion.prefault`` (a huge page per call, growing when the GIL is slow);
- ``prefault-pieces-Nt``: the same with a quarter of the threads;
- ``prefault-8m`` / ``prefault-chunk``: all the threads, with one ``MADV_POPULATE_WRITE``
  per 8 MiB / per chunk;
- ``register`` / ``unregister``: one thread registers then unregisters the faulted
  region's chunks through ``CudaBackend`` (its own context);
- ``release``: the region is unmapped (``HostRegion.release``);
- ``manager-open`` / ``manager-close``: an ``OffloadManager`` of the same size on an
  event loop, entered, awaited ``pinned`` and closed.

For each: the longest, 99th and 90th percentile step over the idle median, the share of
steps over 1.5x, and the longest launch and wait parts.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio

sys.path.append(str(Path(__file__).resolve().parents[2]))

import asyncpin
from asyncpin import _sys
from asyncpin._config import default_prefault_threads
from asyncpin.cuda import CudaBackend
from asyncpin.region import HostRegion
from bench._common import StreamSteps

CHUNK = 64 << 20


def in_threads(n: int, items: list[int], work: Callable[[int], object]) -> None:
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for item in items:
        todo.put(item)

    def worker() -> None:
        while True:
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            work(item)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def summary(
    steps: list[tuple[float, float, float]], alone: float, seconds: float
) -> dict[str, float]:
    totals = sorted(e - s for s, _, e in steps)
    if not totals:
        return {"seconds": seconds, "steps": 0}

    def pct(q: float) -> float:
        return totals[min(len(totals) - 1, int(q * len(totals)))] / alone

    return {
        "seconds": round(seconds, 3),
        "steps": len(totals),
        "max_x": round(totals[-1] / alone, 2),
        "p99_x": round(pct(0.99), 2),
        "p90_x": round(pct(0.90), 2),
        "over_1_5x": round(sum(t > 1.5 * alone for t in totals) / len(totals), 3),
        "launch_max_ms": round(max(m - s for s, m, _ in steps) * 1e3, 2),
        "launch_p50_ms": round(statistics.median(m - s for s, m, _ in steps) * 1e3, 2),
        "wait_max_ms": round(max(e - m for _, m, e in steps) * 1e3, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--gib", type=int, default=32)
    p.add_argument("--json-out")
    args = p.parse_args()
    nbytes = args.gib << 30
    offsets = list(range(0, nbytes, CHUNK))
    threads = default_prefault_threads()
    steps = StreamSteps()
    steps.start()
    time.sleep(1.0)
    phases: dict[str, tuple[float, float]] = {}

    def phase(name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        fn()
        phases[name] = (t0, time.perf_counter())

    phase("idle", lambda: time.sleep(1.0))
    libc = ctypes.CDLL(None, use_errno=True)
    stop = threading.Event()

    def pingpong() -> None:
        while not stop.is_set():
            libc.usleep(800)

    def gil() -> None:
        ts = [threading.Thread(target=pingpong) for _ in range(threads)]
        for t in ts:
            t.start()
        time.sleep(2.0)
        stop.set()
        for t in ts:
            t.join()

    phase("gil", gil)

    def fixed(region: HostRegion, piece: int) -> Callable[[int], None]:
        def work(o: int) -> None:
            for start in range(o, o + CHUNK, piece):
                _sys.libc_madvise(region.address + start, piece, _sys.MADV_POPULATE_WRITE)

        return work

    def library(region: HostRegion) -> Callable[[int], object]:
        return lambda o: region.prefault(o, CHUNK)

    for name, n, piece in [
        ("prefault-pieces", threads, 0),
        (f"prefault-pieces-{max(1, threads // 4)}t", max(1, threads // 4), 0),
        ("prefault-8m", threads, 8 << 20),
        ("prefault-chunk", threads, CHUNK),
    ]:
        region = HostRegion.create(nbytes)
        work = fixed(region, piece) if piece else library(region)
        phase(name, functools.partial(in_threads, n, offsets, work))
        if name != "prefault-chunk":
            region.release()
    address = region.address
    backend = CudaBackend(0)
    backend.pin(address, CHUNK)  # the context is made here, outside the phases
    backend.unpin(address, CHUNK)
    phase("register", lambda: in_threads(1, offsets, lambda o: backend.pin(address + o, CHUNK)))
    backend.before_unpin()
    phase("unregister", lambda: in_threads(1, offsets, lambda o: backend.unpin(address + o, CHUNK)))

    def release() -> None:
        region.release()

    phase("release", release)

    async def manager() -> None:
        t0 = time.perf_counter()
        async with asyncpin.OffloadManager(nbytes) as mgr:
            await mgr.pinned
            t1 = time.perf_counter()
            phases["manager-open"] = (t0, t1)
        phases["manager-close"] = (t1, time.perf_counter())

    anyio.run(manager)
    time.sleep(0.2)
    steps.stop()
    idle = phases["idle"]
    alone = statistics.median(e - s for s, _, e in steps.during(*idle))
    out = {
        "gib": args.gib,
        "threads": threads,
        "step_alone_ms": round(alone * 1e3, 2),
        "phases": {
            name: summary(steps.during(a, b), alone, b - a) for name, (a, b) in phases.items()
        },
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    print(f"step alone {out['step_alone_ms']} ms, {threads} threads, {args.gib} GiB")
    cols = ["seconds", "steps", "max_x", "p99_x", "p90_x", "over_1_5x"]
    cols += ["launch_p50_ms", "launch_max_ms", "wait_max_ms"]
    print(f"{'phase':16}" + "".join(f"{c:>14}" for c in cols))
    for name, row in out["phases"].items():
        print(f"{name:16}" + "".join(f"{row.get(c, ''):>14}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
