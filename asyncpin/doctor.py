"""Pre-flight doctor: checks this machine for what asyncpin needs, and says what to change.

:func:`run_checks` returns one :class:`Check` per item: memory available and the cgroup
limit, RLIMIT_MEMLOCK and CAP_IPC_LOCK, transparent huge pages (mode and defrag), the
hugetlb pool, free space in /dev/shm, stale shared regions, the CUDA driver, runtime and
GPUs, and the batched copy API. ``python -m asyncpin doctor`` prints them as a table
(``--json`` for machines) and exits 1 if any check failed.

Checks are measured against a buffer size: the one given, else the demo's default
(``min(4 GiB, available / 4)``, capped by what is left of RLIMIT_MEMLOCK when mlock pins
it without CAP_IPC_LOCK: :func:`asyncpin.cli.default_nbytes`). A check fails when that
buffer cannot work as asked; it warns when something costs speed or matters only for an
option that is not in use.

Each check reads the machine through one small reader (``_read_meminfo``, ``_cgroup``,
``_memlock``, ``_thp``, ``_shm_free``, ``_cuda``): tests fake a machine by replacing them.
CUDA is touched only when ``torch.cuda.is_available()`` is True.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from asyncpin import _sys
from asyncpin.shm import SHM_DIR, shm_free_bytes, stale_regions

__all__ = ["Check", "CudaInfo", "Memlock", "Status", "render", "run_checks", "worst"]

Status = Literal["pass", "warn", "fail"]
_RANK: dict[Status, int] = {"pass": 0, "warn": 1, "fail": 2}
_THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
_BATCH_COPY_RUNTIME = 12080  # cudaMemcpyBatchAsync: CUDA 12.8 and later
_MEMLOCK_FIX = (
    "raise it: `ulimit -l unlimited` (docker: --ulimit memlock=-1; systemd: "
    "LimitMEMLOCK=infinity; /etc/security/limits.conf), or grant CAP_IPC_LOCK"
)


@dataclass(frozen=True, slots=True)
class Check:
    """One finding: ``status`` is ``pass``, ``warn`` or ``fail``; ``advice`` says what to
    change (empty when there is nothing to do)."""

    name: str
    status: Status
    value: str
    advice: str = ""


@dataclass(frozen=True, slots=True)
class Memlock:
    """RLIMIT_MEMLOCK (None: unlimited), bytes already locked, and CAP_IPC_LOCK."""

    limit_bytes: int | None
    locked_bytes: int
    has_cap_ipc_lock: bool


@dataclass(frozen=True, slots=True)
class CudaInfo:
    """What torch and the CUDA runtime it loaded say. Versions as CUDA spells them
    (12080 is 12.8); None where unknown, ``error`` when asking failed."""

    torch_cuda: str | None  # torch.version.cuda: the CUDA torch was built for
    available: bool  # torch.cuda.is_available()
    devices: tuple[str, ...] = ()
    runtime_version: int | None = None
    driver_version: int | None = None
    batch_copy: bool | None = None
    error: str | None = None


# -- readers (replaced in tests) --------------------------------------------------------


def _read_meminfo() -> dict[str, int]:
    return _sys.meminfo()


def _cgroup() -> _sys.CgroupMemory | None:
    return _sys.cgroup_memory()


def _memlock() -> Memlock:
    return Memlock(_sys.memlock_limit_bytes(), _sys.vm_locked_bytes(), _sys.has_cap_ipc_lock())


def _thp() -> tuple[str | None, str | None]:
    """The selected THP mode and defrag setting (the bracketed words), None if absent."""
    modes: list[str | None] = []
    for name in ("enabled", "defrag"):
        try:
            text = (_THP_DIR / name).read_text()
        except OSError:
            modes.append(None)
            continue
        chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
        modes.append(chosen[0] if chosen else None)
    return modes[0], modes[1]


def _shm_free() -> int | None:
    """Bytes free in /dev/shm less what its sparse files were promised and do not hold
    yet (as a region's creator counts them), None if there is no such file system."""
    try:
        return shm_free_bytes()
    except OSError:
        return None


def _stale() -> list[str]:
    """This user's asyncpin regions in /dev/shm whose creator is gone."""
    return stale_regions()


def _cuda() -> CudaInfo:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return CudaInfo(None, False, error=f"torch cannot be imported: {exc}")
    built_for = torch.version.cuda
    if not torch.cuda.is_available():
        return CudaInfo(built_for, False)
    try:
        devices = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        from asyncpin._cudart import batch_copy_available, cudart

        lib = cudart()
        if lib is None:
            return CudaInfo(built_for, True, devices, error="libcudart is linked statically")
        runtime, driver = ctypes.c_int(0), ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(runtime))
        lib.cudaDriverGetVersion(ctypes.byref(driver))
        return CudaInfo(
            built_for, True, devices, runtime.value, driver.value, batch_copy_available()
        )
    except Exception as exc:
        return CudaInfo(built_for, True, error=f"{type(exc).__name__}: {exc}")


