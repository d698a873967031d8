"""The host backend: real mlock through the manager, its accounting, and its pre-flight.

Every async test runs on asyncio and on trio.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from asyncpin import (
    BackendCallError,
    HostBackend,
    ManagerState,
    OffloadManager,
    PinError,
    PreflightError,
    _sys,
)
from asyncpin.region import Backing

pytestmark = pytest.mark.anyio

PAGE = _sys.PAGE_SIZE
MIB = 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[1]


class RecordingHostBackend(HostBackend):
    """A real mlock backend that records what it pinned and unpinned, and can fail the
    n-th pin (after really pinning the earlier ones) or stall it until released."""

    __slots__ = (
        "_lock",
        "_pins",
        "fail_at",
        "failed",
        "pinned",
        "release",
        "stall_at",
        "stalled",
        "unpinned",
    )

    def __init__(self, *, fail_at: int | None = None, stall_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.failed: tuple[int, int] | None = None
        self.stall_at = stall_at
        self.stalled = threading.Event()
        self.release = threading.Event()
        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._pins = 0

    def pin(self, address: int, nbytes: int) -> None:
        with self._lock:
            n = self._pins
            self._pins += 1
        if n == self.fail_at:
            self.failed = (address, nbytes)
            raise BackendCallError("mlock", errno.ENOMEM, "ENOMEM", f"injected failure at pin {n}")
        if n == self.stall_at:
            self.stalled.set()
            if not self.release.wait(timeout=60):
                raise BackendCallError("mlock", errno.ETIMEDOUT, "ETIMEDOUT", "never released")
        super().pin(address, nbytes)
        with self._lock:
            self.pinned.append((address, nbytes))

    def unpin(self, address: int, nbytes: int) -> None:
        super().unpin(address, nbytes)
        with self._lock:
            self.unpinned.append((address, nbytes))


class TestRealMlock:
    """Pinning with backend='host' really locks nbytes (VmLck), and close gives all of it back."""

    @pytest.mark.parametrize("backing", ["anonymous", "shared"])
    async def test_vmlck_rises_by_nbytes_and_returns_after_close(
        self, backing: Backing, shm_name: str
    ) -> None:
        nbytes = 10 * MIB + 3 * PAGE  # the last chunk is short
        baseline = _sys.vm_locked_bytes()
        name = shm_name if backing == "shared" else None
        async with OffloadManager(
            nbytes, backend="host", backing=backing, name=name, chunk_bytes=4 * MIB
        ) as mgr:
            with anyio.fail_after(60):
                await mgr.pinned
            assert mgr.is_pinned()
            assert _sys.vm_locked_bytes() - baseline == nbytes
            stats = mgr.stats()
            assert (stats.pinned_bytes, stats.chunks_pinned, stats.chunks_total) == (nbytes, 3, 3)
        assert mgr.state is ManagerState.CLOSED
        assert _sys.vm_locked_bytes() == baseline
        assert mgr.stats().pinned_bytes == 0

    async def test_name_string_host_resolves_to_mlock_backend(self) -> None:
        mgr = OffloadManager(MIB, backend="host")
        assert isinstance(mgr.backend, HostBackend)
        assert mgr.backend.name == "host"
        async with mgr:
            with anyio.fail_after(60):
                await mgr.pinned
        assert mgr.state is ManagerState.CLOSED

    async def test_injected_failure_unlocks_what_was_locked(self) -> None:
        chunk = 2 * MIB
        backend = RecordingHostBackend(fail_at=2)
        baseline = _sys.vm_locked_bytes()
        async with OffloadManager(
            5 * chunk, backend=backend, chunk_bytes=chunk, pin_threads=1
        ) as mgr:
            with anyio.fail_after(60), pytest.raises(PinError) as info:
                await mgr.pinned
            error = info.value
            # Prefault workers may hand chunks to the pinner out of order: locate the chunk
            # of the failed call by its address.
            assert backend.failed is not None
            base = mgr.host_view().data_ptr()
            assert (error.offset, error.nbytes) == (backend.failed[0] - base, backend.failed[1])
            assert error.chunk_index == error.offset // chunk
            assert (error.code, error.code_name) == (errno.ENOMEM, "ENOMEM")
            assert isinstance(error.__cause__, BackendCallError)
            assert "injected failure" in str(error)
            assert not mgr.is_pinned()
            assert mgr.pin_error is error
            # The two chunks before the failure are really locked, nothing after it.
            assert _sys.vm_locked_bytes() - baseline == 2 * chunk
            assert len(backend.pinned) == 2
            assert mgr.stats().pinned_bytes == 2 * chunk
        assert _sys.vm_locked_bytes() == baseline
        assert sorted(backend.unpinned) == sorted(backend.pinned)

    @pytest.mark.parametrize("stop_by", ["failure", "close"])
    async def test_stop_with_prefaults_in_flight_exits_cleanly(self, stop_by: str) -> None:
        # Regression: when stop() made the pin worker leave while other prefault workers
        # still had chunks in hand, their send raised BrokenResourceError, which crashed
        # the manager's task group (an ExceptionGroup out of `async with`). The race hit
        # about one attempt in ten, so many attempts make a miss unlikely; a pass is
        # deterministic.
        baseline = _sys.vm_locked_bytes()
        for attempt in range(40):
            backend = RecordingHostBackend(fail_at=1 if stop_by == "failure" else None)
            async with OffloadManager(
                16 * MIB, backend=backend, chunk_bytes=MIB, prefault_threads=4
            ) as mgr:
                if stop_by == "failure":
                    with anyio.fail_after(60), pytest.raises(PinError):
                        await mgr.pinned
            assert mgr.state is ManagerState.CLOSED, attempt
            assert _sys.vm_locked_bytes() == baseline, attempt
            assert sorted(backend.unpinned) == sorted(backend.pinned), attempt

    async def test_cancelled_body_unlocks_everything(self) -> None:
        chunk = 2 * MIB
        backend = RecordingHostBackend(stall_at=2)
        baseline = _sys.vm_locked_bytes()
        mgr = OffloadManager(6 * chunk, backend=backend, chunk_bytes=chunk, pin_threads=1)
        locked_while_stalled = -1
        with anyio.CancelScope() as scope:
            async with mgr:
                try:
                    stalled = await anyio.to_thread.run_sync(backend.stalled.wait, 60)
                    assert stalled, "the pin pipeline never reached the stalled chunk"
                    locked_while_stalled = _sys.vm_locked_bytes() - baseline
                    scope.cancel()
                finally:
                    # Let the stalled pin finish (really locking its chunk) while close runs.
                    backend.release.set()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert locked_while_stalled == 2 * chunk
        assert mgr.state is ManagerState.CLOSED
        assert _sys.vm_locked_bytes() == baseline
        assert len(backend.pinned) >= 2
        assert sorted(backend.unpinned) == sorted(backend.pinned)
        assert not mgr.is_pinned()

    async def test_cancelled_before_any_pin_leaves_nothing_locked(self) -> None:
        backend = RecordingHostBackend(stall_at=0)
        baseline = _sys.vm_locked_bytes()
        with anyio.CancelScope() as scope:
            async with OffloadManager(4 * MIB, backend=backend, chunk_bytes=MIB) as mgr:
                try:
                    assert await anyio.to_thread.run_sync(backend.stalled.wait, 60)
                    assert _sys.vm_locked_bytes() == baseline
                    scope.cancel()
                finally:
                    backend.release.set()
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert mgr.state is ManagerState.CLOSED
        assert _sys.vm_locked_bytes() == baseline
        assert sorted(backend.unpinned) == sorted(backend.pinned)


class TestHostBackendCalls:
    """HostBackend maps mlock/munlock failures to BackendCallError with the errno named."""

    def test_pin_and_unpin_lock_and_unlock(self) -> None:
        backend = HostBackend()
        address = _sys.libc_mmap(
            2 * MIB, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        baseline = _sys.vm_locked_bytes()
        try:
            backend.pin(address, 2 * MIB)
            try:
                assert _sys.vm_locked_bytes() - baseline == 2 * MIB
            finally:
                backend.unpin(address, 2 * MIB)
            assert _sys.vm_locked_bytes() == baseline
        finally:
            _sys.libc_munmap(address, 2 * MIB)

    def test_pin_of_unmapped_memory_is_backend_call_error(self) -> None:
        address = _sys.libc_mmap(
            MIB, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        _sys.libc_munmap(address, MIB)
        backend = HostBackend()
        with pytest.raises(BackendCallError) as pin_info:
            backend.pin(address, MIB)
        assert (pin_info.value.op, pin_info.value.code) == ("mlock", errno.ENOMEM)
        assert pin_info.value.code_name == "ENOMEM"
        assert isinstance(pin_info.value, OSError)
        assert isinstance(pin_info.value.__cause__, _sys.LibcError)
        with pytest.raises(BackendCallError) as unpin_info:
            backend.unpin(address, MIB)
        assert (unpin_info.value.op, unpin_info.value.code_name) == ("munlock", "ENOMEM")


class TestPreflightSkippedWithCapability:
    """The RLIMIT_MEMLOCK pre-check applies only without CAP_IPC_LOCK and with a finite limit."""

    def test_capability_skips_the_check(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_sys, "memlock_limit_bytes", lambda: MIB)
        monkeypatch.setattr(_sys, "has_cap_ipc_lock", lambda: True)
        HostBackend().preflight(1 << 40)

    def test_unlimited_limit_skips_the_check(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_sys, "memlock_limit_bytes", lambda: None)
        monkeypatch.setattr(_sys, "has_cap_ipc_lock", lambda: False)
        HostBackend().preflight(1 << 40)

    def test_without_capability_the_limit_binds(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(_sys, "memlock_limit_bytes", lambda: MIB)
        monkeypatch.setattr(_sys, "has_cap_ipc_lock", lambda: False)
        locked = _sys.vm_locked_bytes()
        with pytest.raises(PreflightError) as info:
            HostBackend().preflight(1 << 40)
        assert info.value.check == "memlock"
        assert info.value.needed == 1 << 40
        assert info.value.available == max(MIB - locked, 0)
        assert "RLIMIT_MEMLOCK" in str(info.value)
        assert "ulimit -l" in str(info.value)

    def test_an_mlock_past_the_limit_names_it(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A hostile trial: two managers that each passed the pre-flight at once, then
        filled the limit together, failed with a bare 'mlock: Cannot allocate memory'."""

        def mlock(address: int, nbytes: int) -> None:
            raise _sys.LibcError("mlock", errno.ENOMEM)

        monkeypatch.setattr(_sys, "libc_mlock", mlock)
        monkeypatch.setattr(_sys, "vm_locked_bytes", lambda: 7 * MIB)
        monkeypatch.setattr(_sys, "memlock_limit_bytes", lambda: 8 * MIB)
        monkeypatch.setattr(_sys, "has_cap_ipc_lock", lambda: False)
        with pytest.raises(BackendCallError) as info:
            HostBackend().pin(0, 2 * MIB)
        assert info.value.code == errno.ENOMEM
        assert f"RLIMIT_MEMLOCK is {8 * MIB} bytes with {7 * MIB} locked" in str(info.value)
        assert "ulimit -l" in str(info.value)
        # Where the limit leaves room for the call, or with the capability (no limit
        # binds), the ENOMEM is not the limit's: the error is the call's own.
        for locked, cap in ((5 * MIB, False), (7 * MIB, True)):
            monkeypatch.setattr(_sys, "vm_locked_bytes", lambda n=locked: n)
            monkeypatch.setattr(_sys, "has_cap_ipc_lock", lambda c=cap: c)
            with pytest.raises(BackendCallError) as info:
                HostBackend().pin(0, 2 * MIB)
            assert "RLIMIT_MEMLOCK" not in str(info.value)

    async def test_manager_pins_past_a_small_limit_with_capability(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        if not _sys.has_cap_ipc_lock():
            pytest.skip("needs CAP_IPC_LOCK (run as root)")
        monkeypatch.setattr(_sys, "memlock_limit_bytes", lambda: PAGE)
        baseline = _sys.vm_locked_bytes()
        async with OffloadManager(8 * MIB, backend="host", chunk_bytes=2 * MIB) as mgr:
            with anyio.fail_after(60):
                await mgr.pinned
            assert _sys.vm_locked_bytes() - baseline == 8 * MIB
        assert _sys.vm_locked_bytes() == baseline

    async def test_manager_fails_before_mapping_without_capability(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(_sys, "memlock_limit_bytes", lambda: MIB)
        monkeypatch.setattr(_sys, "has_cap_ipc_lock", lambda: False)
        mapped: list[int] = []
        real_mmap = _sys.libc_mmap

        def spy_mmap(nbytes: int, prot: int, flags: int, fd: int = -1, addr: int = 0) -> int:
            mapped.append(nbytes)
            return real_mmap(nbytes, prot, flags, fd, addr)

        monkeypatch.setattr(_sys, "libc_mmap", spy_mmap)
        mgr = OffloadManager(8 * MIB, backend="host")
        with pytest.raises(PreflightError, match="RLIMIT_MEMLOCK") as info:
            async with mgr:
                pass
        assert info.value.check == "memlock"
        assert mapped == []


# Runs in a child that gives up CAP_IPC_LOCK (bounding, permitted, effective and
# inheritable sets) and sets a small RLIMIT_MEMLOCK, so the limit really binds.
CHILD_NO_CAP = r"""
import ctypes, errno, json, mmap, resource, sys

LIMIT = int(sys.argv[1])
CAP_IPC_LOCK, PR_CAPBSET_DROP, LINUX_CAPABILITY_VERSION_3 = 14, 24, 0x20080522

class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

class Data(ctypes.Structure):
    _fields_ = [(f, ctypes.c_uint32) for f in ("effective", "permitted", "inheritable")]

def drop_ipc_lock():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0:
        return "prctl(PR_CAPBSET_DROP): " + errno.errorcode[ctypes.get_errno()]
    header, data = Header(LINUX_CAPABILITY_VERSION_3, 0), (Data * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        return "capget: " + errno.errorcode[ctypes.get_errno()]
    mask = ~(1 << CAP_IPC_LOCK) & 0xFFFFFFFF
    for field in ("effective", "permitted", "inheritable"):
        setattr(data[0], field, getattr(data[0], field) & mask)
    if libc.capset(ctypes.byref(header), data) != 0:
        return "capset: " + errno.errorcode[ctypes.get_errno()]
    return None

from asyncpin import _sys

if _sys.has_cap_ipc_lock():
    why = drop_ipc_lock()
    if why is not None:
        print(json.dumps({"skip": why}))
        sys.exit(0)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (LIMIT, LIMIT))

import anyio
from asyncpin import OffloadManager, PreflightError

out = {"has_cap": _sys.has_cap_ipc_lock(), "limit": _sys.memlock_limit_bytes()}

# Proof that the limit binds: a direct mlock beyond it fails.
size = 4 * LIMIT
address = _sys.libc_mmap(size, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
try:
    _sys.libc_mlock(address, size)
    out["direct_mlock"] = "ok"
    _sys.libc_munlock(address, size)
except OSError as exc:
    out["direct_mlock"] = errno.errorcode[exc.errno]
_sys.libc_munmap(address, size)

async def too_big():
    try:
        async with OffloadManager(2 * LIMIT, backend="host") as mgr:
            out["too_big"] = "opened"
    except PreflightError as exc:
        out["too_big"] = {"type": type(exc).__name__, "check": exc.check, "needed": exc.needed,
                          "available": exc.available, "message": str(exc),
                          "is_oserror": isinstance(exc, OSError)}
    out["locked_after_too_big"] = _sys.vm_locked_bytes()

async def fits():
    async with OffloadManager(LIMIT // 2, backend="host", chunk_bytes=LIMIT // 4) as mgr:
        with anyio.fail_after(60):
            await mgr.pinned
        out["locked_while_pinned"] = _sys.vm_locked_bytes()
    out["locked_after_close"] = _sys.vm_locked_bytes()

anyio.run(too_big)
anyio.run(fits)
print("RESULT " + json.dumps(out))
"""


class TestMemlockLimitWithoutCapability:
    """Without CAP_IPC_LOCK a too-small RLIMIT_MEMLOCK is a clear PreflightError, not a crash."""

    def test_small_limit_gives_preflight_error(self) -> None:
        limit = MIB
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        proc = subprocess.run(
            [sys.executable, "-c", CHILD_NO_CAP, str(limit)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        lines = [line for line in proc.stdout.splitlines() if line.startswith(("RESULT ", "{"))]
        assert len(lines) == 1, proc.stdout
        out = json.loads(lines[0].removeprefix("RESULT "))
        if "skip" in out:
            pytest.skip(f"cannot drop CAP_IPC_LOCK here: {out['skip']}")

        # The child really runs without the capability, under the small limit...
        assert out["has_cap"] is False
        assert out["limit"] == limit
        assert out["direct_mlock"] in ("EPERM", "ENOMEM")
        # ...and the manager says what to change instead of failing later.
        too_big = out["too_big"]
        assert too_big["type"] == "PreflightError"
        assert too_big["is_oserror"] is True
        assert too_big["check"] == "memlock"
        assert too_big["needed"] == 2 * limit
        assert too_big["available"] == limit
        message = too_big["message"]
        assert "RLIMIT_MEMLOCK" in message
        assert "ulimit -l" in message
        assert "CAP_IPC_LOCK" in message
        assert out["locked_after_too_big"] == 0
        # Under the limit the same child pins for real.
        assert out["locked_while_pinned"] == limit // 2
        assert out["locked_after_close"] == 0


_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class TestMeasureHugepages:
    """Huge-page use is measured on request, off the event loop, and kept in stats()."""

    @pytest.mark.skipif(
        not _THP.exists() or "[never]" in _THP.read_text(), reason="THP is off on this machine"
    )
    async def test_measure_after_pinned(self) -> None:
        async with OffloadManager(8 << 20, backend="host", chunk_bytes=4 << 20) as mgr:
            await mgr.pinned
            assert mgr.stats().hugepage_bytes is None
            measured = await mgr.measure_hugepages()
            assert measured > 0 and measured % (2 << 20) == 0
            assert mgr.stats().hugepage_bytes == measured
        with pytest.raises(anyio.ClosedResourceError):
            await mgr.measure_hugepages()
