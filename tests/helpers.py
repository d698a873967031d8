"""Helpers shared by the test modules."""

from __future__ import annotations

import gc
import hashlib
import os
import select
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar
from unittest import mock

import anyio
import anyio.to_thread
import pytest
import torch

from asyncpin import AsyncpinError, OffloadManager, _sys
from asyncpin.region import HostRegion

# The bound on every wait in the tests: a broken check fails instead of hanging the run.
TIMEOUT_S = 30.0

E = TypeVar("E", bound=BaseException)


async def wait_thread_event(event: threading.Event) -> None:
    """Wait for an event that a worker thread sets, without blocking the event loop."""
    done = await anyio.to_thread.run_sync(event.wait, TIMEOUT_S)
    assert done, "thread event never set"


class Releasable(Protocol):
    def release(self) -> None: ...


@contextmanager
def releasing(*holds: Releasable) -> Iterator[None]:
    """Release held pins and copies however the block ends: a failed check must not leave a
    shielded close waiting for a call that never returns."""
    try:
        yield
    finally:
        for hold in holds:
            hold.release()


def wait_child(pid: int, timeout_s: float = TIMEOUT_S) -> int:
    """Wait for a forked child with a bound; returns its exit code (killed on timeout)."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"forked child {pid} did not exit within {timeout_s} s")
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    finally:
        os.close(pidfd)


def digest(view: torch.Tensor) -> str:
    """SHA-256 of a CPU tensor's bytes, to compare contents across processes."""
    return hashlib.sha256(view.numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class Footprint:
    """This process's file-backed mappings and open file descriptors. (Anonymous mappings
    are not compared: the interpreter's and malloc's arenas come and go with any
    allocation, and did in CI; asyncpin's own are counted by ``asyncpin_mappings``.)"""

    files: tuple[str, ...]  # file-backed mappings, sorted (a shared region's file)
    fds: frozenset[str]


@dataclass
class MadeRegions:
    """The regions created while the ``made_regions`` fixture watches (``conftest.py``)."""

    made: list[HostRegion] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # each one's (address, nbytes)


def footprint() -> Footprint:
    files = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and not fields[5].startswith("["):
            files.append(fields[5])
    return Footprint(tuple(sorted(files)), frozenset(os.listdir("/proc/self/fd")))


@contextmanager
def asyncpin_mappings() -> Iterator[list[list[int]]]:
    """Every range asyncpin maps (``_sys.libc_mmap``) while inside, as ``[start, end,
    bytes still mapped]``, less what it unmaps (``_sys.libc_munmap``) meanwhile."""
    ranges: list[list[int]] = []
    real_mmap, real_munmap = _sys.libc_mmap, _sys.libc_munmap

    def mmap(nbytes: int, *args: Any, **kwargs: Any) -> int:
        address = real_mmap(nbytes, *args, **kwargs)
        ranges.append([address, address + nbytes, nbytes])
        return address

    def munmap(address: int, nbytes: int) -> None:
        real_munmap(address, nbytes)
        for r in ranges:
            r[2] -= max(0, min(r[1], address + nbytes) - max(r[0], address))

    with mock.patch.object(_sys, "libc_mmap", mmap), mock.patch.object(_sys, "libc_munmap", munmap):
        yield ranges


@contextmanager
def refused(error: type[E], *words: str) -> Iterator[pytest.ExceptionInfo[E]]:
    """Expect ``error`` whose message holds every one of ``words``, leaving no mapping and
    no file descriptor behind (VmLck and /dev/shm are checked by the ``no_leaks`` fixture).
    Earlier garbage is collected first: a shared region's view in a reference cycle holds
    the file's mapping until the collector runs, which must not be inside the count."""
    gc.collect()
    before = footprint()
    with asyncpin_mappings() as ranges:
        with pytest.raises(error) as info:
            yield info
        message = str(info.value)
        for word in words:
            assert word in message, f"{word!r} not in {message!r}"
        assert isinstance(info.value, AsyncpinError)
        if any(left for _, _, left in ranges):
            gc.collect()  # a region's range goes when its last view does
        left = [(hex(start), left) for start, _, left in ranges if left]
    assert not left, f"asyncpin left mapped: {left}"
    assert footprint() == before, "a file mapping or file descriptor was left behind"


async def open_manager(nbytes: Any, **kwargs: Any) -> None:
    """Construct and enter a manager; the bad input may be caught at either step."""
    async with OffloadManager(nbytes, **kwargs):
        pass
    pytest.fail(f"OffloadManager({nbytes!r}, **{kwargs!r}) opened")


@asynccontextmanager
async def pause_held_elsewhere(mgr: OffloadManager) -> AsyncIterator[None]:
    """``mgr.pinning_paused()``, taken by another task before the block begins and held
    until it ends (a close in the block must then not need the pause)."""
    held, release = anyio.Event(), anyio.Event()

    async def hold() -> None:
        async with mgr.pinning_paused():
            held.set()
            await release.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold)
        await held.wait()
        try:
            yield
        finally:
            release.set()