# -- checks -----------------------------------------------------------------------------


def run_checks(
    nbytes: int | None = None,
    *,
    backend: Literal["auto", "host", "cuda"] = "auto",
    backing: Literal["anonymous", "shared"] = "anonymous",
) -> list[Check]:
    """Check the machine for a buffer of ``nbytes`` (default: the demo's size) pinned by
    ``backend`` over a ``backing`` region. Never raises for what it finds; ConfigError
    for arguments out of range (checked as a manager checks them)."""
    from asyncpin.backends import BACKEND_NAMES
    from asyncpin.errors import ConfigError
    from asyncpin.region import validate_backing, validate_nbytes

    if nbytes is not None:
        validate_nbytes(nbytes)
    validate_backing(backing)
    if backend not in BACKEND_NAMES:
        raise ConfigError(f"unknown backend {backend!r}: use one of {', '.join(BACKEND_NAMES)}")
    mem = _read_meminfo()
    cgroup = _cgroup()
    cuda = _cuda()
    available = mem.get("MemAvailable")
    effective = available
    if available is not None and cgroup is not None:
        effective = min(available, max(cgroup.headroom_bytes, 0))
    pins_with_mlock = backend == "host" or (backend == "auto" and not cuda.available)
    memlock = _memlock()
    if nbytes is None:
        from asyncpin.cli import default_nbytes  # the demo's own rule: one definition

        nbytes, _ = default_nbytes(
            backend="host" if pins_with_mlock else "cuda",
            mem_available=effective or 0,
            memlock_limit=memlock.limit_bytes,
            locked_bytes=memlock.locked_bytes,
            has_cap_ipc_lock=memlock.has_cap_ipc_lock,
        )
    thp_mode, defrag = _thp()
    return [
        _check_memory(available, nbytes),
        _check_cgroup(cgroup, available, nbytes),
        _check_memlock(memlock, nbytes, pins_with_mlock),
        _check_thp(thp_mode),
        _check_thp_defrag(defrag),
        _check_hugetlb(mem, nbytes),
        _check_shm(_shm_free(), nbytes, backing),
        _check_stale(_stale()),
        _check_cuda(cuda, backend),
        _check_batch_copy(cuda),
    ]


def _check_memory(available: int | None, nbytes: int) -> Check:
    if available is None:
        return Check("memory", "fail", "MemAvailable missing from /proc/meminfo", "run on Linux")
    value = f"MemAvailable {_fmt(available)}; buffer {_fmt(nbytes)}"
    if nbytes > available:
        return Check("memory", "fail", value, "ask for a smaller buffer (--size) or free memory")
    if nbytes > available * 0.9:
        return Check(
            "memory",
            "warn",
            value,
            "the buffer leaves under 10% of MemAvailable to the engine and the OS; "
            "ask for a smaller one",
        )
    return Check("memory", "pass", value)


def _check_cgroup(cgroup: _sys.CgroupMemory | None, available: int | None, nbytes: int) -> Check:
    if cgroup is None:
        return Check("cgroup", "pass", "no limit")
    headroom = cgroup.headroom_bytes
    value = (
        f"cgroup v{cgroup.version} limit {_fmt(cgroup.limit_bytes)}, used "
        f"{_fmt(cgroup.usage_bytes)}: {_fmt(max(headroom, 0))} left"
    )
    raise_it = (
        "raise the limit (docker --memory, Kubernetes resources.limits.memory, systemd MemoryMax=)"
    )
    if headroom < nbytes:
        return Check(
            "cgroup",
            "fail",
            f"{value}, less than the buffer ({_fmt(nbytes)})",
            f"{raise_it} or ask for a smaller buffer: past the limit the OOM killer ends "
            "the process",
        )
    if available is not None and headroom < available:
        return Check(
            "cgroup",
            "warn",
            f"{value}, below MemAvailable ({_fmt(available)})",
            f"the cgroup limit, not MemAvailable, bounds the buffer; {raise_it} for more",
        )
    return Check("cgroup", "pass", value)


