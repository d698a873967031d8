"""The CUDA engine's plan, pure: addresses, chunk cuts, pack pieces and the method a job
runs with, from ints and lists (torch CPU tensors for large jobs). No CUDA call is made
here, so that every piece is tested without a GPU.

The copy kernel moves 8-byte words (``KERNEL_WORD``). A misaligned access faults with
cudaErrorMisalignedAddress, an error that poisons the CUDA context for the rest of the
process, so the kernel runs only on a layout where every address it computes (each
array's base, its block stride, the block size and so every host block and staging slot)
is a multiple of the word (``kernel_misalignment``, decided when the engine is made). On
any other layout (device arrays that start a few bytes into a buffer, say) ``auto`` is
``batch``, and an explicit ``pack`` or ``kernel`` runs as ``batch`` (DMA copies any
alignment): ``Transfer.method`` says so, and the first such request per method is logged.

A DMA must not span two registrations (the driver answers cudaErrorInvalidValue): host
ranges are cut at chunk boundaries (``chunk_bytes`` spans from the region's start) by one
cutter, ``AddressPlan.cut``, whichever method plans them.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, overload

import torch

__all__ = [
    "BATCH_MIN_BLOCK_BYTES",
    "KERNEL_WORD",
    "SMALL_SEGMENTS",
    "AddressPlan",
    "PackPiece",
    "choose_method",
    "is_small",
    "kernel_misalignment",
    "pack_piece_counts",
]

# Bytes the copy kernel moves per load and store (int64 words): see kernel_misalignment.
KERNEL_WORD = 8
# From here on one DMA per segment is as fast as packing (H200, run 42: 2 MiB stores batch
# 53.4 GB/s, pack 53.8; at 256 KiB batch 47.5, pack 53.6):
# bench/RESULTS.md#transfers-by-block-size.
BATCH_MIN_BLOCK_BYTES = 1 << 20
# Up to this many segments (one block of a 32-layer K/V layout) a transfer is submitted
# with plain-Python addresses, one batched DMA call and one stream: every torch op on a
# CPU tensor would cost more than the copy's own submission.
SMALL_SEGMENTS = 64
# A store of at most this many blocks (and 64 MiB) by pack or kernel is queued on the
# event loop: a few hundred microseconds of driver calls, whatever the block's arrays.
LOOP_STORE_MAX_BLOCKS = 64

# (host, other, sizes) address arrays for each of the two DMA streams.
StreamDmas = list[tuple["array.array[int]", "array.array[int]", "array.array[int]"]]


def kernel_misalignment(
    *,
    array_ptrs: Sequence[int],
    array_strides: Sequence[int],
    array_bytes: Sequence[int],
    host_bases: Sequence[int],
    host_stride: int = 0,
    word: int = KERNEL_WORD,
) -> str | None:
    """Why the copy kernel must not run on this layout, or None when it may.

    The kernel reads and writes ``word``-byte words at ``array_ptrs[a] + g *
    array_strides[a] + k * word`` on the device and ``base + c * stride + offset[a] + k *
    word`` on the host side (``base``: the pinned region, or a pack staging half;
    ``stride``: the host block, or a staging slot of a range of arrays; ``offset[a]``: the
    sum of the block sizes of the arrays before ``a``), for any block ``g``, host block or
    slot ``c``, array ``a``. Every one is a multiple of ``word`` exactly when each term
    is: each array's base address, block stride (bytes) and block size (so that blocks
    are whole words, and the offsets and strides above, sums of block sizes, are too),
    each host base and the host block stride. A pure function of addresses, so that it
    is tested without a GPU."""
    checks: list[tuple[str, int]] = []
    for a, (ptr, stride, size) in enumerate(
        zip(array_ptrs, array_strides, array_bytes, strict=True)
    ):
        checks += [
            (f"array {a}'s block size", size),
            (f"device array {a}'s address", ptr),
            (f"device array {a}'s block stride", stride),
        ]
    checks += [(f"host base {n}", base) for n, base in enumerate(host_bases)]
    checks.append(("host block stride", host_stride))  # ranks' host blocks side by side
    for what, value in checks:
        if value % word:
            return f"{what} ({value:#x}) is not a multiple of the copy kernel's {word}-byte word"
    return None


def is_small(num_blocks: int, num_arrays: int) -> bool:
    """Whether a job takes the small path (``SMALL_SEGMENTS`` segments at most)."""
    return num_blocks * num_arrays <= SMALL_SEGMENTS


def is_run(ids: list[int]) -> bool:
    """Whether ``ids`` (not empty) are consecutive and ascending: ``a, a + 1, ...``."""
    n, a = len(ids), ids[0]
    if ids[-1] - a != n - 1:
        return False
    return n <= 2 or ids == list(range(a, a + n))


def choose_method(
    requested: str,
    *,
    num_blocks: int,
    num_arrays: int,
    block_bytes: int,
    pageable: bool,
    kernel_usable: bool,
    staged: Callable[[], bool],
    partial: bool = False,
    runs: Callable[[], bool] = lambda: False,
    uva: bool = True,
) -> str:
    """The method a job runs with. Never the copy kernel (pack, kernel) unless
    ``kernel_usable`` (the kernel is loaded and the layout is safe for it: a misaligned
    access would end the process's CUDA context). ``staged()`` says whether the direction's pack
    staging exists or could be made now; it is asked only for a pack job that moves
    blocks. ``partial``: the job moves some of the arrays (a layer's group): under auto, small
    blocks of it go by the copy kernel, not pack, since such a job's host bytes are one
    strided piece per block and pack would plan and queue a DMA for each (H200: 32 groups of
    2048 blocks took 136 ms of CPU to queue by pack, 25 ms by kernel; the GPU moved them at
    55 and 51 GB/s): bench/RESULTS.md#layerwise. ``runs()`` says whether both id lists
    are runs of consecutive ids (one block always is): such a small job of small blocks goes
    by the copy kernel, its ids read from a table on the device (one launch: a one-block
    Llama store resumed after 197 us at p50, against 237 us for 64 DMAs in one batched
    call, on the H200: bench/RESULTS.md#await-latency). ``uva``: the host chunks are
    registered with CUDA, so the copy kernel may read and write them (``kernel``); if not,
    a job that would go by it goes by pack (whose kernel touches device memory only)."""
    if pageable or not kernel_usable:
        return "batch"
    if requested != "auto":
        method = requested
    elif is_small(num_blocks, num_arrays):
        if uva and num_blocks and block_bytes < BATCH_MIN_BLOCK_BYTES and runs():
            return "kernel"
        return "batch"
    elif block_bytes >= BATCH_MIN_BLOCK_BYTES:
        method = "batch"
    else:
        method = "kernel" if partial else "pack"
    if method == "kernel" and not uva:
        method = "pack"
    if method == "pack" and num_blocks and not staged():
        return "batch"
    return method


def pack_piece_counts(n: int, per_piece: int, edge: int, *, small_last: bool) -> list[int]:
    """How many blocks each piece of a pack job of ``n`` blocks moves: ``per_piece`` at
    most, and the first piece (a store's) or the last (``small_last``: a load's) at most
    ``edge``. The copy kernel's part of that piece is the one no DMA overlaps: a store's
    DMAs begin once the first piece is gathered, a load ends once the last piece is
    scattered (H200: 158 us for 64 blocks of 2 MiB, against 5 ms for the job's DMAs)."""
    if n <= 0:
        return []
    first = min(n, edge, per_piece)
    counts = [first] + [min(per_piece, n - lo) for lo in range(first, n, per_piece)]
    return counts[::-1] if small_last else counts


@dataclass(frozen=True, eq=False)
class PackPiece:
    """One piece of a pack job: blocks ``[lo, lo + count)`` of the job through staging
    half ``half``, moved by ``dmas`` (host, staging, sizes per DMA stream)."""

    lo: int
    count: int
    half: int
    dmas: StreamDmas


class AddressPlan:
    """The addresses of one layout over one host region: segments, chunk cuts, pack DMAs.

    Segment ``(g, a)`` (device block ``g`` of array ``a``, ``array_bytes[a]`` bytes) lies
    at ``array_ptrs[a] + g * array_strides[a]`` on the device; host block ``c``'s copy of
    it at ``host_base + c * host_stride + offsets[a]`` (block-major: every array's block
    back to back, in order; ``host_stride`` is ``host_block_bytes`` unless the region
    interleaves several ranks' host blocks). A job may move a range of consecutive arrays
    only: its part of a host block is then one span, ``span(arrays)``. Registrations
    (chunks) are ``chunk_bytes`` spans from ``region_base`` (``host_base`` by default)."""

    def __init__(
        self,
        *,
        array_ptrs: Sequence[int],
        array_strides: Sequence[int],
        array_bytes: Sequence[int],
        host_base: int,
        chunk_bytes: int,
        host_stride: int | None = None,
        region_base: int | None = None,
    ) -> None:
        self.num_arrays = len(array_ptrs)
        self.array_bytes = list(array_bytes)
        self.offsets = [sum(self.array_bytes[:a]) for a in range(self.num_arrays)]
        self.host_block_bytes = sum(self.array_bytes)
        self.all_arrays = range(self.num_arrays)
        self.host_stride = self.host_block_bytes if host_stride is None else host_stride
        self.host_base = host_base
        self.region_base = host_base if region_base is None else region_base
        self.chunk_bytes = chunk_bytes
        # Host blocks (every rank's part of one) start at the region's start, as chunks do:
        # no block crosses a registration boundary when they tile chunks.
        self.blocks_tile_chunks = chunk_bytes % self.host_stride == 0
        # The same table two ways: python (small transfers) and CPU tensors.
        self._arrays = list(
            zip(array_ptrs, array_strides, self.offsets, self.array_bytes, strict=True)
        )
        self.ptrs_cpu = torch.tensor(list(array_ptrs), dtype=torch.int64)
        self.strides_cpu = torch.tensor(list(array_strides), dtype=torch.int64)
        self.offsets_cpu = torch.tensor(self.offsets, dtype=torch.int64)
        self.bytes_cpu = torch.tensor(self.array_bytes, dtype=torch.int64)

    def span(self, arrays: range) -> tuple[int, int]:
        """``(offset, nbytes)`` of a range of arrays within a host block."""
        return self.offsets[arrays.start], sum(self.array_bytes[arrays.start : arrays.stop])

    def mean_block_bytes(self, arrays: range) -> int:
        """The mean size of a segment of ``arrays`` (what the choice of method goes by)."""
        return self.span(arrays)[1] // len(arrays)

    # -- segments ---------------------------------------------------------------------

    @overload
    def segments(
        self,
        gpu_ids: list[int],
        cpu_ids: list[int],
        arrays: range | None = ...,
        *,
        tensors: Literal[True] = ...,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    @overload
    def segments(
        self,
        gpu_ids: list[int],
        cpu_ids: list[int],
        arrays: range | None = ...,
        *,
        tensors: Literal[False],
    ) -> tuple[list[int], list[int], list[int]]: ...

    def segments(
        self,
        gpu_ids: list[int],
        cpu_ids: list[int],
        arrays: range | None = None,
        *,
        tensors: bool = True,
    ) -> tuple[list[int], list[int], list[int]] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device addresses, host addresses and sizes of every (block, array) segment of
        ``arrays`` (all by default), block by block: as int64 CPU tensors, or
        (``tensors=False``, for small jobs: a torch op costs microseconds) as plain
        lists."""
        arrays = self.all_arrays if arrays is None else arrays
        if not tensors:
            base, block = self.host_base, self.host_stride
            table = self._arrays[arrays.start : arrays.stop]
            device = [p + g * stride for g in gpu_ids for p, stride, _, _ in table]
            host = [base + c * block + off for c in cpu_ids for _, _, off, _ in table]
            return device, host, [size for _ in cpu_ids for _, _, _, size in table]
        part = slice(arrays.start, arrays.stop)
        g = torch.tensor(gpu_ids, dtype=torch.int64)[:, None]
        c = torch.tensor(cpu_ids, dtype=torch.int64)[:, None]
        device_t = (self.ptrs_cpu[None, part] + g * self.strides_cpu[None, part]).reshape(-1)
        host_t = (self.host_base + c * self.host_stride + self.offsets_cpu[None, part]).reshape(-1)
        sizes = self.bytes_cpu[part].repeat(len(cpu_ids))
        return device_t, host_t, sizes

    def small_segments(
        self, gpu_ids: list[int], cpu_ids: list[int], arrays: range | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        """A small job's (host, device, sizes) lists, cut at chunk boundaries."""
        device, host, sizes = self.segments(gpu_ids, cpu_ids, arrays, tensors=False)
        if self.blocks_tile_chunks:
            return host, device, sizes
        return self.cut(host, device, sizes)

    # -- chunk cuts -------------------------------------------------------------------

    def _cut_range(self, h: int, o: int, z: int) -> Iterator[tuple[int, int, int]]:
        """Range ``[h, h + z)`` of the region (and its partner at ``o``) cut at chunk
        boundaries."""
        base, chunk = self.region_base, self.chunk_bytes
        while z > 0:
            part = min(z, base + ((h - base) // chunk + 1) * chunk - h)
            yield h, o, part
            h, o, z = h + part, o + part, z - part

    def cut(
        self, host: list[int], other: list[int], sizes: list[int]
    ) -> tuple[list[int], list[int], list[int]]:
        """Host ranges (and their partners) cut at chunk boundaries, in order."""
        parts = [
            p for h, o, z in zip(host, other, sizes, strict=True) for p in self._cut_range(h, o, z)
        ]
        return [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]

    def cut_tensors(
        self, host: torch.Tensor, other: torch.Tensor, sizes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``cut`` for int64 tensors: the ranges that cross a boundary go last, in parts."""
        base, chunk = self.region_base, self.chunk_bytes
        crosses = (host - base) // chunk != (host + sizes - 1 - base) // chunk
        if not bool(crosses.any()):
            return host, other, sizes
        parts = self.cut(host[crosses].tolist(), other[crosses].tolist(), sizes[crosses].tolist())
        extra = torch.tensor(parts, dtype=torch.int64)
        keep = ~crosses
        return (
            torch.cat([host[keep], extra[0]]),
            torch.cat([other[keep], extra[1]]),
            torch.cat([sizes[keep], extra[2]]),
        )

    # -- pack -------------------------------------------------------------------------

    def piece_dmas(
        self, cpu_ids: list[int], staging: int, arrays: range | None = None
    ) -> StreamDmas:
        """The DMAs of one pack piece, as (host, staging, sizes) address arrays for each
        of the two DMA streams: one DMA per run of consecutive host blocks (each block's
        span of ``arrays``, all by default, to a staging slot of that size), never across
        a registration (chunk) boundary, dealt alternately to the streams."""
        offset, size = self.span(self.all_arrays if arrays is None else arrays)
        step, base, chunk = self.host_stride, self.host_base, self.chunk_bytes
        host: list[int] = []
        local: list[int] = []
        sizes: list[int] = []
        for j, c in enumerate(cpu_ids):
            h = base + c * step + offset
            # Blocks that tile chunks cross no boundary; a run is not merged across a
            # chunk's start.
            if host and h == host[-1] + sizes[-1] and (h - self.region_base) % chunk:
                sizes[-1] += size
            else:
                host.append(h)
                local.append(staging + j * size)
                sizes.append(size)
        if not self.blocks_tile_chunks:  # a span lies within its block
            host, local, sizes = self.cut(host, local, sizes)
        return [
            (
                array.array("Q", host[k::2]),
                array.array("Q", local[k::2]),
                array.array("Q", sizes[k::2]),
            )
            for k in range(2)
        ]

    def pack_pieces(
        self,
        cpu_ids: list[int],
        *,
        counts: Sequence[int],
        halves: Sequence[int],
        first_half: int,
        arrays: range | None = None,
    ) -> Iterator[PackPiece]:
        """A pack job's pieces in order, ``counts[i]`` blocks in piece i (``ValueError``
        unless they are positive and sum to ``len(cpu_ids)``: ``pack_piece_counts``
        makes them), through the two staging halves
        (addresses ``halves``) in turn from ``first_half``. Lazy: a piece's DMAs are
        planned in plain Python when it is asked for, just before it is queued, so the
        first piece goes out at once and no torch op hands the GIL to another submitting
        thread."""
        if sum(counts) != len(cpu_ids) or any(count <= 0 for count in counts):
            # A piece's count is how many ids the copy kernel reads: never past the job's.
            raise ValueError(f"piece counts {list(counts)} do not split {len(cpu_ids)} blocks")
        return self._pieces(cpu_ids, counts, halves, first_half, arrays)

    def _pieces(
        self,
        cpu_ids: list[int],
        counts: Sequence[int],
        halves: Sequence[int],
        half: int,
        arrays: range | None,
    ) -> Iterator[PackPiece]:
        lo = 0
        for count in counts:
            piece = cpu_ids[lo : lo + count]
            yield PackPiece(lo, len(piece), half, self.piece_dmas(piece, halves[half], arrays))
            half ^= 1
            lo += count
