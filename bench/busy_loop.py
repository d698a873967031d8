"""KV transfers while the event loop is CPU-bound: does the store submitter thread keep up?

    python3 bench/busy_loop.py --json-out $OUT/busy_loop.json
    python3 bench/busy_loop.py --backend trio     # the same on trio
    python3 bench/busy_loop.py --no-sweep         # the engine without the loop-side sweep

A large store is queued by a submitter thread, which needs the GIL for each step. With
the loop idle it has it at once; with the loop busy in Python, every GIL hand-off can
wait for the interpreter's switch interval (5 ms). Llama-8B-like layout, 32 KiB blocks,
2 GiB per transfer (random ids), pack method. The loop is kept busy by a task that runs
pure Python in 2 ms slices with a checkpoint between them. Each store is timed with the
submitter thread (the default) and with the store queued on the loop (``thread_stores``
off); a load (always queued on the loop) is timed alongside for reference. Wall time from
the call to the awaiting coroutine's return; median of 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import structlog
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin import KVLayout, OffloadManager
from asyncpin.engines.cuda import CudaTransferEngine
from bench._gpu import require_gpu

GB = 1e9


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    n = 2048
    tensors = [torch.randn(n, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(64)]
    layout = KVLayout.from_tensors(tensors)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "backend": args.backend,
        "sweep": not args.no_sweep,
        "results": {},
    }
    async with OffloadManager.for_kv(layout, n, backend="cuda") as mgr:
        await mgr.pinned
        engine = mgr._engine
        assert isinstance(engine, CudaTransferEngine)
        if args.no_sweep:  # the sweep counts as scheduled and never is: the engine without it
            engine._completion.sweeping = True
        half = args.blocks
        nbytes = half * layout.host_block_bytes

        async def one(direction: str) -> float:
            g = torch.randperm(n)[:half].tolist()
            c = torch.randperm(n)[:half].tolist()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with anyio.fail_after(args.timeout):
                if direction == "store":
                    await mgr.store(g, c, method="pack")
                else:
                    await mgr.load(c, g, method="pack")
            return time.perf_counter() - t0

        for busy in (False, True):
            stop = anyio.Event()
            slices = 0

            async def hog(stop: anyio.Event = stop) -> None:
                nonlocal slices
                while not stop.is_set():
                    end = time.perf_counter() + 0.002
                    x = 0
                    while time.perf_counter() < end:
                        x += 1
                    slices += 1
                    await anyio.lowlevel.checkpoint()

            async with anyio.create_task_group() as tg:
                if busy:
                    tg.start_soon(hog)
                for label, direction, threaded in (
                    ("load, queued on the loop", "load", True),
                    ("store, queued on the loop", "store", False),
                    ("store, submitter thread", "store", True),
                ):
                    engine.thread_stores = threaded
                    key = f"{'busy' if busy else 'idle'} loop: {label}"
                    times = []
                    try:
                        await one(direction)  # warm-up
                        for _ in range(args.repeats):
                            times.append(await one(direction))
                    except TimeoutError:
                        print(f"{key:<45} a transfer took over {args.timeout} s", flush=True)
                    report["results"][key] = {"ms": [round(t * 1e3, 2) for t in times]}
                    if times:
                        gbps = nbytes / statistics.median(times) / GB
                        report["results"][key]["gbps"] = gbps
                        ms = " ".join(f"{t * 1e3:.0f}" for t in times)
                        print(f"{key:<45} {gbps:6.1f} GB/s  ms: {ms}", flush=True)
                engine.thread_stores = True
                stop.set()
            report["results"][f"{'busy' if busy else 'idle'} slices"] = slices
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=1024, help="blocks per transfer")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per transfer")
    parser.add_argument(
        "--switch-interval", type=float, help="sys.setswitchinterval for the run (seconds)"
    )
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--no-sweep", action="store_true", help="the engine without its sweep")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    require_gpu()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    sweep = "off" if args.no_sweep else "on"
    print(
        f"{args.backend}, sweep {sweep}, switch interval {sys.getswitchinterval() * 1e3:g} ms",
        flush=True,
    )
    report = anyio.run(main_async, args, backend=args.backend)
    report["switch_interval_s"] = sys.getswitchinterval()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
