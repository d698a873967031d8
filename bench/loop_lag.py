"""Where does the event loop's lag during CUDA pinning come from? One variable at a time.

    python3 bench/loop_lag.py --size 16GiB --json-out $OUT/loop_lag.json

Each variant pins the same buffer with the default configuration and one change; a 1 ms
heartbeat records its worst lateness and the 99th percentile. Memory is primed first.
Without a GPU it pins through the host backend (mlock) instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin import OffloadManager
from asyncpin.cli import format_bytes, parse_size

GiB, MiB = 1 << 30, 1 << 20


async def pin_once(nbytes: int, backend: str, **kwargs: Any) -> dict[str, float]:
    lags: list[float] = []
    stop = anyio.Event()

    async def heartbeat() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        await anyio.sleep(0.02)
        lags.clear()
        t0 = time.perf_counter()
        async with OffloadManager(nbytes, backend=backend, **kwargs) as mgr:
            await mgr.pinned
            pinned_s = time.perf_counter() - t0
            window = list(lags)
        stop.set()
    window.sort()
    return {
        "pinned_s": pinned_s,
        "lag_max_ms": window[-1] * 1e3,
        "lag_p99_ms": window[int(len(window) * 0.99)] * 1e3,
        "lag_p50_ms": statistics.median(window) * 1e3,
        "beats": len(window),
    }


def prime(nbytes: int) -> None:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(1)
    del buf


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    nbytes: int = args.size
    backend = "cuda" if torch.cuda.is_available() else "host"
    if backend == "cuda":
        torch.cuda.init()
    variants: list[tuple[str, dict[str, Any], bool]] = [
        ("default", {}, False),
        ("gc disabled", {}, True),
        ("prefault 4", {"prefault_threads": 4}, False),
        ("prefault 2", {"prefault_threads": 2}, False),
        ("4 KiB pages", {"hugepages": "none"}, False),
        ("64 MiB chunks", {"chunk_bytes": 64 * MiB}, False),
    ]
    results = []
    for rep in range(args.repeats):
        for name, kwargs, no_gc in variants:
            prime(nbytes)
            if no_gc:
                gc.collect()
                gc.disable()
            try:
                r = await pin_once(nbytes, backend, **kwargs)
            finally:
                gc.enable()
            results.append({"variant": name, "repeat": rep} | r)
    return {"backend": backend, "size_bytes": nbytes, "runs": results}


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument(
        "--size",
        type=size_arg,
        default=16 * GiB,
        help="buffer to pin: bytes or a number with a unit, e.g. 512MiB, 16GiB (default: 16GiB)",
    )
    # The older spelling, in GiB, as in earlier runs' commands.
    sizes.add_argument("--size-gib", type=float, dest="size_gib", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if args.size_gib is not None:
        args.size = int(args.size_gib * GiB)
        if args.size <= 0:
            parser.error("--size-gib must be more than 0")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    report = anyio.run(main_async, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    print(f"\nloop lag while pinning {format_bytes(report['size_bytes'])} ({report['backend']})")
    print(f"{'variant':<16} {'pinned s':>8} {'lag max ms':>10} {'p99 ms':>7} {'p50 ms':>7}")
    for name in dict.fromkeys(r["variant"] for r in report["runs"]):
        rs = [r for r in report["runs"] if r["variant"] == name]
        med = {
            k: statistics.median(r[k] for r in rs)
            for k in ("pinned_s", "lag_max_ms", "lag_p99_ms", "lag_p50_ms")
        }
        print(
            f"{name:<16} {med['pinned_s']:>8.2f} {med['lag_max_ms']:>10.1f} "
            f"{med['lag_p99_ms']:>7.2f} {med['lag_p50_ms']:>7.2f}"
        )


if __name__ == "__main__":
    main()
