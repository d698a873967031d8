"""What makes a process's first pin call take 1.0-1.5 s in the start-up bench, when making
the pin context takes 0.12-0.21 s (``context_create.py``, runs 127-130)?

    python3 bench/probes/first_pin.py --mode {manager,context-first,setup-first} [--gib 1]
        [--after-recipe GIB] [--plain]

One fresh process per mode, torch's context made first; then a KV manager of ``--gib``
(the CUDA engine, whose first set-up in a process loads the copy kernel: beside its
first pin calls until c32b8b7, before them since), with each pin call timed:

- ``manager``: as the bench's first manager: its first pin call makes the context;
- ``context-first``: the pin context made (and timed) before the manager is entered;
- ``setup-first``: a one-block manager of the same layout opened, made ready and closed
  first (the context and the engine's first set-up both made), then the manager.

``--after-recipe GIB`` first registers and unregisters a zeroed tensor of GIB GiB in
torch's context, as the start-up bench's vLLM recipe does before asyncpin's run in the
same process. ``--plain``: a plain manager (no engine, so no set-up beside the pins).
The backend's ``warm_up()`` (where the manager makes the pin context) is timed too.

It prints the first pin calls' times and the time to ready.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))

import anyio
import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin._cudactx import pin_context
from asyncpin.cuda import CudaBackend


class Timed(CudaBackend):
    """The CUDA backend, each pin call's duration kept."""

    __slots__ = ("pins", "warm_up_s")

    def __init__(self) -> None:
        super().__init__()
        self.pins: list[float] = []
        self.warm_up_s: float | None = None

    def warm_up(self) -> None:
        t0 = time.perf_counter()
        super().warm_up()
        self.warm_up_s = time.perf_counter() - t0

    def pin(self, address: int, nbytes: int) -> None:
        t0 = time.perf_counter()
        super().pin(address, nbytes)
        self.pins.append(time.perf_counter() - t0)


async def ready_s(layout: KVLayout, blocks: int, backend: Timed, *, plain: bool = False) -> float:
    t0 = time.perf_counter()
    if plain:
        manager = OffloadManager(blocks * layout.host_block_bytes, backend=backend)
    else:
        manager = OffloadManager.for_kv(layout, blocks, backend=backend)
    async with manager as mgr:
        await mgr.pinned
        return time.perf_counter() - t0


def register_and_unregister(gib: int) -> float:
    """The vLLM recipe's open and close, in torch's context; its seconds."""
    t0 = time.perf_counter()
    tensor = torch.zeros(gib << 30, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)) == 0
    assert int(cudart.cudaHostUnregister(tensor.data_ptr())) == 0
    del tensor
    return time.perf_counter() - t0


async def main(args: Any) -> dict[str, Any]:
    torch.zeros(1, device="cuda")
    arrays = [
        torch.zeros(2, 256, 16, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(8)
    ]
    layout = KVLayout.from_tensors(arrays, block_dim=1)
    blocks = max(1, (args.gib << 30) // layout.host_block_bytes)
    doc: dict[str, Any] = {"mode": args.mode, "blocks": blocks, "plain": args.plain}
    if args.after_recipe:
        doc["recipe_s"] = register_and_unregister(args.after_recipe)
    if args.mode == "context-first":
        t0 = time.perf_counter()
        pin_context(torch.cuda.current_device())
        doc["context_s"] = time.perf_counter() - t0
    if args.mode == "setup-first":
        first = Timed()
        doc["one_block_ready_s"] = await ready_s(layout, 1, first)
        doc["one_block_pins_s"] = first.pins
    backend = Timed()
    doc["ready_s"] = await ready_s(layout, blocks, backend, plain=args.plain)
    doc["warm_up_s"] = backend.warm_up_s
    doc["first_pins_s"] = backend.pins[:4]
    doc["pin_median_s"] = sorted(backend.pins)[len(backend.pins) // 2]
    return doc


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("manager", "context-first", "setup-first"), required=True)
    p.add_argument("--gib", type=int, default=1)
    p.add_argument("--after-recipe", type=int, default=0, help="GiB (0: none)")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    doc = anyio.run(main, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items()}, default=str))
