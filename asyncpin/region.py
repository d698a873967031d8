"""HostRegion: one host mapping for KV blocks, cut into chunks that are pinned one by one.

A region is an exact page-rounded span of virtual memory: anonymous, or a named file in
/dev/shm that another process can attach to. Mapping costs no time that grows with its
size; pages are faulted in later, chunk by chunk, by :meth:`HostRegion.prefault`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gc
import json
import mmap
import os
import re
import stat
import struct
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from asyncpin import _sys
from asyncpin.errors import ConfigError, PreflightError, RegionNotFoundError

__all__ = [
    "Backing",
    "Chunk",
    "HostRegion",
    "HugePages",
    "RegionHeader",
    "is_stale",
    "round_to_pages",
    "shm_free_bytes",
    "stale_regions",
    "unlink_stale",
]

Backing = Literal["anonymous", "shared"]
HugePages = Literal["thp", "hugetlb", "none"]

SHM_DIR = Path("/dev/shm")
_HUGE_PAGE = 2 << 20
_MAP_HUGETLB = 0x40000
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")
# Far beyond any machine's memory, and far below where size arithmetic (and size_t) wraps.
MAX_NBYTES = 1 << 56

# A shared region's file is its data followed by one header page that says it is asyncpin's.
_MAGIC = b"ASYNCPIN-REGION\x00"
_VERSION = 1
_HEADER = struct.Struct("<16sIIQQI")  # magic, version, header bytes, data bytes, pid, layout len
HEADER_BYTES = _sys.PAGE_SIZE
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def round_to_pages(nbytes: int) -> int:
    return -(-nbytes // _sys.PAGE_SIZE) * _sys.PAGE_SIZE


@dataclass(frozen=True, slots=True)
class Chunk:
    """A slice of the region that is prefaulted and pinned as one unit."""

    index: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class RegionHeader:
    """What a shared region's header page records: the data size, the creator's pid and
    what the bytes mean (the KV layout, when the creator had one)."""

    nbytes: int
    creator_pid: int
    layout: dict[str, Any] | None = None

    def pack(self) -> bytes:
        layout = json.dumps(self.layout, sort_keys=True).encode() if self.layout else b""
        head = _HEADER.pack(
            _MAGIC, _VERSION, HEADER_BYTES, self.nbytes, self.creator_pid, len(layout)
        )
        if len(head) + len(layout) > HEADER_BYTES:
            raise ConfigError("the KV layout's description does not fit in a region header")
        return (head + layout).ljust(HEADER_BYTES, b"\x00")

    @classmethod
    def read(cls, fd: int, file_size: int) -> RegionHeader | None:
        """The header of the file open as ``fd``, or None if it is not an asyncpin region."""
        if file_size < HEADER_BYTES + _sys.PAGE_SIZE or file_size % _sys.PAGE_SIZE:
            return None
        data = os.pread(fd, HEADER_BYTES, file_size - HEADER_BYTES)
        if len(data) < _HEADER.size:
            return None
        magic, version, header_bytes, nbytes, pid, layout_len = _HEADER.unpack_from(data)
        if (
            magic != _MAGIC
            or version != _VERSION
            or header_bytes != HEADER_BYTES
            or nbytes + HEADER_BYTES != file_size
            or _HEADER.size + layout_len > HEADER_BYTES
        ):
            return None
        layout = None
        if layout_len:
            try:
                layout = json.loads(data[_HEADER.size : _HEADER.size + layout_len])
            except (ValueError, RecursionError):  # anyone can write a file: forged nesting
                return None
            if not isinstance(layout, dict):
                return None
        return cls(nbytes, pid, layout)


class _Mapping:
    """The address range of one region. The region and every view of it hold it; once the
    region is released, the range is unmapped when the last holder lets go, so no view can
    read unmapped memory or reach whatever is mapped there next."""

    __slots__ = ("__weakref__", "address", "keep", "nbytes", "pid", "released")

    def __init__(self, address: int, nbytes: int) -> None:
        self.address = address
        self.nbytes = nbytes
        self.pid = os.getpid()
        self.keep: list[Chunk] = []
        self.released = False
        _LIVE.add(self)

    def __del__(self) -> None:
        # In a forked child that could not cover the range (see _cover_in_child), it may
        # hold the child's own memory, which must not be unmapped.
        if self.released and os.getpid() == self.pid:
            _unmap_except(self.address, self.nbytes, self.keep)


_LIVE: weakref.WeakSet[_Mapping] = weakref.WeakSet()
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


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` spans sorted, with touching or overlapping ones joined."""
    out: list[tuple[int, int]] = []
    for offset, nbytes in sorted(spans):
        if out and offset <= out[-1][0] + out[-1][1]:
            start = out[-1][0]
            out[-1] = (start, max(out[-1][1], offset + nbytes - start))
        else:
            out.append((offset, nbytes))
    return out


