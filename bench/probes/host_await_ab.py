"""One-block store awaited on the host engine, one after another: p50/p99 of 2000 per
round, 3 rounds, in microseconds (CPU only: FakeBackend, asyncio). Run it against two
trees to compare them: ``PYTHONPATH=<tree> python bench/probes/host_await_ab.py LABEL``."""

from __future__ import annotations

import logging
import sys
import time

import anyio
import structlog
import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin.testing import FakeBackend

ROUNDS, STORES, BLOCKS = 3, 2000, 64


async def main(label: str) -> None:
    layout = KVLayout.from_tensors([torch.zeros(BLOCKS, 8192)])  # 32 KiB blocks
    p50: list[float] = []
    p99: list[float] = []
    async with OffloadManager.for_kv(layout, BLOCKS, backend=FakeBackend()) as mgr:
        await mgr.pinned
        for _ in range(ROUNDS):
            seconds = []
            for i in range(STORES):
                t0 = time.perf_counter()
                await mgr.store([i % BLOCKS], [i % BLOCKS])
                seconds.append(time.perf_counter() - t0)
            seconds.sort()
            p50.append(seconds[STORES // 2] * 1e6)
            p99.append(seconds[STORES * 99 // 100] * 1e6)
    print(label, {"p50_us": [round(v) for v in p50], "p99_us": [round(v) for v in p99]})


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "tree", backend="asyncio")
