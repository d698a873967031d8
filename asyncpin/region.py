"""HostRegion: one host mapping for KV blocks, cut into chunks that are pinned one by one.

A region is an exact page-rounded span of virtual memory: anonymous, or a named file in
/dev/shm that another process can attach to (the file itself is :mod:`asyncpin.shm`'s).
Mapping costs no time that grows with its size; pages are faulted in later, chunk by chunk,
by :meth:`HostRegion.prefault`.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import operator
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, SupportsIndex, overload

import anyio
import torch

from asyncpin import _sys
from asyncpin._mapping import (
    HUGE_PAGE,
    Mapping,
    hugetlb_free_bytes,
    map_anonymous_aligned,
    map_hugetlb,
    merged,
)
from asyncpin._text import shown
from asyncpin.errors import ConfigError
from asyncpin.shm import (
    RegionHeader,
    SharedFile,
    attach_shared,
    create_shared,
    file_id,
    shm_unpromised_bytes,
    unlink_if_same,
    validate_name,
)

__all__ = [
    "MAX_NBYTES",
    "PREFAULT_MAX_PIECE_BYTES",
    "PREFAULT_PIECE_BYTES",
    "Backing",
    "Chunk",
    "Chunks",
    "HostRegion",
    "HugePages",
    "hugetlb_free_bytes",
    "next_prefault_piece",
    "round_to_pages",
    "validate_backing",
    "validate_hugepages",
    "validate_nbytes",
    "validate_region_options",
]

Backing = Literal["anonymous", "shared"]
HugePages = Literal["thp", "hugetlb", "none"]

# Far beyond any machine's memory, and far below where size arithmetic (and size_t) wraps.
MAX_NBYTES = 1 << 56
# What one prefault system call faults in (HostRegion.prefault), unless the GIL is slow
# to come back (next_prefault_piece), and the most it grows to.
PREFAULT_PIECE_BYTES = HUGE_PAGE
PREFAULT_MAX_PIECE_BYTES = 4 * HUGE_PAGE

# The shared files this process created and has not unlinked yet: (name, file id) by the
# creating process. Unlinked at the interpreter's exit where a close never ran to its end
# (a second Ctrl-C under asyncio.run cancels the close task itself): a file left behind
# holds its memory until a new creator of the name reclaims it. Unlinking a name frees
# nothing that is mapped: attached processes keep their mappings.
_LINKED: dict[tuple[int, int], tuple[str, int]] = {}
_LINKED_LOCK = threading.Lock()


@atexit.register
def _unlink_left_behind() -> None:
    with _LINKED_LOCK:
        left = [(k, v) for k, v in _LINKED.items() if v[1] == os.getpid()]
        _LINKED.clear()
    for file, (name, _) in left:
        try:
            unlink_if_same(name, file)
        except Exception:  # the interpreter is exiting: nothing to report to
            continue


def next_prefault_piece(piece: int, wall_s: float, cpu_s: float, limit: int) -> int:
    """The next prefault call's size, from how the last one went: four times larger (up
    to ``limit`` and :data:`PREFAULT_MAX_PIECE_BYTES`) when the call spent more of its
    time blocked than faulting. Back from the call, the thread waits for the GIL; an
    event loop busy in Python can hold it for a whole switch interval (5 ms) each time:
    prefaulting 2 GiB in 64 MiB chunks next to such a loop took 9.5-12.4 s a huge page
    per call, 5.7-5.9 s growing this way and 2.9-4.0 s a chunk per call (3.2-4.0 s each
    way next to an idle loop), on the dev machine. The bound: each call holds the
    memory-map lock, and a GPU step's launches waited up to 13 / 19 / 120 ms behind
    calls of 2 / 8 / 64 MiB on eight threads (H200, bench/probes/pin_stretch.py). With
    the GIL free the pieces stay one huge page."""
    if wall_s - cpu_s > cpu_s:
        return max(piece, min(piece * 4, limit, PREFAULT_MAX_PIECE_BYTES))
    return piece


def chunk_pieces(offset: int, nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[offset, offset + nbytes)`` of a region cut where its chunks (``chunk_bytes``
    spans from the region's start) meet: ``(start, end)`` pairs, relative to ``offset``."""
    pieces, lo = [], 0
    while lo < nbytes:
        hi = min(nbytes, lo + chunk_bytes - (offset + lo) % chunk_bytes)
        pieces.append((lo, hi))
        lo = hi
    return pieces


