"""The block index's bookkeeping cost (no GPU: the index is pure Python).

- lookup of a 1,000-hash prompt in an index of 1,000,000 resident blocks (all hits, and
  a miss at the first hash);
- one store's bookkeeping (``begin_store`` + ``end_store``) and one load's
  (``begin_load`` + ``end_load``) of 128 host blocks, the blocks of a 256 MiB transfer of
  the Llama-3.1-8B layout (2 MiB host blocks), in a full index, so that every new block
  evicts one. Against the transfer's own time, which ``--transfer-gbps`` gives (the
  figure measured on the GPU: ``bench/RESULTS.md#transfers``).

    python bench/tier_index.py [--blocks 1000000] [--policy lru] [--json-out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from asyncpin.tier import POLICY_NAMES, BlockIndex
from bench._common import median


def _median_us(samples: list[float]) -> float:
    return median(samples) * 1e6


def measure(blocks: int, policy: str, repeats: int, transfer_gbps: float) -> dict[str, object]:
    index = BlockIndex(blocks, policy=policy)
    t0 = time.perf_counter()
    for lo in range(0, blocks, 4096):
        plan = index.begin_store(list(range(lo, min(lo + 4096, blocks))))
        index.end_store(plan, ok=True)
    fill_s = time.perf_counter() - t0
    prompt = list(range(blocks // 2, blocks // 2 + 1000))
    miss = [-1, *prompt[1:]]
    hit_s, miss_s, store_s, load_s = [], [], [], []
    next_hash = blocks
    for _ in range(repeats):
        t = time.perf_counter()
        assert index.lookup(prompt) == 1000
        hit_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert index.lookup(miss) == 0
        miss_s.append(time.perf_counter() - t)
        new = list(range(next_hash, next_hash + 128))
        next_hash += 128
        t = time.perf_counter()
        plan = index.begin_store(new)
        index.end_store(plan, ok=True)
        store_s.append(time.perf_counter() - t)
        assert len(plan.hashes) == 128
        t = time.perf_counter()
        host = index.begin_load(new)
        index.end_load(new, host)
        load_s.append(time.perf_counter() - t)
    transfer_us = (256 << 20) / (transfer_gbps * 1e9) * 1e6
    store_us, load_us = _median_us(store_s), _median_us(load_s)
    return {
        "policy": policy,
        "blocks": blocks,
        "fill_s": fill_s,
        "lookup_1000_hit_us": _median_us(hit_s),
        "lookup_miss_us": _median_us(miss_s),
        "store_128_blocks_us": store_us,
        "load_128_blocks_us": load_us,
        "transfer_256MiB_us": transfer_us,
        "store_overhead": store_us / transfer_us,
        "load_overhead": load_us / transfer_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--policy", choices=POLICY_NAMES, action="append")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument(
        "--transfer-gbps", type=float, default=43.3, help="256 MiB store speed (GB/s)"
    )
    parser.add_argument("--quick", action="store_true", help="10,000 blocks, 20 repeats")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    blocks, repeats = (10_000, 20) if args.quick else (args.blocks, args.repeats)
    results = [
        measure(blocks, policy, repeats, args.transfer_gbps)
        for policy in args.policy or POLICY_NAMES
    ]
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    print(
        f"{'policy':8} {'lookup 1000 hit':>16} {'miss':>8} {'store 128':>10} "
        f"{'load 128':>10} {'vs 256 MiB copy':>16}"
    )
    for r in results:
        print(
            f"{r['policy']:8} {r['lookup_1000_hit_us']:>13.1f} us {r['lookup_miss_us']:>5.1f} us "
            f"{r['store_128_blocks_us']:>7.1f} us {r['load_128_blocks_us']:>7.1f} us "
            f"{r['store_overhead']:>9.2%} / {r['load_overhead']:.2%}"
        )


if __name__ == "__main__":
    main()
