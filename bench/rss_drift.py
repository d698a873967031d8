"""Where does the soak's RSS drift come from? Transfers, manager lifecycles, or captures?

    python3 bench/rss_drift.py --json-out $OUT/rss_drift.json

The soak (bench/soak.py) sees resident memory grow by about 0.4 MB per cycle, and a cycle
is a manager's whole life with transfers and graph captures in it. Without a GPU, the
same cycles through the host engine hold RSS flat. This script separates the three on
the GPU, each after a warm-up, and reports RSS growth per unit:

- ``transfers``: one manager, many store/load round trips (64 blocks, every method);
- ``lifecycles``: managers opened, pinned and closed with no transfer;
- ``captures``: CUDA graphs captured and replayed through the capture gate, no manager;
- ``pageable``: one manager with pinning held back, round trips through pageable memory
  (each copy runs in an anyio worker thread, as in the soak's pageable cycles).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin import KVLayout, OffloadManager, capture_gate
from asyncpin.transfers import Method
from bench._gpu import require_gpu

HOST_BLOCKS = 512  # 1 GiB of 2 MiB host blocks


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def slope(samples: list[tuple[int, float]]) -> float:
    """Least-squares growth per unit, MB."""
    n = len(samples)
    mx = sum(x for x, _ in samples) / n
    my = sum(y for _, y in samples) / n
    sxx = sum((x - mx) ** 2 for x, _ in samples)
    return sum((x - mx) * (y - my) for x, y in samples) / sxx


async def transfers(layout: KVLayout, count: int) -> dict[str, Any]:
    methods: list[Method] = ["pack", "batch", "kernel", "auto"]
    samples: list[tuple[int, float]] = []
    async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend="cuda") as mgr:
        await mgr.pinned
        for i in range(count + 200):
            g = random.sample(range(layout.num_blocks), 64)
            c = random.sample(range(HOST_BLOCKS), 64)
            await mgr.store(g, c, method=methods[i % 4])
            await mgr.load(c, g, method=methods[i % 4])
            if i >= 200 and i % 100 == 0:  # after a warm-up
                samples.append((i - 200, rss_mb()))
    return {"round_trips": count, "samples": samples, "mb_per_1000": 1000 * slope(samples)}


async def lifecycles(layout: KVLayout, count: int) -> dict[str, Any]:
    samples: list[tuple[int, float]] = []
    for i in range(count + 3):
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend="cuda") as mgr:
            await mgr.pinned
        del mgr
        gc.collect()
        if i >= 3:
            samples.append((i - 3, rss_mb()))
    return {"cycles": count, "samples": samples, "mb_per_cycle": slope(samples)}


async def pageable(layout: KVLayout, count: int) -> dict[str, Any]:
    samples: list[tuple[int, float]] = []
    async with (
        OffloadManager.for_kv(
            layout, HOST_BLOCKS, backend="cuda", unpinned_policy="pageable"
        ) as mgr,
        mgr.pinning_paused(),
    ):
        chunks = mgr.stats().chunks_pinned
        last = range(HOST_BLOCKS // 2, HOST_BLOCKS)  # the chunks pinned last
        for i in range(count + 50):
            g = random.sample(range(layout.num_blocks), 8)
            c = random.sample(last, 8)
            await mgr.store(g, c)
            await mgr.load(c, g)
            if i >= 50 and i % 25 == 0:
                samples.append((i - 50, rss_mb()))
        stats = mgr.stats()
    return {
        "round_trips": count,
        "chunks_pinned_before": chunks,
        "transfers_pageable": stats.transfers_pageable,
        "transfers_stored": stats.transfers_stored,
        "samples": samples,
        "mb_per_1000": 1000 * slope(samples),
    }


def captures(count: int) -> dict[str, Any]:
    x = torch.ones(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x * 2  # warm-up outside a capture
    torch.cuda.synchronize()
    samples: list[tuple[int, float]] = []
    for i in range(count + 50):
        graph = torch.cuda.CUDAGraph()
        with capture_gate(), torch.cuda.graph(graph):
            y = x * 2
            for _ in range(20):
                y = y + 1
        graph.replay()
        del graph
        if i >= 50 and i % 50 == 0:
            gc.collect()
            samples.append((i - 50, rss_mb()))
    torch.cuda.synchronize()
    return {"captures": count, "samples": samples, "mb_per_1000": 1000 * slope(samples)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    n = 2048
    tensors = [torch.randn(n, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(64)]
    layout = KVLayout.from_tensors(tensors)
    only = args.only.split(",")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    if "transfers" in only:
        report["transfers"] = await transfers(layout, args.round_trips)
    if "lifecycles" in only:
        report["lifecycles"] = await lifecycles(layout, args.cycles)
    if "captures" in only:
        report["captures"] = captures(args.captures)
    if "pageable" in only:
        report["pageable"] = await pageable(layout, args.pageable_round_trips)
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--captures", type=int, default=1000)
    parser.add_argument("--pageable-round-trips", type=int, default=500)
    parser.add_argument("--only", default="transfers,lifecycles,captures,pageable")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    require_gpu()
    report = asyncio.run(main_async(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    lines = {
        "transfers": ("mb_per_1000", "MB per 1000 round trips", "round_trips"),
        "lifecycles": ("mb_per_cycle", "MB per open/pin/close", "cycles"),
        "captures": ("mb_per_1000", "MB per 1000 captures", "captures"),
        "pageable": ("mb_per_1000", "MB per 1000 pageable round trips", "round_trips"),
    }
    for part, (key, unit, count) in lines.items():
        if part in report:
            print(f"{part + ':':<11} {report[part][key]:+.3f} {unit} ({report[part][count]})")
    if "pageable" in report:
        p = report["pageable"]
        print(
            f"{'':<12}pageable: {p['transfers_pageable']} of {p['transfers_stored'] * 2} transfers"
        )


if __name__ == "__main__":
    main()
