"""Where a direct fetch's reading threads wait: each value's host block is reserved by
the event loop (``anyio.from_thread.run_sync``, one round trip a value), the rest of a
part's read is the socket and the checks. Runs a bench/ script (llama_ttft.py by
default) with both timed and prints the totals.

    python3 bench/probes/fetch_waits.py [--read-depth 4] -- --config llama-3.1-8b \\
        --prompts 8192 --repeats 3 --own-servers cluster --cluster-nodes 6
"""

from __future__ import annotations

import argparse
import atexit
import json
import runpy
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))

import anyio.from_thread  # noqa: E402

import asyncpin.tier.remote as remote  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--read-depth", type=int, default=None)
    p.add_argument("--script", default="llama_ttft.py", help="the bench/ script run")
    p.add_argument("--json-out", default=None, help="this probe's totals")
    args, rest = p.parse_known_args()
    reserve_waits: list[float] = []
    reads: list[float] = []  # readinto calls: one a part, in its thread
    threads: set[int] = set()
    run_sync, readinto = anyio.from_thread.run_sync, remote.RedisStore.readinto

    def timed_run_sync(func: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return run_sync(func, *a, **k)
        finally:
            if getattr(func, "__name__", "") == "reserve":
                reserve_waits.append(time.perf_counter() - t)

    def timed_readinto(self: Any, *a: Any, **k: Any) -> Any:
        threads.add(threading.get_ident())
        t = time.perf_counter()
        try:
            return readinto(self, *a, **k)
        finally:
            reads.append(time.perf_counter() - t)

    anyio.from_thread.run_sync = timed_run_sync  # type: ignore[assignment]
    remote.RedisStore.readinto = timed_readinto  # type: ignore[method-assign]
    if args.read_depth is not None:
        init = remote.RemoteLink.__init__

        def patched(self: Any, *a: Any, **k: Any) -> None:
            k["read_depth"] = args.read_depth
            init(self, *a, **k)

        remote.RemoteLink.__init__ = patched  # type: ignore[method-assign]

    def report() -> None:
        if not reads:
            print("fetch_waits: no direct read ran", file=sys.stderr)
            return
        waits = sorted(reserve_waits)
        doc = {
            "read_depth": args.read_depth,
            "parts_read": len(reads),
            "reading_threads": len(threads),
            "read_thread_s": sum(reads),
            "reserves": len(waits),
            "reserve_wait_s": sum(waits),
            "reserve_share_of_reads": sum(waits) / sum(reads),
            "reserve_wait_us_p50": 1e6 * statistics.median(waits) if waits else None,
            "reserve_wait_us_p99": 1e6 * waits[int(0.99 * (len(waits) - 1))] if waits else None,
            "part_read_ms_p50": 1e3 * statistics.median(reads),
        }
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(doc, indent=1))
        print(
            "fetch_waits: "
            + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in doc.items()
            )
        )

    atexit.register(report)
    sys.argv = [str(ROOT / "bench" / args.script), *[a for a in rest if a != "--"]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
