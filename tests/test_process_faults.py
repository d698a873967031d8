"""Process faults: a shared region's creator killed while another process is attached,
``fork()`` while a region is mapped and pinned, and SIGINT / SIGTERM during the demo.

Children are real processes (``subprocess`` with this repository on PYTHONPATH, or
``os.fork``). Synchronisation is on the lines they print ("READY", "HELD"), read by a
thread into a queue with a bound on every wait; nothing sleeps.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import anyio
import pytest
import torch

from asyncpin import HostBackend, KVLayout, ManagerState, OffloadManager, _sys
from asyncpin.shm import SHM_DIR, is_stale, unlink_stale
from asyncpin.testing import FakeBackend
from tests.helpers import digest, wait_child

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
PAGE = _sys.PAGE_SIZE
TIMEOUT_S = 60.0


# -- helpers ----------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


class Lines:
    """The lines a child writes to one of its pipes, read by a thread: ``expect`` waits
    (bounded) for the first line that starts with a prefix."""

    def __init__(self, pipe: IO[str]) -> None:
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def expect(self, prefix: str, timeout_s: float = TIMEOUT_S) -> str:
        while True:
            try:
                line = self._queue.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(
                    f"no line {prefix!r} within {timeout_s} s: {self.seen}"
                ) from None
            if line is None:
                raise AssertionError(f"the child closed its output before {prefix!r}: {self.seen}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def rest(self) -> list[str]:
        """Every line after those seen, once the child has closed the pipe."""
        self._thread.join(TIMEOUT_S)
        while (line := self._queue.get_nowait()) is not None:
            self.seen.append(line)
        return self.seen


@contextmanager
def child(*args: str) -> Iterator[subprocess.Popen[str]]:
    """A Python child of this repository; killed and reaped however the block ends."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=REPO,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(TIMEOUT_S)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def vmas(address: int, nbytes: int) -> set[tuple[int, int]]:
    """The mappings (start, end) of this process that overlap ``[address, address+nbytes)``."""
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
        if lo < address + nbytes and hi > address:
            found.add((lo, hi))
    return found


@pytest.fixture
def munmaps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every (address, nbytes) asyncpin unmaps during the test: the evidence that a region
    was released (once unmapped, its addresses may be reused by any other mapping)."""
    calls: list[tuple[int, int]] = []
    real = _sys.libc_munmap

    def munmap(address: int, nbytes: int) -> None:
        real(address, nbytes)
        calls.append((address, nbytes))

    monkeypatch.setattr(_sys, "libc_munmap", munmap)
    return calls


def assert_released(
    mgr: OffloadManager,
    fake: FakeBackend,
    munmaps: list[tuple[int, int]],
    address: int,
    nbytes: int,
) -> None:
    """Closed in order: each pinned span unpinned once, on mapped memory; then unmapped."""
    assert mgr.state is ManagerState.CLOSED
    assert all(call.mapped for call in fake.calls)
    ops = [call.op for call in fake.calls]
    if "unpin" in ops:
        assert "pin" not in ops[ops.index("unpin") :], ops
    assert Counter(fake.unpinned_spans()) == Counter(fake.pinned_spans())
    assert mgr.stats().chunks_pinned == 0 and mgr.stats().chunks_leaked == 0
    freed: set[int] = set()
    for start, length in munmaps:
        lo, hi = max(start, address), min(start + length, address + nbytes)
        freed.update(range(lo, hi, PAGE))
    assert freed == set(range(address, address + nbytes, PAGE)), "the region is still mapped"


# -- a shared region's creator is killed --------------------------------------------------

CREATOR = """
import hashlib, sys
import anyio, torch
from asyncpin import OffloadManager

async def main() -> None:
    name, nbytes = sys.argv[1], int(sys.argv[2])
    async with OffloadManager(
        nbytes, backend="host", backing="shared", name=name, chunk_bytes=1 << 20
    ) as mgr:
        with anyio.fail_after(60):
            await mgr.pinned
        view = mgr.host_view()
        gen = torch.Generator().manual_seed(7)
        view.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
        # structlog's default logger prints to stdout too: mark the answer.
        print("READY", hashlib.sha256(view.numpy().tobytes()).hexdigest(), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)  # until killed

