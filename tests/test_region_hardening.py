"""What the region promises to a stranger: views that outlive close, attaching only to
asyncpin's own regions, stale regions reclaimed, /dev/shm never promised twice, names and
sizes that cannot wrap or smuggle.

Cases that crashed or corrupted memory before they were fixed run in a child process, so
that a regression fails the test instead of killing the test run.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest
import structlog
import torch

from asyncpin import KVLayout, OffloadManager, _sys
from asyncpin import doctor as doctor_mod
from asyncpin.errors import ConfigError, PreflightError, RegionNotFoundError
from asyncpin.region import MAX_NBYTES, HostRegion
from asyncpin.shm import (
    HEADER_BYTES,
    SHM_DIR,
    is_stale,
    shm_free_bytes,
    stale_regions,
    unlink_stale,
)

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
PAGE = _sys.PAGE_SIZE
TIMEOUT_S = 120


def run_child(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        cwd=REPO,
        timeout=TIMEOUT_S,
    )


def mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
        if lo <= address < hi:
            return True
    return False


@contextmanager
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs of the test's own, standing in for /dev/shm (skips without mount)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True
    )
    if mount.returncode != 0:
        pytest.skip("needs a tmpfs of its own (mount, as root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def cpu_layout(dtype: torch.dtype = torch.float32) -> KVLayout:
    return KVLayout.from_tensors([torch.zeros(16, 4, 8, dtype=dtype) for _ in range(2)])


# -- views outlive the mapping's owner ----------------------------------------------------

VIEW_AFTER_CLOSE = """
import anyio
from asyncpin import OffloadManager

async def main():
    async with OffloadManager(64 << 20, backend="host") as m:
        await m.pinned
        v = m.host_view()
    return v

v = anyio.run(main)
print("SUM", int(v.sum()))
"""

STALE_VIEW_WRITE = """
import anyio, torch
from asyncpin import OffloadManager

async def main():
    async with OffloadManager(32 << 20, backend="host") as a:
        await a.pinned
        old = a.host_view()
        old.fill_(1)
    fresh = torch.zeros(32 << 20, dtype=torch.uint8)
    async with OffloadManager(32 << 20, backend="host") as b:
        await b.pinned
        new = b.host_view()
        old.fill_(9)  # through the view of the closed manager
        assert int(new.count_nonzero()) == 0, "a stale view wrote into another manager"
        assert int(fresh.count_nonzero()) == 0, "a stale view wrote into a fresh tensor"
        assert int((old == 9).sum()) == old.numel()
    print("OK")

