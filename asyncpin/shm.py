"""Shared regions' files in /dev/shm: the header page that marks a file as asyncpin's,
creating and publishing one, attaching to one, and finding and removing stale ones.

A shared region's file is its data followed by one header page. A creator publishes the
file under its name only once it is complete, and holds a shared ``flock`` on it for as
long as it has it open: a file whose lock nobody holds outlived its creator (stale). No
function here follows a symbolic link or unlinks a file that is not asyncpin's.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import re
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncpin import _sys
from asyncpin.errors import ConfigError, PreflightError, RegionNotFoundError

__all__ = [
    "HEADER_BYTES",
    "SHM_DIR",
    "RegionHeader",
    "SharedFile",
    "attach_shared",
    "check_shm_space",
    "create_shared",
    "file_id",
    "is_stale",
    "shm_free_bytes",
    "shm_unpromised_bytes",
    "stale_regions",
    "unlink_if_same",
    "unlink_stale",
    "validate_name",
]

SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")

# A shared region's file is its data followed by one header page that says it is asyncpin's.
_MAGIC = b"ASYNCPIN-REGION\x00"
_VERSION = 1
_HEADER = struct.Struct("<16sIIQQI")  # magic, version, header bytes, data bytes, pid, layout len
HEADER_BYTES = _sys.PAGE_SIZE
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What opening a name gives for a file of a kind no region is (a socket: ENXIO).
_NOT_A_FILE = frozenset({errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP, errno.ETXTBSY})


def validate_name(name: object) -> str:
    """``name`` if it can name a shared region in /dev/shm, else a ConfigError."""
    if name is None:
        raise ConfigError("backing='shared' needs a name")
    if not _is_name(name):
        raise ConfigError(
            f"shared region name {name!r} must be 1-200 letters, digits, '.', '_' or '-'"
        )
    assert isinstance(name, str)
    return name


def _is_name(name: object) -> bool:
    return isinstance(name, str) and bool(_NAME_RE.fullmatch(name)) and name not in (".", "..")


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


@dataclass(frozen=True, slots=True)
class SharedFile:
    """A shared region's file, open as ``fd`` and mapped (its data, not its header) at
    ``address``: what :func:`create_shared` and :func:`attach_shared` hand to the region."""

    fd: int
    address: int
    header: RegionHeader
    #: Whether creating it removed a stale region of the same name (its creator was gone).
    reclaimed_stale: bool = False


# -- space ---------------------------------------------------------------------------------


def shm_unpromised_bytes() -> int:
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
                promised += _unbacked_bytes(info)
    return st.f_bavail * st.f_frsize - promised


def _unbacked_bytes(info: os.stat_result) -> int:
    """Bytes of a file's size that no block holds yet (a sparse file's promise)."""
    return max(0, info.st_size - info.st_blocks * 512)


def shm_free_bytes() -> int:
    """Bytes a new region in /dev/shm can count on (see :func:`shm_unpromised_bytes`)."""
    return max(0, shm_unpromised_bytes())


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


# -- creating and attaching ----------------------------------------------------------------


def create_shared(nbytes: int, name: str, layout: dict[str, Any] | None) -> SharedFile:
    """Create ``/dev/shm/<name>`` (mode 0600) for ``nbytes`` (a page multiple) of data and
    map its data. The file appears only once it is complete: sized, locked by this process
    and ending with a header page that records its size and ``layout``. A stale region of
    the same name is removed first; any other file of that name is a ConfigError."""
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
                if shm_unpromised_bytes() < 0:
                    raise PreflightError(
                        "shm",
                        nbytes,
                        shm_free_bytes(),
                        f"free space in {SHM_DIR}: another region took it while this one was made",
                    )
                address = _map_shared(fd, nbytes)
            except BaseException:
                unlink_if_same(name, file_id(os.fstat(fd)))
                raise
        except BaseException:
            if address is not None:
                _sys.libc_munmap(address, nbytes)
            os.close(fd)
            raise
    finally:
        os.close(dir_fd)
    return SharedFile(fd, address, header, reclaimed)


def attach_shared(
    name: str,
    *,
    preflight: Callable[[int], None] | None = None,
    layout: dict[str, Any] | None = None,
) -> SharedFile:
    """Open and map the data of the existing shared region ``name``.

    Only a region made by asyncpin is accepted (see :func:`_open_own`). If the header
    records a KV layout and ``layout`` is given, they must agree. Before anything is
    mapped, the memory that attaching would add (the part of the region not backed yet)
    is checked against MemAvailable, then ``preflight(nbytes)`` runs."""
    validate_name(name)
    fd, info, header = _open_own(name, os.O_RDWR)
    try:
        if layout is not None and header.layout is not None:
            _check_layout(name, header.layout, layout)
        nbytes = header.nbytes
        unbacked = _unbacked_bytes(info)
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
        address = _map_shared(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return SharedFile(fd, address, header)


def _map_shared(fd: int, nbytes: int) -> int:
    return _sys.libc_mmap(nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd)


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


def file_id(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def unlink_if_same(name: str, expected: tuple[int, int] | None) -> bool:
    """Unlink /dev/shm/<name> only if it is still the file whose :func:`file_id` is
    ``expected``; returns whether it did."""
    try:
        now = os.stat(SHM_DIR / name, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if file_id(now) != expected:
        return False
    try:
        (SHM_DIR / name).unlink()
    except FileNotFoundError:
        return False
    return True


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
        if exc.errno in _NOT_A_FILE:  # a socket, a device: what no region is
            raise ConfigError(
                f"{path} cannot be opened ({exc.strerror}): not a region made by asyncpin"
            ) from None
        raise  # out of descriptors or memory, an I/O error: this process's trouble
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
    for key in ("num_arrays", "arrays", "host_block_bytes", "ranks"):
        if key not in expected:
            continue
        if key not in recorded:
            raise ConfigError(f"shared region {name!r} does not record its KV blocks' {key}")
        if recorded[key] != expected[key]:
            what = (
                "arrays whose block shapes, dtypes or element order differ (a digest "
                f"{recorded[key]!r}, not {expected[key]!r})"
                if key == "arrays"
                else f"{key}={recorded[key]!r}, not {expected[key]!r}"
            )
            raise ConfigError(
                f"shared region {name!r} holds KV blocks with {what}: the creator's KV "
                "layout differs from this one"
            )


# -- stale regions -------------------------------------------------------------------------


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
    validate_name(name)
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
    validate_name(name)
    try:
        fd, info, _ = _open_own(name, os.O_RDONLY)
    except (RegionNotFoundError, ConfigError):
        return False
    try:
        if not _locked_if_stale(fd):
            return False
        # Unlink the file we found stale, not one created under the same name since.
        return unlink_if_same(name, file_id(info))
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
        if not _is_name(name):
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