def _check_memlock(memlock: Memlock, nbytes: int, pins_with_mlock: bool) -> Check:
    limit = memlock.limit_bytes
    shown = "unlimited" if limit is None else _fmt(limit)
    if memlock.has_cap_ipc_lock:
        return Check("memlock", "pass", f"{shown}; CAP_IPC_LOCK held, so the limit does not bind")
    if limit is None:
        return Check("memlock", "pass", "unlimited")
    left = max(limit - memlock.locked_bytes, 0)
    value = f"{shown} without CAP_IPC_LOCK: {_fmt(left)} left"
    if left >= nbytes:
        return Check("memlock", "pass", value)
    if pins_with_mlock:
        return Check(
            "memlock",
            "fail",
            f"{value}, less than the buffer ({_fmt(nbytes)}) the host backend must mlock",
            _MEMLOCK_FIX,
        )
    return Check(
        "memlock",
        "warn",
        f"{value}; only the host backend (mlock) is bound by it",
        _MEMLOCK_FIX + " before using --backend host",
    )


def _check_thp(mode: str | None) -> Check:
    if mode is None:
        return Check(
            "thp",
            "warn",
            "not available (kernel built without THP)",
            "regions get 4 KiB pages (slower pinning and DMA); hugepages='hugetlb' with a "
            "reserved pool is the alternative",
        )
    if mode == "never":
        return Check(
            "thp",
            "warn",
            "never",
            "regions get 4 KiB pages (slower pinning and DMA): `echo madvise > "
            f"{_THP_DIR / 'enabled'}` (asyncpin asks for huge pages with madvise)",
        )
    return Check("thp", "pass", mode)


def _check_thp_defrag(mode: str | None) -> Check:
    if mode in ("always", "madvise", "defer+madvise"):
        return Check("thp_defrag", "pass", f"{mode}: the region's faults compact memory")
    return Check(
        "thp_defrag",
        "warn",
        mode or "not available",
        "huge pages only while free 2 MiB pages are at hand, so a fragmented machine backs "
        f"the buffer with 4 KiB pages: `echo defer+madvise > {_THP_DIR / 'defrag'}`",
    )