anyio.run(main)
"""


class TestViewsOutliveClose:
    """A view used after close reads its old bytes and can never reach another allocation."""

    def test_reading_a_view_after_close_does_not_crash(self) -> None:
        proc = run_child(VIEW_AFTER_CLOSE)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert "SUM 0" in proc.stdout

    def test_a_stale_view_cannot_write_into_a_new_owner(self) -> None:
        proc = run_child(STALE_VIEW_WRITE)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert "OK" in proc.stdout

    @pytest.mark.parametrize("kind", ["host_view", "host_blocks"])
    async def test_kept_mapped_until_the_last_view_goes(self, kind: str) -> None:
        layout = cpu_layout()
        mgr = OffloadManager.for_kv(layout, 64, backend="host")
        with structlog.testing.capture_logs() as logs:
            async with mgr:
                await mgr.pinned
                view = mgr.host_view() if kind == "host_view" else mgr.host_blocks()
                tail = view.reshape(-1)[-8:]  # a tensor made from the view holds it too
                address = view.data_ptr()
                view.reshape(-1).fill_(3)
            assert mgr.stats().mapped_by_views_bytes == mgr.nbytes
            assert mgr.stats().pinned_bytes == 0  # unpinned in order all the same
            del view
            assert mapped(address) and int(tail.sum()) == 24
            del tail
        assert mgr.stats().mapped_by_views_bytes == 0
        assert not mapped(address)
        kept = [e for e in logs if e["event"] == "region.kept_by_views"]
        assert len(kept) == 1 and kept[0]["nbytes"] == mgr.nbytes

    async def test_no_views_means_unmapped_at_close(self) -> None:
        with structlog.testing.capture_logs() as logs:
            async with OffloadManager.for_kv(cpu_layout(), 64, backend="host") as mgr:
                await mgr.pinned
                address = mgr.host_blocks().data_ptr()
        assert not mapped(address)
        assert mgr.stats().mapped_by_views_bytes == 0
        assert not [e for e in logs if e["event"] == "region.kept_by_views"]


# -- attach only to asyncpin's own regions ------------------------------------------------


@contextmanager
def planted(path: Path) -> Iterator[Path]:
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


class TestAttachRefusesWhatIsNotAsyncpins:
    """Symlinks, foreign files and other layouts are refused; nothing is read, written or
    unlinked through them."""

    def test_symlink_to_a_file_elsewhere(self, shm_name: str, tmp_path: Path) -> None:
        victim = tmp_path / "victim"
        victim.write_bytes(b"\x07" * (4 * PAGE))
        victim.chmod(0o600)
        with planted(SHM_DIR / shm_name) as link:
            link.symlink_to(victim)
            with pytest.raises(ConfigError, match="symbolic link"):
                HostRegion.attach(shm_name)
            with pytest.raises(ConfigError, match="symbolic link"):
                is_stale(shm_name)
            assert unlink_stale(shm_name) is False
            assert link.is_symlink()
        assert victim.read_bytes() == b"\x07" * (4 * PAGE)

    async def test_symlink_to_a_real_region(self, shm_name: str) -> None:
        async with OffloadManager(MIB_2, backend="host", backing="shared", name=shm_name):
            with planted(SHM_DIR / f"{shm_name}-link") as link:
                link.symlink_to(SHM_DIR / shm_name)
                with pytest.raises(ConfigError, match="symbolic link"):
                    async with OffloadManager.attached(link.name, backend="host"):
                        pass

    def test_foreign_file_is_neither_attached_nor_unlinked(self, shm_name: str) -> None:
        with planted(SHM_DIR / shm_name) as path:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, 8 * PAGE)  # page-sized, unlocked: it looked like a stale region
            os.close(fd)
            with pytest.raises(ConfigError, match="no asyncpin header"):
                HostRegion.attach(shm_name)
            with pytest.raises(ConfigError, match="not a region made by asyncpin"):
                is_stale(shm_name)
            assert unlink_stale(shm_name) is False
            assert path.exists()
            assert shm_name not in stale_regions()

    def test_region_with_another_mode(self, shm_name: str) -> None:
        region = HostRegion.create(MIB_2, backing="shared", name=shm_name)
        try:
            (SHM_DIR / shm_name).chmod(0o644)
            with pytest.raises(ConfigError, match="mode 644"):
                HostRegion.attach(shm_name)
        finally:
            region.release()

    async def test_layout_must_match_the_creators(self, shm_name: str) -> None:
        async with OffloadManager.for_kv(
            cpu_layout(torch.float32), 32, backend="host", backing="shared", name=shm_name
        ):
            other = OffloadManager.attached(
                shm_name, backend="host", kv_layout=cpu_layout(torch.float16), num_host_blocks=32
            )
            with pytest.raises(ConfigError, match="dtype"):
                async with other:
                    pass
            same = OffloadManager.attached(
                shm_name, backend="host", kv_layout=cpu_layout(torch.float32), num_host_blocks=16
            )
            async with same:
                assert same.host_blocks().shape[0] == 16


MIB_2 = 2 * MiB

# -- stale regions ------------------------------------------------------------------------

KILLED_CREATOR = """
import sys
from asyncpin.region import HostRegion

region = HostRegion.create(int(sys.argv[2]), backing="shared", name=sys.argv[1])
region.view().fill_(5)
print("READY", flush=True)
sys.stdin.read()  # until killed
"""

KILLED_WHILE_CREATING = """
import fcntl, os, signal, sys
from asyncpin.region import HostRegion

def die(*args):  # SIGKILL between making the file and locking it
    os.kill(os.getpid(), signal.SIGKILL)

