"""Pinning a host buffer: asyncpin against the one-call recipe, in one run.

    python3 bench/pinning.py --size 16GiB --size 64GiB --gpu-step --json-out pinning.json
    python3 bench/pinning.py --quick            # a few MiB, host backend without a GPU

asyncpin: ``OffloadManager(size)`` with its defaults (``backend="auto"``: CUDA's
cudaHostRegister with a GPU, mlock without). Measured from outside the library: entry
(``async with`` until the body runs), time to pinned (start of entry until ``await
mgr.pinned`` returns) and GiB/s, the event loop's lag while pinning (a 1 ms heartbeat:
worst and p99 overshoot), and close of the pinned buffer.

Peer (``zeros+register``, vLLM's recipe): ``torch.zeros(size)``, then one
cudaHostRegister of the whole buffer (one mlock on the host backend), in a constructor on
the event-loop thread. Ratios are peer / asyncpin.

With ``--gpu-step``, a model's step (8 bf16 8192^3 matmuls and a synchronize) runs in a
thread of its own meanwhile; the longest step while pinning, over the step alone, is the
stretch that pinning causes. Before every run the same size is faulted in and freed, so
both recipes start from memory the machine already backs. Repeats rotate the order;
figures are medians. Figures: bench/RESULTS.md#pinning, #loop-lag, #gpu-step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import torch

# Appended, not prepended: the asyncpin under test is the one PYTHONPATH names first.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from asyncpin import OffloadManager
from bench._common import (
    GiB,
    GpuStepper,
    Heartbeat,
    format_bytes,
    machine,
    median,
    parse_size,
    parser,
    quiet_logs,
    write_json,
)

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _prime(nbytes: int) -> None:
    """Fault ``nbytes`` in and free them: the next run finds memory the machine backs."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    del buf


async def measure_asyncpin(
    nbytes: int, hb: Heartbeat, stepper: GpuStepper | None, chunk_bytes: int | None
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    mgr = OffloadManager(nbytes, **kwargs)
    if stepper is not None:
        stepper.start()
    hb.reset()
    t0 = time.perf_counter()
    async with mgr:
        t_entered = time.perf_counter()
        await mgr.pinned
        t_pinned = time.perf_counter()
        lag_s, lag_p99_s = hb.max_s(), hb.p99_s()
        steps = stepper.stop() if stepper is not None else []
        backend = str(getattr(mgr.stats(), "backend", ""))
        t_close = time.perf_counter()
    t_closed = time.perf_counter()
    return {
        "entry_s": t_entered - t0,
        "pinned_s": t_pinned - t0,
        "gib_per_s": nbytes / GiB / (t_pinned - t0),
        "lag_s": lag_s,
        "lag_p99_s": lag_p99_s,
        "close_s": t_closed - t_close,
        "longest_step_s": max(steps) if steps else None,
        "backend": backend,
    }


def _zeros_then_pin(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    tensor = torch.zeros(nbytes, dtype=torch.uint8)
    address = tensor.data_ptr()
    if torch.cuda.is_available():
        rt = torch.cuda.cudart()
        code = int(rt.cudaHostRegister(address, nbytes, 0))
        if code:
            raise RuntimeError(f"cudaHostRegister failed: {code}")
        return tensor, lambda: rt.cudaHostUnregister(address)
    if _LIBC.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)):
        raise OSError(ctypes.get_errno(), "mlock failed")
    return tensor, lambda: _LIBC.munlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))


async def measure_peer(nbytes: int, hb: Heartbeat, stepper: GpuStepper | None) -> dict[str, Any]:
    """The synchronous constructor, on the event-loop thread (it blocks the loop)."""
    await anyio.sleep(0.005)  # let the heartbeat settle into its rhythm
    if stepper is not None:
        stepper.start()
    hb.reset()
    t0 = time.perf_counter()
    tensor, unpin = _zeros_then_pin(nbytes)
    total_s = time.perf_counter() - t0
    await anyio.sleep(0.005)  # the heartbeat wakes now and records the stall
    lag_s = hb.max_s()
    steps = stepper.stop() if stepper is not None else []
    t_close = time.perf_counter()
    unpin()
    del tensor
    return {
        "entry_s": total_s,
        "pinned_s": total_s,
        "gib_per_s": nbytes / GiB / total_s,
        "lag_s": lag_s,
        "lag_p99_s": None,
        "close_s": time.perf_counter() - t_close,
        "longest_step_s": max(steps) if steps else None,
    }


