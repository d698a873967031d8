"""Tensor-parallel ranks sharing host blocks: ``host_slice=(rank, ranks)``.

Each rank has its own slice of every KV block (its heads); the ranks' managers share one
region where host block ``c`` holds every rank's part side by side, so one block id (what
a scheduler's index hands out) names the whole block. Each rank moves its own part and
never touches another's."""

from __future__ import annotations

import anyio
import pytest
import torch

from asyncpin import ConfigError, KVLayout, OffloadManager
from tests.layouts import randomize_arrays

pytestmark = pytest.mark.anyio

TIMEOUT_S = 20
BLOCKS, HOST_BLOCKS, RANKS = 16, 8, 2
CHUNK = 1 << 16


def rank_layout() -> KVLayout:
    """One rank's KV: per layer [2, blocks, 4 tokens, 2 heads (its share), 8]."""
    return KVLayout.from_tensors(
        [torch.zeros(2, BLOCKS, 4, 2, 8, dtype=torch.float16) for _ in range(2)], block_dim=1
    )


def rank_manager(layout: KVLayout, name: str, rank: int) -> OffloadManager:
    if rank == 0:
        return OffloadManager.for_kv(
            layout,
            HOST_BLOCKS,
            backend="host",
            backing="shared",
            name=name,
            chunk_bytes=CHUNK,
            host_slice=(0, RANKS),
        )
    return OffloadManager.attached(
        name,
        backend="host",
        chunk_bytes=CHUNK,
        kv_layout=layout,
        num_host_blocks=HOST_BLOCKS,
        host_slice=(rank, RANKS),
    )


async def test_each_rank_moves_its_own_part_of_shared_host_blocks(shm_name: str) -> None:
    layouts = [rank_layout() for _ in range(RANKS)]
    for rank, layout in enumerate(layouts):
        randomize_arrays(layout, rank + 1)
    kept = [[raw.clone() for raw in layout.byte_arrays()] for layout in layouts]
    gpu, cpu = [3, 9, 0], [7, 2, 5]
    hb = layouts[0].host_block_bytes
    with anyio.fail_after(TIMEOUT_S):
        async with (
            rank_manager(layouts[0], shm_name, 0) as first,
            rank_manager(layouts[1], shm_name, 1) as second,
        ):
            managers = [first, second]
            for mgr in managers:
                await mgr.pinned
            assert first.stats().nbytes >= RANKS * HOST_BLOCKS * hb
            # Both ranks store the same device blocks under the same host block ids.
            await first.store(gpu, cpu)
            await second.store(gpu, cpu)
            region = first.host_view()
            for rank in range(RANKS):
                for g, c in zip(gpu, cpu, strict=True):
                    part = region[c * RANKS * hb + rank * hb :][:hb]
                    expected = torch.cat([raw[g] for raw in kept[rank]])
                    assert torch.equal(part, expected), (rank, c)
                assert torch.equal(
                    managers[rank].host_bytes()[cpu[0]],
                    region[cpu[0] * RANKS * hb + rank * hb :][:hb],
                )
            # A rank's load brings back its own part only.
            for layout in layouts:
                for raw in layout.byte_arrays():
                    raw.zero_()
            await second.load(cpu, [1, 2, 4])
            for g, d in zip(gpu, [1, 2, 4], strict=True):
                for a, raw in enumerate(layouts[1].byte_arrays()):
                    assert torch.equal(raw[d], kept[1][a][g])
            assert not any(raw.any() for raw in layouts[0].byte_arrays())
            await first.load(cpu, [1, 2, 4])
            for g, d in zip(gpu, [1, 2, 4], strict=True):
                for a, raw in enumerate(layouts[0].byte_arrays()):
                    assert torch.equal(raw[d], kept[0][a][g])
            del region


async def test_an_attacher_with_another_number_of_ranks_is_refused(shm_name: str) -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with rank_manager(rank_layout(), shm_name, 0) as first:
            await first.pinned
            other = OffloadManager.attached(
                shm_name,
                backend="host",
                chunk_bytes=CHUNK,
                kv_layout=rank_layout(),
                num_host_blocks=HOST_BLOCKS,
                host_slice=(1, 3),
            )
            with pytest.raises(ConfigError, match="ranks"):
                async with other:
                    pass


@pytest.mark.parametrize(
    "host_slice", [(2, 2), (-1, 2), (0, 0), [0, 2], (0.0, 2), (True, 2), (0, 2, 1), "0,2"], ids=repr
)
def test_a_bad_slice_is_refused(host_slice: object) -> None:
    with pytest.raises(ConfigError, match="host_slice"):
        OffloadManager.for_kv(rank_layout(), HOST_BLOCKS, host_slice=host_slice)


def test_a_slice_needs_a_kv_layout() -> None:
    with pytest.raises(ConfigError, match="host_slice"):
        OffloadManager(1 << 20, host_slice=(0, 2))
