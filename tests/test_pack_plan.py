"""The pack method's DMA plan (pure Python, so it runs without a GPU): every byte of a
piece's host blocks maps to its staging slot, no DMA spans two registrations, runs of
consecutive host blocks merge, and the DMAs are dealt alternately to two streams."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from asyncpin.cuda_transfers import CudaTransferEngine

BASE, STAGING = 1 << 40, 1 << 44


def _engine(block: int, chunk: int) -> CudaTransferEngine:
    engine = CudaTransferEngine.__new__(CudaTransferEngine)
    engine._layout = SimpleNamespace(host_block_bytes=block)  # type: ignore[assignment]
    engine._host_base = BASE
    engine._chunk_bytes = chunk
    engine._blocks_tile_chunks = chunk % block == 0
    return engine


def _ids(rng: random.Random, n: int, limit: int) -> list[int]:
    """Distinct host ids with some runs of consecutive blocks."""
    ids: list[int] = []
    free = list(range(limit))
    rng.shuffle(free)
    taken: set[int] = set()
    for start in free:
        for c in range(start, min(start + rng.choice([1, 1, 3, 9]), limit)):
            if len(ids) < n and c not in taken:
                ids.append(c)
                taken.add(c)
    return ids


@pytest.mark.parametrize(
    ("block", "chunk"),
    [(64, 256), (64, 64), (48, 128), (96, 64)],
    ids=["blocks tile chunks", "block = chunk", "blocks straddle chunks", "block > chunk"],
)
@pytest.mark.parametrize("seed", range(5))
def test_every_byte_lands_in_its_slot(block: int, chunk: int, seed: int) -> None:
    rng = random.Random(seed)
    engine = _engine(block, chunk)
    cpu = _ids(rng, rng.randint(1, 40), 64)
    plan = engine._piece_dmas(cpu, STAGING)
    assert len(plan) == 2
    moved: dict[int, int] = {}
    dmas = []
    for host, local, sizes in plan:
        assert len(host) == len(local) == len(sizes)
        dmas.append(list(zip(host, local, sizes, strict=True)))
        for h, loc, z in zip(host, local, sizes, strict=True):
            assert z > 0
            assert (h - BASE) // chunk == (h + z - 1 - BASE) // chunk, "a DMA spans two chunks"
            for t in range(z):
                assert h + t not in moved, "a host byte is copied twice"
                moved[h + t] = loc + t
    expected = {
        BASE + c * block + t: STAGING + j * block + t
        for j, c in enumerate(cpu)
        for t in range(block)
    }
    assert moved == expected
    # Dealt alternately: stream 0 has the 1st, 3rd, ... DMA of the piece, in slot order.
    pairs = zip(dmas[0], dmas[1], strict=False)
    merged = [d for pair in pairs for d in pair] + dmas[0][len(dmas[1]) :]
    assert len(dmas[0]) - len(dmas[1]) in (0, 1)
    assert [loc for _, loc, _ in merged] == sorted(loc for _, loc, _ in merged)


def test_consecutive_blocks_merge_up_to_a_chunk_boundary() -> None:
    engine = _engine(64, 256)  # four blocks per chunk
    host, _, sizes = engine._piece_dmas([1, 2, 3, 4, 5, 9], STAGING)[0]
    other = engine._piece_dmas([1, 2, 3, 4, 5, 9], STAGING)[1]
    runs = sorted(zip(list(host) + list(other[0]), list(sizes) + list(other[2]), strict=True))
    # Blocks 1-3 end chunk 0, 4-5 start chunk 1, 9 is alone.
    assert runs == [(BASE + 64, 192), (BASE + 256, 128), (BASE + 576, 64)]