_KEYS = ("entry_s", "pinned_s", "lag_s", "lag_p99_s", "close_s", "longest_step_s")


def summarise(
    runs: list[dict[str, Any]], nbytes: int, step_alone_s: float | None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in _KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = median(values) if values else None
    out["gib_per_s"] = nbytes / GiB / out["pinned_s"]  # of the median time
    longest = out["longest_step_s"]
    out["step_stretch"] = longest / step_alone_s if longest and step_alone_s else None
    return out


async def bench(args: Any) -> dict[str, Any]:
    stepper = GpuStepper() if args.gpu_step and torch.cuda.is_available() else None
    step_alone_s = stepper.alone_s() if stepper is not None else None
    hb = Heartbeat()
    doc: dict[str, Any] = {
        "machine": machine(),
        "repeats": args.repeats,
        "step_alone_s": step_alone_s,
        "sizes": {},
    }
    async with anyio.create_task_group() as tg:
        await tg.start(hb.run)
        await anyio.sleep(0.2)
        for nbytes in args.size:
            steps: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
                "asyncpin": partial(measure_asyncpin, nbytes, hb, stepper, args.chunk_bytes)
            }
            if args.peer:
                steps["peer"] = partial(measure_peer, nbytes, hb, stepper)
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in steps}
            # Warm-up, kept out of the medians: the first use of each code path.
            await anyio.to_thread.run_sync(_prime, nbytes)
            await steps["asyncpin"]()
            names = list(steps)
            for rep in range(args.repeats):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    await anyio.to_thread.run_sync(_prime, nbytes)
                    result = await steps[name]()
                    runs[name].append(result)
                    brief = f"pinned {result['pinned_s']:.3f} s, lag {result['lag_s'] * 1e3:.1f} ms"
                    print(
                        f"  [{rep + 1}/{args.repeats}] {format_bytes(nbytes)} {name}: {brief}",
                        file=sys.stderr,
                    )
            summary = {name: summarise(r, nbytes, step_alone_s) for name, r in runs.items()}
            if "peer" in summary:
                ours, peer = summary["asyncpin"], summary["peer"]
                summary["peer_over_asyncpin"] = {
                    "entry": peer["entry_s"] / ours["entry_s"],
                    "pinned": peer["pinned_s"] / ours["pinned_s"],
                }
            summary["runs"] = runs
            doc["sizes"][format_bytes(nbytes).replace(" ", "")] = summary
        tg.cancel_scope.cancel()
    return doc


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


def print_table(doc: dict[str, Any]) -> None:
    where = doc["machine"]["gpu"] or "host backend (no GPU)"
    print(
        f"\nPinning on {where}, median of {doc['repeats']}; asyncpin from "
        f"{doc['machine']['asyncpin_path']}"
    )
    header = (
        f"{'size':>7} {'recipe':<10} {'entry':>10} {'to pinned':>10} {'GiB/s':>6} "
        f"{'max lag':>10} {'lag p99':>9} {'close':>10} {'GPU step':>9}"
    )
    print(header)
    print("-" * len(header))
    for size, summary in doc["sizes"].items():
        for name in ("asyncpin", "peer"):
            s = summary.get(name)
            if s is None:
                continue
            stretch = f"{s['step_stretch']:.2f}x" if s["step_stretch"] else "-"
            print(
                f"{size:>7} {name:<10} {_ms(s['entry_s']):>10} {_ms(s['pinned_s']):>10} "
                f"{s['gib_per_s']:>6.1f} {_ms(s['lag_s']):>10} {_ms(s['lag_p99_s']):>9} "
                f"{_ms(s['close_s']):>10} {stretch:>9}"
            )
        ratio = summary.get("peer_over_asyncpin")
        if ratio:
            print(
                f"{'':>7} peer / asyncpin: entry {ratio['entry']:,.0f}x, "
                f"time to pinned {ratio['pinned']:.2f}x"
            )


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--size", type=parse_size, action="append", help="repeatable (default 16GiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-bytes", type=parse_size, default=None, help="default: the library's")
    p.add_argument("--no-peer", dest="peer", action="store_false")
    p.add_argument("--gpu-step", action="store_true", help="a model's step in a thread meanwhile")
    args = p.parse_args()
    if args.quick:
        args.size, args.repeats, args.gpu_step = [4 << 20], 1, False
    args.size = args.size or [16 * GiB]
    quiet_logs()
    doc = anyio.run(bench, args)
    write_json(args.json_out, doc)
    sys.stderr.flush()
    print_table(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
