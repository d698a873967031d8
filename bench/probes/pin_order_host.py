"""Does pinning once the whole region is faulted in cost the host backend (``mlock``, no
GPU) anything? ``OffloadManager(SIZE, backend="host")`` entered, awaited ``pinned`` and
closed, the two orders (``asyncpin.pinning.PIN_BESIDE_FAULTING``) alternating in one
process, each after ``--pause`` seconds (6 s on the development VM lets the hypervisor
take the freed memory back).

    python3 bench/probes/pin_order_host.py [--gib 2] [--runs 6] [--pause 6]

Prints (ready s, close s) per run. Figures: bench/RESULTS.md#startup (runs 146-149).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import anyio
import structlog

sys.path.append(str(Path(__file__).resolve().parents[2]))

from asyncpin import OffloadManager, pinning


async def one(nbytes: int, beside: bool) -> tuple[float, float]:
    pinning.PIN_BESIDE_FAULTING = beside
    t0 = time.perf_counter()
    async with OffloadManager(nbytes, backend="host") as mgr:
        await mgr.pinned
        ready = time.perf_counter() - t0
        t1 = time.perf_counter()
    return ready, time.perf_counter() - t1


async def main(args: argparse.Namespace) -> None:
    for i in range(args.runs):
        beside = i % 2 == 1
        await anyio.sleep(args.pause)
        ready, close = await one(int(args.gib * (1 << 30)), beside)
        print("beside" if beside else "after ", f"ready {ready:.3f} s, close {close:.3f} s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--pause", type=float, default=0.0)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    anyio.run(main, p.parse_args())
