"""Where a layer-wise load's time goes (H200): the CPU time to queue every group, and the
GPU time from the caller's stream to each group's event, with the GPU held back by a sleep
on the caller's stream while the groups are queued (so the two do not mix), per method.

    python bench/probes/layerwise_costs.py --json-out $OUT/layerwise-costs.json
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any, cast

sys.path.append(str(Path(__file__).resolve().parents[2]))

import anyio
import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin.tier import KVTier
from asyncpin.transfers import Method
from bench._common import median, parser, quiet_logs, write_json

LAYERS = 32


async def main(json_out: Path | None) -> None:
    quiet_logs()
    blocks = 2048
    kv = [
        torch.randn(2, 2 * blocks, 16, 8, 128, device="cuda").to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    layout = KVLayout.from_tensors(kv, block_dim=1)
    side = torch.cuda.Stream()
    out: dict[str, Any] = {}
    async with OffloadManager.for_kv(layout, blocks, backend="cuda") as mgr:
        await mgr.pinned
        tier = KVTier(mgr)
        for n in (128, 2048):
            hashes = list(range(n * 10, n * 11))
            tier.clear()
            await tier.store(hashes, list(range(n))).transfer
            dest = list(range(blocks, blocks + n))
            for way in ("whole", "auto", "pack", "kernel", "batch"):
                cpu, first, last = [], [], []
                for rep in range(6):
                    torch.cuda.synchronize()
                    torch.cuda._sleep(200_000_000)  # ~100 ms: the queueing happens meanwhile
                    start = torch.cuda.Event(enable_timing=True)
                    start.record()
                    t0 = time.perf_counter()
                    if way == "whole":
                        handle: Any = tier.load(hashes, dest)
                        events = [handle.event]
                    else:
                        handle = tier.load_layers(hashes, dest, method=cast(Method, way))
                        events = [t.event for t in handle.transfers]
                    cpu.append(time.perf_counter() - t0)
                    marks = []
                    with torch.cuda.stream(side):
                        for ev in events:
                            side.wait_event(ev)
                            m = torch.cuda.Event(enable_timing=True)
                            m.record()
                            marks.append(m)
                    await handle
                    torch.cuda.synchronize()
                    if rep:
                        first.append(start.elapsed_time(marks[0]))
                        last.append(start.elapsed_time(marks[-1]))
                    methods = (
                        [handle.method] if way == "whole" else [t.method for t in handle.transfers]
                    )
                out[f"{n} {way}"] = {
                    "submit_cpu_ms": median(cpu[1:]) * 1e3,
                    "gpu_first_ms": median(first),
                    "gpu_last_ms": median(last),
                    "methods": sorted(set(methods)),
                    "gbps_gpu": n * layout.host_block_bytes / median(last) / 1e6,
                }
                print(f"{n:5d} {way:7s} {out[f'{n} {way}']}", flush=True)
            prof = cProfile.Profile()
            for _ in range(5):
                torch.cuda._sleep(200_000_000)
                prof.enable()
                handle = tier.load_layers(hashes, dest)
                prof.disable()
                await handle
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            out[f"{n} profile"] = s.getvalue()
            print(s.getvalue()[:6000])
    if json_out:
        write_json(json_out, out)


if __name__ == "__main__":
    args = parser(__doc__).parse_args()
    anyio.run(main, args.json_out)
