"""Background tasks that belong to an object (a manager), not to the task that made it.

A task group would tie them to the task that entered the manager: then only that task,
through ``async with``, could end them, and a close from another task (or an entry
without ``async with``) would exit a cancel scope or a trio nursery from the wrong place.
Instead each task runs on the event loop the owner opened on (asyncio: ``create_task``,
with a strong reference; trio: a system task), inside a cancel scope the owner holds.
A task never raises into anyone: its error is logged (its own outcome, such as a
transfer's handle, reports it to whoever waits), and :meth:`OwnedTasks.aclose` cancels
what is left and waits for it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

__all__ = ["OwnedTasks", "current_loop"]


def current_loop() -> object:
    """The running event loop: asyncio's loop object, or trio's token for this run."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: anyio's other backend is trio
        import trio

        return trio.lowlevel.current_trio_token()


class _Task:
    __slots__ = ("done", "handle", "scope")

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self.handle: asyncio.Task[None] | None = None  # asyncio: the strong reference


class OwnedTasks:
    """Tasks started with :meth:`start_soon` (the signature of a task group's) that end
    when :meth:`aclose` says so, whichever task calls it."""

    __slots__ = ("_closed", "_log", "_loop", "_tasks")

    def __init__(self, log: Any) -> None:
        self._log = log
        self._loop: object | None = None
        self._tasks: set[_Task] = set()
        self._closed = False

    def bind(self) -> None:
        """Run the tasks on the calling event loop from now on (call it from the loop)."""
        self._loop = current_loop()

    @property
    def loop(self) -> object | None:
        return self._loop

    def start_soon(
        self, fn: Callable[..., Awaitable[Any]], *args: Any, name: object = None
    ) -> None:
        """Start ``fn(*args)`` as a task of the owner; call it from the loop's thread."""
        if self._loop is None:
            raise RuntimeError("no event loop bound: call bind() from the loop first")
        if self._closed:
            raise RuntimeError("closed: no new task can start")
        task = _Task()
        label = name if name is not None else getattr(fn, "__qualname__", repr(fn))
        if isinstance(self._loop, asyncio.AbstractEventLoop):
            handle = self._loop.create_task(self._run(task, fn, args, label), name=str(label))
            task.handle = handle
            # Set here, not in _run: a task cancelled before it first runs never enters it.
            handle.add_done_callback(lambda _: self._finished(task))
        else:
            import trio

            trio.lowlevel.spawn_system_task(
                self._run, task, fn, args, label, name=label, context=contextvars.copy_context()
            )
        self._tasks.add(task)

    async def _run(
        self, task: _Task, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], label: object
    ) -> None:
        try:
            with task.scope:
                await fn(*args)
        except Exception as exc:
            self._log.error("task.failed", task=str(label), error=repr(exc), exc_info=exc)
        finally:
            if task.handle is None:  # trio
                self._finished(task)

    def _finished(self, task: _Task) -> None:
        self._tasks.discard(task)
        task.done.set()

    async def aclose(self) -> None:
        """Refuse new tasks, cancel the ones left and wait until each has ended."""
        self._closed = True
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.scope.cancel()
            for task in tasks:
                await task.done.wait()
