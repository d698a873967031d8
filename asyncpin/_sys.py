"""Thin ctypes bindings to libc and readers of /proc, shared by the region and backends.

ctypes foreign calls release the GIL, which is why mapping, prefaulting and locking go
through here rather than through the ``mmap`` module (whose ``madvise`` holds it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import resource
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MADV_DONTFORK",
    "MADV_HUGEPAGE",
    "MADV_POPULATE_WRITE",
    "PAGE_SIZE",
    "CgroupMemory",
    "LibcError",
    "cgroup_memory",
    "has_cap_ipc_lock",
    "hugepage_bytes",
    "libc_madvise",
    "libc_mlock",
    "libc_mmap",
    "libc_munlock",
    "libc_munmap",
    "mem_available_bytes",
    "meminfo",
    "memlock_limit_bytes",
    "vm_locked_bytes",
]

PAGE_SIZE: int = mmap.PAGESIZE
MADV_HUGEPAGE = 14
MADV_DONTFORK = 10
MADV_POPULATE_WRITE = 23
CAP_IPC_LOCK = 14
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
for _name in ("munmap", "madvise", "mlock", "munlock"):
    _fn = getattr(_libc, _name)
    _fn.restype = ctypes.c_int
    _fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + (
        [ctypes.c_int] if _name == "madvise" else []
    )


class LibcError(OSError):
    """A libc call failed; ``errno`` and ``strerror`` are set as for any OSError."""

    def __init__(self, op: str, err: int) -> None:
        super().__init__(err, f"{op}: {os.strerror(err)}")
        self.op = op
        self.code_name = errno.errorcode.get(err, str(err))


def _check(op: str, rc: int) -> None:
    if rc != 0:
        raise LibcError(op, ctypes.get_errno())


def libc_mmap(nbytes: int, prot: int, flags: int, fd: int = -1, addr: int = 0) -> int:
    address = _libc.mmap(addr or None, nbytes, prot, flags, fd, 0)
    if address is None or address == _MAP_FAILED:
        raise LibcError("mmap", ctypes.get_errno())
    return int(address)


def libc_munmap(address: int, nbytes: int) -> None:
    _check("munmap", _libc.munmap(address, nbytes))


def libc_madvise(address: int, nbytes: int, advice: int) -> None:
    _check("madvise", _libc.madvise(address, nbytes, advice))


def libc_mlock(address: int, nbytes: int) -> None:
    _check("mlock", _libc.mlock(address, nbytes))


def libc_munlock(address: int, nbytes: int) -> None:
    _check("munlock", _libc.munlock(address, nbytes))


def _status_field(field: str) -> str | None:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


def vm_locked_bytes() -> int:
    """Bytes this process holds locked (``VmLck`` in /proc/self/status)."""
    value = _status_field("VmLck")
    return int(value.split()[0]) * 1024 if value else 0


def has_cap_ipc_lock() -> bool:
    """Whether CAP_IPC_LOCK is effective: then RLIMIT_MEMLOCK does not bind mlock."""
    value = _status_field("CapEff")
    return value is not None and bool(int(value, 16) >> CAP_IPC_LOCK & 1)


def memlock_limit_bytes() -> int | None:
    """The soft RLIMIT_MEMLOCK in bytes, or None when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """The memory limit of this process's cgroup and what the cgroup uses now, in bytes."""

    version: int  # 1 or 2
    path: str  # the directory the two figures were read from
    limit_bytes: int
    usage_bytes: int

    @property
    def headroom_bytes(self) -> int:
        return self.limit_bytes - self.usage_bytes


def cgroup_memory() -> CgroupMemory | None:
    """This process's cgroup memory limit (v2 or v1), None if there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _id, controllers, rel = line.split(":", 2)
        if controllers == "":
            version, base = 2, Path("/sys/fs/cgroup") / rel.lstrip("/")
            files = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            version, base = 1, Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        try:
            limit = (base / files[0]).read_text().strip()
            usage = int((base / files[1]).read_text())
        except (OSError, ValueError):
            continue
        # v1 spells "no limit" as a huge page-rounded number, v2 as "max".
        if limit == "max" or int(limit) >= 1 << 62:
            continue
        return CgroupMemory(version, str(base), int(limit), usage)
    return None


def _cgroup_headroom_bytes() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 or v1), None if unlimited."""
    cgroup = cgroup_memory()
    return None if cgroup is None else cgroup.headroom_bytes


def hugepage_bytes(start: int, end: int) -> int:
    """Bytes of the mappings overlapping ``[start, end)`` backed by huge pages, transparent
    or hugetlb (from /proc/self/smaps)."""
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


def meminfo() -> dict[str, int]:
    """/proc/meminfo as numbers: sizes in bytes (the kB fields times 1024), counts as is."""
    fields: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if parts[1:] == ["kB"] else 1
            fields[key] = int(parts[0]) * scale
    return fields


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo, lowered to the cgroup's headroom if smaller."""
    available = meminfo().get("MemAvailable", 0)
    headroom = _cgroup_headroom_bytes()
    return available if headroom is None else min(available, headroom)
