"""TTFT of a Llama prefix hit restored from the KV tier, against a full prefill and the prefix
kept on the GPU (transformers, Llama-3.1-8B shapes, random bf16 weights, nothing downloaded).

    python bench/llama_ttft.py --json-out bench/results/llama-ttft.json
    python bench/llama_ttft.py --prompts 2048,8192 --repeats 3
    python bench/llama_ttft.py --quick            # tiny config on the CPU: checks the script

For each prompt size P: request 1 (P random tokens) is prefilled and its P/16 blocks are
stored in the tier (2 MiB host blocks: 32 layers of K and V, 32 KiB each); request 2 is the
same P tokens and ``--suffix`` other ones. Request 2's time to first token (TTFT: from the
device idle to the first greedy token on the host, CUDA-synchronised), median of
``--repeats`` after ``--warmup`` runs of each way, the ways interleaved:

- ``full``: prefill all of request 2 (no prefix cache);
- ``host_layerwise``: lookup, load the prefix into fresh pool blocks one transfer per layer
  (``KVTier.load_layers``); layer i waits for its own load only, then gathers its blocks;
- ``host_whole``: the same with one load of every layer (layer 0 waits for all of it);
- ``kept``: the prefix never left the GPU: gather the pool blocks, prefill the suffix;
- ``remote`` (with ``--redis-url``, a cluster's seed node with ``--redis-cluster``, or
  ``--own-servers node|cluster``: a redis-server, or three as a cluster (``--cluster-nodes``
  for more), started on loopback for the run by tests/redis_servers.py,
  ``ASYNCPIN_TEST_SERVER=valkey`` for Valkey): the host tier cleared (untimed), then
  ``tier.lookup_remote`` and ``tier.restore`` bring the prefix back from that server.

The check: each way generates ``--new-tokens`` greedy tokens once, the kept way twice. Every
hit way must restore every prefix block bit for bit and its forward must read the prefix
the kept way read (``prefix_digest``: a block read before its load landed changes it);
exit status 1 otherwise. Whether the tokens equal the kept way's (and the kept way's own
second run) is reported: on the H200 the same cache decodes to one of a few token
sequences whatever the way, so tokens alone prove nothing there. Uses
``examples/llama_prefix.py`` (its engine: a paged pool ``[blocks, 8, 16, 128]`` per layer's
K and V).
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import torch
import transformers

# Appended, not prepended: the asyncpin under test is the one PYTHONPATH names first.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from asyncpin import KVLayout, OffloadManager
from asyncpin.tier import KVTier
from bench._common import (
    format_bytes,
    machine,
    median,
    own_servers,
    parser,
    quiet_logs,
    require_gpu,
    write_json,
)
from examples.llama_prefix import (
    PrefixEngine,
    Served,
    _sync,
    build_model,
    default_dtype,
    llama_config,
    prefill_and_offload,
    prefix_digest,
    prefix_hashes,
    same_bytes,
    serve,
)

WAYS = ("full", "host_layerwise", "host_whole", "kept")


def _prompts(vocab: int, tokens: int, suffix: int, seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, vocab, (tokens + suffix,), generator=g).tolist()
    second = torch.randint(0, vocab, (suffix,), generator=g).tolist()
    if second[0] == first[tokens]:
        second[0] = (second[0] + 1) % vocab
    return first[:tokens], first[:tokens] + second


async def _serve_remote(
    engine: PrefixEngine, tier: KVTier, prompt: list[int], new: int, digest: bool
) -> Served:
    """The prefix only in the remote tier (the host tier cleared first, untimed):
    ``tier.lookup_remote`` finds it, ``tier.restore`` fetches it into host blocks, checks it
    and loads it; then the suffix is prefilled as for a host hit. TTFT from the lookup."""
    bs = engine.block_size
    hashes = prefix_hashes(prompt, bs)[: (len(prompt) - 1) // bs]
    tier.clear()
    _sync(engine.device)
    t0 = time.perf_counter()
    # As an engine schedules: how many leading blocks the tiers have, then pool blocks.
    ids = engine.allocate(await tier.lookup_remote(hashes))
    # Not given back to the pool if restore fails: its load may still be writing them.
    n = await tier.restore(hashes[: len(ids)], ids)
    engine.free(ids[n:])
    served = Served(tokens=[], ttft_s=0.0, hit_blocks=n, block_ids=ids[:n], load_api="restore")
    served.loaded_bytes = n * tier.manager.kv_layout.host_block_bytes  # type: ignore[union-attr]
    cache, keys, values = engine.prefix_cache(n * bs)
    with engine.restoring(engine.index_of(ids[:n]), keys, values):
        first = int(engine.forward(prompt[n * bs :], cache).argmax())
    served.ttft_s = time.perf_counter() - t0
    if digest:
        served.prefix_digest = prefix_digest(keys, values)
    del keys, values
    served.tokens = engine.decode(first, cache, new - 1)
    return served


async def _serve(
    engine: PrefixEngine, tier: KVTier, prompt: list[int], way: str, new: int, digest: bool = False
) -> Served:
    if way == "remote":
        return await _serve_remote(engine, tier, prompt, new, digest)
    if way.startswith("host"):
        return await serve(
            engine,
            tier,
            prompt,
            mode="host",
            layerwise=way == "host_layerwise",
            new_tokens=new,
            digest=digest,
        )
    return await serve(
        engine,
        tier,
        prompt,
        mode="full" if way == "full" else "kept",
        new_tokens=new,
        digest=digest,
    )


async def measure_size(
    engine: PrefixEngine,
    tier: KVTier,
    tokens: int,
    *,
    suffix: int,
    repeats: int,
    warmup: int,
    new_tokens: int,
    seed: int,
) -> dict[str, Any]:
    vocab = int(engine.model.config.vocab_size)
    first, prompt = _prompts(vocab, tokens, suffix, seed)
    hashes, kept_ids = await prefill_and_offload(engine, tier, first)
    ways = WAYS + (("remote",) if tier.remote is not None else ())
    if tier.remote is not None:
        await tier.remote_written()
    samples: dict[str, list[float]] = {way: [] for way in ways}
    hit: dict[str, int] = {}
    api: dict[str, str | None] = {}
    loaded = 0
    for rep in range(warmup + repeats):
        for way in ways:
            served = await _serve(engine, tier, prompt, way, 1)
            engine.free(served.block_ids)
            if rep >= warmup:
                samples[way].append(served.ttft_s)
            hit[way], api[way] = served.hit_blocks, served.load_api
            loaded = max(loaded, served.loaded_bytes)
    # The greedy check: every way once more, generating new_tokens.
    kept_bytes = engine.read_blocks(kept_ids)
    tokens_of: dict[str, list[int]] = {}
    identical = True
    # "kept" twice: whether the decode itself is deterministic here (the check's noise).
    read: dict[str, list[int] | None] = {}
    for way in (*ways, "kept_again"):
        served = await _serve(engine, tier, prompt, way.removesuffix("_again"), new_tokens, True)
        tokens_of[way] = served.tokens
        read[way] = served.prefix_digest
        identical &= way == "full" or served.hit_blocks == len(hashes)
        if way.startswith("host") or way == "remote":
            restored = engine.read_blocks(served.block_ids)
            identical &= all(
                same_bytes(a, b[: served.hit_blocks])
                for a, b in zip(restored, kept_bytes, strict=True)
            )
            del restored
            engine.free(served.block_ids)
    del kept_bytes
    engine.drop_prefix(hashes)
    ttft = {way: median(samples[way]) for way in ways}
    return {
        "request1_tokens": tokens,
        "prompt_tokens": len(prompt),
        "prefix_blocks": len(hashes),
        "hit_blocks": hit,
        "load_api": api,
        "loaded_bytes": loaded,
        "ttft_ms": {way: t * 1e3 for way, t in ttft.items()},
        "samples_ms": {way: [t * 1e3 for t in s] for way, s in samples.items()},
        "ratios": {
            **({"remote_over_full": ttft["remote"] / ttft["full"]} if "remote" in ttft else {}),
            "full_over_host_layerwise": ttft["full"] / ttft["host_layerwise"],
            "host_layerwise_over_kept": ttft["host_layerwise"] / ttft["kept"],
            "host_whole_over_host_layerwise": ttft["host_whole"] / ttft["host_layerwise"],
        },
        # Bytes of the prefix over the time a host hit adds to a kept one (None: no time).
        "restore_gbps": (
            loaded / added / 1e9 if (added := ttft["host_layerwise"] - ttft["kept"]) > 0 else None
        ),
        "tokens": tokens_of,
        "tokens_match": {
            way: tokens_of[way] == tokens_of["kept"]
            for way in ways
            if way.startswith("host") or way == "remote"
        },
        "kept_deterministic": tokens_of["kept_again"] == tokens_of["kept"],
        # What each hit way's forward read of the prefix, against the kept way's.
        "prefix_read_identical": {
            way: read[way] == read["kept"] for way in ways if way not in ("full", "kept")
        },
        "kv_bit_identical": identical,
        "full_prefill_match": tokens_of["full"] == tokens_of["kept"],
    }


async def bench(args: Any, device: torch.device) -> dict[str, Any]:
    cfg = llama_config(args.config)
    dtype = default_dtype(device)
    model = build_model(cfg, device, dtype, args.seed)
    bs = args.block_size
    max_blocks = max(args.prompts) // bs
    engine = PrefixEngine(model, block_size=bs, num_gpu_blocks=2 * max_blocks + 2)
    layout = KVLayout.from_tensors(engine.kv_tensors)
    doc: dict[str, Any] = {
        "machine": machine(),
        "transformers": transformers.__version__,
        "config": args.config,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": bs,
        "host_block_bytes": layout.host_block_bytes,
        "suffix_tokens": args.suffix,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "new_tokens": args.new_tokens,
        "sizes": {},
    }
    remote = None
    if args.redis_url:
        from asyncpin.tier.remote import RedisStore

        remote = RedisStore(args.redis_url, cluster=args.redis_cluster, timeout_s=30.0)
        doc["remote"] = f"redis ({'cluster' if args.redis_cluster else 'one node'}, loopback)"
    async with (
        OffloadManager.for_kv(layout, max_blocks + 2) as mgr,
        KVTier(
            mgr,
            remote=remote,
            model="llama-ttft",
            namespace=f"ttft-{uuid.uuid4().hex[:8]}",
            remote_queue=max_blocks + 2,
        )
        if remote is not None
        else contextlib.nullcontext(KVTier(mgr)) as tier,
    ):
        await mgr.pinned
        for n, tokens in enumerate(args.prompts):
            doc["sizes"][str(tokens)] = await measure_size(
                engine,
                tier,
                tokens,
                suffix=args.suffix,
                repeats=args.repeats,
                warmup=args.warmup,
                new_tokens=args.new_tokens,
                seed=args.seed + 1 + n,
            )
    return doc


def _check(row: dict[str, Any]) -> str:
    """ "same": every hit restored all the prefix's blocks bit for bit, its forward read the
    prefix the kept way read, and it decoded the kept way's tokens; "KV same, decode
    differs": all that but the tokens (the H200 decodes the same cache to one of a few
    token sequences, whatever the way: run 69); "DIFFER" otherwise (exit status 1)."""
    if not row["kv_bit_identical"] or not all(row["prefix_read_identical"].values()):
        return "DIFFER"
    return "same" if all(row["tokens_match"].values()) else "KV same, decode differs"


def _table(doc: dict[str, Any]) -> None:
    print(
        f"{doc['config']} {doc['dtype']}, block {doc['block_size']} tokens "
        f"({doc['host_block_bytes'] >> 10} KiB host block), suffix {doc['suffix_tokens']}, "
        f"median of {doc['repeats']} (ms)"
    )
    print("full: no prefix cache; lw / all: prefix loaded from the host per layer / at once;")
    print(
        "kept: prefix kept on the device; remote: fetched from "
        f"{doc.get('own_servers') or doc.get('remote') or 'Redis'}, checked, loaded (restore);"
    )
    print("GB/s: loaded bytes over (lw - kept)")
    print(
        f"{'prompt':>7} {'full':>9} {'host lw':>9} {'host all':>9} {'kept':>8} {'remote':>8} "
        f"{'full/lw':>8} {'lw/kept':>8} {'all/lw':>7} {'loaded':>9} {'GB/s':>6}  tokens"
    )
    for row in doc["sizes"].values():
        t, r = row["ttft_ms"], row["ratios"]
        gbps = "-" if row["restore_gbps"] is None else f"{row['restore_gbps']:.1f}"
        remote = f"{t['remote']:>8.1f}" if "remote" in t else f"{'-':>8}"
        check = _check(row)
        check += "" if row["full_prefill_match"] else " (full prefill: differs)"
        print(
            f"{row['prompt_tokens']:>7} {t['full']:>9.1f} {t['host_layerwise']:>9.1f} "
            f"{t['host_whole']:>9.1f} {t['kept']:>8.1f} {remote} "
            f"{r['full_over_host_layerwise']:>7.2f}x "
            f"{r['host_layerwise_over_kept']:>7.2f}x {r['host_whole_over_host_layerwise']:>6.2f}x "
            f"{format_bytes(row['loaded_bytes']):>9} {gbps:>6}  {check}"
        )


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--out", dest="json_out", type=Path, help="same as --json-out")
    p.add_argument("--config", choices=("tiny", "llama-3.1-8b"), default=None)
    p.add_argument(
        "--prompts",
        type=lambda text: [int(x) for x in text.split(",")],
        default=None,
        help="request 1 prompt sizes, comma-separated (2048,8192,32768)",
    )
    p.add_argument("--suffix", type=int, default=64, help="request 2's tokens after the prefix")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens of the check")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--redis-url", default=None, help="adds the remote way: the prefix fetched from there"
    )
    p.add_argument("--redis-cluster", action="store_true", help="--redis-url is a cluster's")
    p.add_argument(
        "--own-servers",
        choices=("node", "cluster"),
        default=None,
        help="the remote way on servers of our own, started for the run",
    )
    p.add_argument("--cluster-nodes", type=int, default=3, help="--own-servers cluster's (3)")
    args = p.parse_args()
    if args.quick:
        args.config = args.config or "tiny"
        args.prompts = args.prompts or [64, 256]
        args.repeats, args.warmup, args.new_tokens = 2, 1, 4
        args.suffix = min(args.suffix, 16)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        require_gpu()
        device = torch.device("cuda")
    args.config = args.config or "llama-3.1-8b"
    args.prompts = args.prompts or [2048, 8192, 32768]
    quiet_logs()
    doc = _on_own_servers(args, device) if args.own_servers else anyio.run(bench, args, device)
    write_json(args.json_out, doc)
    _table(doc)
    if any(_check(row) == "DIFFER" for row in doc["sizes"].values()):
        sys.exit("the tokens or the restored KV differ from the kept prefix's")


def _on_own_servers(args: Any, device: torch.device) -> dict[str, Any]:
    """``bench`` with ``--redis-url`` a server (or a cluster) of our own."""
    from tests.redis_servers import SERVER

    with own_servers(args.own_servers, "asyncpin-redis-ttft-", args.cluster_nodes) as servers:
        args.redis_url, args.redis_cluster = servers.url, args.own_servers == "cluster"
        doc: dict[str, Any] = anyio.run(bench, args, device)
        kind = args.own_servers
        if kind == "cluster":
            kind = f"cluster of {args.cluster_nodes}"
        doc["own_servers"] = f"{SERVER}, {kind}"
        return doc


if __name__ == "__main__":
    main()
