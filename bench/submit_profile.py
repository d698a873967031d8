"""Where does a store's submission time go on CUDA? cProfile over many stores.

    python3 bench/submit_profile.py            # one-block stores (64 segments)
    python3 bench/submit_profile.py --big      # 1024-block stores (Llama-8B layout, 2 GiB)
    python3 bench/submit_profile.py --arrays 1 # one-segment stores

``--big`` also submits each store while the GPU is held busy by a 200 ms sleep kernel on
the caller's stream: if submission then takes ~200 ms, the submitting thread blocked on
the driver's queue, not on its own work.
"""

from __future__ import annotations

import argparse
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
from asyncpin.transfers import Method
from bench._gpu import require_gpu


async def main(big: bool, arrays: int) -> None:
    blocks = 2048 if big else 64
    shape = (blocks, 16, 8, 128)
    tensors = [torch.randn(*shape, device="cuda").to(torch.bfloat16) for _ in range(arrays)]
    layout = KVLayout.from_tensors(tensors)
    repeats, per_job = (20, 1024) if big else (300, 1)
    method: Method
    async with OffloadManager.for_kv(layout, blocks, backend="cuda") as mgr:
        await mgr.pinned
        for method in ("batch", "pack"):

            def ids(i: int) -> tuple[list[int], list[int]]:
                if not big:
                    return [i % 64], [(i * 7) % 64]
                g = torch.randperm(blocks)[:per_job].tolist()
                return g, torch.randperm(blocks)[:per_job].tolist()

            for i in range(5 if big else 50):
                await mgr.store(*ids(i), method=method)
            profile = cProfile.Profile()
            submit = []
            for i in range(repeats):
                g, c = ids(i)
                t0 = time.perf_counter()
                profile.enable()
                transfer = mgr.store(g, c, method=method)
                profile.disable()
                submit.append(time.perf_counter() - t0)
                await transfer
            submit.sort()
            print(
                f"\n{method}: {per_job} blocks, submit p50 {submit[len(submit) // 2] * 1e6:.0f} us"
            )
            if big:
                busy = []
                for i in range(5):
                    g, c = ids(i)
                    torch.cuda._sleep(200_000_000)  # ~100-200 ms on the caller's stream
                    t0 = time.perf_counter()
                    transfer = mgr.store(g, c, method=method)
                    busy.append(time.perf_counter() - t0)
                    await transfer
                busy.sort()
                print(f"{method}: submit p50 while the GPU sleeps {busy[2] * 1e6:.0f} us")
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--big", action="store_true")
    parser.add_argument("--arrays", type=int, default=64, help="KV arrays in the layout")
    args = parser.parse_args()
    require_gpu()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    anyio.run(main, args.big, args.arrays)
