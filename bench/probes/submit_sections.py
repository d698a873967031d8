"""What queuing a KV transfer costs on the CPU, part by part, and how long a thread wakes
another here (issue 17: a one-block await of 216-282 us; 32 KiB blocks at 21-27 GB/s with
32 MiB a transfer).

    python3 bench/probes/submit_sections.py [--json-out F]

Llama-8B layout (64 arrays of 32 KiB blocks). Each case runs ``--repeats`` transfers one
after another on an idle device and reports p50 of the wall time from the call until the
awaiting coroutine resumes (``e2e``), p50 of the call's own time (``call``), and the mean
microseconds per transfer spent in each of the engine's steps (inclusive times; wrapped
at class level, so a step's figure includes the steps it calls). Cases: 1, 16 and 128
blocks, store and load, ``method="auto"``; one block by ``kernel`` too; and the stores with
``thread_stores`` off (queued on the event loop instead of the submitter thread).

Then the wake-ups: the loop puts an item to a thread blocked in ``SimpleQueue.get`` (how
long until the thread runs), and the thread wakes the idle loop with
``call_soon_threadsafe`` (how long until the callback's coroutine runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import random
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))

from asyncpin import KVLayout, OffloadManager
from asyncpin._cudart import Runtime
from asyncpin._router import TransferRouter
from asyncpin.engines.cuda import CudaTransferEngine
from asyncpin.engines.cuda.methods import CopyMethods
from asyncpin.engines.cuda.plan import AddressPlan
from bench._common import kv_tensors, percentiles

_spent: dict[str, float] = defaultdict(float)


def _wrap(owner: Any, name: str) -> None:
    inner = getattr(owner, name)
    label = f"{owner.__name__}.{name}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _spent[label] += time.perf_counter() - t0

    setattr(owner, name, timed)


def _instrument() -> None:
    for owner, names in (
        (TransferRouter, ["submit", "_validated"]),
        (CudaTransferEngine, ["submit", "_enqueue"]),
        (
            CopyMethods,
            ["batch", "pack", "uva_kernel", "ids_on_device", "launch", "start"],
        ),
        (AddressPlan, ["small_segments", "piece_dmas", "segments"]),
        (Runtime, ["copy_segments", "record", "wait", "upload"]),
        (torch.cuda.StreamContext, ["__enter__", "__exit__"]),
    ):
        for name in names:
            _wrap(owner, name)


async def _case(
    mgr: Any, blocks: int, n: int, direction: str, method: str, repeats: int
) -> dict[str, Any]:
    rng = random.Random(n)
    e2e, call = [], []
    methods = set()
    for i in range(repeats + 5):
        gpu, cpu = rng.sample(range(blocks), n), rng.sample(range(blocks), n)
        torch.cuda.synchronize()
        if i == 5:
            _spent.clear()
        t0 = time.perf_counter()
        if direction == "store":
            transfer = mgr.store(gpu, cpu, method=method)
        else:
            transfer = mgr.load(cpu, gpu, method=method)
        t1 = time.perf_counter()
        await transfer
        t2 = time.perf_counter()
        methods.add(transfer.method)
        if i >= 5:
            call.append(t1 - t0)
            e2e.append(t2 - t0)
    us = 1e6
    return {
        "method": ",".join(sorted(methods)),
        "e2e_p50_us": percentiles(e2e)["p50"] * us,
        "e2e_p99_us": percentiles(e2e)["p99"] * us,
        "call_p50_us": percentiles(call)["p50"] * us,
        "sections_us": {k: v / repeats * us for k, v in sorted(_spent.items())},
    }


async def _wakes(samples: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    items: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def worker() -> None:
        while (item := items.get()) is not None:
            t_sent, fut = item
            t_woke = time.perf_counter()
            loop.call_soon_threadsafe(fut.set_result, (t_sent, t_woke, time.perf_counter()))

    thread = threading.Thread(target=worker)
    thread.start()
    thread_wake, loop_wake = [], []
    for _ in range(samples):
        await asyncio.sleep(0.001)  # both sides asleep
        fut = loop.create_future()
        items.put((time.perf_counter(), fut))
        t_sent, t_woke, t_called = await fut
        t_back = time.perf_counter()
        thread_wake.append(t_woke - t_sent)
        loop_wake.append(t_back - t_called)
    items.put(None)
    thread.join()
    us = 1e6
    return {
        "thread_wake_p50_us": percentiles(thread_wake)["p50"] * us,
        "thread_wake_p99_us": percentiles(thread_wake)["p99"] * us,
        "loop_wake_p50_us": percentiles(loop_wake)["p50"] * us,
        "loop_wake_p99_us": percentiles(loop_wake)["p99"] * us,
    }


async def main_async(args: Any) -> dict[str, Any]:
    blocks = 512
    layout = KVLayout.from_tensors(kv_tensors("cuda", blocks))
    doc: dict[str, Any] = {"wakes": await _wakes(args.repeats), "cases": {}}
    _instrument()
    cases: list[tuple[int, str, str, bool]] = [
        (1, "store", "auto", True),
        (1, "load", "auto", True),
        (1, "store", "kernel", True),
        (1, "load", "kernel", True),
        (16, "store", "auto", True),
        (16, "load", "auto", True),
        (16, "store", "auto", False),
        (128, "store", "auto", True),
        (128, "load", "auto", True),
        (128, "store", "auto", False),
    ]
    async with OffloadManager.for_kv(layout, blocks) as mgr:
        await mgr.pinned
        engine: Any = mgr._opened.engine if mgr._opened is not None else None
        for n, direction, method, threaded in cases:
            engine.thread_stores = threaded
            key = f"{direction}_{n}_{method}" + ("" if threaded else "_on_loop")
            reps = args.repeats if n < 128 else max(args.repeats // 4, 10)
            doc["cases"][key] = row = await _case(mgr, blocks, n, direction, method, reps)
            print(key, json.dumps(row), file=sys.stderr)
        engine.thread_stores = True
    return doc


def _table(doc: dict[str, Any], out: Callable[[str], None]) -> None:
    w = doc["wakes"]
    out(
        f"wake-ups p50/p99 us: thread {w['thread_wake_p50_us']:.0f}/{w['thread_wake_p99_us']:.0f},"
        f" loop {w['loop_wake_p50_us']:.0f}/{w['loop_wake_p99_us']:.0f}"
    )
    out(f"{'case':24} {'method':7} {'e2e p50':>8} {'p99':>6} {'call':>6}  top sections (us)")
    for key, row in doc["cases"].items():
        top = sorted(row["sections_us"].items(), key=lambda kv: -kv[1])[:7]
        parts = ", ".join(f"{k.split('.')[-1]} {v:.0f}" for k, v in top)
        out(
            f"{key:24} {row['method']:7} {row['e2e_p50_us']:8.0f} {row['e2e_p99_us']:6.0f}"
            f" {row['call_p50_us']:6.0f}  {parts}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--json-out")
    args = p.parse_args()
    doc = asyncio.run(main_async(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    _table(doc, print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
