"""A region's address range: how it is mapped (anonymous at a huge-page boundary, or
from the hugetlb pool), how long it lives (while the region or any view of it holds it;
covered with private zeros in a forked child), and how it is unmapped (all but the
spans of chunks whose unpin failed)."""

from __future__ import annotations

import errno
import mmap
import os
import weakref

from asyncpin import _sys
from asyncpin.errors import PreflightError

__all__ = [
    "HUGE_PAGE",
    "UNMAP_PIECE_BYTES",
    "Mapping",
    "hugetlb_free_bytes",
    "map_anonymous_aligned",
    "map_hugetlb",
    "merged",
]

HUGE_PAGE = 2 << 20
# The most that one munmap call of a region's release unmaps (a multiple of HUGE_PAGE, so
# that a hugetlb mapping is cut at its page boundaries).
UNMAP_PIECE_BYTES = 64 << 20
_MAP_HUGETLB = 0x40000


class Mapping:
    """The address range of one region. The region and every view of it hold it; once the
    region is released, the range is unmapped when the last holder lets go, so no view can
    read unmapped memory or reach whatever is mapped there next."""

    __slots__ = ("__weakref__", "address", "keep", "nbytes", "pid", "released")

    def __init__(self, address: int, nbytes: int) -> None:
        self.address = address
        self.nbytes = nbytes
        self.pid = os.getpid()
        self.keep: list[tuple[int, int]] = []  # (offset, nbytes) left mapped: leaked
        self.released = False
        _LIVE.add(self)

    def __del__(self) -> None:
        # In a forked child that could not cover the range (see _cover_in_child), it may
        # hold the child's own memory, which must not be unmapped.
        if self.released and os.getpid() == self.pid:
            _unmap_except(self.address, self.nbytes, self.keep)


_LIVE: weakref.WeakSet[Mapping] = weakref.WeakSet()
_MAP_FIXED_NOREPLACE = 0x100000
_MAP_NORESERVE = 0x4000


def _cover_in_child() -> None:
    """After fork, in the child: a region is MADV_DONTFORK, so its range is a hole there
    that the child's own allocations would fill, and a view kept across the fork would
    then write into them. Map private zero pages over each hole first: a stale view in the
    child reads zeros and writes to memory nobody else has, and the placeholder is the
    child's to unmap when the last view goes."""
    for mapping in list(_LIVE):
        try:
            _sys.libc_mmap(
                mapping.nbytes,
                mmap.PROT_READ | mmap.PROT_WRITE,
                # No reservation: a placeholder as large as the region costs nothing
                # until a stale view touches it.
                mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED_NOREPLACE,
                addr=mapping.address,
            )
        except OSError:
            continue  # taken already (or an old kernel): never unmapped by this child
        mapping.pid, mapping.keep, mapping.released = os.getpid(), [], True


os.register_at_fork(after_in_child=_cover_in_child)


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` spans sorted, with touching or overlapping ones joined."""
    out: list[tuple[int, int]] = []
    for offset, nbytes in sorted(spans):
        if out and offset <= out[-1][0] + out[-1][1]:
            start = out[-1][0]
            out[-1] = (start, max(out[-1][1], offset + nbytes - start))
        else:
            out.append((offset, nbytes))
    return out


def _unmap_except(address: int, nbytes: int, keep: list[tuple[int, int]]) -> None:
    """Unmap ``[address, address + nbytes)`` but the ``(offset, nbytes)`` spans of ``keep``."""
    cursor = 0
    for offset, size in sorted(keep):
        if offset > cursor:
            _unmap(address + cursor, offset - cursor)
        cursor = offset + size
    if cursor < nbytes:
        _unmap(address + cursor, nbytes - cursor)


def _unmap(address: int, nbytes: int) -> None:
    """munmap in pieces of UNMAP_PIECE_BYTES: one call holds the process's memory-map lock
    for writing while it frees every page, and every thread that maps memory or faults a
    page meanwhile waits (8 GiB in one call held another thread's 64 KiB mmap for
    565-768 ms on the dev machine; in 64 MiB pieces, 21-24 ms: bench/probes/unmap_lock.py)."""
    for start in range(address, address + nbytes, UNMAP_PIECE_BYTES):
        _sys.libc_munmap(start, min(UNMAP_PIECE_BYTES, address + nbytes - start))


def hugetlb_free_bytes() -> int:
    """Free pages of the default hugetlb pool, in bytes (/proc/meminfo)."""
    fields = _sys.meminfo()
    return fields.get("HugePages_Free", 0) * fields.get("Hugepagesize", 0)


def map_hugetlb(nbytes: int) -> int:
    """Map from the reserved hugetlb pool; a short pool is a PreflightError saying what to do."""
    free = hugetlb_free_bytes()
    fix = (
        f"the pool needs {nbytes // HUGE_PAGE} free 2 MiB pages (raise "
        "/proc/sys/vm/nr_hugepages) or use hugepages='thp'"
    )
    if nbytes > free:
        raise PreflightError("hugetlb", nbytes, free, fix)
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    try:
        return _sys.libc_mmap(nbytes, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB)
    except OSError as exc:
        if exc.errno == errno.ENOMEM:
            raise PreflightError("hugetlb", nbytes, hugetlb_free_bytes(), fix) from exc
        raise


def map_anonymous_aligned(nbytes: int) -> int:
    """Map anonymous memory at a 2 MiB boundary, exactly ``nbytes`` long, so that THP
    can back it from its first byte; the slack of the over-sized mapping is unmapped."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    raw = _sys.libc_mmap(nbytes + HUGE_PAGE, prot, flags)
    start = -(-raw // HUGE_PAGE) * HUGE_PAGE
    if start > raw:
        _sys.libc_munmap(raw, start - raw)
    tail = raw + nbytes + HUGE_PAGE - (start + nbytes)
    if tail:
        _sys.libc_munmap(start + nbytes, tail)
    return start
