"""The pack method's DMA plan (pure Python, so it runs without a GPU): every byte of a
piece's staging slots comes from its host block, no DMA spans two registrations, runs of
consecutive host blocks merge, and the DMAs are dealt alternately to two streams."""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from asyncpin.engines.cuda import CudaTransferEngine

BASE, STAGING = 1 << 40, 1 << 44


def _engine(block: int, chunk: int) -> CudaTransferEngine:
    engine = CudaTransferEngine.__new__(CudaTransferEngine)
    engine._layout = SimpleNamespace(host_block_bytes=block)  # type: ignore[assignment]
    engine._host_base = BASE
    engine._chunk_bytes = chunk
    engine._blocks_tile_chunks = chunk % block == 0
    return engine


def _ids(rng: random.Random, n: int, limit: int, *, repeats: bool) -> list[int]:
    """Host ids with some runs of consecutive blocks. A load's may repeat (only its device
    destinations must be distinct); a store's may not."""
    ids: list[int] = []
    free = list(range(limit))
    rng.shuffle(free)
    taken: set[int] = set()
    for start in free:
        for c in range(start, min(start + rng.choice([1, 1, 3, 9]), limit)):
            if len(ids) < n and (repeats or c not in taken):
                ids.append(c)
                taken.add(c)
        if repeats and ids and rng.random() < 0.2:
            ids.append(rng.choice(ids))  # the same host block read again
    return ids[:n]


@pytest.mark.parametrize(
    ("block", "chunk"),
    [(64, 256), (64, 64), (48, 128), (96, 64)],
    ids=["blocks tile chunks", "block = chunk", "blocks straddle chunks", "block > chunk"],
)
@pytest.mark.parametrize("repeats", [False, True], ids=["store ids", "load ids"])
@pytest.mark.parametrize("seed", range(5))
def test_every_byte_lands_in_its_slot(block: int, chunk: int, repeats: bool, seed: int) -> None:
    rng = random.Random(seed)
    engine = _engine(block, chunk)
    cpu = _ids(rng, rng.randint(1, 40), 64, repeats=repeats)
    plan = engine._piece_dmas(cpu, STAGING)
    assert len(plan) == 2
    source: dict[int, int] = {}  # staging byte -> the host byte it is copied with
    dmas = []
    for host, local, sizes in plan:
        assert len(host) == len(local) == len(sizes)
        dmas.append(list(zip(host, local, sizes, strict=True)))
        for h, loc, z in zip(host, local, sizes, strict=True):
            assert z > 0
            assert (h - BASE) // chunk == (h + z - 1 - BASE) // chunk, "a DMA spans two chunks"
            for t in range(z):
                assert loc + t not in source, "a staging byte is copied twice"
                source[loc + t] = h + t
    expected = {
        STAGING + j * block + t: BASE + c * block + t
        for j, c in enumerate(cpu)
        for t in range(block)
    }
    assert source == expected
    # Dealt alternately: stream 0 has the 1st, 3rd, ... DMA of the piece, in slot order.
    pairs = zip(dmas[0], dmas[1], strict=False)
    merged = [d for pair in pairs for d in pair] + dmas[0][len(dmas[1]) :]
    assert len(dmas[0]) - len(dmas[1]) in (0, 1)
    assert [loc for _, loc, _ in merged] == sorted(loc for _, loc, _ in merged)


def _runs(plan: Sequence[Sequence[Any]]) -> list[tuple[int, int]]:
    return sorted((h, z) for host, _, sizes in plan for h, z in zip(host, sizes, strict=True))


def test_consecutive_blocks_merge_up_to_a_chunk_boundary() -> None:
    engine = _engine(64, 256)  # four blocks per chunk
    runs = _runs(engine._piece_dmas([1, 2, 3, 4, 5, 9], STAGING))
    # Blocks 1-3 end chunk 0, 4-5 start chunk 1, 9 is alone.
    assert runs == [(BASE + 64, 192), (BASE + 256, 128), (BASE + 576, 64)]


def test_consecutive_blocks_merge_then_cut_where_blocks_straddle_chunks() -> None:
    engine = _engine(48, 128)  # blocks 0-5 (288 bytes) cross chunk starts at 128 and 256
    runs = _runs(engine._piece_dmas([0, 1, 2, 3, 4, 5], STAGING))
    # One run cut at the two chunk starts; block by block it would be eight DMAs.
    assert runs == [(BASE, 128), (BASE + 128, 128), (BASE + 256, 32)]


def test_a_host_block_read_twice_is_two_dmas() -> None:
    engine = _engine(64, 1024)
    plan: Sequence[Sequence[Any]] = engine._piece_dmas([3, 3, 4, 3], STAGING)
    dmas = sorted(
        (loc, h, z)
        for host, local, sizes in plan
        for h, loc, z in zip(host, local, sizes, strict=True)
    )
    # Slot 0 <- block 3; slots 1-2 <- blocks 3-4 (one run); slot 3 <- block 3 again.
    assert dmas == [
        (STAGING, BASE + 192, 64),
        (STAGING + 64, BASE + 192, 128),
        (STAGING + 192, BASE + 192, 64),
    ]
