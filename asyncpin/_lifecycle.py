"""Who may use a manager, and when: its state, the process and thread that opened it, and
the close, which runs once, in order, as a task of its own."""

from __future__ import annotations

import enum
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from asyncpin._tasks import OwnedTasks, current_loop
from asyncpin.errors import ForkedManagerError, LifecycleError
from asyncpin.gate import PauseGate, held_here

__all__ = ["Lifecycle", "ManagerState"]


class ManagerState(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Lifecycle:
    """The state machine NEW → OPEN → CLOSING → CLOSED (or NEW → CLOSED)."""

    def __init__(self, gate: PauseGate, tasks: OwnedTasks, log: Any) -> None:
        self._state = ManagerState.NEW
        self._gate = gate
        self._tasks = tasks
        self._log = log
        # The close order runs as a task of its own: a caller cancelled while it waits
        # (asyncio's native cancel, Ctrl-C) stops waiting, never the close.
        self._closer = OwnedTasks(log)
        self._closed = anyio.Event()
        # Set while a task is entering and has not yet opened or let go of what it made:
        # a close from NEW waits for it (``entering`` / ``entered``).
        self._entry: anyio.Event | None = None
        self.pid: int | None = None  # the process that opened it
        self._loop_thread: int | None = None  # the thread that entered: transfers only there
        self.close_seconds: float | None = None

    @property
    def state(self) -> ManagerState:
        """CLOSED in a forked child: nothing of the manager is usable there."""
        return ManagerState.CLOSED if self.forked() else self._state

    @property
    def is_new(self) -> bool:
        return self._state is ManagerState.NEW

    def entering(self) -> None:
        """An entry begins, on the calling loop (the manager's tasks and a close run
        there from now on: the entry awaits before it opens, and a close from another
        task of this loop may come meanwhile); a close from NEW now waits for
        :meth:`entered`. RuntimeError if an entry has begun before."""
        if self._state is not ManagerState.NEW or self._entry is not None:
            raise RuntimeError("an OffloadManager can be entered only once")
        self._tasks.bind()
        self._entry = anyio.Event()

    def entered(self) -> None:
        """The entry is over: opened (OPEN), or all it made let go of."""
        if self._entry is not None:
            self._entry.set()
        if self._state is ManagerState.CLOSED:  # closed meanwhile: this close is over
            self._closed.set()

    def opened(self) -> None:
        """NEW → OPEN, from the task that entered."""
        self._closer.bind()
        self._state = ManagerState.OPEN
        self._loop_thread = threading.get_ident()
        self.pid = os.getpid()

    def forked(self) -> bool:
        """Whether this process is a fork of the one that opened the manager."""
        return self.pid is not None and os.getpid() != self.pid

    def check_process(self) -> None:
        if self.forked():
            raise ForkedManagerError(
                f"this OffloadManager belongs to process {self.pid}, not to this forked "
                f"child ({os.getpid()}): its region is not mapped here and its pins are the "
                "parent's; open a new manager in this process"
            )

    def check_open(self, message: str = "the manager is not open") -> None:
        """Raise unless open, in the process that opened it. ``message`` is for a
        manager that has closed or is closing; one not open yet is named as such."""
        self.check_process()
        if self._state is ManagerState.OPEN:
            return
        if self._state is ManagerState.NEW:
            when = (
                "its entry is under way"
                if self._entry is not None
                else "enter it first: async with OffloadManager(...)"
            )
            raise anyio.ClosedResourceError(f"the manager is not open yet ({when})")
        raise anyio.ClosedResourceError(message)

    def check_loop_thread(self, call: str) -> None:
        if threading.get_ident() != self._loop_thread:
            raise RuntimeError(
                f"{call}() must be called from the event loop's thread (the one that "
                "entered the manager); from another thread, go through "
                "anyio.from_thread.run_sync"
            )

    def _check_not_held(self) -> None:
        held = held_here(self._gate)
        if held is not None:
            raise LifecycleError(
                f"aclose() called inside {held}: the close waits for the pin calls and "
                f"transfers that {held} holds back, so it would never return; close the "
                f"manager after leaving the {held} block (it is still open)"
            )

    def _check_can_close(self) -> None:
        """Refuse a close that could only hang or break, before anything changes."""
        self._check_not_held()
        if current_loop() is not self._tasks.loop:
            raise LifecycleError(
                "aclose() called from another event loop than the one that opened the "
                "manager, whose tasks run there: close it on that loop (from another "
                "thread, through anyio.from_thread.run(mgr.aclose))"
            )

    async def aclose(
        self,
        close_in_order: Callable[[], Awaitable[None]],
        never_opened: Callable[[], None],
        leaked: Callable[[], int],
    ) -> None:
        """Close once: ``never_opened()`` from NEW (then, during an entry, the close
        is over once the entering task has let go of what it made: a close called from
        a thread that entry waits for, an engine's ``prepare`` say, would wait for
        ever); else ``close_in_order()`` in the closer task. Every caller waits for the
        same close, shielded (``leaked()`` says how many chunks it left mapped)."""
        if self.forked():
            return
        if self._state is not ManagerState.NEW and self._state is not ManagerState.CLOSED:
            self._check_can_close()
        elif self._entry is not None and not self._entry.is_set():
            self._check_can_close()  # the entry's set-up may wait for a hold, or a loop
        with anyio.CancelScope(shield=True):
            if self._state is ManagerState.NEW:
                self._state = ManagerState.CLOSED
                never_opened()
                if self._entry is None or self._entry.is_set():
                    self._closed.set()
                # else the entering task sets it once it has let go of what it made
                await self._closed.wait()
                return
            if self._state is ManagerState.OPEN:
                self._state = ManagerState.CLOSING
                self._closer.start_soon(self._close, close_in_order, leaked)
            await self._closed.wait()

    async def _close(
        self, close_in_order: Callable[[], Awaitable[None]], leaked: Callable[[], int]
    ) -> None:
        """The close order, in a task of its own that no caller's cancellation reaches."""
        with anyio.CancelScope(shield=True):
            t0 = time.perf_counter()
            try:
                await close_in_order()
            finally:
                self.close_seconds = time.perf_counter() - t0
                self._state = ManagerState.CLOSED
                self._closed.set()
                self._log.info(
                    "manager.closed", close_seconds=self.close_seconds, leaked_chunks=leaked()
                )
