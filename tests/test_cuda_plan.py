"""The CUDA engine's plan, pure (no GPU): segment addresses, the chunk cutter, the pack
method's pieces and DMAs, and the choice of method.

Pack: every byte of a piece's staging slots comes from its host block, no DMA spans two
registrations, runs of consecutive host blocks merge, and the DMAs are dealt alternately
to two streams."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncpin.engines.cuda.plan import (
    SMALL_SEGMENTS,
    AddressPlan,
    PackPiece,
    choose_method,
    is_run,
    is_small,
    kernel_misalignment,
    pack_piece_counts,
)

BASE, STAGING, DEVICE = 1 << 40, 1 << 44, 1 << 46


def _plan(block: int, chunk: int, *, arrays: int = 1) -> AddressPlan:
    """Host blocks of ``block`` bytes (``arrays`` arrays of ``block // arrays``) from
    ``BASE``, registered in ``chunk``-byte spans."""
    part = block // arrays
    return AddressPlan(
        array_ptrs=[DEVICE + a * (1 << 30) for a in range(arrays)],
        array_strides=[2 * part + 8] * arrays,
        array_bytes=[part] * arrays,
        host_base=BASE,
        chunk_bytes=chunk,
    )


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
    addresses = _plan(block, chunk)
    cpu = _ids(rng, rng.randint(1, 40), 64, repeats=repeats)
    plan = addresses.piece_dmas(cpu, STAGING)
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
    addresses = _plan(64, 256)  # four blocks per chunk
    runs = _runs(addresses.piece_dmas([1, 2, 3, 4, 5, 9], STAGING))
    # Blocks 1-3 end chunk 0, 4-5 start chunk 1, 9 is alone.
    assert runs == [(BASE + 64, 192), (BASE + 256, 128), (BASE + 576, 64)]


def test_consecutive_blocks_merge_then_cut_where_blocks_straddle_chunks() -> None:
    addresses = _plan(48, 128)  # blocks 0-5 (288 bytes) cross chunk starts at 128 and 256
    runs = _runs(addresses.piece_dmas([0, 1, 2, 3, 4, 5], STAGING))
    # One run cut at the two chunk starts; block by block it would be eight DMAs.
    assert runs == [(BASE, 128), (BASE + 128, 128), (BASE + 256, 32)]


def test_a_host_block_read_twice_is_two_dmas() -> None:
    addresses = _plan(64, 1024)
    plan: Sequence[Sequence[Any]] = addresses.piece_dmas([3, 3, 4, 3], STAGING)
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


# -- the chunk cutter -------------------------------------------------------------------


def _bytes_by_chunk(ranges: list[tuple[int, int, int]], chunk: int) -> dict[int, int]:
    """Brute force: each host byte of ``ranges`` (host, other, size) mapped to its
    partner byte, checking that no range holds bytes of two chunks."""
    pairs: dict[int, int] = {}
    for h, o, z in ranges:
        assert z > 0
        assert len({(h + t - BASE) // chunk for t in range(z)}) == 1, "a range spans chunks"
        for t in range(z):
            pairs[h + t] = o + t
    return pairs


class TestChunkCutter:
    """Host ranges are cut exactly at chunk starts (from the region's base), nowhere else."""

    @pytest.mark.parametrize(
        ("start", "size", "parts"),
        [
            (0, 64, 1),  # inside one chunk
            (0, 256, 1),  # exactly one chunk
            (200, 56, 1),  # ends on a boundary
            (200, 100, 2),  # straddles one boundary
            (200, 600, 4),  # straddles three
            (256, 768, 3),  # starts on one, whole chunks
        ],
    )
    def test_ranges_straddling_boundaries(self, start: int, size: int, parts: int) -> None:
        plan = _plan(64, 256)
        host, other, sizes = plan.cut([BASE + start], [STAGING], [size])
        assert len(host) == parts and sum(sizes) == size
        ranges = list(zip(host, other, sizes, strict=True))
        expected = {BASE + start + t: STAGING + t for t in range(size)}
        assert _bytes_by_chunk(ranges, 256) == expected
        assert host == sorted(host)

    def test_blocks_that_tile_chunks_are_never_cut(self) -> None:
        plan = _plan(64, 256)
        assert plan.blocks_tile_chunks
        starts = [BASE + 64 * c for c in range(12)]
        assert plan.cut(starts, starts, [64] * 12) == (starts, starts, [64] * 12)

    @pytest.mark.parametrize("seed", range(30))
    def test_random_ranges_against_bytes(self, seed: int) -> None:
        rng = random.Random(seed)
        chunk = rng.choice([16, 48, 64, 100])
        plan = _plan(rng.choice([8, 24, 64]), chunk)
        ranges = [
            (BASE + rng.randrange(0, 600), STAGING + 1000 * i, rng.randint(1, 250))
            for i in range(rng.randint(1, 8))
        ]
        host, other, sizes = plan.cut(*(list(x) for x in zip(*ranges, strict=True)))
        cut = list(zip(host, other, sizes, strict=True))
        expected: dict[int, int] = {}
        for h, o, z in ranges:
            expected.update({h + t: o + t for t in range(z)})
        assert _bytes_by_chunk(cut, chunk) == expected
        # Each range's parts are consecutive and in order: only chunk starts cut them.
        assert all((h - BASE) % chunk == 0 for h, _, _ in cut if h not in [r[0] for r in ranges])
        # The tensor form cuts the same ranges (those that cross go last).
        t_host, t_other, t_sizes = plan.cut_tensors(
            *(torch.tensor(list(x), dtype=torch.int64) for x in zip(*ranges, strict=True))
        )
        tensor_cut = list(zip(t_host.tolist(), t_other.tolist(), t_sizes.tolist(), strict=True))
        assert sorted(tensor_cut) == sorted(cut)


# -- segment addresses --------------------------------------------------------------------


class TestSegments:
    """One definition of a segment's addresses, as lists (small jobs) or tensors."""

    @pytest.mark.parametrize("arrays", [1, 3, 16])
    def test_lists_and_tensors_agree(self, arrays: int) -> None:
        plan = _plan(64 * arrays, 1 << 20, arrays=arrays)
        rng = random.Random(arrays)
        gpu = [rng.randrange(100) for _ in range(9)]
        cpu = [rng.randrange(100) for _ in range(9)]
        device, host, sizes = plan.segments(gpu, cpu, tensors=False)
        device_t, host_t, sizes_t = plan.segments(gpu, cpu)
        assert device == device_t.tolist() and host == host_t.tolist()
        assert sizes == sizes_t.tolist() == [64] * len(host)
        # Block by block, array by array, as the kernel and the host layout define them.
        stride = 2 * 64 + 8
        assert device[:arrays] == [DEVICE + a * (1 << 30) + gpu[0] * stride for a in range(arrays)]
        assert host[:arrays] == [BASE + (cpu[0] * arrays + a) * 64 for a in range(arrays)]

    def test_small_segments_are_cut_where_blocks_straddle_chunks(self) -> None:
        plan = _plan(96, 64, arrays=2)  # 48-byte segments, 64-byte chunks
        host, device, sizes = plan.small_segments([0, 1], [0, 1])
        ranges = list(zip(host, device, sizes, strict=True))
        d, h, _ = plan.segments([0, 1], [0, 1], tensors=False)
        expected: dict[int, int] = {}
        for hh, dd in zip(h, d, strict=True):
            expected.update({hh + t: dd + t for t in range(48)})
        assert _bytes_by_chunk(ranges, 64) == expected
        assert len(ranges) > len(h)

    def test_small_means_at_most_64_segments(self) -> None:
        assert is_small(4, 16) and not is_small(5, 16) and is_small(SMALL_SEGMENTS, 1)


# -- pack pieces ----------------------------------------------------------------------------


class TestPackPieces:
    """Pieces are planned lazily, cover the job exactly, and alternate staging halves."""

    def test_a_generator_planning_each_piece_when_asked(self) -> None:
        plan = _plan(64, 256)
        calls: list[int] = []
        real = plan.piece_dmas

        def counted(cpu_ids: list[int], staging: int, arrays: range | None = None) -> Any:
            calls.append(len(cpu_ids))
            return real(cpu_ids, staging, arrays)

        plan.piece_dmas = counted  # type: ignore[method-assign]
        pieces = plan.pack_pieces(
            list(range(10)), counts=[4, 4, 2], halves=(STAGING, 0), first_half=0
        )
        assert isinstance(pieces, Iterator) and calls == []
        first = next(pieces)
        assert calls == [4] and isinstance(first, PackPiece)
        assert [p.count for p in pieces] == [4, 2] and calls == [4, 4, 2]

    @pytest.mark.parametrize("seed", range(10))
    def test_pieces_cover_the_job_through_alternate_halves(self, seed: int) -> None:
        rng = random.Random(seed)
        block, chunk = rng.choice([(64, 256), (48, 128), (96, 64)])
        plan = _plan(block, chunk)
        cpu = _ids(rng, rng.randint(1, 60), 64, repeats=bool(seed % 2))
        per_piece, first = rng.randint(1, 9), seed % 2
        counts = pack_piece_counts(
            len(cpu), per_piece, rng.randint(1, 12), small_last=bool(seed % 3)
        )
        halves = (STAGING, STAGING + (1 << 30))
        pieces = list(plan.pack_pieces(cpu, counts=counts, halves=halves, first_half=first))
        assert [p.count for p in pieces] == counts
        assert [p.lo for p in pieces] == [sum(counts[:i]) for i in range(len(counts))]
        assert [p.half for p in pieces] == [(first + i) % 2 for i in range(len(pieces))]
        for p in pieces:
            # Each piece's DMAs are the piece's blocks into its half's slots.
            source: dict[int, int] = {}
            for host, local, sizes in p.dmas:
                for h, loc, z in zip(host, local, sizes, strict=True):
                    assert (h - BASE) // chunk == (h + z - 1 - BASE) // chunk
                    source.update({loc + t: h + t for t in range(z)})
            assert source == {
                halves[p.half] + j * block + t: BASE + c * block + t
                for j, c in enumerate(cpu[p.lo : p.lo + p.count])
                for t in range(block)
            }

    @pytest.mark.parametrize("counts", [[2, 4], [2], [3, 0], [4, -1], []])
    def test_counts_that_do_not_split_the_job_are_refused(self, counts: list[int]) -> None:
        # A piece's count is how many ids the copy kernel reads: never past the job's.
        with pytest.raises(ValueError, match="do not split 3 blocks"):
            _plan(64, 256).pack_pieces([1, 2, 3], counts=counts, halves=(STAGING, 0), first_half=0)

    @pytest.mark.parametrize(
        ("n", "per_piece", "edge", "store", "load"),
        [
            (128, 64, 8, [8, 64, 56], [56, 64, 8]),  # 256 MiB of 2 MiB blocks
            (16, 64, 8, [8, 8], [8, 8]),
            (8, 64, 8, [8], [8]),
            (3, 64, 8, [3], [3]),
            (10, 4, 8, [4, 4, 2], [2, 4, 4]),  # the edge never exceeds a piece
            (7, 3, 1, [1, 3, 3], [3, 3, 1]),
            (0, 4, 2, [], []),
        ],
    )
    def test_piece_counts(
        self, n: int, per_piece: int, edge: int, store: list[int], load: list[int]
    ) -> None:
        assert pack_piece_counts(n, per_piece, edge, small_last=False) == store
        assert pack_piece_counts(n, per_piece, edge, small_last=True) == load

    @pytest.mark.parametrize("seed", range(20))
    def test_piece_counts_cover_the_job(self, seed: int) -> None:
        rng = random.Random(seed)
        n, per_piece, edge = rng.randint(1, 500), rng.randint(1, 70), rng.randint(1, 90)
        for small_last in (False, True):
            counts = pack_piece_counts(n, per_piece, edge, small_last=small_last)
            assert sum(counts) == n and all(0 < c <= per_piece for c in counts)
            edge_piece = counts[-1] if small_last else counts[0]
            assert edge_piece <= edge


# -- the choice of method -----------------------------------------------------------------


def _choose(
    requested: str,
    *,
    blocks: int = 100,
    arrays: int = 4,
    block_bytes: int = 32 << 10,
    pageable: bool = False,
    kernel: bool = True,
    staged: bool = True,
    partial: bool = False,
    runs: bool = False,
    uva: bool = True,
) -> tuple[str, int]:
    """The method chosen, and how many times staging was asked for."""
    asked: list[int] = []

    def stage() -> bool:
        asked.append(1)
        return staged

    method = choose_method(
        requested,
        num_blocks=blocks,
        num_arrays=arrays,
        block_bytes=block_bytes,
        pageable=pageable,
        kernel_usable=kernel,
        staged=stage,
        partial=partial,
        runs=lambda: runs,
        uva=uva,
    )
    return method, len(asked)


class TestChooseMethod:
    """Every branch of the method choice."""

    @pytest.mark.parametrize("requested", ["auto", "batch", "pack", "kernel"])
    def test_pageable_is_batch(self, requested: str) -> None:
        assert _choose(requested, pageable=True) == ("batch", 0)

    @pytest.mark.parametrize("requested", ["auto", "batch", "pack", "kernel"])
    def test_no_usable_kernel_is_batch(self, requested: str) -> None:
        assert _choose(requested, kernel=False) == ("batch", 0)

    def test_explicit_methods_are_kept(self) -> None:
        assert _choose("batch") == ("batch", 0)
        assert _choose("kernel") == ("kernel", 0)
        assert _choose("pack") == ("pack", 1)
        assert _choose("kernel", blocks=1) == ("kernel", 0)  # small jobs too

    def test_auto_small_is_batch(self) -> None:
        assert _choose("auto", blocks=16, arrays=4) == ("batch", 0)

    def test_without_registered_host_memory_nothing_goes_by_kernel(self) -> None:
        # The copy kernel would read host memory the device cannot address.
        assert _choose("kernel", uva=False) == ("pack", 1)
        assert _choose("kernel", staged=False, uva=False) == ("batch", 1)
        assert _choose("auto", partial=True, uva=False) == ("pack", 1)
        assert _choose("auto", blocks=1, arrays=64, runs=True, uva=False) == ("batch", 0)
        assert _choose("pack", uva=False) == ("pack", 1)

    def test_auto_small_runs_of_small_blocks_are_kernel(self) -> None:
        assert _choose("auto", blocks=1, arrays=64, runs=True) == ("kernel", 0)
        assert _choose("auto", blocks=16, arrays=4, runs=True) == ("kernel", 0)
        # Not with blocks of 1 MiB and more, nor without a usable kernel, nor if not small.
        assert _choose("auto", blocks=1, block_bytes=1 << 20, runs=True) == ("batch", 0)
        assert _choose("auto", blocks=1, kernel=False, runs=True) == ("batch", 0)
        assert _choose("auto", blocks=17, arrays=4, runs=True) == ("pack", 1)
        assert _choose("auto", blocks=1, pageable=True, runs=True) == ("batch", 0)

    def test_auto_large_blocks_is_batch(self) -> None:
        assert _choose("auto", block_bytes=1 << 20) == ("batch", 0)

    def test_auto_small_blocks_is_pack(self) -> None:
        assert _choose("auto", block_bytes=(1 << 20) - 8) == ("pack", 1)

    def test_auto_part_of_the_arrays_is_kernel(self) -> None:
        # A layer's group: its host bytes are a strided piece per block, which pack
        # would queue one DMA each; the kernel reads them in one launch.
        assert _choose("auto", partial=True) == ("kernel", 0)
        assert _choose("auto", partial=True, blocks=16, arrays=4) == ("batch", 0)  # small
        assert _choose("auto", partial=True, block_bytes=1 << 20) == ("batch", 0)
        assert _choose("auto", partial=True, kernel=False) == ("batch", 0)
        assert _choose("pack", partial=True) == ("pack", 1)  # asked for: kept

    def test_pack_without_staging_is_batch(self) -> None:
        assert _choose("pack", staged=False) == ("batch", 1)
        assert _choose("auto", staged=False) == ("batch", 1)

    def test_an_empty_pack_job_asks_for_no_staging(self) -> None:
        assert _choose("pack", blocks=0, staged=False) == ("pack", 0)


# -- arrays of different sizes, and ranges of arrays ------------------------------------


def _mixed_plan(sizes: list[int], chunk: int, rank: int = 0, ranks: int = 1) -> AddressPlan:
    """Rank ``rank`` of ``ranks`` sharing the region's host blocks (``host_slice``)."""
    return AddressPlan(
        array_ptrs=[DEVICE + a * (1 << 30) for a in range(len(sizes))],
        array_strides=[s + 8 for s in sizes],
        array_bytes=sizes,
        host_base=BASE + rank * sum(sizes),
        chunk_bytes=chunk,
        host_stride=ranks * sum(sizes),
        region_base=BASE,
    )


@pytest.mark.parametrize("seed", range(16))
def test_ranges_of_mixed_arrays_move_exactly_their_bytes(seed: int) -> None:
    """The host bytes of (block, array) pairs, by brute force: array ``a`` of host block
    ``c`` of rank ``r`` (of ``ranks``) lies at ``(c * ranks + r) * sum(sizes) +
    sum(sizes[:a])``. Segments (lists and tensors) and a pack piece's DMAs to staging
    slots of the range's span move exactly those bytes, cut at chunk boundaries counted
    from the region's start."""
    rng = random.Random(seed)
    sizes = [rng.choice([8, 24, 40, 136, 576]) for _ in range(rng.randint(1, 6))]
    ranks = rng.choice([1, 1, 2, 4])
    rank = rng.randrange(ranks)
    chunk = rng.choice([64, 256, 4096, sum(sizes) * 2 * ranks])
    plan = _mixed_plan(sizes, chunk, rank, ranks)
    lo = rng.randrange(len(sizes))
    arrays = range(lo, rng.randint(lo + 1, len(sizes)))
    n = rng.randint(1, 12)
    gpu, cpu = rng.sample(range(50), n), _ids(rng, n, 40, repeats=False)
    hb = sum(sizes)
    first = rank * hb  # the rank's part of host block 0
    offset = sum(sizes[: arrays.start])
    span = sum(sizes[arrays.start : arrays.stop])
    assert plan.span(arrays) == (offset, span)

    expected: dict[int, int] = {}  # host byte -> device byte
    for g, c in zip(gpu, cpu, strict=True):
        for a in arrays:
            for t in range(sizes[a]):
                expected[BASE + c * hb * ranks + first + sum(sizes[:a]) + t] = (
                    DEVICE + a * (1 << 30) + g * (sizes[a] + 8) + t
                )
    device, host, lengths = plan.segments(gpu, cpu, arrays, tensors=False)
    device_t, host_t, lengths_t = plan.segments(gpu, cpu, arrays)
    assert (device, host, lengths) == (device_t.tolist(), host_t.tolist(), lengths_t.tolist())
    small = plan.small_segments(gpu, cpu, arrays)
    assert _bytes_by_chunk(list(zip(*small, strict=True)), chunk) == expected

    # Pack: host span of block c -> slot j of ``span`` bytes.
    moved: dict[int, int] = {}
    for host_a, local_a, sizes_a in plan.piece_dmas(cpu, STAGING, arrays):
        ranges = list(zip(host_a, local_a, sizes_a, strict=True))
        moved.update(_bytes_by_chunk(ranges, chunk))
    assert moved == {
        BASE + c * hb * ranks + first + offset + t: STAGING + j * span + t
        for j, c in enumerate(cpu)
        for t in range(span)
    }


def test_the_kernel_is_refused_for_an_array_of_a_size_not_in_words() -> None:
    ptrs, strides = [DEVICE, DEVICE + (1 << 30)], [4096, 4096]
    assert (
        kernel_misalignment(
            array_ptrs=ptrs, array_strides=strides, array_bytes=[576, 136], host_bases=[BASE]
        )
        is None
    )
    verdict = kernel_misalignment(
        array_ptrs=ptrs, array_strides=strides, array_bytes=[576, 134], host_bases=[BASE]
    )
    assert verdict is not None and "array 1's block size" in verdict


class TestIdsOnDevice:
    """The device ids a copy kernel reads: a list that is a run of consecutive ids (one
    block always is) is a slice of the table 0, 1, 2, ... (no upload); the others are
    uploaded, back to back, into the lane's buffer in one call on its kernel stream."""

    @staticmethod
    def _methods() -> tuple[Any, Any, list[tuple[int, list[int], int]]]:
        from asyncpin.engines.cuda.methods import CopyMethods

        uploads: list[tuple[int, list[int], int]] = []
        rt = SimpleNamespace(
            batch=object(),
            upload=lambda dst, src, stream: uploads.append((dst, src.tolist(), stream)),
        )
        copies = CopyMethods(rt, _plan(64, 1 << 20), None)  # type: ignore[arg-type]
        copies.to_device(torch.device("cpu"), 100)
        lane = SimpleNamespace(
            ids=torch.empty(200, dtype=torch.int64), kernel=SimpleNamespace(cuda_stream=77)
        )
        return copies, lane, uploads

    @pytest.mark.parametrize(
        "lists",
        [[[7], [0]], [[99], [99]], [[3, 4], [10, 11]], [list(range(5, 37)), list(range(60, 92))]],
    )
    def test_runs_are_table_slices(self, lists: list[list[int]]) -> None:
        copies, lane, uploads = self._methods()
        addresses = copies.ids_on_device(lane, lists)
        table = copies._identity
        for address, ids in zip(addresses, lists, strict=True):
            at = (address - table.data_ptr()) // 8
            assert table[at : at + len(ids)].tolist() == ids
        assert uploads == []

    @pytest.mark.parametrize(
        ("first", "second"),
        [
            ([3, 5], [0, 1]),  # a gap
            ([4, 3], [0, 1]),  # descending
            ([0, 1], [2, 2]),  # a repeat
            ([1, 3, 3], [0, 1, 2]),  # ends match a run, the middle does not
            ([0, 1, 2], [0, 2, 2]),
            ([2, 1, 2], [5, 6, 7]),
            ([3, 5], [2, 2, 9]),  # neither: both uploaded, the second after the first
        ],
    )
    def test_other_lists_are_uploaded_back_to_back(
        self, first: list[int], second: list[int]
    ) -> None:
        copies, lane, uploads = self._methods()
        addresses = copies.ids_on_device(lane, [first, second])
        base = lane.ids.data_ptr()
        sent = [ids for ids in (first, second) if not is_run(ids)]
        assert uploads == [(base, [i for ids in sent for i in ids], 77)]
        at = base
        for address, ids in zip(addresses, (first, second), strict=True):
            if is_run(ids):
                assert address == copies._identity.data_ptr() + 8 * ids[0]
            else:
                assert address == at
                at += 8 * len(ids)

    def test_one_list(self) -> None:
        copies, lane, uploads = self._methods()
        assert copies.ids_on_device(lane, [[9, 2, 5]]) == [lane.ids.data_ptr()]
        assert uploads == [(lane.ids.data_ptr(), [9, 2, 5], 77)]


@pytest.mark.parametrize(
    ("ids", "run"),
    [
        ([5], True),
        ([5, 6], True),
        ([0, 1, 2, 3], True),
        ([6, 5], False),
        ([1, 3], False),
        ([2, 2], False),
        ([1, 3, 3], False),
        ([1, 1, 3], False),
        ([0, 2, 1, 3], False),
    ],
)
def test_is_run(ids: list[int], run: bool) -> None:
    assert is_run(ids) is run


class TestLaunchArguments:
    """``CopyMethods.launch`` hands the copy kernel its PTX parameters, in their order,
    as 64-bit integers: a mismatch would read garbage addresses on the device."""

    @staticmethod
    def _params() -> list[str]:
        from asyncpin.engines.cuda.kernel import KV_COPY_PTX

        return re.findall(r"\.param \.u64 (\w+)", KV_COPY_PTX)

    @pytest.mark.parametrize("slot", [False, True])
    @pytest.mark.parametrize("to_host", [True, False])
    def test_arguments_follow_the_kernel_parameters(self, slot: bool, to_host: bool) -> None:
        from asyncpin.engines.cuda.methods import CopyMethods

        launches: list[tuple[Any, ...]] = []

        class Kernel:
            def launch(self, stream: int, grid: int, args: Any, *, to_host: bool) -> None:
                launches.append((stream, grid, args, to_host))

        plan = _plan(64 * 4, 1 << 20, arrays=4)
        copies = CopyMethods(object(), plan, Kernel())  # type: ignore[arg-type]
        copies.to_device(torch.device("cpu"), 16)
        gpu, cpu = 0x7000_0000, 0x7100_0000  # the ids' device addresses
        stream = SimpleNamespace(cuda_stream=1234)
        copies.launch(
            stream,  # type: ignore[arg-type]
            gpu,
            cpu,
            3,
            BASE + 4096,
            to_host=to_host,
            ctas=2,
            arrays=range(1, 3),
            slot=slot,
        )
        [(on, grid, args, direction)] = launches
        assert (on, grid, direction) == (1234, 2, to_host)
        params = self._params()
        assert params[-1] == "to_host" and len(args) == len(params) - 1
        given = dict(zip(params, args, strict=False))
        tables = copies._tables
        offset, stride = plan.span(range(1, 3)) if slot else (0, plan.host_stride)
        assert given == {
            "gpu_ids": gpu,
            "cpu_ids": cpu,
            "array_ptrs": tables[0].data_ptr(),
            "array_strides": tables[1].data_ptr(),
            "array_words": tables[2].data_ptr(),
            "array_offsets": tables[3].data_ptr(),
            "host_base": BASE + 4096 - offset,
            "host_stride": stride,
            "first_array": 1,
            "n_segments": 3 * 2,
            "n_arrays": 2,
        }
        assert tables[2].tolist() == [8] * 4  # each array's 64-byte block: 8 words
        assert all(isinstance(v, int) for v in args)
        copies.release()
        assert copies._tables == () and copies._table_ptrs == ()


class TestCopyKernelCalls:
    """``CopyKernel`` over a stand-in libcudart: what reaches ``cudaLaunchKernel``
    through the ``void**`` parameter array, and a failed load."""

    @staticmethod
    def _runtime(monkeypatch: pytest.MonkeyPatch, *, load_code: int = 0) -> Any:
        import ctypes

        import asyncpin.engines.cuda.kernel as kernel_module
        from asyncpin._cudart import Runtime

        monkeypatch.setattr(kernel_module, "_loaded", {})
        launches: list[tuple[int, int, int, list[int], int, int]] = []

        def load(library: Any, code: Any, *rest: Any) -> int:
            ctypes.cast(library, ctypes.POINTER(ctypes.c_void_p))[0] = 0x1000
            return load_code

        def get_kernel(kernel: Any, library: Any, name: bytes) -> int:
            assert name == b"kv_copy"
            ctypes.cast(kernel, ctypes.POINTER(ctypes.c_void_p))[0] = 0x2000
            return 0

        def launch(
            kernel: int, grid: Any, block: Any, params: Any, shared: int, stream: int
        ) -> int:
            values = [ctypes.c_uint64.from_address(params[k]).value for k in range(12)]
            launches.append((kernel, grid.x, block.x, values, shared, stream))
            return 0

        lib = SimpleNamespace(
            cudaLibraryLoadData=load,
            cudaLibraryGetKernel=get_kernel,
            cudaLaunchKernel=launch,
            cudaGetLastError=lambda: 0,
            cudaGetErrorName=lambda code: b"cudaErrorInvalidPtx",
            cudaGetErrorString=lambda code: b"a PTX JIT compilation failed",
        )
        rt = Runtime.__new__(Runtime)
        rt.lib, rt.version = lib, 13000  # type: ignore[assignment]
        rt.launches = launches  # type: ignore[attr-defined]
        return rt

    @pytest.mark.parametrize("to_host", [True, False])
    def test_every_parameter_reaches_the_launch(
        self, monkeypatch: pytest.MonkeyPatch, to_host: bool
    ) -> None:
        from asyncpin.engines.cuda.kernel import THREADS, CopyKernel, kernel_available

        rt = self._runtime(monkeypatch)
        assert kernel_available(rt)
        kernel = CopyKernel(rt)
        args = (11, 12, 13, 14, 15, 16, -4096, 17, 18, 19, 20)  # a base below an offset
        kernel.launch(77, 5, args, to_host=to_host)
        [(handle, grid, threads, values, shared, stream)] = rt.launches
        assert (handle, grid, threads, shared, stream) == (0x2000, 5, THREADS, 0, 77)
        assert values == [*args[:6], 2**64 - 4096, *args[7:], int(to_host)]

    @pytest.mark.parametrize("count", [0, 10, 12])
    def test_a_wrong_argument_count_is_refused(
        self, monkeypatch: pytest.MonkeyPatch, count: int
    ) -> None:
        from asyncpin.engines.cuda.kernel import CopyKernel

        rt = self._runtime(monkeypatch)
        with pytest.raises(ValueError, match="11 arguments"):
            CopyKernel(rt).launch(1, 1, tuple(range(count)), to_host=True)
        assert rt.launches == []

    def test_a_failed_load_raises_the_runtime_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from asyncpin.engines.cuda.kernel import CopyKernel
        from asyncpin.errors import BackendCallError

        rt = self._runtime(monkeypatch, load_code=218)
        with pytest.raises(BackendCallError, match="cudaErrorInvalidPtx"):
            CopyKernel(rt)

    def test_a_runtime_before_12_has_no_kernel(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from asyncpin.engines.cuda.kernel import kernel_available
        from asyncpin.engines.cuda.methods import load_kernel

        rt = self._runtime(monkeypatch)
        rt.version = 11080
        assert not kernel_available(rt) and load_kernel(rt) is None
        del rt.lib.cudaLibraryLoadData
        rt.version = 13000
        assert not kernel_available(rt)
