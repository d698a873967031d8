"""Why does asyncpin's pin context take 1.5 s to make in the start-up bench, and only
0.13-0.16 s alone? (Issue 17: the first pin call makes it; at 64 GiB that was a third of
the time to ready, and the longest step while pinning lay beside it, runs 123-124.)

    python3 bench/probes/context_create.py [--gib 32] [--repeats 3] [--json-out FILE]

Each phase makes the context (``asyncpin._cudactx.PinContext``: cuCtxCreate, then a pop)
``--repeats`` times and destroys it, while:

- ``idle``: nothing else runs;
- ``step``: the start-up bench's model step runs in a thread (``StepLog``);
- ``step-captures``: that, and its graph-capturing thread as vLLM captures;
- ``prefault``: the library's prefault threads fault a fresh region of ``--gib`` in huge
  pages (``HostRegion.prefault``), as the pin pipeline does while the first pin call
  makes the context; the context is made once they are under way;
- ``all``: the step, the captures and the prefault together (the start-up bench).

For each: the creation times, the longest step begun during each creation over the
step alone, and the capturing thread's longest ``enter``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))

import torch

from asyncpin._config import default_prefault_threads
from asyncpin._cudactx import PinContext, _load_driver
from asyncpin.region import HostRegion
from bench.startup import CAPTURE_SPANS, Capturer, Clock, StepLog, _register, _unregister

PIECE = 64 << 20  # what each prefault thread takes at a time (a chunk)


@contextlib.contextmanager
def prefaulting(nbytes: int, threads: int) -> Iterator[None]:
    """Threads faulting in a fresh region chunk by chunk, until the block ends or the
    region is all faulted; the region is released after."""
    region = HostRegion.create(nbytes)
    stop = threading.Event()
    started = threading.Barrier(threads + 1)
    lock = threading.Lock()
    offsets = list(range(0, nbytes, PIECE))

    def run() -> None:
        started.wait()
        while not stop.is_set():
            with lock:
                if not offsets:
                    return
                offset = offsets.pop(0)
            region.prefault(offset, min(PIECE, nbytes - offset), stop)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    started.wait()
    time.sleep(0.05)  # the threads under way (a probe, not a test)
    try:
        yield
    finally:
        stop.set()
        for w in workers:
            w.join()
        region.release()


def make_once(lib: ctypes.CDLL) -> float:
    t0 = time.perf_counter()
    context = PinContext(lib, torch.cuda.current_device())
    made = time.perf_counter() - t0
    lib.cuCtxDestroy_v2(context._handle)
    return made


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--after-register",
        type=int,
        default=0,
        help="GiB that torch.zeros then cudaHostRegister/Unregister in torch's context "
        "before the first context (the vLLM recipe's open and close)",
    )
    p.add_argument(
        "--mapped", type=int, default=0, help="GiB of region mapped (not faulted) meanwhile"
    )
    p.add_argument(
        "--first-under-load",
        action="store_true",
        help="make the process's first context with the step and the captures running",
    )
    args = p.parse_args()
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    lib = _load_driver()
    threads = default_prefault_threads()
    steps = StepLog()
    alone = steps.alone_s()
    capturer: Capturer | None = None
    doc: dict[str, Any] = {"step_alone_s": alone, "prefault_threads": threads, "phases": {}}
    if args.after_register:
        buf = torch.zeros(args.after_register << 30, dtype=torch.uint8)
        t = time.perf_counter()
        _register(buf.data_ptr(), buf.numel())
        _unregister(buf.data_ptr(), buf.numel())
        doc["register_unregister_s"] = time.perf_counter() - t
        del buf
    mapped = HostRegion.create(args.mapped << 30) if args.mapped else None
    if args.first_under_load:
        steps.start()
        capturer = Capturer("vllm")
        capturer.start()
        time.sleep(0.5)  # both under way (a probe, not a test)
    t0 = Clock.now()
    doc["first_made_s"] = make_once(lib)  # the process's first: the bench's first pin call
    t1 = Clock.now()
    doc["first_under_load"] = args.first_under_load
    if args.first_under_load:
        doc["first_step_stretch"] = steps.longest(t0, t1) / alone
        assert capturer is not None
        capturer.stop()
        capturer = None
        steps.stop()
    if mapped is not None:
        mapped.release()
    doc["after_register_gib"], doc["mapped_gib"] = args.after_register, args.mapped
    running = False
    for phase in ("idle", "step", "step-captures", "prefault", "all"):
        if (phase in ("step", "step-captures", "all")) != running:
            if running:
                steps.stop()
            else:
                steps.start()
            running = not running
        if (phase in ("step-captures", "all")) != (capturer is not None):
            if capturer is None:
                capturer = Capturer("vllm")
                capturer.start()
            else:
                capturer.stop()
                capturer = None
        rows = []
        for _ in range(args.repeats):
            with contextlib.ExitStack() as stack:
                if phase in ("prefault", "all"):
                    stack.enter_context(prefaulting(args.gib << 30, threads))
                CAPTURE_SPANS.clear()
                t0 = Clock.now()
                made = make_once(lib)
                t1 = Clock.now()
            enters = [e - s for name, s, e in list(CAPTURE_SPANS) if name == "enter" and e >= t0]
            rows.append(
                {
                    "made_s": made,
                    "step_stretch": steps.longest(t0, t1) / alone if running else None,
                    "capture_enter_max_s": max(enters, default=None),
                }
            )
        doc["phases"][phase] = rows
    if capturer is not None:
        capturer.stop()
    steps.stop()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    print(f"step alone {alone * 1e3:.1f} ms, {threads} prefault threads, {args.gib} GiB")
    first = "under load" if args.first_under_load else "idle"
    print(
        f"the process's first context ({first}; after registering {args.after_register} "
        f"GiB, {args.mapped} GiB mapped): {doc['first_made_s']:.3f} s"
    )
    print("| phase | context made (s) | longest step / alone | capture enter max (s) |")
    print("| --- | --- | --- | --- |")
    for phase, rows in doc["phases"].items():
        times = ", ".join(f"{r['made_s']:.3f}" for r in rows)
        stretch = ", ".join(f"{r['step_stretch']:.2f}" if r["step_stretch"] else "-" for r in rows)
        enter = ", ".join(
            f"{r['capture_enter_max_s']:.3f}" if r["capture_enter_max_s"] else "-" for r in rows
        )
        print(f"| {phase} | {times} | {stretch} | {enter} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
