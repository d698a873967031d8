"""Block hit rates of the KV tier's eviction policies on a synthetic, seeded serving trace.

    python3 bench/hit_rates.py --json-out bench/results/hit-rates.json
    python3 bench/hit_rates.py --quick           # a small trace: seconds

Pure Python on the CPU: only ``asyncpin.tier.policies`` is exercised, no GPU, no bytes.

The trace. A request is the chain of its prompt's block hashes (a block's hash stands for
its whole prefix, so two prompts share blocks exactly as far as they share a prefix).
Tenants (popularity Zipf, s = 1) each have a system prompt of their own; requests are

- turns of multi-turn sessions: the tenant's system prompt, then the session's history;
  each turn extends the previous turn's prompt (the answer and the next message). A pool
  of sessions is active at once; each request continues one of them at random, and a
  session that has had its turns makes room for a new one;
- now and then (``--doc-fraction``) a one-off long document after a system prompt: a scan
  of blocks never requested again.

The index simulated around a policy does what an engine's offloading connector does: a
request hits its longest resident prefix; those blocks are touched, then the missing ones
after the first miss are stored and inserted (one already resident past a gap is neither
stored again nor counted). Both go to the policy from the chain's tail to its head, as
vLLM's offloading manager touches them, so a chain's head is its most recent block. While
a request is served its blocks are protected (its loads and stores are in flight): a
policy never evicts them, and when it has nothing else to evict the block is not stored,
as a store "stores what fits".

Capacities are fractions of the working set (the distinct blocks of the trace). The block
hit rate is hit blocks over requested blocks; the ceiling is what a cache that never evicts
gets (every block misses once). Figures: bench/RESULTS.md#hit-rates.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

# Appended, not prepended: the asyncpin under test is the one PYTHONPATH names first.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from asyncpin.tier.policies import POLICY_NAMES, make_policy
from bench._common import machine, parser, write_json

FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass(frozen=True)
class TraceSpec:
    """The trace's shape; block counts are in KV blocks (16 tokens each in vLLM's default)."""

    seed: int = 20240607
    requests: int = 16_000
    tenants: int = 20
    system_blocks: tuple[int, int] = (50, 400)
    active_sessions: int = 1_000
    mean_turns: float = 6.0
    max_turns: int = 30
    first_turn_blocks: tuple[int, int] = (8, 128)
    next_turn_blocks: tuple[int, int] = (8, 64)
    doc_fraction: float = 0.05
    doc_blocks: tuple[int, int] = (500, 2_000)


QUICK = TraceSpec(
    requests=600,
    tenants=5,
    system_blocks=(10, 60),
    active_sessions=40,
    first_turn_blocks=(4, 24),
    next_turn_blocks=(2, 12),
    doc_blocks=(50, 200),
)


@dataclass
class _Session:
    prompt: list[int]
    turns_left: int


def make_trace(spec: TraceSpec) -> Iterator[list[int]]:
    """The requests, each a list of block hashes (ints), the same for the same ``spec``."""
    rng = random.Random(spec.seed)
    next_id = 0

    def new_blocks(bounds: tuple[int, int]) -> list[int]:
        nonlocal next_id
        n = rng.randint(*bounds)
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [new_blocks(spec.system_blocks) for _ in range(spec.tenants)]
    cum_weights = list(accumulate(1.0 / rank for rank in range(1, spec.tenants + 1)))

    def tenant_prompt() -> list[int]:
        return systems[rng.choices(range(spec.tenants), cum_weights=cum_weights)[0]]

    def new_session() -> _Session:
        turns = min(spec.max_turns, 1 + int(rng.expovariate(1.0 / (spec.mean_turns - 1))))
        return _Session(tenant_prompt() + new_blocks(spec.first_turn_blocks), turns)

    active: list[_Session] = []
    for _ in range(spec.requests):
        if rng.random() < spec.doc_fraction:
            yield tenant_prompt() + new_blocks(spec.doc_blocks)
            continue
        while len(active) < spec.active_sessions:
            active.append(new_session())
        i = rng.randrange(len(active))
        session = active[i]
        yield session.prompt
        session.turns_left -= 1
        if session.turns_left == 0:
            active[i] = active[-1]
            active.pop()
        else:
            session.prompt = session.prompt + new_blocks(spec.next_turn_blocks)


def simulate(name: str, capacity: int, trace: list[list[int]]) -> dict[str, Any]:
    """Serve ``trace`` through policy ``name`` holding ``capacity`` blocks; its figures."""
    policy = make_policy(name, capacity)
    resident: set[int] = set()
    hit = requested = not_stored = evicted = 0
    t0 = time.perf_counter()
    for request in trace:
        n = len(request)
        k = 0
        while k < n and request[k] in resident:
            k += 1
        hit += k
        requested += n
        in_flight = set(request)

        def evictable(key: object, in_flight: set[int] = in_flight) -> bool:
            return key not in in_flight

        for key in reversed(request[:k]):
            policy.touch(key)
        for key in reversed(request[k:]):
            if key in resident:
                continue
            if len(resident) >= capacity:
                victim = policy.evict(evictable)
                if victim is None:
                    not_stored += 1
                    continue
                resident.remove(victim)  # type: ignore[arg-type]
                evicted += 1
            policy.insert(key)
            resident.add(key)
        assert len(policy) == len(resident)
    return {
        "capacity_blocks": capacity,
        "hit_rate": hit / requested,
        "hit_blocks": hit,
        "evicted": evicted,
        "not_stored": not_stored,
        "seconds": time.perf_counter() - t0,
    }


def bench(spec: TraceSpec, policies: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    trace = list(make_trace(spec))
    requested = sum(map(len, trace))
    working_set = len({key for request in trace for key in request})
    doc = {
        "trace": {
            "spec": asdict(spec),
            "requests": len(trace),
            "requested_blocks": requested,
            "working_set_blocks": working_set,
            "ceiling_hit_rate": 1 - working_set / requested,
            "seconds_to_build": time.perf_counter() - t0,
        },
        "results": {},
        "machine": machine(),
    }
    for fraction in FRACTIONS:
        capacity = max(1, round(fraction * working_set))
        row: dict[str, Any] = {}
        for name in policies:
            row[name] = simulate(name, capacity, trace)
            print(
                f"  {fraction:.0%} ({capacity:,} blocks) {name:>7}: "
                f"{row[name]['hit_rate']:.2%} in {row[name]['seconds']:.1f} s",
                file=sys.stderr,
            )
        if "lru" in row:
            for figures in row.values():
                figures["vs_lru"] = figures["hit_rate"] / row["lru"]["hit_rate"]
        doc["results"][f"{fraction:.0%}"] = row
    return doc


def print_table(doc: dict[str, Any]) -> None:
    trace = doc["trace"]
    print(
        f"{trace['requests']:,} requests, {trace['requested_blocks']:,} blocks requested, "
        f"working set {trace['working_set_blocks']:,} blocks; "
        f"ceiling (no eviction) {trace['ceiling_hit_rate']:.2%}"
    )
    names = list(next(iter(doc["results"].values())))
    print("| capacity | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for fraction, row in doc["results"].items():
        cells = [
            f"{row[n]['hit_rate']:.2%}"
            + (f" ({row[n]['vs_lru']:.3f}x)" if n != "lru" and "vs_lru" in row[n] else "")
            for n in names
        ]
        capacity = next(iter(row.values()))["capacity_blocks"]
        print(f"| {fraction} ({capacity:,}) | " + " | ".join(cells) + " |")


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--policy", action="append", choices=POLICY_NAMES, help="repeatable (all)")
    p.add_argument("--requests", type=int, default=None, help="default: 16000 (--quick: 600)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--doc-fraction", type=float, default=None, help="default 0.05")
    args = p.parse_args()
    spec = QUICK if args.quick else TraceSpec()
    overrides = {"requests": args.requests, "seed": args.seed, "doc_fraction": args.doc_fraction}
    spec = TraceSpec(**(asdict(spec) | {k: v for k, v in overrides.items() if v is not None}))
    doc = bench(spec, args.policy or list(POLICY_NAMES))
    write_json(args.json_out, doc)
    sys.stderr.flush()
    print_table(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
