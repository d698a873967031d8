"""Shutdown signals held off while a close runs: the demo's and ``examples/server.py``'s.

From the moment a :class:`SignalGuard` is entered until it exits, no signal of
:data:`SHUTDOWN_SIGNALS` gets its default action: the application decides what each one
means (the demo starts its close at the first and only reports the later ones).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import anyio
import anyio.lowlevel

from asyncpin._threads import call_soon

__all__ = ["SHUTDOWN_SIGNALS", "SignalGuard"]

#: Signals that end the demo (and ``examples/server.py``) through its close: those whose
#: default action ends the process and that a terminal (Ctrl-C, Ctrl-\, hang-up), a shell
#: (``kill``) or a supervisor commonly sends.
SHUTDOWN_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


class SignalGuard:
    """While entered, no signal of ``signals`` gets its default action (ending the process,
    or KeyboardInterrupt for SIGINT): each is noted in :attr:`received`, in order, and wakes
    :meth:`wait`.

    The handlers are Python-level (``signal.signal``), installed before an event loop starts
    and removed after it has gone, so no signal in between finds a default handler (an
    event loop's own handlers, ``loop.add_signal_handler``, end with it). :meth:`wait`
    wakes two ways: the handler itself schedules the wake-up on the waiting loop (it runs
    in the main thread, once the loop wakes for the signal), and a wake-up socket
    (``signal.set_wakeup_fd``) wakes a loop that nothing else would wake. An event loop
    that installs its own wake-up descriptor (uvloop does) replaces the socket; the first
    way still works. Enter it from the main thread; elsewhere it does nothing, since
    Python runs signal handlers only in the main thread.
    """

    def __init__(self, signals: Iterable[signal.Signals] = SHUTDOWN_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: list[signal.Signals] = []
        self._previous: dict[signal.Signals, Any] = {}
        self._previous_wakeup = -1
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._waker: Callable[[], None] | None = None

    @property
    def first(self) -> signal.Signals | None:
        """The first signal received, or None."""
        return self.received[0] if self.received else None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum))
        waker, self._waker = self._waker, None
        if waker is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nothing waits
                waker()

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        self._wakeup = reader, writer
        self._previous_wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._wakeup is None:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_wakeup)
        for sock in self._wakeup:
            sock.close()
        self._wakeup = None

    async def wait(self, seen: int) -> None:
        """Return once more than ``seen`` signals have been received (never, if not entered
        in the main thread)."""
        while len(self.received) <= seen:
            if self._wakeup is None:
                await anyio.sleep_forever()
                return
            woken = anyio.Event()
            self._waker = call_soon(woken.set)
            if len(self.received) > seen:
                break
            reader = self._wakeup[0]
            async with anyio.create_task_group() as tg:
                tg.start_soon(_set_when_readable, reader, woken)
                await woken.wait()
                tg.cancel_scope.cancel()
            try:
                while reader.recv(4096):
                    pass
            except BlockingIOError:
                pass
            # The wake-up byte is written before the Python-level handler runs (in the
            # main thread, at its next check): let it run before looking again.
            await anyio.lowlevel.checkpoint()
        self._waker = None


async def _set_when_readable(sock: socket.socket, event: anyio.Event) -> None:
    await anyio.wait_readable(sock)
    event.set()
