"""Samples the kernel stacks of another process's threads, from a process of its own (so
that what stalls the process sampled, its GIL or its memory-map lock, does not stall the
sampling). Started by ``bench/startup.py --stacks kernel``; needs root to read
``/proc/PID/task/TID/stack``.

    python3 bench/_kstacks.py PID [INTERVAL_S] [TID ...]

Every INTERVAL_S (default 0.0005) until its standard input closes, it reads each thread's
state; for a thread in uninterruptible sleep (D), and for the TIDs named (the event
loop's) whatever their state, it reads the kernel stack too. After its first sweep it
prints ``sampling``. Consecutive samples of a
thread with the same state and stack are kept as one span. It then prints, on one line,
``{"clock": "perf_counter", "sweeps": N, "spans": [[tid, name, first, last, state, stack], ...]}``
(times on ``time.perf_counter()``, which is CLOCK_MONOTONIC on Linux: the same clock in
every process; a stack's frames innermost first, offsets dropped).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _frames(text: str, depth: int = 8) -> str:
    frames = [line.split("] ", 1)[-1].split("+", 1)[0] for line in text.splitlines()]
    return " < ".join(frames[:depth])


def sample(pid: int, interval: float, watched: set[int]) -> None:
    task = f"/proc/{pid}/task"
    open_spans: dict[int, list[Any]] = {}
    spans: list[list[Any]] = []
    sweeps = 0
    while not select.select([sys.stdin], [], [], interval)[0]:
        now = time.perf_counter()
        sweeps += 1
        try:
            tids = [int(t) for t in os.listdir(task)]
        except OSError:
            break  # the process is gone
        seen = set()
        for tid in tids:
            stat = _read(f"{task}/{tid}/stat")
            try:
                assert stat is not None
                name, rest = stat.split("(", 1)[1].rsplit(")", 1)
                state = rest.split()[0]
            except (AssertionError, IndexError, ValueError):
                continue  # gone, or a line of another shape: this sweep goes without it
            if state != "D" and tid not in watched:
                continue
            stack = _frames(_read(f"{task}/{tid}/stack") or "")
            seen.add(tid)
            span = open_spans.get(tid)
            if span is not None and span[4] == state and span[5] == stack:
                span[3] = now
                continue
            span = [tid, name, now, now, state, stack]
            open_spans[tid] = span
            spans.append(span)
        for tid in list(open_spans):
            if tid not in seen:
                del open_spans[tid]
        if sweeps == 1:
            print("sampling", flush=True)  # the bench waits for this before it starts
    print(json.dumps({"clock": "perf_counter", "sweeps": sweeps, "spans": spans}), flush=True)


def main() -> int:
    pid = int(sys.argv[1])
    interval = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0005
    sample(pid, interval, {int(t) for t in sys.argv[3:]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