anyio.run(main)
"""


class TestCreatorKilled:
    """A killed creator leaves attachers working and its file stale, for unlink_stale()."""

    NBYTES = 8 * MiB

    @contextmanager
    def creator(self, name: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
        with child("-c", CREATOR, name, str(self.NBYTES)) as proc:
            assert proc.stdout is not None
            ready = Lines(proc.stdout).expect("READY")
            yield proc, ready.split()[1]

    @staticmethod
    def kill(proc: subprocess.Popen[str]) -> None:
        proc.kill()
        assert proc.wait(TIMEOUT_S) == -signal.SIGKILL

    async def test_attacher_survives_the_creator(
        self, shm_name: str, munmaps: list[tuple[int, int]]
    ) -> None:
        path = SHM_DIR / shm_name
        baseline = _sys.vm_locked_bytes()
        fake = FakeBackend(inner=HostBackend())
        try:
            with self.creator(shm_name) as (proc, creator_digest):
                assert not is_stale(shm_name), "a live creator's region is not stale"
                assert not unlink_stale(shm_name)
                with anyio.fail_after(TIMEOUT_S):
                    async with OffloadManager.attached(
                        shm_name, backend=fake, chunk_bytes=1 * MiB
                    ) as mgr:
                        view = mgr.host_view()
                        address = view.data_ptr()
                        assert digest(view) == creator_digest
                        self.kill(proc)  # while this manager is still pinning, maybe
                        await mgr.pinned
                        assert mgr.stats().pinned_bytes == self.NBYTES
                        assert is_stale(shm_name)
                        # The mapping outlives its creator: reads and writes go on.
                        assert digest(view) == creator_digest
                        fresh = torch.randint(0, 256, (self.NBYTES,), dtype=torch.uint8)
                        view.copy_(fresh)
                        assert torch.equal(view, fresh)
                        written = digest(view)
                        del view  # a live view keeps the range mapped past close
            assert_released(mgr, fake, munmaps, address, self.NBYTES)
            assert _sys.vm_locked_bytes() == baseline
            # Neither the dead creator nor the attacher unlinked the file: it holds what
            # the attacher wrote, until someone removes it.
            assert path.exists()
            assert hashlib.sha256(path.read_bytes()[: self.NBYTES]).hexdigest() == written
            assert is_stale(shm_name)
            assert unlink_stale(shm_name)
            assert not path.exists()
            assert not unlink_stale(shm_name)
        finally:
            path.unlink(missing_ok=True)

    async def test_attach_after_the_creator_died(
        self, shm_name: str, munmaps: list[tuple[int, int]]
    ) -> None:
        path = SHM_DIR / shm_name
        fake = FakeBackend(inner=HostBackend())
        try:
            with self.creator(shm_name) as (proc, creator_digest):
                self.kill(proc)
            assert is_stale(shm_name)
            with anyio.fail_after(TIMEOUT_S):
                async with OffloadManager.attached(
                    shm_name, backend=fake, chunk_bytes=1 * MiB
                ) as mgr:
                    address = mgr.host_view().data_ptr()
                    await mgr.pinned
                    assert digest(mgr.host_view()) == creator_digest
            assert_released(mgr, fake, munmaps, address, self.NBYTES)
            assert unlink_stale(shm_name)
        finally:
            path.unlink(missing_ok=True)

    async def test_own_region_is_never_stale(self, shm_name: str) -> None:
        async with OffloadManager(
            1 * MiB, backend=FakeBackend(), backing="shared", name=shm_name
        ) as mgr:
            assert mgr.region_name == shm_name
            assert not is_stale(shm_name)
            assert not unlink_stale(shm_name)
            assert (SHM_DIR / shm_name).exists()
        assert not (SHM_DIR / shm_name).exists()


# -- fork while mapped and pinned -----------------------------------------------------------


LEFT_OPEN = """
import os, sys
import anyio
from asyncpin import OffloadManager
from asyncpin.testing import FakeBackend

name, managers = sys.argv[1], []

async def main() -> None:
    manager = OffloadManager(1 << 20, backing="shared", name=name, backend=FakeBackend())
    await manager.__aenter__()  # never closed: as when the close task itself is cancelled
    await manager.pinned
    managers.append(manager)

