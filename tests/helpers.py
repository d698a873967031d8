"""Helpers shared by the test modules."""

from __future__ import annotations

import hashlib
import os
import select
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
import anyio.to_thread
import pytest
import torch

from asyncpin import AsyncpinError, OffloadManager

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
    """This process's threads, mappings and open file descriptors."""

    threads: frozenset[str]
    anonymous: int  # anonymous mappings: threads make and drop theirs (stacks, arenas)
    files: tuple[str, ...]  # file-backed mappings, sorted (a shared region's file)
    fds: frozenset[str]

    def same_as(self, before: Footprint) -> bool:
        """Nothing left behind since ``before``. While a thread started or ended meanwhile
        (anyio's pool, a finished test's threads), its stack and malloc arena come and go:
        anonymous mappings are then not comparable, the rest is."""
        if self.threads == before.threads:
            return self == before
        return (self.files, self.fds) == (before.files, before.fds)


def footprint() -> Footprint:
    anonymous, files = 0, []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5].startswith("["):
            anonymous += 1
        else:
            files.append(fields[5])
    return Footprint(
        frozenset(os.listdir("/proc/self/task")),
        anonymous,
        tuple(sorted(files)),
        frozenset(os.listdir("/proc/self/fd")),
    )


@contextmanager
def refused(error: type[E], *words: str) -> Iterator[pytest.ExceptionInfo[E]]:
    """Expect ``error`` whose message holds every one of ``words``, leaving no mapping and
    no file descriptor behind (VmLck and /dev/shm are checked by the ``no_leaks`` fixture)."""
    before = footprint()
    with pytest.raises(error) as info:
        yield info
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert isinstance(info.value, AsyncpinError)
    assert footprint().same_as(before), "a mapping or file descriptor was left behind"


async def open_manager(nbytes: Any, **kwargs: Any) -> None:
    """Construct and enter a manager; the bad input may be caught at either step."""
    async with OffloadManager(nbytes, **kwargs):
        pass
    pytest.fail(f"OffloadManager({nbytes!r}, **{kwargs!r}) opened")
