"""HostRegion: one host mapping for KV blocks, cut into chunks that are pinned one by one.

A region is an exact page-rounded span of virtual memory: anonymous, or a named file in
/dev/shm that another process can attach to. Mapping costs no time that grows with its
size; pages are faulted in later, chunk by chunk, by :meth:`HostRegion.prefault`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from asyncpin import _sys
from asyncpin.errors import ConfigError, PreflightError, RegionNotFoundError

__all__ = [
    "Backing",
    "Chunk",
    "HostRegion",
    "HugePages",
    "is_stale",
    "round_to_pages",
    "unlink_stale",
]

Backing = Literal["anonymous", "shared"]
HugePages = Literal["thp", "hugetlb", "none"]

SHM_DIR = Path("/dev/shm")
_HUGE_PAGE = 2 << 20
_MAP_HUGETLB = 0x40000
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def round_to_pages(nbytes: int) -> int:
    return -(-nbytes // _sys.PAGE_SIZE) * _sys.PAGE_SIZE


@dataclass(frozen=True, slots=True)
class Chunk:
    """A slice of the region that is prefaulted and pinned as one unit."""

    index: int
    offset: int
    nbytes: int


class HostRegion:
    """One mapping of host memory.

    Use :meth:`create` or :meth:`attach`; :meth:`close` releases it. After close every
    view handed out earlier points at unmapped memory and must not be touched.
    """

    __slots__ = (
        "_address",
        "_closed",
        "_fd",
        "_owner",
        "_path",
        "backing",
        "hugepages",
        "name",
        "nbytes",
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
        path: Path | None,
        owner: bool,
    ) -> None:
        self._address = address
        self.nbytes = nbytes
        self.backing: Backing = backing
        self.hugepages: HugePages = hugepages
        self.name = name
        self._fd = fd
        self._path = path
        self._owner = owner
        self._closed = False

    # -- construction -----------------------------------------------------------------

    @classmethod
    def create(
        cls,
        nbytes: int,
        *,
        backing: Backing = "anonymous",
        name: str | None = None,
        hugepages: HugePages = "thp",
    ) -> HostRegion:
        """Map ``nbytes`` (rounded up to a page) of fresh memory.

        For ``backing="shared"`` a file ``/dev/shm/<name>`` is created exclusively with
        mode 0600; it is unlinked when this region closes.
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
                path=None,
                owner=True,
            )
        elif backing == "shared":
            path = _shm_path(name)
            check_shm_space(nbytes)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raise ConfigError(
                    f"a shared region named {name!r} already exists ({path}); "
                    "attach to it, or pick another name"
                ) from None
            try:
                # Held until this process closes the file or dies: how is_stale() tells a
                # live creator from a killed one. Taken before the file has a size, so a
                # file without a size is never mistaken for a stale one.
                fcntl.flock(fd, fcntl.LOCK_SH)
                os.ftruncate(fd, nbytes)
                address = _sys.libc_mmap(
                    nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd
                )
            except BaseException:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            region = cls(
                address=address,
                nbytes=nbytes,
                backing=backing,
                hugepages=hugepages,
                name=name,
                fd=fd,
                path=path,
                owner=True,
            )
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
    ) -> HostRegion:
        """Map an existing shared region by name. An attacher never unlinks it.

        ``preflight(nbytes)`` runs once the size is known, before anything is mapped."""
        path = _shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise RegionNotFoundError(name, str(path)) from None
        except IsADirectoryError:
            raise ConfigError(f"{path} is a directory, not a shared region") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise ConfigError(
                    f"{path} is not a regular file owned by uid {os.geteuid()}; refusing to attach"
                )
            nbytes = info.st_size
            if nbytes <= 0 or nbytes % _sys.PAGE_SIZE:
                raise ConfigError(f"{path} has size {nbytes}, not a region made by asyncpin")
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
            path=path,
            owner=False,
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
        """A uint8 tensor over ``[offset, offset + nbytes)``; valid until :meth:`close`."""
        self._check_open()
        if nbytes is None:
            nbytes = self.nbytes - offset
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            raise ConfigError(
                f"view [{offset}, {offset + nbytes}) is outside the region of {self.nbytes} bytes"
            )
        array = (ctypes.c_uint8 * nbytes).from_address(self._address + offset)
        return torch.frombuffer(array, dtype=torch.uint8)

    def prefault(self, offset: int, nbytes: int) -> None:
        """Fault in ``[offset, offset+nbytes)`` for writing, with the GIL released, without
        changing a byte.

        Uses MADV_POPULATE_WRITE (an error, not SIGBUS, if memory runs out). Kernels
        before 5.14 lack it (EINVAL): then this does nothing and the pin call (mlock,
        cudaHostRegister) faults the pages in itself. Touching them with writes is no
        substitute: the chunk may already hold data (an attached region, or a pageable
        store that reached the chunk first), and a memset erased it.
        """
        self._check_open()
        try:
            _sys.libc_madvise(self._address + offset, nbytes, _sys.MADV_POPULATE_WRITE)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise

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

    def release(self, keep: list[Chunk] | None = None) -> None:
        """Unmap the region except the chunks in ``keep`` (leaked on purpose), close the
        file and, for the creator of a shared region, unlink it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        cursor = 0
        for chunk in sorted(keep or [], key=lambda c: c.offset):
            if chunk.offset > cursor:
                _sys.libc_munmap(self._address + cursor, chunk.offset - cursor)
            cursor = chunk.offset + chunk.nbytes
        if cursor < self.nbytes:
            _sys.libc_munmap(self._address + cursor, self.nbytes - cursor)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._owner and self._path is not None:
            self._path.unlink(missing_ok=True)

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


def validate_nbytes(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise ConfigError(f"nbytes must be an int, not {type(nbytes).__name__}")
    if nbytes <= 0:
        raise ConfigError(f"nbytes must be positive, got {nbytes}")
    return round_to_pages(nbytes)


def check_shm_space(nbytes: int) -> None:
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise PreflightError(
            "shm",
            nbytes,
            free,
            f"free space in {SHM_DIR} or enlarge it (mount -o remount,size=... {SHM_DIR}; "
            "in docker: --shm-size)",
        )


def is_stale(name: str) -> bool:
    """Whether the shared region ``name`` outlived its creator: the creator died (killed,
    say) without unlinking it. Raises RegionNotFoundError if there is no such file.

    A creator holds a shared ``flock`` on its file for as long as it has the region open
    (a child it forked without exec, which inherits the descriptor, holds it too); the
    kernel drops it when the process dies. Attachers take no lock, so a region that
    attachers still map is stale all the same once its creator is gone: only its name is
    left to clean up (:func:`unlink_stale`). A file being created (no size yet) is not.
    """
    path = _shm_path(name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise RegionNotFoundError(name, str(path)) from None
    try:
        return _locked_if_stale(fd)
    finally:
        os.close(fd)


def unlink_stale(name: str) -> bool:
    """Unlink the shared region ``name`` if it is stale (see :func:`is_stale`); returns
    whether it did. Processes that still map it keep their mappings; the memory goes back
    when the last one unmaps it. A region of a live creator is left alone."""
    path = _shm_path(name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if not _locked_if_stale(fd):
            return False
        # Unlink the file we found stale, not one created under the same name since.
        mine, now = os.fstat(fd), os.stat(path)
        if (mine.st_dev, mine.st_ino) != (now.st_dev, now.st_ino):
            return False
        path.unlink()
        return True
    finally:
        os.close(fd)


def _locked_if_stale(fd: int) -> bool:
    """Take an exclusive lock on ``fd`` if no creator holds its shared one (stale)."""
    if os.fstat(fd).st_size == 0:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _shm_path(name: str | None) -> Path:
    if name is None:
        raise ConfigError("backing='shared' needs a name")
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise ConfigError(
            f"shared region name {name!r} must be 1-200 letters, digits, '.', '_' or '-'"
        )
    return SHM_DIR / name


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
