"""What does it cost the submitting thread to send a job's block ids to the device?

    python3 bench/upload_costs.py --json-out $OUT/upload_costs.json

Three ways, timed on the CPU (the time the call holds the submitting thread), median of
20 after a warm-up, with the stream idle and with ~20 ms of work queued ahead on it:

- ``during_call``: ``cudaMemcpyBatchAsync`` from pageable memory with the source read
  during the call (what the engine does: no pinned memory, allowed during a capture);
- ``pinned_cache``: ``torch.frombuffer(...).pin_memory()`` and a non-blocking copy
  (torch's pinned cache; forbidden during a capture on another thread);
- ``pinned_buffer``: a memmove into a pinned buffer allocated once, and one
  ``cudaMemcpyAsync`` from it.

A job of n blocks sends 16 n bytes: 16 KiB for a 2 GiB job of the Llama-8B layout.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin._cudart import Runtime as _Runtime
from bench._gpu import require_gpu

SIZES = [16 << 10, 256 << 10, 2 << 20]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json-out")
    args = parser.parse_args()
    require_gpu()
    rt = _Runtime()
    stream = torch.cuda.Stream()
    dev = torch.empty(max(SIZES), dtype=torch.uint8, device="cuda")
    ring = torch.empty(max(SIZES), dtype=torch.uint8).pin_memory()
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "us": {}}

    for size in SIZES:
        src = array.array("q", range(size // 8))

        def during_call(src: array.array[int] = src) -> None:
            rt.upload(dev.data_ptr(), src, stream.cuda_stream)

        def pinned_cache(src: array.array[int] = src, size: int = size) -> None:
            pinned = torch.frombuffer(src, dtype=torch.uint8).pin_memory()
            with torch.cuda.stream(stream):
                dev[:size].copy_(pinned, non_blocking=True)

        def pinned_buffer(src: array.array[int] = src, size: int = size) -> None:
            ctypes.memmove(ring.data_ptr(), src.buffer_info()[0], size)
            code = rt.lib.cudaMemcpyAsync(
                dev.data_ptr(), ring.data_ptr(), size, 4, stream.cuda_stream
            )
            rt._check("cudaMemcpyAsync", code)

        ways: dict[str, Callable[[], None]] = {
            "during_call": during_call,
            "pinned_cache": pinned_cache,
            "pinned_buffer": pinned_buffer,
        }
        for busy in (False, True):
            for name, fn in ways.items():
                times = []
                for rep in range(23):
                    torch.cuda.synchronize()
                    if busy:
                        with torch.cuda.stream(stream):
                            torch.cuda._sleep(40_000_000)  # ~20 ms
                    t0 = time.perf_counter()
                    fn()
                    elapsed = time.perf_counter() - t0
                    if rep >= 3:
                        times.append(elapsed)
                torch.cuda.synchronize()
                key = f"{name}_{size >> 10}KiB_{'busy' if busy else 'idle'}"
                results["us"][key] = round(1e6 * statistics.median(times), 1)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    print(
        f"{'size':>8} {'stream':6} "
        + " ".join(f"{w:>14}" for w in ("during_call", "pinned_cache", "pinned_buffer"))
    )
    for size in SIZES:
        for state in ("idle", "busy"):
            row = [
                results["us"][f"{w}_{size >> 10}KiB_{state}"]
                for w in ("during_call", "pinned_cache", "pinned_buffer")
            ]
            print(f"{size >> 10:>6}Ki {state:6} " + " ".join(f"{v:>12} us" for v in row))


if __name__ == "__main__":
    main()
