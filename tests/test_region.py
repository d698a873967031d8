"""HostRegion: exact mappings, chunking, views, THP, release, fork safety, shared backing."""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import mmap
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import asyncpin.region as region_module
from asyncpin import ConfigError, OffloadManager, RegionNotFoundError, _sys
from asyncpin._mapping import UNMAP_PIECE_BYTES
from asyncpin.region import (
    PREFAULT_MAX_PIECE_BYTES,
    PREFAULT_PIECE_BYTES,
    Backing,
    Chunk,
    Chunks,
    HostRegion,
    next_prefault_piece,
    validate_backing,
    validate_hugepages,
    validate_nbytes,
)
from asyncpin.shm import HEADER_BYTES, SHM_DIR, is_stale, validate_name
from asyncpin.testing import is_mapped
from tests.helpers import digest, wait_child

PAGE = _sys.PAGE_SIZE
MIB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[1]
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vma_containing(address: int) -> tuple[int, int]:
    """The [start, end) of the mapping in /proc/self/maps that holds ``address``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
        if lo <= address < hi:
            return lo, hi
    raise AssertionError(f"0x{address:x} is not mapped")


def random_fill(view: torch.Tensor) -> bytes:
    """Fill ``view`` with random bytes that contain no zero (fresh memory is all zeros)."""
    data = bytes(b | 1 for b in os.urandom(view.numel()))
    view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return data


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class TestSize:
    """A region is exactly its size rounded up to a page, and anonymous ones are 2 MiB aligned."""

    @pytest.mark.parametrize(
        ("asked", "expected"),
        [
            (1, PAGE),
            (PAGE - 1, PAGE),
            (PAGE, PAGE),
            (PAGE + 1, 2 * PAGE),
            (3 * MIB + 5, 3 * MIB + PAGE),
            (4 * MIB, 4 * MIB),
        ],
    )
    def test_anonymous_size_is_page_rounded_and_exact(self, asked: int, expected: int) -> None:
        region = HostRegion.create(asked)
        try:
            assert region.nbytes == expected
            # The mapping holding the region is exactly the region: no slack is left
            # mapped around it (DONTFORK keeps it from merging with neighbours).
            assert vma_containing(region.address) == (region.address, region.address + expected)
        finally:
            region.release()

    @pytest.mark.parametrize("nbytes", [PAGE, 3 * PAGE, 2 * MIB - PAGE, 2 * MIB, 5 * MIB + 7])
    def test_anonymous_region_starts_at_2mib_boundary(self, nbytes: int) -> None:
        region = HostRegion.create(nbytes)
        try:
            assert region.address % (2 * MIB) == 0
        finally:
            region.release()

    def test_shared_size_is_page_rounded(self, shm_name: str) -> None:
        region = HostRegion.create(PAGE + 1, backing="shared", name=shm_name)
        try:
            assert region.nbytes == 2 * PAGE
            # The data, then the header page that says the file is asyncpin's.
            assert (SHM_DIR / shm_name).stat().st_size == 2 * PAGE + HEADER_BYTES
            assert region.is_owner
        finally:
            region.release()


class TestChunks:
    """chunks() cuts the region into page-multiple pieces in order; only the last may be short."""

    def test_last_chunk_is_short(self) -> None:
        region = HostRegion.create(10 * PAGE)
        try:
            chunks = region.chunks(4 * PAGE)
        finally:
            region.release()
        assert [(c.index, c.offset, c.nbytes) for c in chunks] == [
            (0, 0, 4 * PAGE),
            (1, 4 * PAGE, 4 * PAGE),
            (2, 8 * PAGE, 2 * PAGE),
        ]

    @pytest.mark.parametrize(("nbytes", "chunk_bytes"), [(8 * PAGE, 4 * PAGE), (3 * MIB, MIB)])
    def test_exact_multiple_gives_equal_chunks(self, nbytes: int, chunk_bytes: int) -> None:
        region = HostRegion.create(nbytes)
        try:
            chunks = region.chunks(chunk_bytes)
        finally:
            region.release()
        assert len(chunks) == nbytes // chunk_bytes
        assert all(c.nbytes == chunk_bytes for c in chunks)
        assert [c.offset for c in chunks] == list(range(0, nbytes, chunk_bytes))

    def test_chunk_larger_than_region_is_one_chunk(self) -> None:
        region = HostRegion.create(3 * PAGE)
        try:
            chunks = region.chunks(64 * PAGE)
        finally:
            region.release()
        assert [(c.index, c.offset, c.nbytes) for c in chunks] == [(0, 0, 3 * PAGE)]

    def test_chunks_tile_the_region_without_gaps(self) -> None:
        region = HostRegion.create(37 * PAGE)
        try:
            chunks = region.chunks(5 * PAGE)
        finally:
            region.release()
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert chunks[0].offset == 0
        for before, after in itertools.pairwise(chunks):
            assert after.offset == before.offset + before.nbytes
        assert sum(c.nbytes for c in chunks) == 37 * PAGE
        assert chunks[-1].nbytes == 2 * PAGE

    def test_chunks_are_a_sequence_made_as_read(self) -> None:
        chunks = Chunks(10 * PAGE, 4 * PAGE)
        assert len(chunks) == 3
        assert chunks[-1] == chunks[2] == Chunk(2, 8 * PAGE, 2 * PAGE)
        assert chunks[1:] == [Chunk(1, 4 * PAGE, 4 * PAGE), Chunk(2, 8 * PAGE, 2 * PAGE)]
        assert list(reversed(chunks)) == [chunks[2], chunks[1], chunks[0]]
        for index in (3, -4):
            with pytest.raises(IndexError):
                chunks[index]
        # 1 TiB in 16 MiB chunks: 65536 of them, none made until read.
        many = Chunks(1 << 40, 16 * MIB)
        assert len(many) == 65536 and many[65535] == Chunk(65535, (1 << 40) - 16 * MIB, 16 * MIB)
        # An index as a list takes it: an int of any kind, never a float.
        big = many[np.int32(40000)]
        assert big == Chunk(40000, 40000 * 16 * MIB, 16 * MIB) and type(big.offset) is int
        with pytest.raises(TypeError):
            many[1.5]  # type: ignore[call-overload]

    def test_chunks_compare_as_a_list_of_them_did(self) -> None:
        chunks = Chunks(10 * PAGE, 4 * PAGE)
        listed = [Chunk(0, 0, 4 * PAGE), Chunk(1, 4 * PAGE, 4 * PAGE), Chunk(2, 8 * PAGE, 2 * PAGE)]
        assert chunks == listed and listed == chunks
        assert chunks == Chunks(10 * PAGE, 4 * PAGE)
        assert Chunks(PAGE, PAGE) == Chunks(PAGE, 4 * PAGE)  # one chunk of a page, both
        assert chunks != listed[:2] and chunks != Chunks(10 * PAGE, 2 * PAGE)
        region = HostRegion.create(10 * PAGE)
        try:
            assert isinstance(region.chunks(4 * PAGE), Chunks)
            assert region.chunks(4 * PAGE) == listed
        finally:
            region.release()

    @pytest.mark.parametrize("chunk_bytes", [0, -PAGE, PAGE + 1, PAGE // 2])
    def test_bad_chunk_size_is_config_error(self, chunk_bytes: int) -> None:
        region = HostRegion.create(4 * PAGE)
        try:
            with pytest.raises(ConfigError, match="multiple of the page size"):
                region.chunks(chunk_bytes)
        finally:
            region.release()


class TestView:
    """view() aliases the mapping: writes through one view are read through another."""

    def test_write_then_read_through_views(self) -> None:
        region = HostRegion.create(4 * PAGE)
        try:
            whole = region.view()
            assert whole.dtype == torch.uint8
            assert whole.numel() == region.nbytes
            assert int(whole.sum()) == 0  # fresh anonymous memory
            part = region.view(PAGE, 2 * PAGE)
            assert part.numel() == 2 * PAGE
            written = random_fill(part)
            assert region.view(PAGE, 2 * PAGE).numpy().tobytes() == written
            assert whole[PAGE : 3 * PAGE].numpy().tobytes() == written
            # Untouched neighbours stay zero.
            assert int(whole[:PAGE].sum()) == 0
            assert int(whole[3 * PAGE :].sum()) == 0
        finally:
            region.release()

    def test_view_sees_raw_memory(self) -> None:
        region = HostRegion.create(2 * PAGE)
        try:
            ctypes.memmove(region.address + PAGE + 3, b"asyncpin", 8)
            assert region.view(PAGE + 3, 8).numpy().tobytes() == b"asyncpin"
            assert region.view(PAGE).numel() == PAGE
        finally:
            region.release()

    @pytest.mark.parametrize(
        ("offset", "nbytes"), [(-1, 1), (0, 0), (0, 3 * PAGE), (2 * PAGE, 1), (PAGE, -PAGE)]
    )
    def test_view_outside_region_is_config_error(self, offset: int, nbytes: int) -> None:
        region = HostRegion.create(2 * PAGE)
        try:
            expected = "positive length" if nbytes <= 0 else "outside the region"
            with pytest.raises(ConfigError, match=expected):
                region.view(offset, nbytes)
        finally:
            region.release()

    @pytest.mark.parametrize(
        ("offset", "nbytes"), [("0", None), ("0", 1), (0.5, 1), (0, 1.0), (True, 1), (0, False)]
    )
    def test_view_of_what_is_no_int_is_config_error(self, offset: Any, nbytes: Any) -> None:
        """A newcomer's trial: host_view('0') raised a bare TypeError, host_view(0.5, 1)
        said the view was outside the region."""
        region = HostRegion.create(2 * PAGE)
        try:
            with pytest.raises(ConfigError, match="is an int, not"):
                region.view(offset, nbytes)
        finally:
            region.release()

    def test_view_after_release_is_refused(self) -> None:
        region = HostRegion.create(PAGE)
        region.release()
        with pytest.raises(anyio.ClosedResourceError, match="closed"):
            region.view()
        with pytest.raises(anyio.ClosedResourceError, match="closed"):
            _ = region.address

    @pytest.mark.parametrize("use", ["view", "prefault", "reserve", "address"])
    @pytest.mark.parametrize("backing", ["anonymous", "shared"])
    def test_use_after_release_is_closed_resource_error(
        self, backing: Backing, use: str, shm_name: str
    ) -> None:
        name = shm_name if backing == "shared" else None
        region = HostRegion.create(PAGE, backing=backing, name=name)
        region.release()
        calls: dict[str, Callable[[], object]] = {
            "view": lambda: region.view(0, PAGE),
            "prefault": lambda: region.prefault(0, PAGE),
            "reserve": lambda: region.reserve([(0, PAGE)]),
            "address": lambda: region.address,
        }
        with pytest.raises(anyio.ClosedResourceError, match="the region is closed"):
            calls[use]()


class TestValidators:
    """Each configuration value has one validator, and every caller reports its message."""

    @staticmethod
    def message(call: Callable[[], object]) -> str:
        with pytest.raises(ConfigError) as info:
            call()
        return str(info.value)

    @pytest.mark.parametrize("backing", ["file", "", "SHARED", None])
    def test_backing(self, backing: Any) -> None:
        said = self.message(lambda: validate_backing(backing))
        assert said == f"unknown backing {backing!r}: use 'anonymous' or 'shared'"
        assert self.message(lambda: OffloadManager(PAGE, backing=backing)) == said
        assert self.message(lambda: HostRegion.create(PAGE, backing=backing)) == said

    @pytest.mark.parametrize("hugepages", ["always", "", "THP", True])
    def test_hugepages(self, hugepages: Any) -> None:
        said = self.message(lambda: validate_hugepages(hugepages))
        assert said == f"unknown hugepages policy {hugepages!r}: use 'thp', 'hugetlb' or 'none'"
        assert self.message(lambda: OffloadManager(PAGE, hugepages=hugepages)) == said
        assert self.message(lambda: HostRegion.create(PAGE, hugepages=hugepages)) == said

    @pytest.mark.parametrize("nbytes", [0, -1, True, 1.5, "1", 1 << 60])
    def test_nbytes(self, nbytes: Any) -> None:
        said = self.message(lambda: validate_nbytes(nbytes))
        assert said.startswith("nbytes")
        assert self.message(lambda: OffloadManager(nbytes)) == said
        assert self.message(lambda: HostRegion.create(nbytes)) == said

    @pytest.mark.parametrize("name", [None, "", ".", "..", "a/b", "x" * 201, 7])
    def test_name(self, name: Any) -> None:
        said = self.message(lambda: validate_name(name))
        assert "name" in said
        assert self.message(lambda: HostRegion.create(PAGE, backing="shared", name=name)) == said
        if name is not None:
            assert self.message(lambda: HostRegion.attach(name)) == said
            assert self.message(lambda: is_stale(name)) == said

    def test_good_values_pass_through(self) -> None:
        assert validate_backing("shared") == "shared"
        assert validate_hugepages("none") == "none"
        assert validate_nbytes(PAGE + 1) == 2 * PAGE
        assert validate_name("a-b_c.1") == "a-b_c.1"


class TestTransparentHugePages:
    """An anonymous region with hugepages='thp' is backed by huge pages once prefaulted."""

    def test_prefaulted_thp_region_has_huge_pages(self) -> None:
        setting = THP_ENABLED.read_text() if THP_ENABLED.exists() else "[never]"
        if "[never]" in setting:
            pytest.skip(f"transparent huge pages are disabled here ({setting.strip()})")
        region = HostRegion.create(8 * MIB, hugepages="thp")
        try:
            assert region.hugepage_bytes() == 0  # nothing faulted in yet
            region.prefault(0, region.nbytes)
            huge = region.hugepage_bytes()
            assert 0 < huge <= region.nbytes
            assert huge % (2 * MIB) == 0
        finally:
            region.release()
        assert region.hugepage_bytes() == 0

    @staticmethod
    def _populate_calls(
        monkeypatch: pytest.MonkeyPatch, region: HostRegion, offset: int, nbytes: int
    ) -> list[tuple[int, int]]:
        """The (offset in the region, length) of each MADV_POPULATE_WRITE call that
        ``region.prefault(offset, nbytes)`` makes."""
        calls: list[tuple[int, int, int]] = []
        real = _sys.libc_madvise

        def record(address: int, size: int, advice: int) -> None:
            calls.append((address, size, advice))
            real(address, size, advice)

        monkeypatch.setattr(_sys, "libc_madvise", record)
        region.prefault(offset, nbytes)
        monkeypatch.undo()
        return [(a - region.address, n) for a, n, adv in calls if adv == _sys.MADV_POPULATE_WRITE]

    def test_prefault_goes_a_huge_page_at_a_time(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # Each call holds the memory-map lock while it faults: a whole chunk at once held
        # up every thread that maps memory meanwhile (the GIL's holder among them).
        monkeypatch.setattr(region_module, "next_prefault_piece", lambda p, w, c, n: p)
        region = HostRegion.create(8 * MIB)
        try:
            offset, nbytes = PAGE, 5 * MIB + 3 * PAGE
            calls = self._populate_calls(monkeypatch, region, offset, nbytes)
            piece = PREFAULT_PIECE_BYTES
            assert calls == [
                (offset, piece),
                (offset + piece, piece),
                (offset + 2 * piece, MIB + 3 * PAGE),
            ]
        finally:
            region.release()

    def test_prefault_pieces_grow_as_told(self, monkeypatch: pytest.MonkeyPatch) -> None:
        seen: list[tuple[int, int]] = []

        def grow(piece: int, wall_s: float, cpu_s: float, limit: int) -> int:
            seen.append((piece, limit))
            return piece * 2

        monkeypatch.setattr(region_module, "next_prefault_piece", grow)
        region = HostRegion.create(16 * MIB)
        try:
            calls = self._populate_calls(monkeypatch, region, 0, 14 * MIB)
            assert calls == [(0, 2 * MIB), (2 * MIB, 4 * MIB), (6 * MIB, 8 * MIB)]
            assert seen == [(2 * MIB, 14 * MIB), (4 * MIB, 14 * MIB), (8 * MIB, 14 * MIB)]
        finally:
            region.release()

    def test_prefault_stops_between_pieces(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(region_module, "next_prefault_piece", lambda p, w, c, n: p)
        region = HostRegion.create(8 * MIB)
        stop = threading.Event()
        calls: list[int] = []
        real = _sys.libc_madvise

        def madvise(address: int, size: int, advice: int) -> None:
            calls.append(size)
            stop.set()  # set during the first piece: that piece completes, no other starts
            real(address, size, advice)

        try:
            assert region.prefault(0, 8 * MIB, stop) is True  # nothing asked it to stop
            monkeypatch.setattr(_sys, "libc_madvise", madvise)
            stop.clear()
            assert region.prefault(0, 8 * MIB, stop) is False
            assert calls == [PREFAULT_PIECE_BYTES]
            assert region.prefault(0, 8 * MIB, stop) is False  # set before: no call at all
            assert calls == [PREFAULT_PIECE_BYTES]
        finally:
            region.release()

    def test_next_prefault_piece(self) -> None:
        piece = PREFAULT_PIECE_BYTES
        # Faulting most of the time: the piece stays.
        assert next_prefault_piece(piece, 1e-3, 0.9e-3, 64 * MIB) == piece
        # Blocked more than faulting (the GIL slow to come back): four times larger, up
        # to the limit and to PREFAULT_MAX_PIECE_BYTES (each call holds the memory-map
        # lock: a 64 MiB call held a GPU step's launches up to 120 ms on the H200).
        assert next_prefault_piece(piece, 6e-3, 1e-3, 64 * MIB) == 4 * piece
        assert next_prefault_piece(4 * piece, 6e-3, 1e-3, 64 * MIB) == PREFAULT_MAX_PIECE_BYTES
        assert next_prefault_piece(piece, 6e-3, 1e-3, 6 * MIB) == 6 * MIB
        assert next_prefault_piece(piece, 6e-3, 1e-3, MIB) == piece

    def test_prefault_keeps_data(self) -> None:
        region = HostRegion.create(4 * MIB)
        try:
            written = random_fill(region.view(0, MIB))
            region.prefault(0, region.nbytes)
            assert region.view(0, MIB).numpy().tobytes() == written
        finally:
            region.release()


class TestRelease:
    """release() unmaps everything but the kept chunks, once; a second call is a no-op."""

    @pytest.mark.parametrize("backing", ["anonymous", "shared"])
    def test_release_unmaps_and_is_idempotent(self, backing: Backing, shm_name: str) -> None:
        name = shm_name if backing == "shared" else None
        region = HostRegion.create(4 * MIB, backing=backing, name=name)
        address, nbytes = region.address, region.nbytes
        region.view().fill_(7)
        assert is_mapped(address, nbytes)
        region.release()
        assert region.closed
        assert not is_mapped(address, PAGE)
        assert not is_mapped(address + nbytes - PAGE, PAGE)
        region.release()
        region.close()
        assert region.closed
        assert "closed" in repr(region)

    def test_release_with_a_view_alive_runs_no_full_collection(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # A close releases the region in a worker thread; a full collection there holds
        # the GIL for 100+ ms in a process with torch loaded, stalling the event loop.
        region = HostRegion.create(4 * MIB)
        view = region.view()
        address = region.address
        collections: list[tuple[Any, ...]] = []

        def collect(*args: Any) -> int:
            collections.append(args)
            return 0

        monkeypatch.setattr("gc.collect", collect)
        assert region.release() is False  # the view holds the range
        assert collections == []
        assert is_mapped(address, PAGE)
        del view
        assert not is_mapped(address, PAGE)

    def test_second_release_does_not_unlink_a_newer_region(self, shm_name: str) -> None:
        first = HostRegion.create(PAGE, backing="shared", name=shm_name)
        first.release()
        assert not (SHM_DIR / shm_name).exists()
        second = HostRegion.create(PAGE, backing="shared", name=shm_name)
        try:
            first.release()
            assert (SHM_DIR / shm_name).exists()
        finally:
            second.release()
        assert not (SHM_DIR / shm_name).exists()

    @pytest.mark.parametrize("kept", [0, 1, 3])
    def test_release_keeps_only_the_kept_chunk(self, kept: int) -> None:
        region = HostRegion.create(3 * MIB + 2 * PAGE)
        chunks = region.chunks(MIB)
        assert len(chunks) == 4 and chunks[3].nbytes == 2 * PAGE
        address = region.address
        keep = chunks[kept]
        written = random_fill(region.view(keep.offset, keep.nbytes))
        region.release(keep=[keep])
        try:
            assert region.closed
            assert is_mapped(address + keep.offset, keep.nbytes)
            for chunk in chunks:
                if chunk != keep:
                    assert not is_mapped(address + chunk.offset, PAGE), chunk
                    assert not is_mapped(address + chunk.offset + chunk.nbytes - PAGE, PAGE)
            # The kept chunk still holds its data (it was leaked, not freed).
            assert ctypes.string_at(address + keep.offset, keep.nbytes) == written
        finally:
            _sys.libc_munmap(address + keep.offset, keep.nbytes)
        assert not is_mapped(address + keep.offset, PAGE)

    def test_release_unmaps_in_pieces(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # One munmap holds the memory-map lock for writing while it frees every page:
        # every other thread that maps memory or faults a page waits that long.
        calls: list[tuple[int, int]] = []
        real = _sys.libc_munmap

        def record(address: int, nbytes: int) -> None:
            calls.append((address, nbytes))
            real(address, nbytes)

        region = HostRegion.create(2 * UNMAP_PIECE_BYTES + 5 * MIB)
        chunks = region.chunks(MIB)
        address, nbytes = region.address, region.nbytes
        keep = chunks[70]  # a leaked chunk splits the range in two
        monkeypatch.setattr(_sys, "libc_munmap", record)
        region.release(keep=[keep])
        monkeypatch.undo()
        try:
            assert all(n <= UNMAP_PIECE_BYTES for _, n in calls)
            assert len(calls) == 3  # 64 + 6 MiB before the chunk, 62 after
            pieces = sorted(calls)
            covered = [(a - address, n) for a, n in pieces]
            assert sum(n for _, n in covered) == nbytes - keep.nbytes
            assert all(o + n <= keep.offset or o >= keep.offset + keep.nbytes for o, n in covered)
            assert not is_mapped(address, PAGE)
            assert not is_mapped(address + nbytes - PAGE, PAGE)
            assert is_mapped(address + keep.offset, keep.nbytes)
        finally:
            _sys.libc_munmap(address + keep.offset, keep.nbytes)

    def test_release_keeps_several_chunks(self) -> None:
        region = HostRegion.create(4 * MIB)
        chunks = region.chunks(MIB)
        address = region.address
        keep = [chunks[2], chunks[0]]  # out of order on purpose
        region.release(keep=keep)
        try:
            assert is_mapped(address, MIB)
            assert not is_mapped(address + MIB, PAGE)
            assert is_mapped(address + 2 * MIB, MIB)
            assert not is_mapped(address + 3 * MIB, PAGE)
        finally:
            for chunk in keep:
                _sys.libc_munmap(address + chunk.offset, chunk.nbytes)


class TestDontFork:
    """A forked child does not inherit the region (MADV_DONTFORK): it sees zeros there, and
    its writes leave the parent's data intact."""

    @pytest.mark.parametrize("backing", ["anonymous", "shared"])
    def test_child_of_fork_cannot_see_region(self, backing: Backing, shm_name: str) -> None:
        name = shm_name if backing == "shared" else None
        region = HostRegion.create(4 * MIB, backing=backing, name=name)
        # A control mapping without DONTFORK proves the child's check can say "mapped".
        control = _sys.libc_mmap(
            MIB, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        try:
            address, nbytes = region.address, region.nbytes
            random_fill(region.view())
            before = digest(region.view())
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the child
                code = 3
                try:
                    # Not the parent's pages: a placeholder of zeros covers the range, so
                    # that a stale view reads zeros and writes reach nobody's memory.
                    first, last = address, address + nbytes - PAGE
                    zeros = all(ctypes.string_at(a, PAGE) == bytes(PAGE) for a in (first, last))
                    ctypes.memset(first, 0xAB, PAGE)
                    code = 0 if zeros and is_mapped(control, MIB) else 1
                finally:
                    os._exit(code)
            assert wait_child(pid, timeout_s=30) == 0
            assert is_mapped(address, nbytes)
            assert digest(region.view()) == before
        finally:
            _sys.libc_munmap(control, MIB)
            region.release()


CHILD_ATTACH = """
import hashlib, sys
import anyio, torch
from asyncpin import OffloadManager

async def main() -> None:
    name = sys.argv[1]
    new = bytearray(sys.stdin.buffer.read())
    async with OffloadManager.attached(name, backend="host", chunk_bytes=1 << 20) as mgr:
        with anyio.fail_after(60):
            await mgr.pinned
        view = mgr.host_view()
        # structlog's default logger also prints to stdout: mark the answer.
        print("RESULT", mgr.nbytes, hashlib.sha256(view.numpy().tobytes()).hexdigest(), flush=True)
        view.copy_(torch.frombuffer(new, dtype=torch.uint8))

anyio.run(main)
"""


class TestSharedBacking:
    """A shared region is seen by other processes by name, and only its creator unlinks it."""

    async def test_another_process_reads_and_writes(self, shm_name: str) -> None:
        path = SHM_DIR / shm_name
        nbytes = 4 * MIB
        async with OffloadManager(
            nbytes, backend="host", backing="shared", name=shm_name, chunk_bytes=MIB
        ) as mgr:
            with anyio.fail_after(60):
                await mgr.pinned
            view = mgr.host_view()
            ours = random_fill(view)
            theirs = bytes(b | 1 for b in os.urandom(nbytes))
            assert theirs != ours
            with anyio.fail_after(120):
                result = await anyio.run_process(
                    [sys.executable, "-c", CHILD_ATTACH, shm_name],
                    input=theirs,
                    env=child_env(),
                    check=False,
                )
            assert result.returncode == 0, result.stderr.decode()
            answers = [
                line.split()[1:]
                for line in result.stdout.decode().splitlines()
                if line.startswith("RESULT ")
            ]
            assert len(answers) == 1, result.stdout.decode()
            child_nbytes, child_digest = answers[0]
            assert int(child_nbytes) == nbytes
            assert child_digest == hashlib.sha256(ours).hexdigest()
            # The child's bytes arrived, and the attacher's close did not unlink the file.
            assert digest(view) == hashlib.sha256(theirs).hexdigest()
            assert path.exists()
        assert not path.exists()

    async def test_file_is_unlinked_when_the_body_raised(self, shm_name: str) -> None:
        path = SHM_DIR / shm_name

        class Boom(Exception):
            pass

        # The body's own exception comes out unchanged (not wrapped in an ExceptionGroup).
        with pytest.raises(Boom):
            async with OffloadManager(MIB, backend="host", backing="shared", name=shm_name) as mgr:
                assert path.exists()
                assert mgr.region_name == shm_name
                raise Boom
        assert not path.exists()

    async def test_attacher_close_keeps_file_and_creator_sees_its_writes(
        self, shm_name: str
    ) -> None:
        path = SHM_DIR / shm_name
        async with OffloadManager(
            2 * MIB, backend="host", backing="shared", name=shm_name
        ) as creator:
            async with OffloadManager.attached(shm_name, backend="host") as attacher:
                assert attacher.nbytes == creator.nbytes
                written = random_fill(attacher.host_view())
                with anyio.fail_after(60):
                    await attacher.pinned
            assert path.exists()
            assert creator.host_view().numpy().tobytes() == written
        assert not path.exists()

    def test_attached_region_outlives_creator_unlink(self, shm_name: str) -> None:
        path = SHM_DIR / shm_name
        creator = HostRegion.create(MIB, backing="shared", name=shm_name)
        attacher = HostRegion.attach(shm_name)
        try:
            assert not attacher.is_owner
            assert attacher.nbytes == creator.nbytes
            assert attacher.address != creator.address
            written = random_fill(creator.view())
            assert attacher.view().numpy().tobytes() == written
            attacher.release()
            assert path.exists()
            attacher = HostRegion.attach(shm_name)
            creator.release()
            assert not path.exists()
            # The attacher's mapping stays valid after the name is gone.
            assert attacher.view().numpy().tobytes() == written
        finally:
            attacher.release()
            creator.release()

    async def test_creating_an_existing_name_is_config_error(self, shm_name: str) -> None:
        path = SHM_DIR / shm_name
        async with OffloadManager(MIB, backend="host", backing="shared", name=shm_name) as mgr:
            written = random_fill(mgr.host_view())
            second = OffloadManager(MIB, backend="host", backing="shared", name=shm_name)
            with pytest.raises(ConfigError, match="already exists") as info:
                async with second:
                    pass
            assert isinstance(info.value, ValueError)
            assert shm_name in str(info.value)
            # The failed creator did not unlink or clobber the first one's file.
            assert path.exists()
            assert mgr.host_view().numpy().tobytes() == written
        assert not path.exists()

    def test_creating_over_a_foreign_file_leaves_it_alone(self, shm_name: str) -> None:
        path = SHM_DIR / shm_name
        path.write_bytes(b"not asyncpin")
        try:
            with pytest.raises(ConfigError, match="exists and is not a region made by asyncpin"):
                HostRegion.create(MIB, backing="shared", name=shm_name)
            assert path.read_bytes() == b"not asyncpin"
        finally:
            path.unlink()

    async def test_attach_to_missing_name_is_region_not_found(self, shm_name: str) -> None:
        with pytest.raises(RegionNotFoundError) as info:
            async with OffloadManager.attached(shm_name, backend="host"):
                pass
        assert isinstance(info.value, FileNotFoundError)
        assert info.value.name == shm_name
        assert "no shared region named" in str(info.value)
        with pytest.raises(FileNotFoundError):
            HostRegion.attach(shm_name)
