"""Layer-wise loads: a restored prefix lets layer 0 run while later layers are coming.

A Llama-3.1-8B KV layout (32 layers, K and V joined per layer, 32 KiB per block and
array). A prefix of 2k, 8k and 32k tokens (128, 512, 2048 blocks) is stored through a
``KVTier`` and restored into other device blocks three ways, each followed on a compute
stream by 32 "layers" of work (two GEMMs of a Llama-8B MLP over a 512-token suffix):

- ``whole``: ``tier.load``; the compute stream waits for the whole load, then runs the
  layers (a restore that is not layer-wise);
- ``layerwise``: ``tier.load_layers``; before layer i the compute stream waits only for
  the event of layer i's group;
- ``layerwise_x4``: the same with groups of 4 layers (8 transfers; layers 4i..4i+3 wait
  for group i);
- ``peer``: the bus-limit recipe: per layer one ``copy_`` of that layer's blocks from a
  pinned host tensor where they lie contiguously (no block table, no index), an event per
  layer on a side stream, the same per-layer waits.

Reported: time to layer 0's KV (first group's event), the load alone, and from submission
to the end of the last layer (CUDA events); ratios layerwise/whole and layerwise/peer.
``--quick`` runs the API path on the host engine with a tiny layout (no overlap to see).

    python bench/layerwise.py [--tokens 2048 8192 32768] [--suffix 512] [--json-out PATH]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))

import anyio
import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin.tier import KVTier
from bench._common import HEAD_DIM, HEADS, TOKENS, machine, median, parser, quiet_logs, write_json

LAYERS, HIDDEN, INTERMEDIATE = 32, 4096, 14336
# Arrays 8i..8i+7: layers 4i..4i+3 (K and V each).
FOUR_LAYERS = [range(8 * i, 8 * i + 8) for i in range(LAYERS // 4)]


class Layers:
    """Per-layer work on the compute stream: a Llama-8B MLP's two GEMMs over the suffix."""

    def __init__(self, suffix: int, device: str) -> None:
        self.x = torch.randn(suffix, HIDDEN, device=device, dtype=torch.bfloat16)
        self.up = torch.randn(HIDDEN, INTERMEDIATE, device=device, dtype=torch.bfloat16) * 0.01
        self.down = torch.randn(INTERMEDIATE, HIDDEN, device=device, dtype=torch.bfloat16) * 0.01

    def run(self) -> None:
        torch.relu(self.x @ self.up) @ self.down


