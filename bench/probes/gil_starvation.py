"""How long a worker thread's result takes to reach a busy asyncio loop (no GPU needed).

    python3 bench/probes/gil_starvation.py --json-out gil.json

Every thread that hands a result to the event loop (asyncpin's completion waiters and
store submitter, anyio's worker threads) needs the GIL for a moment. Here a thread sleeps
5 ms (standing in for a copy), then calls ``loop.call_soon_threadsafe``, while a task keeps
the loop busy in pure-Python slices with a checkpoint between them. Each case is run
with Python's switch interval set as shown. CPython's GIL forces a switch to a waiting
thread only when the GIL has not changed hands for a whole interval. A loop that yields
to its selector more often than that (releasing the GIL for a moment each time) can
starve the thread for seconds. Samples that take longer than ``--limit`` seconds are
reported as such.

Found (2-core development machine, ``bench/results/gil-starvation-dev.json``): with the
default 5 ms switch interval a thread's result reached a loop busy in 2 ms slices after
0.16 s to more than 2 s, against 5.3 ms with the loop idle. That is why the CUDA engine's
loop also sweeps for finished transfers (bench/RESULTS.md#starved-threads).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any


async def completions(slice_s: float, samples: int, limit_s: float) -> list[float | None]:
    loop = asyncio.get_running_loop()
    stop = False

    async def hog() -> None:
        while not stop:
            end = time.perf_counter() + slice_s
            x = 0
            while time.perf_counter() < end:
                x += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(hog()) if slice_s > 0 else None  # 0: the loop idles
    await asyncio.sleep(0)
    out: list[float | None] = []
    for _ in range(samples):
        fut: asyncio.Future[None] = loop.create_future()

        def work(fut: asyncio.Future[None] = fut) -> None:
            time.sleep(0.005)
            loop.call_soon_threadsafe(fut.set_result, None)  # shielded: never cancelled

        t0 = time.perf_counter()
        threading.Thread(target=work, daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(fut), limit_s)
            out.append(time.perf_counter() - t0)
        except TimeoutError:
            out.append(None)
            await fut  # let the thread finish before the next sample
    stop = True
    if task is not None:
        await task
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--limit", type=float, default=2.0, help="seconds per sample")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    report: dict[str, Any] = {"python": sys.version.split()[0], "cases": []}
    print(f"{'loop slice':>10} {'switch interval':>15}   thread result reached the loop after (ms)")
    for slice_ms, interval_ms in ((0, 5), (0.5, 5), (2, 5), (10, 5), (2, 0.5)):
        sys.setswitchinterval(interval_ms / 1e3)
        samples = asyncio.run(completions(slice_ms / 1e3, args.samples, args.limit))
        ms = [None if s is None else round(s * 1e3, 1) for s in samples]
        done = [s for s in ms if s is not None]
        report["cases"].append(
            {
                "slice_ms": slice_ms,
                "switch_interval_ms": interval_ms,
                "ms": ms,
                "median_ms": statistics.median(done) if done else None,
            }
        )
        cells = " ".join(f">{args.limit:g}s" if s is None else f"{s:g}" for s in ms)
        label = "idle" if slice_ms == 0 else f"{slice_ms:g} ms"
        print(f"{label:>10} {interval_ms:>12g} ms   {cells}", flush=True)
    sys.setswitchinterval(0.005)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