def round_to_pages(nbytes: int) -> int:
    return -(-nbytes // _sys.PAGE_SIZE) * _sys.PAGE_SIZE


@dataclass(frozen=True, slots=True)
class Chunk:
    """A slice of the region that is prefaulted and pinned as one unit."""

    index: int
    offset: int
    nbytes: int


class Chunks(Sequence[Chunk]):
    """A region's chunks in order, each made when it is asked for: a region of 1 TiB in
    16 MiB chunks has 65536, and making them all up front took milliseconds of the event
    loop at entry (and fed the garbage collector)."""

    __slots__ = ("_chunk_bytes", "_count", "_nbytes")

    def __init__(self, nbytes: int, chunk_bytes: int) -> None:
        self._nbytes = nbytes
        self._chunk_bytes = chunk_bytes
        self._count = -(-nbytes // chunk_bytes)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: SupportsIndex) -> Chunk: ...
    @overload
    def __getitem__(self, index: slice) -> list[Chunk]: ...
    def __getitem__(self, index: SupportsIndex | slice) -> Chunk | list[Chunk]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        index = int(operator.index(index))  # a float is refused; NumPy's ints become ints
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(f"chunk {index} of {self._count}")
        offset = index * self._chunk_bytes
        return Chunk(index, offset, min(self._chunk_bytes, self._nbytes - offset))

    def __eq__(self, other: object) -> bool:
        """Equal to the same cut of the same size, or to a sequence of the same chunks (a
        list, as ``chunks()`` returned before)."""
        if isinstance(other, Chunks) and (self._nbytes, self._chunk_bytes) == (
            other._nbytes,
            other._chunk_bytes,
        ):
            return True
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == self._count and all(
                a == b for a, b in zip(self, other, strict=True)
            )
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as a list's: equal by value

    def __repr__(self) -> str:
        return f"Chunks({self._count} of {self._chunk_bytes} bytes over {self._nbytes})"


class HostRegion:
    """One mapping of host memory.

    Use :meth:`create` or :meth:`attach`; :meth:`release` (or :meth:`close`) gives it up.
    A view handed out by :meth:`view` keeps the address range mapped for as long as the
    view (or any tensor made from it) lives, even past release: reading a stale view
    reads the old bytes, and writing to it can never reach another allocation.
    """

    __slots__ = (
        "_address",
        "_closed",
        "_fd",
        "_file_id",
        "_mapping",
        "_mapping_ref",
        "_owner",
        "_pid",
        "backing",
        "header",
        "hugepages",
        "name",
        "nbytes",
        "reclaimed_stale",
    )

    def __init__(
        self,
        *,
        address: int,
        nbytes: int,
        backing: Backing,
        hugepages: HugePages,
        name: str | None,
        fd: int,
        owner: bool,
        header: RegionHeader | None = None,
        reclaimed_stale: bool = False,
    ) -> None:
        self._address = address
        self.nbytes = nbytes
        self.backing: Backing = backing
        self.hugepages: HugePages = hugepages
        self.name = name
        self.header = header
        #: Whether creating it removed a stale region of the same name (its creator was gone).
        self.reclaimed_stale = reclaimed_stale
        self._fd = fd
        self._file_id = file_id(os.fstat(fd)) if fd >= 0 else None
        self._owner = owner
        self._pid = os.getpid()
        if owner and name is not None and self._file_id is not None:
            with _LINKED_LOCK:
                _LINKED[self._file_id] = (name, self._pid)
        self._closed = False
        self._mapping: Mapping | None = Mapping(address, nbytes)
        self._mapping_ref = weakref.ref(self._mapping)

    # -- construction -----------------------------------------------------------------

    @classmethod
    def create(
        cls,
        nbytes: int,
        *,
        backing: Backing = "anonymous",
        name: str | None = None,
        hugepages: HugePages = "thp",
        layout: dict[str, Any] | None = None,
    ) -> HostRegion:
        """Map ``nbytes`` (rounded up to a page) of fresh memory.

        For ``backing="shared"`` the file ``/dev/shm/<name>`` (mode 0600) appears only once
        it is complete: sized, locked by its creator and ending with a header page that
        records its size and ``layout``. A stale region of the same name, made by asyncpin
        and left by a creator that is gone, is removed first (``reclaimed_stale``); any
        other file of that name is a ConfigError. The file is unlinked when this region is
        released, if it is still this region's.
        """
        nbytes = validate_nbytes(nbytes)
        backing, hugepages = validate_region_options(backing, name, hugepages)
        if backing == "anonymous":
            if hugepages == "hugetlb":
                nbytes = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
                address = map_hugetlb(nbytes)
            else:
                address = map_anonymous_aligned(nbytes)
            region = cls(
                address=address,
                nbytes=nbytes,
                backing=backing,
                hugepages=hugepages,
                name=None,
                fd=-1,
                owner=True,
            )
        else:
            assert name is not None
            shared = create_shared(nbytes, name, layout)
            region = cls._shared(shared, name, hugepages, owner=True)
        region._advise()
        return region

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        hugepages: HugePages = "thp",
        preflight: Callable[[int], None] | None = None,
        layout: dict[str, Any] | None = None,
    ) -> HostRegion:
        """Map an existing shared region by name. An attacher never unlinks it.

        Only a region made by asyncpin is accepted: the file is opened without following
        a symbolic link, must be a regular file in /dev/shm owned by this user with mode
        0600, and must end with a valid header. If the header records a KV layout and
        ``layout`` is given, they must agree. Before anything is mapped, the memory that
        attaching would add (the part of the region not backed yet) is checked against
        MemAvailable, then ``preflight(nbytes)`` runs."""
        shared = attach_shared(name, preflight=preflight, layout=layout)
        region = cls._shared(shared, name, hugepages, owner=False)
        region._advise()
        return region

    @classmethod
    def _shared(
        cls, shared: SharedFile, name: str, hugepages: HugePages, *, owner: bool
    ) -> HostRegion:
        return cls(
            address=shared.address,
            nbytes=shared.header.nbytes,
            backing="shared",
            hugepages=hugepages,
            name=name,
            fd=shared.fd,
            owner=owner,
            header=shared.header,
            reclaimed_stale=shared.reclaimed_stale,
        )

    def _advise(self) -> None:
        # Children of a fork must not inherit (and copy-on-write) pinned DMA memory.
        _sys.libc_madvise(self._address, self.nbytes, _sys.MADV_DONTFORK)
        if self.hugepages == "thp" and self.backing == "anonymous":
            try:
                _sys.libc_madvise(self._address, self.nbytes, _sys.MADV_HUGEPAGE)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: kernel built without THP
                    raise

    # -- use --------------------------------------------------------------------------

    @property
    def address(self) -> int:
        self._check_open()
        return self._address

    @property
    def is_owner(self) -> bool:
        return self._owner

    @property
    def closed(self) -> bool:
        return self._closed

    def mapped_by_views_bytes(self) -> int:
        """Bytes still mapped after release because views of them are alive (0 otherwise)."""
        return self.nbytes if self._closed and self._mapping_ref() is not None else 0

    def chunks(self, chunk_bytes: int) -> Chunks:
        """Cut the region into ``chunk_bytes`` pieces (a page multiple); the last may be
        short. A sequence whose chunks are made as they are read."""
        if chunk_bytes <= 0 or chunk_bytes % _sys.PAGE_SIZE:
            raise ConfigError(
                f"chunk_bytes={chunk_bytes} must be a positive multiple of the page size "
                f"({_sys.PAGE_SIZE})"
            )
        return Chunks(self.nbytes, chunk_bytes)

    def view(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor over ``[offset, offset + nbytes)``. It (and every tensor made
        from it) keeps that memory mapped while it lives, past :meth:`release` too."""
        self._check_open()
        for name, value in (("offset", offset), ("nbytes", nbytes)):
            if isinstance(value, bool) or not isinstance(value, int | None):
                raise ConfigError(f"a view's {name} is an int, not {shown(value)}")
        if nbytes is None:
            nbytes = self.nbytes - offset
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            if isinstance(nbytes, int) and nbytes <= 0:
                raise ConfigError(f"a view needs a positive length, not nbytes={shown(nbytes)}")
            raise ConfigError(
                f"view of {shown(nbytes)} bytes at offset {shown(offset)} is outside the region of "
                f"{self.nbytes} bytes"
            )
        array = (ctypes.c_uint8 * nbytes).from_address(self._address + offset)
        # The tensor holds the ctypes array, which holds the mapping.
        array._asyncpin_mapping = self._mapping  # type: ignore[attr-defined]
        return torch.frombuffer(array, dtype=torch.uint8)

    def prefault(self, offset: int, nbytes: int, stop: threading.Event | None = None) -> bool:
        """Fault in ``[offset, offset+nbytes)`` for writing, with the GIL released, without
        changing a byte, in pieces of :data:`PREFAULT_PIECE_BYTES`. Returns False when
        ``stop`` was found set before a piece began (what is left is not faulted: a
        close waits for one piece, not a whole chunk), else True.

        Uses MADV_POPULATE_WRITE (an error, not SIGBUS, if memory runs out). Kernels
        before 5.14 lack it (EINVAL): then this does nothing and the pin call (mlock,
        CUDA registration) faults the pages in itself. Touching them with writes is no
        substitute: the chunk may already hold data (an attached region, or a pageable
        store that reached the chunk first), and a memset erased it. For a shared region,
        a full /dev/shm is reported as ENOSPC.
        """
        self._check_open()
        try:
            # One huge page per call: each call holds the process's memory-map lock for
            # reading while it faults, and a thread that maps or unmaps anything meanwhile
            # (a thread's stack, an allocator's arena, the driver) waits for every such
            # call under way to end, and holds up other threads behind it (the GIL, a
            # kernel launch). A 64 MiB chunk took ~25 ms on the H200; 2 MiB ~1 ms.
            piece, start, end = PREFAULT_PIECE_BYTES, offset, offset + nbytes
            while start < end:
                if stop is not None and stop.is_set():
                    return False
                size = min(piece, end - start)
                wall, cpu = time.perf_counter(), time.thread_time()
                _sys.libc_madvise(self._address + start, size, _sys.MADV_POPULATE_WRITE)
                start += size
                piece = next_prefault_piece(
                    piece, time.perf_counter() - wall, time.thread_time() - cpu, nbytes
                )
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return True
            if exc.errno == errno.EFAULT and self.backing == "shared":
                held = _file_size(self._fd)
                if held is not None and held < start + size:  # data from the file's start
                    raise _sys.LibcError(
                        f"faulting in /dev/shm/{self.name}: the file was truncated to {held} "
                        f"bytes, short of the region's {self.nbytes} (by another process)",
                        errno.EFAULT,
                    ) from exc
                raise _sys.LibcError(
                    f"faulting in /dev/shm/{self.name} (the file system ran out of space: "
                    f"{shm_unpromised_bytes()} bytes free after what other files were promised)",
                    errno.ENOSPC,
                ) from exc
            raise
        return True

    def truncated_to(self) -> int | None:
        """For a shared region whose file another process cut short of the region's
        bytes, the file's size now; None otherwise (or where it cannot be told)."""
        if self.backing != "shared" or self._closed:
            return None
        held = _file_size(self._fd)
        return held if held is not None and held < self.nbytes else None

    def reserve(self, spans: list[tuple[int, int]]) -> None:
        """Give the ``(offset, nbytes)`` spans of a shared region their memory in /dev/shm
        now (``fallocate``), so that touching them cannot end the process with SIGBUS when
        the file system is full: an OSError (ENOSPC) here instead. Nothing to do for an
        anonymous region. Call it off the event loop: it allocates and zeroes pages."""
        self._check_open()
        if self.backing != "shared":
            return
        for offset, nbytes in merged(spans):
            try:
                os.posix_fallocate(self._fd, offset, nbytes)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise _sys.LibcError(
                    f"reserving {nbytes} bytes of /dev/shm/{self.name} (the file system is full)",
                    errno.ENOSPC,
                ) from exc

    def hugepage_bytes(self) -> int:
        """Bytes of this mapping backed by transparent huge pages (from /proc/self/smaps)."""
        if self._closed:
            return 0
        return _sys.hugepage_bytes(self._address, self._address + self.nbytes)

    def release(self, keep: list[Chunk] | None = None) -> bool:
        """Give the region up: unmap it except the chunks in ``keep`` (leaked on purpose),
        close the file and, for the creator of a shared region, unlink it if the name
        still leads to this region's file. Idempotent.

        Returns True when the address range was unmapped now, False when views of it are
        still alive: the range (no longer pinned) is then unmapped when the last view is
        gone. In a forked child nothing is unmapped or unlinked: the region is the parent's.
        """
        if self._closed:
            return self._mapping_ref() is None
        self._closed = True
        mapping, self._mapping = self._mapping, None
        assert mapping is not None
        if os.getpid() != self._pid:
            self._fd = -1  # the parent's descriptor, inherited: leave it to the parent
            return False
        try:
            if self._owner and self.name is not None:
                unlink_if_same(self.name, self._file_id)
                if self._file_id is not None:
                    with _LINKED_LOCK:
                        _LINKED.pop(self._file_id, None)
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            mapping.keep = [(chunk.offset, chunk.nbytes) for chunk in keep or []]
            mapping.released = True
            del mapping  # unmapped here unless a view holds it
        # No gc.collect() for views caught in unreachable cycles: a full collection holds
        # the GIL (100+ ms in a process with torch loaded), stalling the event loop; the
        # interpreter's own collections unmap such a range later.
        return self._mapping_ref() is None

    def close(self) -> None:
        self.release()

    def _check_open(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError("the region is closed")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"0x{self._address:x}"
        return (
            f"<HostRegion {self.backing} name={self.name!r} nbytes={self.nbytes} "
            f"hugepages={self.hugepages} at {state}>"
        )


def validate_nbytes(nbytes: int) -> int:
    """``nbytes`` rounded up to a page if it can size a region, else a ConfigError."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise ConfigError(f"nbytes must be an int, not {type(nbytes).__name__}")
    if nbytes <= 0:
        raise ConfigError(f"nbytes must be positive, got {shown(nbytes)}")
    if nbytes > MAX_NBYTES:
        raise ConfigError(
            f"nbytes={shown(nbytes)} is larger than any machine's memory ({MAX_NBYTES})"
        )
    return round_to_pages(nbytes)


def validate_backing(backing: object) -> Backing:
    """``backing`` if it is a kind of region (``'anonymous'`` or ``'shared'``), else a
    ConfigError."""
    if backing not in ("anonymous", "shared"):
        raise ConfigError(f"unknown backing {backing!r}: use 'anonymous' or 'shared'")
    return backing


def validate_region_options(
    backing: object, name: object, hugepages: object
) -> tuple[Backing, HugePages]:
    """``(backing, hugepages)`` if they and ``name`` make a region together (a name for a
    shared region and only there, huge pages from the hugetlb pool for an anonymous one
    only), else a ConfigError for the first that does not."""
    backing = validate_backing(backing)
    if backing == "shared":
        validate_name(name)
    elif name is not None:
        raise ConfigError("name is only meaningful for backing='shared'")
    hugepages = validate_hugepages(hugepages)
    if hugepages == "hugetlb" and backing != "anonymous":
        raise ConfigError("hugepages='hugetlb' is available for backing='anonymous' only")
    return backing, hugepages


def validate_hugepages(hugepages: object) -> HugePages:
    """``hugepages`` if it is a huge-page policy (``'thp'``, ``'hugetlb'`` or ``'none'``),
    else a ConfigError."""
    if hugepages not in ("thp", "hugetlb", "none"):
        raise ConfigError(f"unknown hugepages policy {hugepages!r}: use 'thp', 'hugetlb' or 'none'")
    return hugepages


def _file_size(fd: int) -> int | None:
    """The size of the file open as ``fd``, None where there is none or it cannot be told
    (the error being reported is the caller's)."""
    if fd < 0:
        return None
    try:
        return os.fstat(fd).st_size
    except OSError:
        return None
