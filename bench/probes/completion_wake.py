"""How long after the device finishes a piece of work does the host learn of it, by each
way of waiting (issue 17: a 32 MiB store resumed about 0.4 ms after the device began, and
the trace of run 79 put about 0.1 ms between a pack store's last DMA and its waiter
thread's wake-up).

    python3 bench/probes/completion_wake.py [--samples N] [--json-out F]

For each tail (the device work the wait is for):

- ``kernel``: a kernel that spins about 300 us (``torch.cuda._sleep``);
- ``dma``: a 16 MiB device-to-host copy into pinned memory (about 300 us);
- ``dma_join``: the same copy, then another stream waits for it and the event is recorded
  there (how a pack store's end is recorded: its DMA streams joined into the kernel
  stream);

and each way of waiting, the wall time from queuing the work until the waiter has
returned, p50/p99 (the work's own time is common to all, so differences are wake-ups):

- ``spin``: this thread queries a plain event until it completes (the floor; burns a
  core);
- ``block``: this thread waits on a blocking-sync event;
- ``thread_loop``: a thread waits on a blocking-sync event, then wakes the idle asyncio
  loop with ``call_soon_threadsafe``; timed until the awaiting coroutine resumes (how
  transfers complete today).

Then, with 1 ms of device work, a blocking-sync event recorded 50-400 us before its end
(``early``): the waiter sleeps on that one first, so that it is awake when the work
ends, and (``early_nudge``) also wakes the loop with an empty callback then; against
``plain``, the waiter sleeping on the end alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench._common import percentiles

_CYCLES_PER_US = 1980  # H200 SM clock, about; the kernel's length needs no precision


def _tails(side: torch.cuda.Stream, other: torch.cuda.Stream) -> dict[str, Callable[[], Any]]:
    """Each tail queues its work and returns the stream its end is recorded on."""
    dev = torch.randint(0, 255, (16 << 20,), dtype=torch.uint8, device="cuda")
    host = torch.empty(16 << 20, dtype=torch.uint8).pin_memory()
    moved = torch.cuda.Event()

    def kernel() -> torch.cuda.Stream:
        with torch.cuda.stream(side):
            torch.cuda._sleep(300 * _CYCLES_PER_US)
        return side

    def dma() -> torch.cuda.Stream:
        with torch.cuda.stream(side):
            host.copy_(dev, non_blocking=True)
        return side

    def dma_join() -> torch.cuda.Stream:
        dma()
        moved.record(side)
        other.wait_event(moved)
        return other

    return {"kernel": kernel, "dma": dma, "dma_join": dma_join}


async def _measure(samples: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    items: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def waiter() -> None:
        while (item := items.get()) is not None:
            event, fut = item
            event.synchronize()
            loop.call_soon_threadsafe(fut.set_result, None)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    out: dict[str, Any] = {}
    for name, tail in _tails(side, other).items():
        times: dict[str, list[float]] = {"spin": [], "block": [], "thread_loop": []}
        for i in range(samples + 5):
            for how in times:
                torch.cuda.synchronize()
                await asyncio.sleep(0.0005)  # every thread asleep, as between transfers
                event = torch.cuda.Event(blocking=how != "spin")
                t0 = time.perf_counter()
                event.record(tail())
                if how == "spin":
                    while not event.query():
                        pass
                elif how == "block":
                    event.synchronize()
                else:
                    fut = loop.create_future()
                    items.put((event, fut))
                    await fut
                if i >= 5:
                    times[how].append(time.perf_counter() - t0)
        row = {how: percentiles(t) for how, t in times.items()}
        out[name] = {
            **{f"{how}_p50_us": p["p50"] * 1e6 for how, p in row.items()},
            **{f"{how}_p99_us": p["p99"] * 1e6 for how, p in row.items()},
        }
        print(name, json.dumps(out[name]), file=sys.stderr)
    items.put(None)
    thread.join()
    return out


async def _early(samples: int, leads_us: list[int], total_us: int = 1000) -> dict[str, Any]:
    """A kernel of ``total_us``, with a blocking-sync event ``lead`` us before its end:
    waiting on that one first wakes the threads while the device still works, and the
    wait for the end then starts from threads just awake."""
    loop = asyncio.get_running_loop()
    side = torch.cuda.Stream()
    items: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def waiter() -> None:
        while (item := items.get()) is not None:
            early, done, fut, nudge = item
            if early is not None:
                early.synchronize()
                if nudge:
                    loop.call_soon_threadsafe(lambda: None)
            done.synchronize()
            loop.call_soon_threadsafe(fut.set_result, None)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    out: dict[str, Any] = {}
    for lead in leads_us:
        ways = ("plain", "early", "early_nudge")
        times: dict[str, list[float]] = {w: [] for w in ways}
        for i in range(samples + 5):
            for way in ways:
                torch.cuda.synchronize()
                await asyncio.sleep(0.0005)
                early = torch.cuda.Event(blocking=True) if way != "plain" else None
                done = torch.cuda.Event(blocking=True)
                t0 = time.perf_counter()
                with torch.cuda.stream(side):
                    torch.cuda._sleep((total_us - lead) * _CYCLES_PER_US)
                    if early is not None:
                        early.record(side)
                    torch.cuda._sleep(lead * _CYCLES_PER_US)
                    done.record(side)
                fut = loop.create_future()
                items.put((early, done, fut, way == "early_nudge"))
                await fut
                if i >= 5:
                    times[way].append(time.perf_counter() - t0)
        out[f"lead_{lead}us"] = {
            f"{w}_{q}_us": percentiles(t)[q] * 1e6 for w, t in times.items() for q in ("p50", "p99")
        }
        print(lead, json.dumps(out[f"lead_{lead}us"]), file=sys.stderr)
    items.put(None)
    thread.join()
    return out


def _table(rows: dict[str, Any], title: str, ways: tuple[str, ...]) -> None:
    print(f"{title:26} " + " ".join(f"{w + ' p50':>14}" for w in ways) + "   (us; p99 in brackets)")
    for name, r in rows.items():
        print(
            f"{name:26} "
            + " ".join(f"{r[f'{w}_p50_us']:7.0f} [{r[f'{w}_p99_us']:4.0f}]" for w in ways)
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--json-out")
    args = p.parse_args()
    doc = {
        "tails": asyncio.run(_measure(args.samples)),
        "early": asyncio.run(_early(args.samples, [50, 100, 200, 400])),
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    _table(doc["tails"], "tail", ("spin", "block", "thread_loop"))
    _table(doc["early"], "1 ms kernel, early event", ("plain", "early", "early_nudge"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