def _check_hugetlb(mem: dict[str, int], nbytes: int) -> Check:
    total, free = mem.get("HugePages_Total", 0), mem.get("HugePages_Free", 0)
    size = mem.get("Hugepagesize", 2 << 20)
    if total == 0:
        return Check("hugetlb", "pass", "none reserved (needed only for hugepages='hugetlb')")
    value = f"{free} of {total} pages of {_fmt(size)} free ({_fmt(free * size)})"
    if free * size < nbytes:
        needed = -(-nbytes // size)
        return Check(
            "hugetlb",
            "warn",
            f"{value}, less than the buffer ({_fmt(nbytes)})",
            f"hugepages='hugetlb' needs {needed} free pages: raise /proc/sys/vm/nr_hugepages "
            "(or keep the default hugepages='thp')",
        )
    return Check("hugetlb", "pass", value)


def _check_shm(free: int | None, nbytes: int, backing: str) -> Check:
    only = "" if backing == "shared" else " (needed only for backing='shared')"
    short: Status = "fail" if backing == "shared" else "warn"
    if free is None:
        return Check("shm", short, f"not mounted{only}", f"mount a tmpfs at {SHM_DIR}")
    value = f"{_fmt(free)} free"
    if free < nbytes:
        return Check(
            "shm",
            short,
            f"{value}, less than the buffer ({_fmt(nbytes)}){only}",
            f"enlarge it: `mount -o remount,size=... {SHM_DIR}` (docker: --shm-size; "
            "Kubernetes: an emptyDir volume with medium: Memory)",
        )
    return Check("shm", "pass", value)


def _check_stale(names: list[str]) -> Check:
    if not names:
        return Check("stale_regions", "pass", "none")
    return Check(
        "stale_regions",
        "warn",
        f"{len(names)} left by a creator that is gone: {', '.join(names)}",
        "a new creator of the same name reclaims it; or remove it with "
        "`python -c 'import asyncpin.shm as s; s.unlink_stale(\"NAME\")'` (processes "
        "still attached keep their mappings)",
    )


def _check_cuda(cuda: CudaInfo, backend: str) -> Check:
    if not cuda.available:
        build = (
            f"torch built for CUDA {cuda.torch_cuda}" if cuda.torch_cuda else "a CPU build of torch"
        )
        asked = backend == "cuda"
        then = "the cuda backend cannot run" if asked else "the host backend pins with mlock"
        return Check(
            "cuda",
            "fail" if asked else "warn",
            f"no GPU visible ({build}); {then}",
            "for GPU offload: a CUDA build of torch, an NVIDIA driver, and the GPU visible "
            "(nvidia-smi; CUDA_VISIBLE_DEVICES)",
        )
    if cuda.error is not None:
        return Check("cuda", "warn", f"GPU visible, but asking CUDA failed: {cuda.error}")
    gpus = ", ".join(cuda.devices) or "?"
    value = (
        f"{len(cuda.devices)} GPU(s): {gpus}; driver supports CUDA "
        f"{_cuda_version(cuda.driver_version)}, runtime {_cuda_version(cuda.runtime_version)} "
        f"(torch built for {cuda.torch_cuda})"
    )
    if (
        cuda.driver_version is not None
        and cuda.runtime_version is not None
        and cuda.driver_version < cuda.runtime_version
    ):
        return Check(
            "cuda",
            "fail",
            value,
            "the driver is older than the CUDA runtime: update the NVIDIA driver, or use a "
            "torch built for an older CUDA",
        )
    return Check("cuda", "pass", value)


def _check_batch_copy(cuda: CudaInfo) -> Check:
    if not cuda.available:
        return Check("batch_copy", "warn", "no GPU")
    if cuda.batch_copy:
        return Check("batch_copy", "pass", "cudaMemcpyBatchAsync available")
    if cuda.batch_copy is None:
        return Check("batch_copy", "warn", "unknown: the CUDA runtime could not be asked")
    return Check(
        "batch_copy",
        "warn",
        f"no cudaMemcpyBatchAsync in runtime {_cuda_version(cuda.runtime_version)}: one "
        "cudaMemcpyAsync per block segment",
        "a torch built for CUDA 12.8 or later batches small-block transfers",
    )


# -- output -----------------------------------------------------------------------------


def worst(checks: list[Check]) -> Status:
    """The most severe status among ``checks`` (``pass`` when there are none)."""
    return max((check.status for check in checks), key=_RANK.__getitem__, default="pass")


def render(checks: list[Check], *, as_json: bool) -> str:
    """The checks as JSON (``{"status": worst, "checks": [...]}``) or as a table (rich, or
    plain text where rich is not installed)."""
    if as_json:
        doc: dict[str, Any] = {
            "status": worst(checks),
            "checks": [asdict(check) for check in checks],
        }
        return json.dumps(doc, indent=2)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        from asyncpin.cli import plain_table

        header = ("check", "status", "value", "what to change")
        rows = [(c.name, c.status, c.value, c.advice) for c in checks]
        return plain_table("asyncpin doctor", header, rows)

    colours = {"pass": "green", "warn": "yellow", "fail": "bold red"}
    table = Table(title="asyncpin doctor", show_header=True, header_style="bold")
    table.add_column("check")
    table.add_column("status")
    table.add_column("value")
    table.add_column("what to change")
    for check in checks:
        style = colours[check.status]
        table.add_row(check.name, f"[{style}]{check.status}[/]", check.value, check.advice)
    console = Console(highlight=False, width=max(Console().width, 120))
    with console.capture() as captured:
        console.print(table)
    return captured.get().rstrip("\n")


def _fmt(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _cuda_version(version: int | None) -> str:
    if version is None:
        return "?"
    return f"{version // 1000}.{version % 1000 // 10}"
