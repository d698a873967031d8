"""A call in a worker thread that is waited for to its end, whatever cancellations come,
and a way back to the event loop that does not wait for it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread

from asyncpin._tasks import current_loop

__all__ = ["Once", "call_soon", "to_the_end"]


def call_soon(fn: Callable[[], None]) -> Callable[[], None]:
    """A callable that schedules ``fn`` on the running event loop and returns at once,
    from any thread, and from a signal handler (asyncio's ``call_soon_threadsafe``,
    trio's ``run_sync_soon``). Make it on the loop."""
    loop: Any = current_loop()  # asyncio's loop, or trio's token for this run
    if isinstance(loop, asyncio.AbstractEventLoop):

        def wake() -> None:
            loop.call_soon_threadsafe(fn)

        return wake
    return lambda: loop.run_sync_soon(fn)


async def to_the_end(fn: Callable[[], object]) -> None:
    """``fn()`` in a worker thread of its own, once, and return only when it has: an
    anyio cancellation is held back by a shield; a native asyncio cancel
    (``Task.cancel()``), which ends a wait for a worker thread at once and makes anyio
    skip a job not yet started, is absorbed while the wait goes on, and raised after
    (what ``fn`` raised chained to it: a cancelled task ends cancelled). Else what
    ``fn`` raises is raised."""
    once = Once(fn)
    cancelled: BaseException | None = None
    while not once.over.is_set():
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(once, limiter=anyio.CapacityLimiter(1))
        except anyio.get_cancelled_exc_class() as exc:
            cancelled = exc
    if cancelled is not None:
        if once.error is not None:
            raise cancelled from once.error
        raise cancelled
    if once.error is not None:
        raise once.error


class Once:
    """``fn()`` run by the first caller, from whichever thread; later callers wait for
    it to end."""

    __slots__ = ("_fn", "_lock", "_taken", "error", "over")

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._taken = False
        self.error: BaseException | None = None
        self.over = threading.Event()

    def __call__(self) -> None:
        with self._lock:
            taken, self._taken = self._taken, True
        if taken:
            self.over.wait()
            return
        try:
            self._fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.over.set()