anyio.run(main)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked child's exit: the parent's file stays
os.waitpid(pid, 0)
print("after the forked child:", os.path.exists(f"/dev/shm/{name}"), flush=True)
"""


def test_a_shared_file_never_closed_is_unlinked_when_its_creator_exits(shm_name: str) -> None:
    """A hostile trial: two Ctrl-C under asyncio.run cancel the manager's close task
    itself, and the shared file stayed in /dev/shm, holding its memory, until a new
    creator of the name reclaimed it. The creator's exit unlinks what it never closed
    (not a forked child's exit)."""
    with child("-c", LEFT_OPEN, shm_name) as proc:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err
    assert "after the forked child: True" in out, (out, err)
    assert not (SHM_DIR / shm_name).exists()


class TestForkWhilePinned:
    """A child forked from a pinned region inherits neither it nor its locks; the parent is fine."""

    CHUNK = 1 * MiB
    HOST_BLOCKS = 64  # 32 KiB host blocks: 2 MiB, two chunks
    DEVICE_BLOCKS = 16

    @pytest.mark.parametrize("moment", ["pinned", "pinning"])
    async def test_fork(self, moment: str, munmaps: list[tuple[int, int]]) -> None:
        gen = torch.Generator().manual_seed(11)
        arrays = [
            torch.randint(0, 256, (self.DEVICE_BLOCKS, 16 * 1024), dtype=torch.uint8, generator=gen)
            for _ in range(2)
        ]
        layout = KVLayout.from_tensors(arrays)
        # "pinning": fork while the second chunk's pin call is held in its thread.
        fake = FakeBackend(inner=HostBackend(), stall_pin_at=1 if moment == "pinning" else None)
        baseline = _sys.vm_locked_bytes()
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(
                layout,
                self.HOST_BLOCKS,
                backend=fake,
                chunk_bytes=self.CHUNK,
                unpinned_policy="pageable",
            ) as mgr:
                address, nbytes = mgr.host_view().data_ptr(), mgr.nbytes
                try:
                    await self.fork_and_check(mgr, fake, layout, wait_pinned=moment == "pinned")
                finally:
                    fake.release()  # before close, which waits for a held pin call
        assert_released(mgr, fake, munmaps, address, nbytes)
        assert _sys.vm_locked_bytes() == baseline

    async def fork_and_check(
        self, mgr: OffloadManager, fake: FakeBackend, layout: KVLayout, *, wait_pinned: bool
    ) -> None:
        view = mgr.host_view()
        address, nbytes = view.data_ptr(), mgr.nbytes
        originals = [array.clone() for array in layout.arrays]
        ids = list(range(self.DEVICE_BLOCKS))
        await mgr.store(ids, [c * 4 for c in ids])  # spread over both chunks
        if wait_pinned:
            await mgr.pinned
        else:
            ok = await anyio.to_thread.run_sync(fake.stalled.wait, TIMEOUT_S)
            assert ok, "the pin call was never held"
        before = digest(view)
        locked = _sys.vm_locked_bytes()
        pinned = mgr.stats().pinned_bytes
        assert pinned > 0
        region_vmas = vmas(address, nbytes)
        assert region_vmas

        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 3
            try:
                # Not inherited (MADV_DONTFORK): a placeholder of zeros covers the range
                # instead of the parent's bytes, and no locks (mlock is never inherited).
                inherited = ctypes.string_at(address, nbytes) != bytes(nbytes)
                code = 1 if inherited else 2 if _sys.vm_locked_bytes() else 0
            finally:
                os._exit(code)
        assert wait_child(pid) == 0, "the child inherited the region or its locks"

        # The parent's data, pins and transfers are untouched.
        assert digest(view) == before
        assert _sys.vm_locked_bytes() == locked
        fake.release()
        await mgr.pinned
        assert _sys.vm_locked_bytes() == locked - pinned + nbytes
        for array in layout.arrays:
            array.zero_()
        await mgr.load([c * 4 for c in ids], ids)
        for array, original in zip(layout.arrays, originals, strict=True):
            assert torch.equal(array, original)


# -- signals during the demo ----------------------------------------------------------------

# Runs `python -m asyncpin demo ...` with one change: the pin call of chunk HOLD_AT waits
# at the pause gate until close stops the pipeline, and says so on stderr ("HELD"). So
# the signal always lands mid-pinning, with HOLD_AT chunks pinned.
HELD_DEMO = """
import runpy, sys, threading
import asyncpin.gate as gate

HOLD_AT = 2
real_enter_call = gate.PauseGate.enter_call
calls = []
lock = threading.Lock()

def enter_call(self, abort=None):
    if abort is not None:  # a pin call (unpins pass no abort flag)
        with lock:
            calls.append(None)
            n = len(calls) - 1
        if n == HOLD_AT:
            print("HELD", file=sys.stderr, flush=True)
            abort.wait()
            return False
    return real_enter_call(self, abort)

gate.PauseGate.enter_call = enter_call
sys.argv = ["asyncpin", *sys.argv[1:]]
runpy.run_module("asyncpin", run_name="__main__", alter_sys=True)
"""


class TestSignalsDuringDemo:
    """SIGINT / SIGTERM mid-pinning: the demo releases everything, says so, exits 130 / 143."""

    @pytest.mark.parametrize("backing", ["anonymous", "shared"])
    @pytest.mark.parametrize(
        ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["INT", "TERM"]
    )
    def test_signal_mid_pinning(
        self, signum: signal.Signals, code: int, backing: str, shm_name: str
    ) -> None:
        args = ["demo", "--backend", "host", "--size", "256MiB", "--chunk-mib", "16"]
        if backing == "shared":
            args += ["--backing", "shared", "--name", shm_name]
        path = SHM_DIR / shm_name
        try:
            with child("-c", HELD_DEMO, *args) as proc:
                assert proc.stdout is not None and proc.stderr is not None
                out, err = Lines(proc.stdout), Lines(proc.stderr)
                out.expect("entered")
                err.expect("HELD")
                assert path.exists() == (backing == "shared")
                proc.send_signal(signum)
                assert proc.wait(TIMEOUT_S) == code, err.rest()
                lines = err.rest()
            assert lines[0] == "HELD"
            assert len(lines) == 2, lines  # one line, and no traceback
            line = lines[1]
            assert line.startswith(f"asyncpin demo: interrupted by {signum.name}; manager closed")
            assert line.endswith("with 0 B still pinned")
            assert not path.exists(), "the demo left its shared region behind"
        finally:
            path.unlink(missing_ok=True)