def _unmap_except(address: int, nbytes: int, keep: list[Chunk]) -> None:
    cursor = 0
    for chunk in sorted(keep, key=lambda c: c.offset):
        if chunk.offset > cursor:
            _sys.libc_munmap(address + cursor, chunk.offset - cursor)
        cursor = chunk.offset + chunk.nbytes
    if cursor < nbytes:
        _sys.libc_munmap(address + cursor, nbytes - cursor)


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
        self._file_id = _file_id(os.fstat(fd)) if fd >= 0 else None
        self._owner = owner
        self._pid = os.getpid()
        self._closed = False
        self._mapping: _Mapping | None = _Mapping(address, nbytes)
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
        if hugepages not in ("thp", "hugetlb", "none"):
            raise ConfigError(
                f"unknown hugepages policy {hugepages!r}: use 'thp', 'hugetlb' or 'none'"
            )
        if hugepages == "hugetlb" and backing != "anonymous":
            raise ConfigError("hugepages='hugetlb' is available for backing='anonymous' only")
        if backing == "anonymous":
            if name is not None:
                raise ConfigError("name is only meaningful for backing='shared'")
            if hugepages == "hugetlb":
                nbytes = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
                address = _map_hugetlb(nbytes)
            else:
                address = _map_anonymous_aligned(nbytes)
            region = cls(
                address=address,
                nbytes=nbytes,
                backing=backing,
                hugepages=hugepages,
                name=None,
                fd=-1,
                owner=True,
            )
        elif backing == "shared":
            _check_name(name)
            assert name is not None
            region = _create_shared(cls, nbytes, name, hugepages, layout)
        else:
            raise ConfigError(f"unknown backing {backing!r}: use 'anonymous' or 'shared'")
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
        _check_name(name)
        fd, info, header = _open_own(name, os.O_RDWR)
        try:
            if layout is not None and header.layout is not None:
                _check_layout(name, header.layout, layout)
            nbytes = header.nbytes
            unbacked = max(0, info.st_size - info.st_blocks * 512)
            available = _sys.mem_available_bytes()
            if unbacked > available:
                raise PreflightError(
                    "memory",
                    unbacked,
                    available,
                    f"{unbacked} bytes of shared region {name!r} are not backed yet and "
                    "pinning it would fault them in: free memory first",
                )
            if preflight is not None:
                preflight(nbytes)
            address = _sys.libc_mmap(nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd)
        except BaseException:
            os.close(fd)
            raise
        region = cls(
            address=address,
            nbytes=nbytes,
            backing="shared",
            hugepages=hugepages,
            name=name,
            fd=fd,
            owner=False,
            header=header,
        )
        region._advise()
        return region

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

    def chunks(self, chunk_bytes: int) -> list[Chunk]:
        """Cut the region into ``chunk_bytes`` pieces (a page multiple); the last may be short."""
        if chunk_bytes <= 0 or chunk_bytes % _sys.PAGE_SIZE:
            raise ConfigError(
                f"chunk_bytes={chunk_bytes} must be a positive multiple of the page size "
                f"({_sys.PAGE_SIZE})"
            )
        return [
            Chunk(i, offset, min(chunk_bytes, self.nbytes - offset))
            for i, offset in enumerate(range(0, self.nbytes, chunk_bytes))
        ]

    def view(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor over ``[offset, offset + nbytes)``. It (and every tensor made
        from it) keeps that memory mapped while it lives, past :meth:`release` too."""
        self._check_open()
        if nbytes is None:
            nbytes = self.nbytes - offset
        if (
            isinstance(offset, bool)
            or not isinstance(offset, int)
            or isinstance(nbytes, bool)
            or not isinstance(nbytes, int)
            or offset < 0
            or nbytes <= 0
            or offset + nbytes > self.nbytes
        ):
            if isinstance(nbytes, int) and nbytes <= 0:
                raise ConfigError(f"a view needs a positive length, not nbytes={nbytes}")
            raise ConfigError(
                f"view of {nbytes!r} bytes at offset {offset!r} is outside the region of "
                f"{self.nbytes} bytes"
            )
        array = (ctypes.c_uint8 * nbytes).from_address(self._address + offset)
        # The tensor holds the ctypes array, which holds the mapping.
        array._asyncpin_mapping = self._mapping  # type: ignore[attr-defined]
        return torch.frombuffer(array, dtype=torch.uint8)

    def prefault(self, offset: int, nbytes: int) -> None:
        """Fault in ``[offset, offset+nbytes)`` for writing, with the GIL released, without
        changing a byte.

        Uses MADV_POPULATE_WRITE (an error, not SIGBUS, if memory runs out). Kernels
        before 5.14 lack it (EINVAL): then this does nothing and the pin call (mlock,
        cudaHostRegister) faults the pages in itself. Touching them with writes is no
        substitute: the chunk may already hold data (an attached region, or a pageable
        store that reached the chunk first), and a memset erased it. For a shared region,
        a full /dev/shm is reported as ENOSPC.
        """
        self._check_open()
        try:
            _sys.libc_madvise(self._address + offset, nbytes, _sys.MADV_POPULATE_WRITE)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return
            if exc.errno == errno.EFAULT and self.backing == "shared":
                raise _sys.LibcError(
                    f"faulting in /dev/shm/{self.name} (the file system ran out of space: "
                    f"{_shm_free_raw()} bytes free after what other files were promised)",
                    errno.ENOSPC,
                ) from exc
            raise

    def reserve(self, spans: list[tuple[int, int]]) -> None:
        """Give the ``(offset, nbytes)`` spans of a shared region their memory in /dev/shm
        now (``fallocate``), so that touching them cannot end the process with SIGBUS when
        the file system is full: an OSError (ENOSPC) here instead. Nothing to do for an
        anonymous region. Call it off the event loop: it allocates and zeroes pages."""
        self._check_open()
        if self.backing != "shared":
            return
        for offset, nbytes in _merged(spans):
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
        start, end = self._address, self._address + self.nbytes
        total = 0
        inside = False
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and line.startswith(
                ("AnonHugePages:", "ShmemPmdMapped:", "Private_Hugetlb:", "Shared_Hugetlb:")
            ):
                total += int(line.split()[1]) * 1024
        return total

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
                _unlink_if_same(self.name, self._file_id)
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            mapping.keep = list(keep or [])
            mapping.released = True
            del mapping  # unmapped here unless a view holds it
        if self._mapping_ref() is not None:
            gc.collect()  # views caught in reference cycles that nothing reaches any more
        return self._mapping_ref() is None

    def close(self) -> None:
        self.release()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the region is closed")

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"0x{self._address:x}"
        return (
            f"<HostRegion {self.backing} name={self.name!r} nbytes={self.nbytes} "
            f"hugepages={self.hugepages} at {state}>"
        )


def validate_backing(backing: str) -> None:
    if backing not in ("anonymous", "shared"):
        raise ConfigError(f"unknown backing {backing!r}: use 'anonymous' or 'shared'")


def validate_hugepages(hugepages: str) -> None:
    if hugepages not in ("thp", "hugetlb", "none"):
        raise ConfigError(
            f"unknown hugepages policy {hugepages!r}: use 'thp', 'hugetlb' or 'none'"
        )


def validate_nbytes(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise ConfigError(f"nbytes must be an int, not {type(nbytes).__name__}")
    if nbytes <= 0:
        raise ConfigError(f"nbytes must be positive, got {nbytes}")
    if nbytes > MAX_NBYTES:
        raise ConfigError(f"nbytes={nbytes} is larger than any machine's memory ({MAX_NBYTES})")
    return round_to_pages(nbytes)


def _shm_free_raw() -> int:
    """Free bytes in /dev/shm less the bytes this user's sparse files there were promised
    (their size) and do not hold yet: a file's size takes no space until its pages are
    touched, so the plain free space lets two regions promise the same memory. Other
    users' files are not counted: any user could otherwise refuse every creator with one
    huge empty file. Negative when over-promised."""
    st = os.statvfs(SHM_DIR)
    uid = os.geteuid()
    promised = 0
    with os.scandir(SHM_DIR) as entries:
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            if stat.S_ISREG(info.st_mode) and info.st_uid == uid:
                promised += max(0, info.st_size - info.st_blocks * 512)
    return st.f_bavail * st.f_frsize - promised


def shm_free_bytes() -> int:
    """Bytes a new region in /dev/shm can count on (see :func:`_shm_free_raw`)."""
    return max(0, _shm_free_raw())


def check_shm_space(nbytes: int) -> None:
    free = shm_free_bytes()
    if nbytes > free:
        raise PreflightError(
            "shm",
            nbytes,
            free,
            f"free space in {SHM_DIR} (less what other files there were promised and do "
            f"not hold yet) or enlarge it (mount -o remount,size=... {SHM_DIR}; in docker: "
            "--shm-size)",
        )


def _create_shared(
    cls: type[HostRegion],
    nbytes: int,
    name: str,
    hugepages: HugePages,
    layout: dict[str, Any] | None,
) -> HostRegion:
    header = RegionHeader(nbytes, os.getpid(), layout)
    header_page = header.pack()  # a layout too large is refused before anything is made
    # A stale region of this name goes first: its memory must not count against its
    # replacement (a supervisor restarting a killed server reuses the name).
    try:
        reclaimed_early = _exists(name) and _stale_for_sure(name) and unlink_stale(name)
    except (ConfigError, RegionNotFoundError):
        reclaimed_early = False  # not asyncpin's, or gone: publishing says which
    check_shm_space(nbytes + HEADER_BYTES)
    dir_fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # An unnamed file, published under its name only once it is complete: a creator
        # killed on the way leaves nothing behind.
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        address = None
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            # Held until this process closes the file or dies: how is_stale() tells a live
            # creator from a killed one.
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, nbytes + HEADER_BYTES)
            os.pwrite(fd, header_page, nbytes)
            reclaimed = _publish(fd, name, dir_fd) or reclaimed_early
            try:
                # Checked again with this file visible: two creators that passed the check
                # at once must not both keep memory that only one of them can have.
                if _shm_free_raw() < 0:
                    raise PreflightError(
                        "shm",
                        nbytes,
                        shm_free_bytes(),
                        f"free space in {SHM_DIR}: another region took it while this one was made",
                    )
                address = _sys.libc_mmap(
                    nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd
                )
            except BaseException:
                _unlink_if_same(name, _file_id(os.fstat(fd)))
                raise
        except BaseException:
            if address is not None:
                _sys.libc_munmap(address, nbytes)
            os.close(fd)
            raise
    finally:
        os.close(dir_fd)
    return cls(
        address=address,
        nbytes=nbytes,
        backing="shared",
        hugepages=hugepages,
        name=name,
        fd=fd,
        owner=True,
        header=header,
        reclaimed_stale=reclaimed,
    )


def _publish(fd: int, name: str, dir_fd: int) -> bool:
    """Give the unnamed file ``fd`` its name; True if a stale region had to go first."""
    path = SHM_DIR / name
    reclaimed = False
    for _ in range(8):  # each pass loses a race with another process at most
        try:
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)
            return reclaimed
        except FileExistsError:
            pass
        try:
            stale = _stale_for_sure(name)
        except RegionNotFoundError:
            continue  # gone meanwhile
        except ConfigError:
            raise ConfigError(
                f"{path} exists and is not a region made by asyncpin; pick another name"
            ) from None
        if not stale:
            raise ConfigError(
                f"a shared region named {name!r} already exists ({path}) and its creator is "
                "alive; attach to it, or pick another name"
            )
        reclaimed = unlink_stale(name) or reclaimed
    raise ConfigError(f"could not create {path}: other processes keep creating and removing it")


def _exists(name: str) -> bool:
    return os.path.lexists(SHM_DIR / name)


def _stale_for_sure(name: str) -> bool:
    """:func:`is_stale`, asked again when the answer is "live": another process probing
    the same region (a doctor, a scan) holds its lock for a moment, which looks like a
    live creator. A live creator's lock is there every time."""
    for attempt in range(4):
        if is_stale(name):
            return True
        if attempt < 3:
            time.sleep(0.001 * (attempt + 1))
    return False


def _file_id(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _unlink_if_same(name: str, file_id: tuple[int, int] | None) -> None:
    """Unlink /dev/shm/<name> only if it is still the file ``file_id`` names."""
    try:
        now = os.stat(SHM_DIR / name, follow_symlinks=False)
    except FileNotFoundError:
        return
    if _file_id(now) == file_id:
        (SHM_DIR / name).unlink(missing_ok=True)


def _open_own(name: str, flags: int) -> tuple[int, os.stat_result, RegionHeader]:
    """Open /dev/shm/<name> if it is a region made by asyncpin, of this user.

    Never follows a symbolic link; the opened file must be a regular file on the /dev/shm
    file system, owned by this user, mode 0600, one link, with a valid header. Raises
    RegionNotFoundError, or ConfigError saying which check failed."""
    path = SHM_DIR / name
    try:
        fd = os.open(path, flags | _OPEN_FLAGS)
    except FileNotFoundError:
        raise RegionNotFoundError(name, str(path)) from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory, not a shared region") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(
                f"{path} is a symbolic link; refusing to follow it (not a region made by asyncpin)"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise ConfigError(
                f"{path} cannot be opened by uid {os.geteuid()} ({exc.strerror}): another "
                "user's file, not a region of this user's"
            ) from None
        raise
    try:
        info = os.fstat(fd)
        uid = os.geteuid()
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
            raise ConfigError(
                f"{path} is not a regular file owned by uid {uid}; refusing to attach"
            )
        if info.st_dev != os.stat(SHM_DIR).st_dev or info.st_nlink != 1:
            raise ConfigError(f"{path} is linked from elsewhere; refusing to attach")
        header = RegionHeader.read(fd, info.st_size)
        if header is None:
            raise ConfigError(
                f"{path} has size {info.st_size} and no asyncpin header: not a region made by "
                "asyncpin"
            )
        if stat.S_IMODE(info.st_mode) != 0o600:
            raise ConfigError(
                f"{path} has mode {stat.S_IMODE(info.st_mode):o}, not 0600: not a region made "
                "by asyncpin"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, info, header


def _check_layout(name: str, recorded: dict[str, Any], expected: dict[str, Any]) -> None:
    # The most telling difference first; an attacher may use fewer host blocks (the size
    # check covers that).
    for key in ("num_arrays", "dtype", "block_shape", "host_block_bytes"):
        if key not in expected:
            continue
        if key not in recorded:
            raise ConfigError(f"shared region {name!r} does not record its KV blocks' {key}")
        if recorded[key] != expected[key]:
            raise ConfigError(
                f"shared region {name!r} holds KV blocks with {key}={recorded[key]!r}, "
                f"not {expected[key]!r}: the creator's KV layout differs from this one"
            )


def is_stale(name: str) -> bool:
    """Whether the shared region ``name`` outlived its creator: the creator died (killed,
    say) without unlinking it. Raises RegionNotFoundError if there is no such file, and
    ConfigError if the file is not a region made by asyncpin (of this user).

    A creator holds a shared ``flock`` on its file for as long as it has the region open
    (a child it forked without exec, which inherits the descriptor, holds it too); the
    kernel drops it when the process dies. Attachers take no lock, so a region that
    attachers still map is stale all the same once its creator is gone: only its name is
    left to clean up (:func:`unlink_stale`).
    """
    _check_name(name)
    fd, _, _ = _open_own(name, os.O_RDONLY)
    try:
        return _locked_if_stale(fd)
    finally:
        os.close(fd)


def unlink_stale(name: str) -> bool:
    """Unlink the shared region ``name`` if it is asyncpin's and stale (see
    :func:`is_stale`); returns whether it did. Processes that still map it keep their
    mappings; the memory goes back when the last one unmaps it. A region of a live
    creator, a missing name and a file that is not asyncpin's are left alone."""
    _check_name(name)
    try:
        fd, info, _ = _open_own(name, os.O_RDONLY)
    except (RegionNotFoundError, ConfigError):
        return False
    try:
        if not _locked_if_stale(fd):
            return False
        # Unlink the file we found stale, not one created under the same name since.
        try:
            now = os.stat(SHM_DIR / name, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if _file_id(now) != _file_id(info):
            return False
        (SHM_DIR / name).unlink()
        return True
    finally:
        os.close(fd)


def stale_regions() -> list[str]:
    """Names of this user's asyncpin regions in /dev/shm whose creator is gone."""
    names = []
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    for name in entries:
        if not _NAME_RE.fullmatch(name) or name in (".", ".."):
            continue
        try:
            if is_stale(name):
                names.append(name)
        except (OSError, ConfigError):
            continue  # not ours, not asyncpin's, or gone meanwhile
    return names


def _locked_if_stale(fd: int) -> bool:
    """Take an exclusive lock on ``fd`` if no creator holds its shared one (stale)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _check_name(name: str | None) -> None:
    if name is None:
        raise ConfigError("backing='shared' needs a name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            f"shared region name {name!r} must be 1-200 letters, digits, '.', '_' or '-'"
        )


def hugetlb_free_bytes() -> int:
    """Free pages of the default hugetlb pool, in bytes (/proc/meminfo)."""
    fields = _sys.meminfo()
    return fields.get("HugePages_Free", 0) * fields.get("Hugepagesize", 0)


def _map_hugetlb(nbytes: int) -> int:
    """Map from the reserved hugetlb pool; a short pool is a PreflightError saying what to do."""
    free = hugetlb_free_bytes()
    fix = (
        f"the pool needs {nbytes // _HUGE_PAGE} free 2 MiB pages (raise "
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


def _map_anonymous_aligned(nbytes: int) -> int:
    """Map anonymous memory at a 2 MiB boundary, exactly ``nbytes`` long, so that THP
    can back it from its first byte; the slack of the over-sized mapping is unmapped."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    raw = _sys.libc_mmap(nbytes + _HUGE_PAGE, prot, flags)
    start = -(-raw // _HUGE_PAGE) * _HUGE_PAGE
    if start > raw:
        _sys.libc_munmap(raw, start - raw)
    tail = raw + nbytes + _HUGE_PAGE - (start + nbytes)
    if tail:
        _sys.libc_munmap(start + nbytes, tail)
    return start