async def measure_gpu(tokens: list[int], suffix: int, repeats: int) -> dict[str, Any]:
    blocks = max(tokens) // TOKENS
    device_blocks = 2 * blocks
    kv = [
        torch.randn(2, device_blocks, TOKENS, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    layout = KVLayout.from_tensors(kv, block_dim=1)
    layers = Layers(suffix, "cuda")
    compute = torch.cuda.Stream()
    side = torch.cuda.Stream()
    rows: dict[str, Any] = {}
    async with OffloadManager.for_kv(layout, blocks, backend="cuda") as mgr:
        await mgr.pinned
        tier = KVTier(mgr)
        # The peer's host copy: each layer's blocks contiguous in pinned memory.
        peer_host = [torch.empty_like(t[:, :blocks], device="cpu").pin_memory() for t in kv]
        for _ in range(3):  # warm-up of the GEMMs and every path
            layers.run()
        torch.cuda.synchronize()
        for n_tokens in tokens:
            n = n_tokens // TOKENS
            hashes = list(range(n_tokens * 10, n_tokens * 10 + n))
            tier.clear()
            await tier.store(hashes, list(range(n))).transfer
            for i, t in enumerate(kv):
                peer_host[i][:, :n].copy_(t[:, :n])
            dest = list(range(blocks, blocks + n))
            nbytes = n * layout.host_block_bytes
            samples: dict[str, list[dict[str, float]]] = {
                "whole": [],
                "layerwise": [],
                "layerwise_x4": [],
                "peer": [],
            }
            for _ in range(repeats):
                for how in samples:
                    torch.cuda.synchronize()
                    start = torch.cuda.Event(enable_timing=True)
                    first = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    pending: Any = None
                    with torch.cuda.stream(compute):
                        start.record()
                        if how == "whole":
                            pending = tier.load(hashes, dest)
                            waits = [pending.event] * LAYERS
                        elif how == "layerwise":
                            pending = tier.load_layers(hashes, dest)
                            waits = [t.event for t in pending.transfers]
                        elif how == "layerwise_x4":  # groups of 4 layers: 8 transfers
                            pending = tier.load_layers(hashes, dest, groups=FOUR_LAYERS)
                            waits = [t.event for t in pending.transfers for _ in range(4)]
                        else:
                            side.wait_stream(compute)
                            waits = []
                            with torch.cuda.stream(side):
                                for i, t in enumerate(kv):
                                    for k in range(2):  # K, V: each a contiguous run
                                        t[k, blocks : blocks + n].copy_(
                                            peer_host[i][k, :n], non_blocking=True
                                        )
                                    event = torch.cuda.Event()
                                    event.record()
                                    waits.append(event)
                        assert all(w is not None for w in waits), "a load not queued at once"
                        for i, event in enumerate(waits):
                            compute.wait_event(event)
                            if i == 0:
                                first.record()
                            layers.run()
                        end.record()
                    if pending is not None:
                        await pending
                    compute.synchronize()
                    samples[how].append(
                        {
                            "first_layer_ms": start.elapsed_time(first),
                            "total_ms": start.elapsed_time(end),
                        }
                    )
            # The loads alone, no compute: GB/s of each path.
            alone: dict[str, float] = {}
            for how in ("whole", "layerwise"):
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    if how == "whole":
                        await tier.load(hashes, dest)
                    else:
                        await tier.load_layers(hashes, dest)
                    times.append(time.perf_counter() - t0)
                alone[f"{how}_load_gbps"] = nbytes / median(times) / 1e9
            torch.cuda.synchronize()
            layers_only = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                with torch.cuda.stream(compute):
                    for _ in range(LAYERS):
                        layers.run()
                compute.synchronize()
                layers_only.append(time.perf_counter() - t0)
            row: dict[str, Any] = {
                how: {k: median([s[k] for s in v]) for k in v[0]} for how, v in samples.items()
            }
            row.update(alone)
            row["compute_only_ms"] = median(layers_only) * 1e3
            whole, layered = tier.load(hashes, dest), tier.load_layers(hashes, dest)
            await whole
            await layered
            row["methods"] = {  # what auto chose
                "whole": whole.method,
                "layerwise": sorted({t.method for t in layered.transfers}),
            }
            row["bytes"] = nbytes
            row["layerwise_vs_whole"] = row["layerwise"]["total_ms"] / row["whole"]["total_ms"]
            row["layerwise_vs_peer"] = row["layerwise"]["total_ms"] / row["peer"]["total_ms"]
            row["layerwise_x4_vs_whole"] = (
                row["layerwise_x4"]["total_ms"] / row["whole"]["total_ms"]
            )
            rows[str(n_tokens)] = row
    return rows


async def measure_cpu(repeats: int) -> dict[str, Any]:
    """The API path on the host engine: tiny, no overlap to see."""
    kv = [torch.randn(2, 32, 4, 2, 8) for _ in range(4)]
    layout = KVLayout.from_tensors(kv, block_dim=1)
    async with OffloadManager.for_kv(layout, 16) as mgr:
        await mgr.pinned
        tier = KVTier(mgr)
        hashes = list(range(16))
        await tier.store(hashes, list(range(16))).transfer
        times: dict[str, list[float]] = {"whole": [], "layerwise": []}
        for _ in range(repeats):
            t0 = time.perf_counter()
            await tier.load(hashes, list(range(16, 32)))
            times["whole"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await tier.load_layers(hashes, list(range(16, 32)))
            times["layerwise"].append(time.perf_counter() - t0)
    return {"16 blocks, host engine": {k: {"total_ms": median(v) * 1e3} for k, v in times.items()}}


def print_table(rows: dict[str, Any]) -> None:
    print(
        "| prefix tokens | layer 0 ready (whole / layerwise / peer) | end of 32 layers "
        "(whole / layerwise / peer) | layerwise vs whole | vs peer | load GB/s whole / layerwise "
        "| groups of 4 layers: end, vs whole |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        if "peer" not in row:
            print(
                f"| {name} | - | {row['whole']['total_ms']:.2f} / "
                f"{row['layerwise']['total_ms']:.2f} ms | - | - | - |"
            )
            continue
        f = [row[h]["first_layer_ms"] for h in ("whole", "layerwise", "peer")]
        t = [row[h]["total_ms"] for h in ("whole", "layerwise", "peer")]
        print(
            f"| {name} | {f[0]:.2f} / {f[1]:.2f} / {f[2]:.2f} ms | {t[0]:.2f} / {t[1]:.2f} / "
            f"{t[2]:.2f} ms | {row['layerwise_vs_whole']:.2f}x | {row['layerwise_vs_peer']:.2f}x "
            f"| {row['whole_load_gbps']:.1f} / {row['layerwise_load_gbps']:.1f} "
            f"| {row['layerwise_x4']['total_ms']:.2f} ms, {row['layerwise_x4_vs_whole']:.2f}x |"
        )


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--suffix", type=int, default=512, help="tokens of per-layer work")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    quiet_logs()
    if args.quick or not torch.cuda.is_available():
        if not args.quick:
            sys.exit("layerwise.py needs a CUDA GPU (or --quick)")
        rows = anyio.run(measure_cpu, 3)
    else:
        rows = anyio.run(measure_gpu, args.tokens, args.suffix, args.repeats)
    doc = {"machine": machine(), "suffix_tokens": args.suffix, "layerwise": rows}
    write_json(args.json_out, doc)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
