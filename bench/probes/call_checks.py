"""What the checks every store() and load() makes cost, alone (run 161): the KV
storages' addresses read back, and whether the caller's stream captures a graph.

    python3 bench/probes/call_checks.py

Llama-8B-like KV (32 layers of ``[2, 64, 16, 8, 128]`` bf16); mean microseconds per
call over 2000 calls.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))

from asyncpin._cudart import Runtime


def _timed(name: str, call: Callable[[], object], n: int = 2000) -> None:
    call()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    print(f"{name:40} {(time.perf_counter() - t0) / n * 1e6:8.2f} us")


def main() -> None:
    rt = Runtime()
    kv = [torch.empty(2, 64, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(32)]
    arrays = [t[i] for t in kv for i in range(2)]
    storages = [t.untyped_storage() for t in kv]
    ptrs = [s.data_ptr() for s in storages]
    _timed("32 storages data_ptr", lambda: [s.data_ptr() for s in storages] == ptrs)
    _timed("64 arrays data_ptr", lambda: [a.data_ptr() for a in arrays])
    _timed("getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(0))
    current = torch._C._cuda_getCurrentRawStream(0)
    _timed("rt.capturing(current)", lambda: rt.capturing(current))
    side = torch.cuda.Stream()
    _timed("rt.capturing(side)", lambda: rt.capturing(side.cuda_stream))
    _timed("torch is_current_stream_capturing", torch.cuda.is_current_stream_capturing)


if __name__ == "__main__":
    main()