fcntl.flock = die
HostRegion.create(int(sys.argv[2]), backing="shared", name=sys.argv[1])
"""


class TestStaleRegions:
    """A killed creator's region is reported and reclaimed; a half-made one never appears."""

    def kill_a_creator(self, name: str) -> None:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_CREATOR, name, str(MIB_2)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
            cwd=REPO,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "READY"
        finally:
            proc.kill()
            proc.wait(TIMEOUT_S)
        assert (SHM_DIR / name).exists()

    async def test_reported_and_reclaimed_by_a_new_creator(self, shm_name: str) -> None:
        self.kill_a_creator(shm_name)
        try:
            assert is_stale(shm_name)
            assert shm_name in stale_regions()
            check = {c.name: c for c in doctor_mod.run_checks(nbytes=MIB_2)}["stale_regions"]
            assert check.status == "warn" and shm_name in check.value
            with structlog.testing.capture_logs() as logs:
                async with OffloadManager(
                    MIB_2, backend="host", backing="shared", name=shm_name
                ) as mgr:
                    assert not is_stale(shm_name)
                    # A fresh region: the dead creator's bytes are not handed out.
                    assert int(mgr.host_view().count_nonzero()) == 0
        finally:
            unlink_stale(shm_name)
        events = [e for e in logs if e["event"] == "region.reclaimed_stale"]
        assert len(events) == 1 and events[0]["region_name"] == shm_name
        assert not (SHM_DIR / shm_name).exists()

    def test_a_live_creators_region_is_not_reclaimed(self, shm_name: str) -> None:
        first = HostRegion.create(MIB_2, backing="shared", name=shm_name)
        try:
            with pytest.raises(ConfigError, match="creator is alive"):
                HostRegion.create(MIB_2, backing="shared", name=shm_name)
            assert not is_stale(shm_name)
        finally:
            first.release()

    def test_killed_while_creating_leaves_nothing(self, shm_name: str) -> None:
        proc = run_child(KILLED_WHILE_CREATING, shm_name, str(MIB_2))
        try:
            assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
            assert not (SHM_DIR / shm_name).exists()
        finally:
            (SHM_DIR / shm_name).unlink(missing_ok=True)


# -- /dev/shm space ------------------------------------------------------------------------


FULL_SHM_PAGEABLE = """
import errno, os, sys
from pathlib import Path
import anyio, torch
import asyncpin.region as region
import asyncpin.shm as shm
from asyncpin import KVLayout, OffloadManager, TransferError
from asyncpin.testing import FakeBackend

mnt = Path(sys.argv[1])
shm.SHM_DIR = mnt  # a small tmpfs standing in for /dev/shm
region.HostRegion.prefault = lambda self, offset, nbytes: None  # pages stay unbacked
layout = KVLayout.from_tensors([torch.full((8, 65536), 7, dtype=torch.uint8)])

async def main():
    fake = FakeBackend(stall_pin_at=0)  # nothing gets pinned: stores go pageable
    async with OffloadManager.for_kv(
        layout, 32, backend=fake, backing="shared", name="r", unpinned_policy="pageable",
        chunk_bytes=1 << 20,
    ) as mgr:
        fd = os.open(mnt / "filler", os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            while True:
                os.write(fd, bytes(65536))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        try:
            await mgr.store([0], [31])
        except TransferError as exc:
            print("REFUSED", exc, flush=True)
        (mnt / "filler").unlink()
        fake.release()
    print("CLOSED", flush=True)

anyio.run(main)
"""


