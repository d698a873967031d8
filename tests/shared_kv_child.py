"""Child process for tests/test_multiprocess.py: attaches to a shared KV region by name.

    python tests/shared_kv_child.py NAME WORK_FILE

``WORK_FILE`` (``torch.save``) holds the KV layout's shape and what to do: the host
blocks to load (``load_cpu_ids``), and blocks to store (``store_blocks`` into
``store_cpu_ids``). The child pins its own mapping, loads into its own KV arrays, stores,
and writes the blocks it loaded to ``WORK_FILE + ".out"``; it never unlinks the region.
"""

from __future__ import annotations

import sys

import anyio
import torch

from asyncpin import KVLayout, OffloadManager


async def main(name: str, work_file: str) -> None:
    work = torch.load(work_file)
    tensors = [torch.zeros(work["shape"], dtype=work["dtype"]) for _ in range(work["layers"])]
    layout = KVLayout.from_tensors(tensors, block_dim=work["block_dim"])
    load_ids: list[int] = work["load_cpu_ids"]
    store_ids: list[int] = work["store_cpu_ids"]
    async with OffloadManager.attached(
        name,
        backend="host",
        chunk_bytes=work["chunk_bytes"],
        kv_layout=layout,
        num_host_blocks=work["num_host_blocks"],
    ) as mgr:
        with anyio.fail_after(60):
            await mgr.pinned
            # Device blocks 0..n-1 receive the loaded blocks; n.. hold what to store.
            gpu_loaded = list(range(len(load_ids)))
            gpu_stored = list(range(len(load_ids), len(load_ids) + len(store_ids)))
            await mgr.load(load_ids, gpu_loaded)
            loaded = torch.stack([array[gpu_loaded] for array in layout.arrays], dim=1)
            blocks: torch.Tensor = work["store_blocks"]
            for a, array in enumerate(layout.arrays):
                array[gpu_stored] = blocks[:, a]
            await mgr.store(gpu_stored, store_ids)
    torch.save(loaded.clone(), work_file + ".out")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
