"""GPU soak: open / pin / random store-load with verification / close, over and over, with
CUDA graph captures through the capture gate in between.

    python3 bench/soak.py --seconds 200 --json-out soak.json

Each cycle opens a 4 GiB manager for a Llama-8B-like KV layout (64 arrays of 32 KiB
blocks; 2048 host blocks of 2 MiB), alternating the unpinned policy (wait / pageable).
While it pins and after, rounds of random stores and loads run with random methods and
fresh random data, each checked byte for byte on the GPU; graph captures run through
``install_capture_gate()``. Some cycles close with transfers still in flight or with a
waiter cancelled. After every close: the region is unmapped, no chunk is still
registered, and locked bytes, mappings and GPU memory are back to their baseline.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import random
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin import KVLayout, OffloadManager, install_capture_gate
from asyncpin._cudart import cudart as _cudart
from asyncpin._sys import vm_locked_bytes
from asyncpin.testing import is_mapped
from asyncpin.transfers import Method
from bench._gpu import require_gpu

HOST_BLOCKS, GPU_BLOCKS, LAYERS = 2048, 1024, 32
METHODS: tuple[Method, ...] = ("auto", "batch", "pack", "kernel")


class _PointerAttributes(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        ("reserved", ctypes.c_byte * 256),  # room for fields newer runtimes add
    ]


def registered(addresses: list[int]) -> int:
    """How many of ``addresses`` CUDA still knows as registered host memory."""
    lib = _cudart()
    assert lib is not None
    count = 0
    for address in addresses:
        attrs = _PointerAttributes()
        code = lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(address))
        lib.cudaGetLastError()
        count += code == 0 and attrs.type != 0  # 0: cudaMemoryTypeUnregistered
    return count


def usage() -> dict[str, int]:
    """Locked bytes, GPU memory held by tensors; mappings and RSS (for the record only:
    worker threads come and go)."""
    status = Path("/proc/self/status").read_text().splitlines()
    rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    return {
        "locked": vm_locked_bytes(),
        "gpu": torch.cuda.memory_allocated(),
        "maps": len(Path("/proc/self/maps").read_text().splitlines()),
        "rss": rss,
    }


def graph_step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(20):
        x = torch.tanh(x @ w)
    return x


class Soak:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        tensors = [
            torch.empty(GPU_BLOCKS, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
            for _ in range(2 * LAYERS)
        ]
        self.layout = KVLayout.from_tensors(tensors)
        self.x = torch.randn(256, 256, device="cuda")
        self.w = torch.randn(256, 256, device="cuda") / 16
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy cuBLAS set-up must not happen in a capture
            graph_step(self.x, self.w)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []

    def fill(self, gpu: list[int]) -> None:
        ids = torch.tensor(gpu, device="cuda")
        for array in self.layout.arrays:
            array.view(torch.int16)[ids] = torch.randint(
                -(2**15), 2**15, (len(gpu), *array.shape[1:]), dtype=torch.int16, device="cuda"
            )

    def capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                y = graph_step(self.x, self.w)
            graph.replay()
            torch.cuda.synchronize()
            ok = torch.allclose(y, graph_step(self.x, self.w), atol=1e-4)
        except RuntimeError as exc:
            self.errors.append(f"capture: {str(exc).splitlines()[0]}")
            return
        self.counts["captures"] += 1
        if not ok:
            self.errors.append("capture: the graph computed something else")

    async def round(self, mgr: OffloadManager) -> None:
        """A random store, verified; then a load of those host blocks elsewhere, verified."""
        rng, layout = self.rng, self.layout
        n = rng.choice((1, 1, 2, 4, 16, 64, 300))
        gpu = rng.sample(range(GPU_BLOCKS), n)
        cpu = rng.sample(range(HOST_BLOCKS), n)
        method = rng.choice(METHODS)
        self.fill(gpu)
        store = mgr.store(gpu, cpu, method=method)
        self.counts[f"store_{store.method}_{store.path}"] += 1
        await store
        # Compared as int16: random bit patterns hold NaNs, which never equal themselves.
        host = mgr.host_blocks()[cpu].to("cuda").view(torch.int16)
        for a, array in enumerate(layout.arrays):
            self.counts["mismatches"] += int(
                not torch.equal(host[:, a], array.view(torch.int16)[gpu])
            )
        self.counts["bytes_verified"] += store.nbytes
        dest = rng.sample(range(GPU_BLOCKS), n)
        self.fill(dest)  # what the load must overwrite
        load = mgr.load(cpu, dest, method=rng.choice(METHODS))
        self.counts[f"load_{load.method}_{load.path}"] += 1
        if rng.random() < 0.1:  # a cancelled waiter leaves the copy alone
            with anyio.move_on_after(0):
                await load
            self.counts["waits_cancelled"] += 1
        await load
        torch.cuda.current_stream().wait_event(load.event)
        for a, array in enumerate(layout.arrays):
            self.counts["mismatches"] += int(
                not torch.equal(array.view(torch.int16)[dest], host[:, a])
            )
        self.counts["bytes_verified"] += load.nbytes

    async def cycle(self, index: int) -> None:
        policy: Any = "pageable" if index % 2 else "wait"
        mgr = OffloadManager.for_kv(
            self.layout, HOST_BLOCKS, backend="cuda", unpinned_policy=policy
        )
        base = usage()
        async with mgr:
            address, nbytes = mgr.host_view().data_ptr(), mgr.nbytes
            chunk = mgr.stats().chunk_bytes
            chunks = [address + i * chunk for i in range(mgr.stats().chunks_total)]
            while not mgr.pinned.is_set():  # captures and transfers while pinning
                self.capture()
                self.counts["captures_while_pinning"] += 1
                await self.round(mgr)
                self.counts["rounds_while_pinning"] += 1
            await mgr.pinned
            for _ in range(4):
                self.capture()
                await self.round(mgr)
            if index % 3 == 0:  # close with a transfer in flight
                torch.cuda._sleep(20_000_000)
                inflight = mgr.store(list(range(64)), list(range(64)))
                self.counts["closed_with_transfer_in_flight"] += 1
        if index % 3 == 0 and (not inflight.done() or inflight.error is not None):
            self.errors.append(f"cycle {index}: the in-flight store did not complete")
        stats = mgr.stats()
        self.counts["cycles"] += 1
        self.counts["bytes_pinned"] += nbytes
        self.counts["transfers_waited_for_pinning"] += stats.transfers_waited_for_pinning
        self.counts["transfers_pageable"] += stats.transfers_pageable
        self.counts["transfers_failed"] += stats.transfers_failed
        self.counts["chunks_leaked"] += stats.chunks_leaked
        del mgr
        gc.collect()  # the closed manager's small device tables go with the object
        after = usage()
        if is_mapped(address, nbytes):
            self.errors.append(f"cycle {index}: the region is still mapped")
        still = registered(chunks)
        if still:
            self.errors.append(f"cycle {index}: {still} chunks still registered")
        # Cycle 0 warms up for good (cuBLAS workspaces, graph pools, worker threads);
        # from then on a cycle must leave locked bytes and GPU memory as it found them.
        for key in ("locked", "gpu") if index else ("locked",):
            if after[key] != base[key]:
                self.errors.append(f"cycle {index}: {key} {base[key]} -> {after[key]}")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    soak = Soak(args.seed)
    start = usage()
    handle = install_capture_gate()
    t0 = time.perf_counter()
    try:
        index, after_warm_up = 0, {}
        while time.perf_counter() - t0 < args.seconds:
            await soak.cycle(index)
            if index == 0:
                after_warm_up = usage()
                if args.tracemalloc:  # Python's own allocations from here on
                    tracemalloc.start(8)
                    first = tracemalloc.take_snapshot()
            index += 1
    finally:
        handle.uninstall()
    end = usage()
    python_growth: dict[str, Any] = {}
    if args.tracemalloc and tracemalloc.is_tracing():
        diff = tracemalloc.take_snapshot().compare_to(first, "lineno")
        python_growth = {
            "traced_bytes_now": tracemalloc.get_traced_memory()[0],
            "top": [str(stat) for stat in diff[:12]],
        }
        tracemalloc.stop()
    return {
        "seconds": time.perf_counter() - t0,
        "counts": dict(soak.counts),
        "errors": soak.errors,
        "start": start,
        "after_first_cycle": after_warm_up,
        "end": end,
        "python_growth_after_first_cycle": python_growth,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--tracemalloc", action="store_true", help="trace Python allocations after cycle 0"
    )
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    require_gpu()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    report = anyio.run(main, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    c = report["counts"]
    print(f"\nsoak {report['seconds']:.0f} s: {c.get('cycles', 0)} cycles of 4 GiB")
    for key in sorted(c):
        print(f"  {key:40} {c[key]}")
    print(f"  start {report['start']}\n  after cycle 0 {report['after_first_cycle']}")
    print(f"  end   {report['end']}")
    growth = report["python_growth_after_first_cycle"]
    if growth:
        cycles = max(c.get("cycles", 0) - 1, 1)
        print(
            f"  Python heap traced after cycle 0: {growth['traced_bytes_now'] / cycles:.0f} B/cycle"
        )
        for line in growth["top"][:6]:
            print(f"    {line}")
    print(f"errors ({len(report['errors'])}): {report['errors'][:10]}")