class TestShmSpace:
    """Space promised to one region is not promised again; attach checks what it adds."""

    def test_two_creators_cannot_promise_the_same_space(self, shm_name: str) -> None:
        half = (shm_free_bytes() // 2 + MIB_2) // PAGE * PAGE
        first = HostRegion.create(half, backing="shared", name=shm_name)
        try:
            with pytest.raises(PreflightError, match="shm") as info:
                HostRegion.create(half, backing="shared", name=f"{shm_name}-2")
            assert info.value.check == "shm"
            assert not (SHM_DIR / f"{shm_name}-2").exists()
        finally:
            first.release()

    def test_another_users_empty_file_cannot_refuse_creators(self, shm_name: str) -> None:
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file away")
        with planted(SHM_DIR / f"{shm_name}-huge") as path:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, 1 << 50)  # promises far more than /dev/shm holds, costs nothing
            os.close(fd)
            os.chown(path, 65534, 65534)
            region = HostRegion.create(MIB_2, backing="shared", name=shm_name)
            region.release()

    def test_attach_checks_the_memory_it_adds(
        self, shm_name: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        nbytes = 8 * MiB
        creator = HostRegion.create(nbytes, backing="shared", name=shm_name)
        try:
            monkeypatch.setattr(_sys, "mem_available_bytes", lambda: 1 * MiB)
            with pytest.raises(PreflightError, match="not backed yet") as info:
                HostRegion.attach(shm_name)
            assert info.value.check == "memory" and info.value.needed == nbytes
            creator.view().fill_(1)  # every page backed: attaching adds nothing
            attacher = HostRegion.attach(shm_name)
            attacher.release()
        finally:
            creator.release()

    def test_pageable_store_into_a_full_shm_is_an_error_not_sigbus(self, tmp_path: Path) -> None:
        with small_tmpfs(tmp_path) as mnt:
            proc = run_child(FULL_SHM_PAGEABLE, str(mnt))
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert "REFUSED" in proc.stdout and "file system is full" in proc.stdout
        assert "CLOSED" in proc.stdout

    def test_full_shm_while_faulting_is_enospc(
        self, shm_name: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        region = HostRegion.create(MIB_2, backing="shared", name=shm_name)
        real = _sys.libc_madvise

        def madvise(address: int, nbytes: int, advice: int) -> None:
            if advice == _sys.MADV_POPULATE_WRITE:
                raise _sys.LibcError("madvise", errno.EFAULT)  # what a full tmpfs returns
            real(address, nbytes, advice)

        monkeypatch.setattr(_sys, "libc_madvise", madvise)
        try:
            with pytest.raises(OSError, match="ran out of space") as info:
                region.prefault(0, MIB_2)
            assert info.value.errno == errno.ENOSPC
        finally:
            region.release()

    def test_a_file_truncated_by_another_process_is_named_so(self, shm_name: str) -> None:
        # Faulting pages past the end of a truncated file fails as a full tmpfs does
        # (EFAULT): the error says which happened (it blamed a full /dev/shm).
        region = HostRegion.create(4 * MIB_2, backing="shared", name=shm_name)
        try:
            try:
                _sys.libc_madvise(region.address, PAGE, _sys.MADV_POPULATE_WRITE)
            except _sys.LibcError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                pytest.skip("needs MADV_POPULATE_WRITE (Linux 5.14): the pin call faults instead")
            fd = os.open(SHM_DIR / shm_name, os.O_RDWR)  # another process of this user
            try:
                os.ftruncate(fd, MIB_2)
            finally:
                os.close(fd)
            with pytest.raises(OSError, match=f"truncated to {MIB_2} bytes") as info:
                region.prefault(0, 4 * MIB_2)
            assert info.value.errno == errno.EFAULT
        finally:
            region.release()

    def test_a_file_truncated_while_pinning_is_named_so(self, shm_name: str) -> None:
        """A hostile trial: once the region is faulted in, the pin call (mlock) meets the
        truncation and says ENOMEM, which named neither the truncation nor EFAULT."""
        from asyncpin import HostBackend, PinError
        from asyncpin.testing import FakeBackend

        def truncate(n: int, address: int, nbytes: int) -> None:
            if n == 1:  # the first chunk is pinned: another process cuts the file short
                fd = os.open(SHM_DIR / shm_name, os.O_RDWR)
                try:
                    os.ftruncate(fd, MIB_2)
                finally:
                    os.close(fd)

        backend = FakeBackend(inner=HostBackend(), before_pin=truncate)

        async def run() -> PinError:
            async with OffloadManager(
                4 * MIB_2, backing="shared", name=shm_name, chunk_bytes=MIB_2, backend=backend
            ) as mgr:
                with pytest.raises(PinError) as info:
                    await mgr.pinned
            return info.value

        error = anyio.run(run)
        assert error.code == errno.EFAULT and error.code_name == "EFAULT", error
        assert f"truncated to {MIB_2} bytes" in str(error), error
        assert error.chunk_index == 1


# -- names, sizes, unlinking ------------------------------------------------------------


class TestNamesSizesAndUnlink:
    """Names match exactly, sizes cannot wrap, and close unlinks only its own file."""

    def test_trailing_newline_is_refused(self, shm_name: str) -> None:
        name = f"{shm_name}\n"
        with pytest.raises(ConfigError, match="shared region name"):
            HostRegion.create(MIB_2, backing="shared", name=name)
        with pytest.raises(ConfigError, match="shared region name"):
            HostRegion.attach(name)
        with pytest.raises(ConfigError, match="shared region name"):
            is_stale(name)
        assert not (SHM_DIR / name).exists()

    @pytest.mark.parametrize("nbytes", [2**64, 2**64 + PAGE, MAX_NBYTES + 1])
    async def test_size_that_would_wrap(self, nbytes: int) -> None:
        with pytest.raises(ConfigError, match="larger than any machine"):
            HostRegion.create(nbytes)
        with pytest.raises(ConfigError, match="larger than any machine"):
            OffloadManager(nbytes, backend="host")

    def test_close_leaves_a_successors_file(self, shm_name: str) -> None:
        path = SHM_DIR / shm_name
        first = HostRegion.create(MIB_2, backing="shared", name=shm_name)
        path.unlink()  # removed from under it, e.g. by an operator
        second = HostRegion.create(MIB_2, backing="shared", name=shm_name)
        try:
            first.release()
            assert path.exists(), "the first region's close unlinked its successor's file"
            assert path.stat().st_size == MIB_2 + HEADER_BYTES
        finally:
            second.release()
        assert not path.exists()

    def test_attach_to_missing_name(self, shm_name: str) -> None:
        with pytest.raises(RegionNotFoundError):
            HostRegion.attach(shm_name)


# -- forged headers and a full /dev/shm at restart ------------------------------------------


def forge(path: Path, nbytes: int, layout: bytes) -> None:
    """A file with asyncpin's header, written by hand: what any process of this user can do."""
    import struct

    head = struct.pack("<16sIIQQI", b"ASYNCPIN-REGION\x00", 1, HEADER_BYTES, nbytes, 1, len(layout))
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes + HEADER_BYTES)
        os.pwrite(fd, (head + layout).ljust(HEADER_BYTES, b"\x00"), nbytes)
    finally:
        os.close(fd)


RESTART_ON_A_SMALL_SHM = """
import os, signal, subprocess, sys
from pathlib import Path
import asyncpin.region as region
import asyncpin.shm as shm

mnt, name, nbytes = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
shm.SHM_DIR = mnt
if sys.argv[4] == "creator":
    r = region.HostRegion.create(nbytes, backing="shared", name=name)
    r.view().fill_(1)  # every page backed, as a server that ran a while
    os.kill(os.getpid(), signal.SIGKILL)
r = region.HostRegion.create(nbytes, backing="shared", name=name)
print("RECLAIMED", r.reclaimed_stale, flush=True)
r.release()
"""


class TestForgedHeadersAndRestart:
    """A forged header is refused without a crash; a restart reclaims a big stale region."""

    def test_deeply_nested_layout(self, shm_name: str) -> None:
        with planted(SHM_DIR / shm_name) as path:
            forge(path, MIB_2, b"[" * 4000)
            with pytest.raises(ConfigError, match="no asyncpin header"):
                HostRegion.attach(shm_name)
            assert shm_name not in stale_regions()
            assert unlink_stale(shm_name) is False and path.exists()
            checks = {c.name: c for c in doctor_mod.run_checks(nbytes=MIB_2)}
            assert checks["stale_regions"].status == "pass"

    def test_layout_the_header_does_not_record(self, shm_name: str) -> None:
        with planted(SHM_DIR / shm_name) as path:
            forge(path, MIB_2, b'{"x": 1}')
            with pytest.raises(ConfigError, match="does not record"):
                HostRegion.attach(shm_name, layout={"num_arrays": 2})

    def test_restart_reclaims_a_region_larger_than_what_is_left(self, tmp_path: Path) -> None:
        with small_tmpfs(tmp_path) as mnt:
            args = (str(mnt), "kv", str(6 * MiB))
            killed = run_child(RESTART_ON_A_SMALL_SHM, *args, "creator")
            assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
            assert (mnt / "kv").exists()
            restarted = run_child(RESTART_ON_A_SMALL_SHM, *args, "restart")
            assert restarted.returncode == 0, restarted.stderr[-2000:]
            assert "RECLAIMED True" in restarted.stdout
            assert not (mnt / "kv").exists()
