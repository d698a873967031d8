"""KV block transfers: store, load and both at once, against contiguous DMA; await latency.

    python3 bench/transfers.py --json-out transfers.json
    python3 bench/transfers.py --quick          # small, runs on the host engine without a GPU

Layout like Llama-3.1-8B: 32 layers, K and V apart (64 arrays), blocks of 16 tokens x 8
heads x 128 bf16 = 32 KiB per array, 2 MiB per host block; random data, random block ids.
For each transfer size (``--sizes``, default 32 MiB and 256 MiB: 16 and 128 blocks),
the wall time from ``mgr.store()`` / ``mgr.load()`` until the awaiting coroutine resumes,
median of ``--repeats`` (the block ids are drawn before the clock starts); GB/s count
bytes moved (1e9 bytes a second). "Both" is a store and a load of that size each, queued
together, both awaited: bytes of both over the time. "In flight": ``--in-flight`` stores
(or loads) of that size queued at once, then all awaited, as an engine queues a step's
transfers without waiting for the last: the host's queuing and wake-ups overlap the
device's copies. Through the manager's default method (``--method`` to force one).

Peer in the same run: contiguous DMA of the same number of bytes between a device buffer
and a buffer from torch's pinned allocator (``copy_(non_blocking=True)`` and a
synchronize; "both": one stream per direction), the bus's ceiling for that size.

Await latency: a one-block store (64 segments, 2 MiB) on an idle event loop, from
``store()`` until the awaiting coroutine resumes, p50/p99 of ``--samples``; peer: the same
64 copies with torch on a side stream and ``await to_thread(event.synchronize)``.
Figures: bench/RESULTS.md#transfers, #await-latency.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch

# Appended, not prepended: the asyncpin under test is the one PYTHONPATH names first.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from asyncpin import KVLayout, OffloadManager
from bench._common import (
    GB,
    format_bytes,
    kv_tensors,
    machine,
    median,
    parse_size,
    parser,
    percentiles,
    quiet_logs,
    write_json,
)

WARMUP = 3


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


async def timed(
    step: Callable[[Any], Awaitable[None]], repeats: int, pick: Callable[[], Any] = lambda: None
) -> float:
    """Median wall time of ``step(pick())`` after a warm-up, the device idle before each;
    ``pick`` (the block ids) runs before the clock starts."""
    times = []
    for i in range(WARMUP + repeats):
        args = pick()
        _sync()
        t0 = time.perf_counter()
        await step(args)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return median(times)


class Contiguous:
    """The peer: contiguous copies of ``nbytes`` between device memory and a buffer of
    torch's pinned allocator, one stream per direction."""

    def __init__(self, nbytes: int, device: str) -> None:
        cuda = device == "cuda"
        self.dev = [
            torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device) for _ in range(2)
        ]
        self.host = [
            torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory()
            if cuda
            else torch.empty(nbytes, dtype=torch.uint8)
            for _ in range(2)
        ]
        self.streams = [torch.cuda.Stream() for _ in range(2)] if cuda else []

    def _copy(self, direction: str, k: int) -> None:
        if direction == "store":
            self.host[k].copy_(self.dev[k], non_blocking=True)
        else:
            self.dev[k].copy_(self.host[k], non_blocking=True)

    def runner(self, *directions: str) -> Callable[[Any], Awaitable[None]]:
        """``run(directions)`` as a step of ``timed`` (which hands it no ids)."""
        return lambda _ids: self.run(directions)

    async def run(self, directions: tuple[str, ...]) -> None:
        if not self.streams:  # no GPU: memcpy in a worker thread, as a copy would be
            for k, d in enumerate(directions):
                await anyio.to_thread.run_sync(self._copy, d, k)
            return
        for k, d in enumerate(directions):
            with torch.cuda.stream(self.streams[k]):
                self._copy(d, k)
        for k in range(len(directions)):
            self.streams[k].synchronize()


