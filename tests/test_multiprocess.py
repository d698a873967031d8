"""KV blocks shared between processes through a shared region.

One process creates the region (``OffloadManager.for_kv(..., backing="shared",
name=...)``), another attaches to it (``OffloadManager.attached(name, kv_layout=...,
num_host_blocks=...)``); each pins its own mapping. What one stores the other loads,
byte for byte. Only the creator unlinks the file, and its close leaves an attached
mapping valid.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest
import torch

from asyncpin import ConfigError, KVLayout, OffloadManager

REPO_ROOT = Path(__file__).resolve().parent.parent
CHILD = Path(__file__).resolve().parent / "shared_kv_child.py"
SHM_DIR = Path("/dev/shm")
CHUNK = 64 << 10
LAYERS = 2
NUM_GPU_BLOCKS = 16
# vLLM's per-layer shape: [K/V, blocks, tokens per block, head size].
SHAPE = (2, NUM_GPU_BLOCKS, 8, 64)
DTYPE = torch.bfloat16
NUM_HOST_BLOCKS = 64
TIMEOUT_S = 120.0


def make_layout() -> KVLayout:
    """This process's own "device" KV arrays (CPU tensors), zeroed."""
    return KVLayout.from_tensors(
        [torch.zeros(SHAPE, dtype=DTYPE) for _ in range(LAYERS)], block_dim=1
    )


def random_blocks(layout: KVLayout, count: int, generator: torch.Generator) -> torch.Tensor:
    """``[count, num_arrays, *block_shape]`` of random bytes, none of them zero."""
    shape = (count, layout.num_arrays, *layout.block_shape)
    nbytes = count * layout.host_block_bytes
    raw = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(layout.dtype).view(shape)


def put_blocks(layout: KVLayout, gpu_ids: list[int], blocks: torch.Tensor) -> None:
    for a, array in enumerate(layout.arrays):
        array[gpu_ids] = blocks[:, a]


def get_blocks(layout: KVLayout, gpu_ids: list[int]) -> torch.Tensor:
    return torch.stack([array[gpu_ids] for array in layout.arrays], dim=1)


def raw(blocks: torch.Tensor) -> bytes:
    return blocks.contiguous().view(torch.uint8).numpy().tobytes()


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def creator(layout: KVLayout, name: str, num_host_blocks: int = NUM_HOST_BLOCKS) -> OffloadManager:
    return OffloadManager.for_kv(
        layout, num_host_blocks, backend="host", backing="shared", name=name, chunk_bytes=CHUNK
    )


def attacher(layout: KVLayout, name: str, num_host_blocks: int = NUM_HOST_BLOCKS) -> OffloadManager:
    return OffloadManager.attached(
        name,
        backend="host",
        chunk_bytes=CHUNK,
        kv_layout=layout,
        num_host_blocks=num_host_blocks,
    )


class TestTwoProcesses:
    """What one process stores, another process that attached to the region loads."""

    async def test_store_in_one_load_in_the_other(self, shm_name: str, tmp_path: Path) -> None:
        path = SHM_DIR / shm_name
        generator = torch.Generator().manual_seed(1234)
        layout = make_layout()
        ours = random_blocks(layout, 4, generator)
        theirs = random_blocks(layout, 3, generator)
        assert raw(ours) != raw(theirs)
        put_blocks(layout, [0, 1, 2, 3], ours)
        work = tmp_path / "work.pt"
        torch.save(
            {
                "layers": LAYERS,
                "shape": SHAPE,
                "dtype": DTYPE,
                "block_dim": 1,
                "chunk_bytes": CHUNK,
                "num_host_blocks": NUM_HOST_BLOCKS,
                "load_cpu_ids": [50, 3, 17, 63],
                "store_cpu_ids": [5, 6, 7],
                "store_blocks": theirs,
            },
            work,
        )
        with anyio.fail_after(TIMEOUT_S):
            async with creator(layout, shm_name) as mgr:
                await mgr.pinned
                await mgr.store([0, 1, 2, 3], [50, 3, 17, 63])
                result = await anyio.run_process(
                    [sys.executable, str(CHILD), shm_name, str(work)],
                    env=child_env(),
                    check=False,
                )
                assert result.returncode == 0, result.stderr.decode()
                # The child loaded our blocks...
                loaded = torch.load(f"{work}.out")
                assert raw(loaded) == raw(ours)
                # ...and we load the blocks it stored.
                await mgr.load([5, 6, 7], [8, 9, 10])
                assert raw(get_blocks(layout, [8, 9, 10])) == raw(theirs)
                assert raw(mgr.host_blocks()[[5, 6, 7]]) == raw(theirs)
                # The attacher's close did not unlink the file.
                assert path.exists()
        assert not path.exists()


class TestOwnership:
    """The creator unlinks; an attached mapping stays valid after that; sizes are checked."""

    async def test_attached_mapping_outlives_the_creators_close(self, shm_name: str) -> None:
        path = SHM_DIR / shm_name
        generator = torch.Generator().manual_seed(99)
        first, second = make_layout(), make_layout()
        blocks = random_blocks(first, 2, generator)
        more = random_blocks(first, 2, generator)
        put_blocks(first, [0, 1], blocks)
        with anyio.fail_after(TIMEOUT_S):
            async with creator(first, shm_name) as owner:
                await owner.pinned
                await owner.store([0, 1], [10, 20])
                async with attacher(second, shm_name) as other:
                    await other.pinned
                    await owner.aclose()
                    assert not path.exists()
                    # The name is gone; the memory is not.
                    await other.load([10, 20], [2, 3])
                    assert raw(get_blocks(second, [2, 3])) == raw(blocks)
                    put_blocks(second, [4, 5], more)
                    await other.store([4, 5], [30, 31])
                    await other.load([30, 31], [6, 7])
                    assert raw(get_blocks(second, [6, 7])) == raw(more)
                    assert other.stats().transfers_failed == 0

    async def test_region_too_small_for_the_layout(self, shm_name: str) -> None:
        layout = make_layout()
        with anyio.fail_after(TIMEOUT_S):
            async with creator(layout, shm_name, num_host_blocks=16):
                mgr = attacher(make_layout(), shm_name, num_host_blocks=17)
                with pytest.raises(ConfigError, match="too small for 17 host blocks") as info:
                    async with mgr:
                        pass
                assert shm_name in str(info.value)
                # It released its mapping; the creator's region is untouched.
                assert mgr.stats().pinned_bytes == 0
                async with attacher(make_layout(), shm_name, num_host_blocks=16) as fits:
                    assert fits.host_blocks().shape[0] == 16

    def test_layout_and_block_count_go_together(self, shm_name: str) -> None:
        with pytest.raises(ConfigError, match="go together"):
            OffloadManager.attached(shm_name, kv_layout=make_layout())
