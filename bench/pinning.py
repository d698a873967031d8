"""Pinning on the host backend (mlock): asyncpin against the synchronous recipe, one run.

    PYTHONPATH=. python3 bench/pinning.py --size 2GiB --repeats 3 \\
        --json-out bench/results/pinning-host.json

asyncpin: ``OffloadManager(backend="host")``; measured from outside the library with the
same clock as the peer: entry latency (``async with`` until the body runs), time to pinned
(entry start until ``await mgr.pinned`` returns) and GiB/s, the event loop's worst lag
while pinning (a heartbeat task sleeping 1 ms in a loop, started before entering, records
its worst overshoot), the close latency of a fully pinned buffer, and the close latency
mid-pinning (enter, poll every 1 ms until one chunk is pinned, time ``aclose()``).

Peers, run on the event-loop thread as a synchronous constructor would be:
``zeros+mlock`` (torch.zeros, which faults the pages in torch's intra-op threads, then one
mlock: vLLM's recipe with mlock in place of cudaHostRegister) and ``empty+mlock``
(torch.empty, then one mlock that faults the pages itself). Their entry latency and time
to pinned are the same number: the whole constructor. Ratios are peer / asyncpin.

Regimes. ``warm``: before each run, an untimed pass faults the same size in and frees
it, so the run reuses memory the hypervisor already backs. ``cold``: a pause
(``--cold-gap-s``) before each run. On a VM whose balloon reports free pages to the
hypervisor (virtio_balloon free page reporting: freed blocks go back to the host about
2 s after they are freed), the next touch of such memory pays the hypervisor's fault as
well as the guest's, and that, not the pinning code, bounds GiB/s. On bare metal the two
regimes should agree. The sweep (chunk 64/256 MiB x 1/2 prefault threads, and the main
configuration without THP) runs in both;
close mid-pinning runs cold for the main configuration only, to keep the run short. Each
repeat rotates the order of the runs.

Every run gives back all it locked: VmLck is asserted back at its baseline after each.
Figures are medians of ``--repeats``; the full figures go to ``--json-out``; a short
table is printed last.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog
import torch
from anyio.abc import TaskStatus

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncpin import OffloadManager, _sys
from asyncpin.cli import format_bytes, parse_size
from asyncpin.region import HugePages

MiB, GiB = 1 << 20, 1 << 30
HEARTBEAT_S = 0.001
POLL_S = 0.001
_SUMMARY_KEYS = ("entry_s", "pinned_s", "gib_per_s", "lag_s", "close_full_s", "hugepage_bytes")


# -- the heartbeat ------------------------------------------------------------------------


class Heartbeat:
    """Sleeps ``period_s`` in a loop and records its worst overshoot (the loop's lag)."""

    def __init__(self, period_s: float = HEARTBEAT_S) -> None:
        self.period_s = period_s
        self.max_lag_s = 0.0
        self._deadline = time.perf_counter() + period_s

    async def run(self, *, task_status: TaskStatus[None]) -> None:
        task_status.started()
        while True:
            self._deadline = time.perf_counter() + self.period_s
            await anyio.sleep(self.period_s)
            self.max_lag_s = max(self.max_lag_s, time.perf_counter() - self._deadline)

    def reset(self) -> None:
        self.max_lag_s = 0.0

    def peek(self) -> float:
        """The worst lag so far, counting a sleep that is overdue but has not woken yet."""
        return max(self.max_lag_s, time.perf_counter() - self._deadline)


# -- configurations -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Config:
    chunk_mib: int
    prefault_threads: int
    pin_threads: int = 1
    hugepages: HugePages = "thp"

    @property
    def label(self) -> str:
        pages = "" if self.hugepages == "thp" else ", 4 KiB pages"
        return f"chunk {self.chunk_mib} MiB, {self.prefault_threads} prefault{pages}"


def _manager(nbytes: int, cfg: Config) -> OffloadManager:
    return OffloadManager(
        nbytes,
        backend="host",
        chunk_bytes=cfg.chunk_mib * MiB,
        prefault_threads=cfg.prefault_threads,
        pin_threads=cfg.pin_threads,
        hugepages=cfg.hugepages,
    )


def _check_released(baseline: int, what: str) -> int:
    locked = _sys.vm_locked_bytes()
    assert locked == baseline, f"VmLck {locked} after {what}, baseline {baseline}"
    return locked


# -- asyncpin -----------------------------------------------------------------------------


async def measure_asyncpin(nbytes: int, cfg: Config, hb: Heartbeat) -> dict[str, Any]:
    """Entry, time to pinned, loop lag while pinning, and close of the pinned buffer."""
    mgr = _manager(nbytes, cfg)
    hb.reset()
    t0 = time.perf_counter()
    async with mgr:
        t_entered = time.perf_counter()
        await mgr.pinned
        t_pinned = time.perf_counter()
        lag_s = hb.peek()
        await mgr.measure_hugepages()
        at_pinned = asdict(mgr.stats())
        t_close = time.perf_counter()
    t_closed = time.perf_counter()
    pinned_s = t_pinned - t0
    return {
        "nbytes": nbytes,
        "entry_s": t_entered - t0,
        "pinned_s": pinned_s,
        "gib_per_s": nbytes / GiB / pinned_s,
        "lag_s": lag_s,
        "close_full_s": t_closed - t_close,
        "hugepage_bytes": at_pinned["hugepage_bytes"],
        "stats_at_pinned": at_pinned,
        "stats_final": asdict(mgr.stats()),
    }


async def measure_close_mid(nbytes: int, cfg: Config, hb: Heartbeat) -> dict[str, Any]:
    """Enter, wait for the first pinned chunk (1 ms polling), then time aclose()."""
    mgr = _manager(nbytes, cfg)
    result: dict[str, Any] = {"raised": None}
    try:
        async with mgr:
            while mgr.stats().chunks_pinned < 1:  # noqa: ASYNC110 - polling is the point here
                await anyio.sleep(POLL_S)
            at_close = mgr.stats()
            hb.reset()
            t0 = time.perf_counter()
            await mgr.aclose()
            result["close_mid_s"] = time.perf_counter() - t0
            result["lag_during_close_s"] = hb.peek()
            result["pinned_bytes_at_close"] = at_close.pinned_bytes
            result["chunks_pinned_at_close"] = at_close.chunks_pinned
    except* anyio.BrokenResourceError as group:
        # A regression guard: before af9d9c5 a close mid-pinning could make the pin
        # pipeline raise BrokenResourceError out of `async with` after close. Count it.
        result["raised"] = repr(group)
    result["state_after"] = mgr.stats().state
    return result


# -- the synchronous peers ----------------------------------------------------------------


def _page_span(tensor: torch.Tensor) -> tuple[int, int]:
    page = _sys.PAGE_SIZE
    start = tensor.data_ptr() // page * page
    end = -(-(tensor.data_ptr() + tensor.numel()) // page) * page
    return start, end - start


def _hugepage_bytes(address: int, nbytes: int) -> int:
    end = address + nbytes
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < end and hi > address
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def _zeros_then_mlock(nbytes: int) -> tuple[torch.Tensor, int, int]:
    tensor = torch.zeros(nbytes, dtype=torch.uint8)
    address, span = _page_span(tensor)
    _sys.libc_mlock(address, span)
    return tensor, address, span


def _empty_then_mlock(nbytes: int) -> tuple[torch.Tensor, int, int]:
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    address, span = _page_span(tensor)
    _sys.libc_mlock(address, span)  # faults every page in, inside the kernel
    return tensor, address, span


PEERS: dict[str, Callable[[int], tuple[torch.Tensor, int, int]]] = {
    "zeros+mlock": _zeros_then_mlock,
    "empty+mlock": _empty_then_mlock,
}


async def measure_peer(nbytes: int, kind: str, hb: Heartbeat) -> dict[str, Any]:
    """The synchronous constructor, run on the event-loop thread (it blocks the loop)."""
    await anyio.sleep(0.005)  # let the heartbeat settle into its rhythm
    hb.reset()
    t0 = time.perf_counter()
    tensor, address, span = PEERS[kind](nbytes)
    total_s = time.perf_counter() - t0
    await anyio.sleep(0.005)  # the heartbeat wakes now and records the stall
    lag_s = hb.peek()
    huge = _hugepage_bytes(address, span)
    t_close = time.perf_counter()
    _sys.libc_munlock(address, span)
    del tensor
    close_s = time.perf_counter() - t_close
    return {
        "nbytes": nbytes,
        "entry_s": total_s,
        "pinned_s": total_s,
        "gib_per_s": nbytes / GiB / total_s,
        "lag_s": lag_s,
        "close_full_s": close_s,
        "hugepage_bytes": huge,
    }


# -- the run ------------------------------------------------------------------------------


def _prime(nbytes: int) -> float:
    """Fault ``nbytes`` in and give them back, so the next run finds memory the hypervisor
    backs (the warm regime); returns how long that took (long means it was cold)."""
    address = _sys.libc_mmap(
        nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    try:
        _sys.libc_madvise(address, nbytes, _sys.MADV_HUGEPAGE)
        t0 = time.perf_counter()
        _sys.libc_madvise(address, nbytes, _sys.MADV_POPULATE_WRITE)
        return time.perf_counter() - t0
    finally:
        _sys.libc_munmap(address, nbytes)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _machine() -> dict[str, Any]:
    meminfo = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return {
        "kernel": platform.release(),
        "cpus": len(os.sched_getaffinity(0)),
        "mem_total_bytes": int(meminfo[1]) * 1024,
        "thp_enabled": thp.read_text().strip() if thp.exists() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cap_ipc_lock": _sys.has_cap_ipc_lock(),
        "memlock_limit_bytes": _sys.memlock_limit_bytes(),
    }


async def _idle_lag(hb: Heartbeat, seconds: float = 0.5) -> float:
    hb.reset()
    await anyio.sleep(seconds)
    return hb.peek()


@dataclass(slots=True)
class Cell:
    """One measurement repeated ``--repeats`` times in one regime."""

    regime: str
    group: str  # "asyncpin", "close_mid" or "peer"
    label: str
    step: Callable[[], Awaitable[dict[str, Any]]]
    runs: list[dict[str, Any]]


def _cells(
    args: argparse.Namespace, nbytes: int, configs: list[Config], hb: Heartbeat
) -> list[Cell]:
    main_cfg = configs[0]
    cells: list[Cell] = []
    for regime in args.regimes:
        # The cold regime waits for the hypervisor to take freed memory back before each
        # run, so it is slow: close mid-pinning runs there for the main configuration only.
        cold = regime == "cold"
        for cfg in configs:
            cells.append(
                Cell(regime, "asyncpin", cfg.label, _bind(measure_asyncpin, nbytes, cfg, hb), [])
            )
            if not cold or cfg == main_cfg:
                cells.append(
                    Cell(
                        regime,
                        "close_mid",
                        cfg.label,
                        _bind(measure_close_mid, nbytes, cfg, hb),
                        [],
                    )
                )
        for kind in PEERS:
            cells.append(Cell(regime, "peer", kind, _bind(measure_peer, nbytes, kind, hb), []))
    return cells


def _summarise(cells: list[Cell], regime: str, main_label: str) -> dict[str, Any]:
    def summary_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
        summary = {key: _median(runs, key) for key in _SUMMARY_KEYS}
        # GiB/s of the median time, so that the two columns agree.
        pinned_s = summary["pinned_s"]
        summary["gib_per_s"] = runs[0]["nbytes"] / GiB / pinned_s if pinned_s else None
        return summary

    mine = [c for c in cells if c.regime == regime]
    asyncpin = {c.label: summary_of(c.runs) for c in mine if c.group == "asyncpin"}
    for c in mine:
        if c.group == "close_mid":
            asyncpin[c.label]["close_mid_s"] = _median(c.runs, "close_mid_s")
            asyncpin[c.label]["close_mid_raised"] = sum(1 for r in c.runs if r["raised"])
    peers = {c.label: summary_of(c.runs) for c in mine if c.group == "peer"}
    main = asyncpin[main_label]
    return {
        "asyncpin": asyncpin,
        "peers": peers,
        "ratios_peer_over_asyncpin": {kind: _ratios(peer, main) for kind, peer in peers.items()},
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    nbytes: int = args.size
    cpus = len(os.sched_getaffinity(0))
    main_cfg = Config(args.chunk_mib, args.prefault_threads)
    configs = [main_cfg]
    if args.sweep:
        for chunk_mib in sorted({64, args.chunk_mib}, reverse=True):
            for threads in sorted({1, min(2, cpus)}, reverse=True):
                if Config(chunk_mib, threads) not in configs:
                    configs.append(Config(chunk_mib, threads))
        # The same as the main configuration without THP: tells what huge pages cost or
        # save at first touch on this machine.
        configs.append(Config(main_cfg.chunk_mib, main_cfg.prefault_threads, hugepages="none"))
    baseline = _sys.vm_locked_bytes()
    locked_after: list[int] = []
    hb = Heartbeat()
    cells = _cells(args, nbytes, configs, hb)
    t_start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        await tg.start(hb.run)
        idle_lag_s = await _idle_lag(hb)
        # Warm-up at full size, kept out of the medians: first use of the code paths.
        warmup: dict[str, dict[str, Any]] = {}
        for what, step in (
            ("asyncpin", _bind(measure_asyncpin, nbytes, main_cfg, hb)),
            ("zeros+mlock", _bind(measure_peer, nbytes, "zeros+mlock", hb)),
        ):
            warmup[what] = await step()
            locked_after.append(_check_released(baseline, f"warm-up {what}"))
            print(f"  [warm-up] {what}: {_brief(warmup[what])}", file=sys.stderr)
        for regime in args.regimes:
            mine = [c for c in cells if c.regime == regime]
            for rep in range(args.repeats):
                # Rotate the order each repeat so that no recipe always follows the same one.
                for cell in mine[rep % len(mine) :] + mine[: rep % len(mine)]:
                    prime_s = None
                    if regime == "cold":
                        await anyio.sleep(args.cold_gap_s)
                    else:
                        prime_s = await anyio.to_thread.run_sync(_prime, nbytes)
                    result = await cell.step()
                    result["repeat"] = rep
                    result["prime_s"] = prime_s
                    cell.runs.append(result)
                    what = f"{regime} {cell.group} {cell.label}"
                    locked_after.append(_check_released(baseline, what))
                    print(f"  [{rep + 1}/{args.repeats}] {what}: {_brief(result)}", file=sys.stderr)
        tg.cancel_scope.cancel()
    return {
        "command": [sys.executable, *sys.argv],
        "machine": _machine(),
        "nbytes": nbytes,
        "repeats": args.repeats,
        "heartbeat_period_s": HEARTBEAT_S,
        "idle_lag_s": idle_lag_s,
        "cold_gap_s": args.cold_gap_s,
        "main_config": asdict(main_cfg) | {"label": main_cfg.label},
        "configs": [asdict(c) | {"label": c.label} for c in configs],
        "warmup": {k: {key: v.get(key) for key in _SUMMARY_KEYS} for k, v in warmup.items()},
        "regimes": {r: _summarise(cells, r, main_cfg.label) for r in args.regimes},
        "vmlck_baseline_bytes": baseline,
        "vmlck_after_each_run_bytes": locked_after,
        "vmlck_back_to_baseline": all(v == baseline for v in locked_after),
        "total_seconds": time.perf_counter() - t_start,
        "runs": [
            {"regime": c.regime, "group": c.group, "label": c.label, "runs": c.runs} for c in cells
        ],
    }


def _bind(
    fn: Callable[..., Awaitable[dict[str, Any]]], *args: Any
) -> Callable[[], Awaitable[dict[str, Any]]]:
    return lambda: fn(*args)


def _ratios(peer: dict[str, Any], ours: dict[str, Any]) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        num, den = peer.get(key), ours.get(key)
        return num / den if num is not None and den else None

    return {"entry": ratio("entry_s"), "pinned": ratio("pinned_s"), "lag": ratio("lag_s")}


def _brief(result: dict[str, Any]) -> str:
    parts = []
    for key in ("entry_s", "pinned_s", "lag_s", "close_full_s", "close_mid_s"):
        if result.get(key) is not None:
            parts.append(f"{key[:-2]} {_ms(result[key])}")
    if result.get("raised"):
        parts.append("RAISED BrokenResourceError")
    return ", ".join(parts)


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}x"


_REGIME_TITLES = {
    "warm": "warm: each run primed by faulting the same size in and freeing it just before",
    "cold": "cold: a pause before each run lets the hypervisor take freed memory back",
}


def print_table(doc: dict[str, Any]) -> None:
    size = format_bytes(doc["nbytes"])
    print(
        f"\nPinning {size} on the host backend (mlock), median of {doc['repeats']}; "
        f"heartbeat {doc['heartbeat_period_s'] * 1e3:.0f} ms, idle lag {_ms(doc['idle_lag_s'])}"
    )
    header = (
        f"{'recipe':<48} {'entry':>10} {'to pinned':>10} {'GiB/s':>6} {'max lag':>10} "
        f"{'close':>10} {'close mid':>10} {'huge pages':>11}"
    )
    for regime, summary in doc["regimes"].items():
        print(f"\n{_REGIME_TITLES.get(regime, regime)}")
        print(header)
        print("-" * len(header))
        for label, s in summary["asyncpin"].items():
            raised = s.get("close_mid_raised")
            bad = f" ({raised} raised)" if raised else ""
            print(
                f"{'asyncpin ' + label:<48} {_ms(s['entry_s']):>10} {_ms(s['pinned_s']):>10} "
                f"{s['gib_per_s']:>6.2f} {_ms(s['lag_s']):>10} {_ms(s['close_full_s']):>10} "
                f"{_ms(s.get('close_mid_s')):>10} {format_bytes(s['hugepage_bytes'] or 0):>11}"
                f"{bad}"
            )
        for kind, s in summary["peers"].items():
            print(
                f"{'peer ' + kind:<48} {_ms(s['entry_s']):>10} {_ms(s['pinned_s']):>10} "
                f"{s['gib_per_s']:>6.2f} {_ms(s['lag_s']):>10} {_ms(s['close_full_s']):>10} "
                f"{'-':>10} {format_bytes(s['hugepage_bytes'] or 0):>11}"
            )
        print(f"ratios, peer / asyncpin {doc['main_config']['label']}:")
        for kind, r in summary["ratios_peer_over_asyncpin"].items():
            print(
                f"  {kind:<12} entry {_x(r['entry'])}, time to pinned {_x(r['pinned'])}, "
                f"max loop lag {_x(r['lag'])}"
            )
    print()
    for what, w in doc["warmup"].items():
        print(
            f"warm-up (not in the medians) {what}: to pinned {_ms(w['pinned_s'])}, "
            f"{w['gib_per_s']:.2f} GiB/s, max lag {_ms(w['lag_s'])}"
        )
    state = "yes" if doc["vmlck_back_to_baseline"] else "NO"
    print(
        f"VmLck back to baseline ({doc['vmlck_baseline_bytes']} B) after all "
        f"{len(doc['vmlck_after_each_run_bytes'])} runs: {state}; "
        f"total {doc['total_seconds']:.0f} s"
    )


def _regimes(text: str) -> list[str]:
    regimes = [r.strip() for r in text.split(",") if r.strip()]
    if not regimes or any(r not in _REGIME_TITLES for r in regimes):
        raise argparse.ArgumentTypeError(f"regimes are a comma list of warm, cold; got {text!r}")
    return regimes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--size", type=parse_size, default=2 * GiB)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=256)
    parser.add_argument(
        "--prefault-threads", type=int, default=min(4, len(os.sched_getaffinity(0)))
    )
    parser.add_argument(
        "--no-sweep", dest="sweep", action="store_false", help="only the main configuration"
    )
    parser.add_argument(
        "--regimes",
        type=_regimes,
        default=["warm", "cold"],
        help="warm, cold or both (default: warm,cold)",
    )
    parser.add_argument(
        "--cold-gap-s",
        type=float,
        default=5.0,
        help="pause before each cold run; longer than the balloon's free-page-reporting delay",
    )
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )
    doc = anyio.run(bench, args)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"full figures: {args.json_out}", file=sys.stderr)
    sys.stderr.flush()
    print_table(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