async def bench_sizes(args: Any, device: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    block_bytes = 2 * args.layers * (32 << 10)
    counts = [max(1, size // block_bytes) for size in args.sizes]
    k = args.in_flight
    # Room for k stores and k loads of the largest size, disjoint.
    blocks = 2 * max(k, 2) * max(counts)
    layout = KVLayout.from_tensors(kv_tensors(device, blocks, args.layers))
    out: dict[str, Any] = {"host_block_bytes": layout.host_block_bytes, "sizes": {}}
    async with OffloadManager.for_kv(layout, blocks) as mgr:
        await mgr.pinned
        for n in counts:
            nbytes = n * layout.host_block_bytes

            def pick(n: int = n, k: int = 1) -> list[list[int]]:
                """Block ids for ``k`` stores and ``k`` loads of ``n`` blocks: device and
                host blocks distinct across all of them."""
                gpu = rng.sample(range(blocks), 2 * k * n)
                cpu = rng.sample(range(blocks), 2 * k * n)
                return [lst[j * n : (j + 1) * n] for j in range(2 * k) for lst in (gpu, cpu)]

            def queued(
                direction: str, count: int = 1
            ) -> Callable[[list[list[int]]], Awaitable[None]]:
                """``count`` transfers of one direction queued at once, then all awaited."""

                async def run(ids: list[list[int]]) -> None:
                    pairs = zip(ids[0 : 2 * count : 2], ids[1 : 2 * count : 2], strict=True)
                    transfers = [
                        mgr.store(g, c, method=args.method)
                        if direction == "store"
                        else mgr.load(c, g, method=args.method)
                        for g, c in pairs
                    ]
                    for transfer in transfers:
                        await transfer

                return run

            async def both(ids: list[list[int]]) -> None:
                s = mgr.store(ids[0], ids[1], method=args.method)
                ld = mgr.load(ids[3], ids[2], method=args.method)
                await s
                await ld

            peer = Contiguous(nbytes, device)
            row: dict[str, Any] = {"blocks": n, "bytes": nbytes, "in_flight": args.in_flight}
            picks = partial(pick, n, 1)
            for key, step, moved, picker in (
                ("store", queued("store"), nbytes, picks),
                ("load", queued("load"), nbytes, picks),
                ("both", both, 2 * nbytes, picks),
                ("store_in_flight", queued("store", k), k * nbytes, partial(pick, n, k)),
                ("load_in_flight", queued("load", k), k * nbytes, partial(pick, n, k)),
                ("contiguous_store", peer.runner("store"), nbytes, lambda: None),
                ("contiguous_load", peer.runner("load"), nbytes, lambda: None),
                ("contiguous_both", peer.runner("store", "load"), 2 * nbytes, lambda: None),
            ):
                row[f"{key}_gbps"] = moved / await timed(step, args.repeats, picker) / GB
            for key in ("store", "load", "both"):
                row[f"{key}_over_contiguous"] = row[f"{key}_gbps"] / row[f"contiguous_{key}_gbps"]
            for key in ("store", "load"):
                row[f"{key}_in_flight_over_contiguous"] = (
                    row[f"{key}_in_flight_gbps"] / row[f"contiguous_{key}_gbps"]
                )
            del peer
            out["sizes"][format_bytes(nbytes).replace(" ", "")] = row
            print(
                f"  {format_bytes(nbytes)}: "
                + ", ".join(f"{key} {v:.1f}" for key, v in row.items() if key.endswith("_gbps")),
                file=sys.stderr,
            )
    return out


async def await_latency(args: Any, device: str) -> dict[str, Any]:
    """One block, stored and awaited on an idle loop; the torch peer on the same bytes."""
    blocks = 64
    tensors = kv_tensors(device, blocks, args.layers)
    layout = KVLayout.from_tensors(tensors)
    cuda = device == "cuda"
    lat: list[float] = []
    submit: list[float] = []
    async with OffloadManager.for_kv(layout, blocks) as mgr:
        await mgr.pinned
        for i in range(WARMUP + args.samples):
            t0 = time.perf_counter()
            transfer = mgr.store([i % blocks], [(i * 7) % blocks])
            t1 = time.perf_counter()
            await transfer
            if i >= WARMUP:
                submit.append(t1 - t0)
                lat.append(time.perf_counter() - t0)
    host = torch.empty((len(tensors), *tensors[0].shape[1:]), dtype=tensors[0].dtype)
    host = host.pin_memory() if cuda else host
    side = torch.cuda.Stream() if cuda else None
    peer: list[float] = []
    for i in range(WARMUP + args.samples):
        t0 = time.perf_counter()
        if side is not None:
            with torch.cuda.stream(side):
                side.wait_stream(torch.cuda.current_stream())
                for a, array in enumerate(tensors):
                    host[a].copy_(array[i % blocks], non_blocking=True)
                event = torch.cuda.Event(blocking=True)
                event.record(side)
            await anyio.to_thread.run_sync(event.synchronize)
        else:

            def copy(i: int = i) -> None:
                for a, array in enumerate(tensors):
                    host[a].copy_(array[i % blocks])

            await anyio.to_thread.run_sync(copy)
        if i >= WARMUP:
            peer.append(time.perf_counter() - t0)
    us = 1e6
    ours, theirs, queued = percentiles(lat), percentiles(peer), percentiles(submit)
    return {
        "block_bytes": layout.host_block_bytes,
        "segments": len(tensors),
        "samples": args.samples,
        "p50_us": ours["p50"] * us,
        "p99_us": ours["p99"] * us,
        "submit_p50_us": queued["p50"] * us,
        "peer_p50_us": theirs["p50"] * us,
        "peer_p99_us": theirs["p99"] * us,
    }


async def bench(args: Any) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    doc: dict[str, Any] = {"machine": machine(), "layers": args.layers, "repeats": args.repeats}
    if "sizes" in args.only:
        doc["transfers"] = await bench_sizes(args, device)
    if "latency" in args.only:
        doc["await"] = await await_latency(args, device)
    return doc


def print_table(doc: dict[str, Any]) -> None:
    m = doc["machine"]
    print(
        f"\nKV transfers, 32 KiB blocks x {2 * doc['layers']} arrays, median of "
        f"{doc['repeats']}; {m['gpu'] or 'host engine (no GPU)'}; asyncpin from "
        f"{m['asyncpin_path']}"
    )
    if "transfers" in doc:
        print(
            f"{'per transfer':>12} {'store':>6} {'load':>6} {'both':>6}   "
            f"{'in flight: store':>16} {'load':>6}   "
            f"{'contiguous: store':>17} {'load':>6} {'both':>6}   GB/s"
        )
        for size, r in doc["transfers"]["sizes"].items():
            print(
                f"{size:>12} {r['store_gbps']:>6.1f} {r['load_gbps']:>6.1f} "
                f"{r['both_gbps']:>6.1f}   {r['store_in_flight_gbps']:>16.1f} "
                f"{r['load_in_flight_gbps']:>6.1f}   {r['contiguous_store_gbps']:>17.1f} "
                f"{r['contiguous_load_gbps']:>6.1f} {r['contiguous_both_gbps']:>6.1f}"
            )
    if "await" in doc:
        a = doc["await"]
        print(
            f"await one block ({a['segments']} segments, {format_bytes(a['block_bytes'])}), "
            f"idle loop: p50 {a['p50_us']:.0f} / p99 {a['p99_us']:.0f} us "
            f"(submit {a['submit_p50_us']:.0f}); peer to_thread(event.synchronize) "
            f"{a['peer_p50_us']:.0f} / {a['peer_p99_us']:.0f} us"
        )


def main() -> int:
    p = parser(__doc__)
    p.add_argument(
        "--sizes",
        type=lambda t: [parse_size(s) for s in t.split(",")],
        default=[32 << 20, 256 << 20],
        help="bytes per transfer, comma list",
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--only", default="sizes,latency", help="sizes, latency or both")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--method", default="auto", help="auto, batch, pack or kernel")
    p.add_argument("--in-flight", type=int, default=4, help="transfers queued at once")
    args = p.parse_args()
    if args.quick:
        # The same block counts at 1/32 of the bytes: 2 arrays, so that the host region
        # stays within a small RLIMIT_MEMLOCK (4 MiB).
        args.layers, args.repeats, args.samples, args.in_flight = 1, 3, 20, 2
        args.sizes = [s // 32 for s in args.sizes]
    quiet_logs()
    doc = anyio.run(bench, args)
    write_json(args.json_out, doc)
    sys.stderr.flush()
    print_table(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
