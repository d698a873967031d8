"""Where does a small store's submission time go on CUDA? cProfile over many stores.

python3 bench/submit_profile.py
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import anyio
import structlog
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin import KVLayout, OffloadManager


async def main() -> None:
    tensors = [torch.randn(64, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(64)]
    layout = KVLayout.from_tensors(tensors)
    async with OffloadManager.for_kv(layout, 64, backend="cuda") as mgr:
        await mgr.pinned
        for method in ("batch", "pack"):
            for i in range(50):
                await mgr.store([i % 64], [(i * 7) % 64], method=method)
            profile = cProfile.Profile()
            submit = []
            for i in range(300):
                t0 = time.perf_counter()
                profile.enable()
                transfer = mgr.store([i % 64], [(i * 7) % 64], method=method)
                profile.disable()
                submit.append(time.perf_counter() - t0)
                await transfer
            submit.sort()
            print(f"\n{method}: submit p50 {submit[150] * 1e6:.0f} us (profiled)")
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    anyio.run(main)
