"""Which of the transfer engine's CUDA calls break a CUDA graph capture on another thread?

    python3 bench/capture_probe.py --json-out $OUT/capture_probe.json

A capture in torch's default mode ("global") forbids "potentially unsafe" API calls in
every other thread while it lasts; such a call fails and invalidates the capture. The
pause gate keeps pin/unpin calls out of captures. This probe asks the same of each call
the transfer engine makes from its threads (the loop's, the store submitter's and the
completion waiters'): the main thread begins a capture, a second thread makes the call
while it is open, then the capture ends and the graph is replayed and checked. Each case
runs in a fresh process, so a failure cannot leak into the next.

Last, ``engine``: an event loop in a second thread runs store/load round trips through an
OffloadManager while the main thread captures graphs through ``install_capture_gate()``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._gpu import require_gpu

CASES = [
    "nothing",
    "event_record_raw",
    "event_record_legacy_stream",
    "stream_wait_raw",
    "batch_copy_raw",
    "memcpy_async_raw",
    "event_query",
    "event_synchronize_done",
    "event_synchronize_pending",
    "torch_event_record",
    "pin_memory_cached",
    "pin_memory_new",
    "kernel_launch",
    "device_alloc_new",
    "upload_during_call",
    "upload_2mib_behind_busy_stream",
    "engine",
]


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"


def one_case(case: str) -> dict[str, Any]:
    from asyncpin._cudart import Runtime as _Runtime

    rt = _Runtime()
    side = torch.cuda.Stream()
    host = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.randint(0, 255, (4 << 20,), dtype=torch.uint8, device="cuda")
    raw_event = rt.event()
    done_event = torch.cuda.Event(blocking=True)
    done_event.record(side)
    torch.cuda.synchronize()
    pending = torch.cuda.Event(blocking=True)
    if case == "event_synchronize_pending":
        with torch.cuda.stream(side):
            torch.cuda._sleep(300_000_000)  # a few hundred ms
            pending.record(side)

    def act() -> None:
        if case == "event_record_raw":
            rt.record(raw_event, side.cuda_stream)
        elif case == "event_record_legacy_stream":
            rt.record(raw_event, 0)
        elif case == "stream_wait_raw":
            rt.wait(side.cuda_stream, raw_event)
        elif case == "batch_copy_raw":
            import array

            a = [array.array("Q", [x]) for x in (host.data_ptr(), dev.data_ptr(), 1 << 20)]
            rt.copy_segments(a[0], a[1], a[2], side.cuda_stream)
        elif case == "memcpy_async_raw":
            code = rt.lib.cudaMemcpyAsync(
                host.data_ptr(), dev.data_ptr(), 1 << 20, 4, side.cuda_stream
            )
            rt._check("cudaMemcpyAsync", code)
        elif case == "event_query":
            done_event.query()
        elif case == "event_synchronize_done":
            done_event.synchronize()
        elif case == "event_synchronize_pending":
            pending.synchronize()
        elif case == "torch_event_record":
            torch.cuda.Event(blocking=True).record(side)
        elif case == "pin_memory_cached":
            torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
        elif case == "pin_memory_new":
            torch.empty(3 << 20, dtype=torch.uint8).pin_memory()
        elif case == "device_alloc_new":
            with torch.cuda.stream(side):
                torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
        elif case == "upload_during_call":
            import array

            rt.upload(dev.data_ptr(), array.array("q", range(1000)), side.cuda_stream)
        elif case == "upload_2mib_behind_busy_stream":
            # An id upload of a 4 GiB job of 32 KiB blocks, queued behind ~150 ms of work:
            # does the call wait for the stream (it would hold the event loop)?
            import array

            with torch.cuda.stream(side):
                torch.cuda._sleep(300_000_000)
            rt.upload(dev.data_ptr(), array.array("q", range(1 << 18)), side.cuda_stream)
        elif case == "kernel_launch":
            with torch.cuda.stream(side):
                dev.add_(1)

    x = torch.ones(1 << 16, device="cuda")
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    capturing, acted = threading.Event(), threading.Event()
    result: dict[str, Any] = {"case": case, "call": "ok"}

    def thread() -> None:
        if case == "event_synchronize_pending":
            # Enter the blocking call first; the capture begins while it waits.
            capturing.set()
        else:
            capturing.wait()
        t0 = time.perf_counter()
        try:
            act()
        except BaseException as exc:
            result["call"] = _first_line(exc)
        result["call_ms"] = round(1e3 * (time.perf_counter() - t0), 3)
        acted.set()

    t = threading.Thread(target=thread)
    graph = torch.cuda.CUDAGraph()
    try:
        if case == "event_synchronize_pending":
            t.start()
            capturing.wait()
            time.sleep(0.05)  # let the thread enter cudaEventSynchronize
        with torch.cuda.graph(graph):
            y.copy_(x * 2)
            if case != "event_synchronize_pending":
                t.start()
                capturing.set()
            acted.wait(10)
            y.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        result["capture"] = "ok" if bool((y == 3).all()) else "wrong result"
    except BaseException as exc:
        result["capture"] = _first_line(exc)
    t.join()
    try:
        torch.cuda.synchronize()
        result["after"] = "ok"
    except BaseException as exc:
        result["after"] = _first_line(exc)
    return result


def engine_case(seconds: float) -> dict[str, Any]:
    import asyncio

    from asyncpin import KVLayout, OffloadManager, install_capture_gate
    from asyncpin.transfers import Method

    n = 512
    tensors = [torch.randn(n, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(64)]
    layout = KVLayout.from_tensors(tensors)
    counts = {"captures": 0, "capture_errors": 0, "transfers": 0, "transfer_errors": 0}
    errors: list[str] = []
    stop = threading.Event()
    ready = threading.Event()

    async def transfers() -> None:
        async with OffloadManager.for_kv(layout, n, backend="cuda") as mgr:
            await mgr.pinned  # no warm-up: the manager compiled its kernels at open
            ready.set()
            methods: tuple[Method, ...] = ("pack", "batch", "kernel", "auto")
            k = 0
            while not stop.is_set():
                ids = torch.randperm(n)[:64].tolist()
                method = methods[k % 4]
                pairs = [(mgr.store, ids, ids), (mgr.load, ids, ids), (mgr.store, ids[:1], ids[:1])]
                for call, a, b in pairs:
                    try:
                        await call(a, b, method=method)
                    except Exception as exc:
                        counts["transfer_errors"] += 1
                        where = "".join(traceback.format_exception(exc.__cause__ or exc)[-6:])
                        errors.append(f"transfer {call.__name__} {len(a)} {method}: {where}")
                    counts["transfers"] += 1
                k += 1

    def loop_thread() -> None:
        try:
            asyncio.run(transfers())
        except BaseException as exc:
            errors.append("loop: " + _first_line(exc))
            ready.set()

    handle = install_capture_gate()
    t = threading.Thread(target=loop_thread)
    t.start()
    ready.wait(120)
    x = torch.ones(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        y = x * 2  # warm-up outside the capture
    torch.cuda.synchronize()
    end = time.monotonic() + seconds
    while time.monotonic() < end and t.is_alive():
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                y = x * 2
                for _ in range(50):
                    y = y * 1
            graph.replay()
        except BaseException as exc:
            counts["capture_errors"] += 1
            if len(errors) < 20:
                errors.append("capture: " + _first_line(exc))
        counts["captures"] += 1
    stop.set()
    t.join(120)
    handle.uninstall()
    try:
        torch.cuda.synchronize()
        after = "ok"
    except BaseException as exc:
        after = _first_line(exc)
    return {"case": "engine", **counts, "after": after, "errors": errors[:20]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    require_gpu()
    if args.case:
        out = engine_case(args.seconds) if args.case == "engine" else one_case(args.case)
        print(json.dumps(out))
        return
    results = []
    for case in CASES:
        cmd = [sys.executable, __file__, "--case", case, "--seconds", str(args.seconds)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if lines:
            results.append(json.loads(lines[-1]))
        else:
            results.append({"case": case, "rc": proc.returncode, "stderr": proc.stderr[-800:]})
        print(json.dumps(results[-1]), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    print(f"\n{'case':32} {'call':44} capture")
    for r in results:
        if r["case"] == "engine":
            print(
                f"{'engine':32} transfers {r.get('transfers')} errors {r.get('transfer_errors')}"
                f"   captures {r.get('captures')} errors {r.get('capture_errors')}"
            )
        else:
            call = f"{str(r.get('call'))[:30]} ({r.get('call_ms')} ms)"
            print(f"{r['case']:32} {call:44} {r.get('capture', r.get('stderr'))}")


if __name__ == "__main__":
    main()
