"""Helpers shared by the test modules."""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import anyio
import anyio.to_thread

# The bound on every wait in the tests: a broken check fails instead of hanging the run.
TIMEOUT_S = 30.0


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
