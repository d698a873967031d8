"""The pause gate: keeps pin/unpin calls apart from work that must not overlap them.

``cudaHostRegister`` issued while another thread captures a CUDA graph fails with error
900 and invalidates the capture (measured in torch's context; from the CUDA backend's own
context it has not been tried). The gate holds every pin backend call: ``warm_up``
(the CUDA backend makes its context there), each pin and unpin, and the close's
``before_unpin`` (a device-wide synchronize for the CUDA backend).

Each manager has a :class:`PauseGate`; in addition a
process-wide hold (:func:`capture_gate`) pauses the gates of every manager at once, and
:func:`install_capture_gate` makes every ``torch.cuda.CUDAGraph`` capture take that
hold, so an engine installs it once and need not know which managers exist.

All gates share one condition variable: calls are chunk-sized (milliseconds), so one
lock costs nothing measurable and keeps the global and per-manager holds consistent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import TracebackType
from typing import Any

from asyncpin._threads import to_the_end
from asyncpin.errors import LifecycleError

__all__ = ["PauseGate", "PausedContext", "capture_gate", "install_capture_gate"]

_cond = threading.Condition()
_global_holders = 0
_global_in_flight = 0
# The gated calls the current thread is inside: (gate, counted by the process-wide gate).
_in_calls = threading.local()


def _calls_here() -> list[tuple[PauseGate, bool]]:
    calls: list[tuple[PauseGate, bool]] | None = getattr(_in_calls, "calls", None)
    if calls is None:
        calls = _in_calls.calls = []
    return calls


def _refuse_inside_a_call(what: str) -> None:
    raise LifecycleError(
        f"{what} taken inside a call that it holds back (a pin backend's warm_up, pin, "
        "unpin or before_unpin, or an engine's set-up, in this thread): it would wait for "
        "itself for ever"
    )


class _Mark:
    """One hold taken through a :class:`PausedContext`, as the code that holds it sees it:
    ``gate`` is the manager's gate, or None for the process-wide one."""

    __slots__ = ("active", "gate")

    def __init__(self, gate: PauseGate | None) -> None:
        self.gate = gate
        self.active = True


# The holds the current context is inside: a thread's ``with`` block, or an async task's
# (and the tasks it starts inside the block, which copy the context). Marks are shared
# objects, so a hold released while a copy still lists it reads as released there too.
_held: ContextVar[tuple[_Mark, ...]] = ContextVar("asyncpin_gate_held", default=())


def held_here(gate: PauseGate) -> str | None:
    """The hold that the calling code is inside, if it would hold up ``gate``'s calls:
    ``"pinning_paused()"`` for ``gate`` itself, ``"capture_gate()"`` for the process-wide
    one; None if neither. Code inside a hold that waits for those calls waits forever."""
    for mark in _held.get():
        if mark.active and mark.gate is None:
            return "capture_gate()"
        if mark.active and mark.gate is gate:
            return "pinning_paused()"
    return None


class PauseGate:
    """Per-manager gate. ``paused()`` waits for the call in flight to return and holds
    new ones until it exits; usable from any thread (``with``) or from async code
    (``async with``, which waits in a worker thread). Reentrant and counted."""

    __slots__ = ("_holders", "_in_flight")

    def __init__(self) -> None:
        self._holders = 0
        self._in_flight = 0

    def hold(self) -> None:
        if any(gate is self for gate, _ in _calls_here()):
            _refuse_inside_a_call("pinning_paused()")
        with _cond:
            self._holders += 1
            while self._in_flight:
                _cond.wait()

    def unhold(self) -> None:
        with _cond:
            if self._holders <= 0:
                raise RuntimeError("pause gate released more often than held")
            self._holders -= 1
            _cond.notify_all()

    def enter_call(self, abort: threading.Event | None = None) -> bool:
        """Block while paused; False if ``abort`` was set while waiting (no call made)."""
        return self._enter(abort, count_global=True)

    def exit_call(self) -> None:
        self._exit(count_global=True)

    def enter_local(self, abort: threading.Event | None = None) -> bool:
        """:meth:`enter_call` for a call that waits for the process-wide gate itself,
        inside (the engine's set-up, through ``outside_captures()``): it waits while
        either gate is held, but counts itself in flight for this gate only, so that a
        capture that begins meanwhile never waits for a call that waits for it."""
        return self._enter(abort, count_global=False)

    def exit_local(self) -> None:
        self._exit(count_global=False)

    def _enter(self, abort: threading.Event | None, *, count_global: bool) -> bool:
        global _global_in_flight
        with _cond:
            while (self._holders or _global_holders) and not (abort and abort.is_set()):
                _cond.wait()
            if abort is not None and abort.is_set():
                return False
            self._in_flight += 1
            _global_in_flight += count_global
        _calls_here().append((self, count_global))
        return True

    def _exit(self, *, count_global: bool) -> None:
        global _global_in_flight
        calls = _calls_here()
        if (self, count_global) in calls:
            calls.remove((self, count_global))
        with _cond:
            self._in_flight -= 1
            _global_in_flight -= count_global
            _cond.notify_all()

    def wake(self) -> None:
        """Wake waiters so they re-check their abort flag."""
        with _cond:
            _cond.notify_all()

    def is_paused(self) -> bool:
        return bool(self._holders or _global_holders)

    def paused(self) -> PausedContext:
        return PausedContext(self.hold, self.unhold, self)


class PausedContext:
    """``with`` (any thread) and ``async with`` (waits off the event loop) over a hold.

    The block's context is marked as holding it (see :func:`held_here`), so that a call
    inside it that would wait for the hold to end can refuse instead of hanging."""

    __slots__ = ("_gate", "_hold", "_marks", "_unhold")

    def __init__(
        self, hold: Callable[[], None], unhold: Callable[[], None], gate: PauseGate | None
    ) -> None:
        self._hold = hold
        self._unhold = unhold
        self._gate = gate
        self._marks: list[_Mark] = []  # one per entry not yet exited, oldest first

    def _mark(self) -> None:
        mark = _Mark(self._gate)
        self._marks.append(mark)
        _held.set((*_held.get(), mark))

    def _unmark(self) -> None:
        here = _held.get()
        # The entry made in this context, else (exited elsewhere) the latest one.
        mine = [m for m in self._marks if m in here]
        mark = mine[-1] if mine else self._marks[-1] if self._marks else None
        if mark is None:
            return
        mark.active = False
        self._marks.remove(mark)
        if mark in here:
            _held.set(tuple(m for m in here if m is not mark))

    def __enter__(self) -> None:
        self._hold()
        self._mark()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._unmark()
        self._unhold()

    async def __aenter__(self) -> None:
        # Taken in a worker thread, which waits for the calls in flight: a cancellation
        # meanwhile waits for the thread (``to_the_end``), then gives back what it took.
        taken = False

        def hold() -> None:
            nonlocal taken
            self._hold()
            taken = True

        try:
            await to_the_end(hold)
        except BaseException:
            if taken:
                self._unhold()
            raise
        self._mark()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._unmark()
        self._unhold()


def _hold_all() -> None:
    global _global_holders
    if any(count_global for _, count_global in _calls_here()):
        _refuse_inside_a_call("capture_gate()")
    with _cond:
        _global_holders += 1
        while _global_in_flight:
            _cond.wait()


def _unhold_all() -> None:
    global _global_holders
    with _cond:
        if _global_holders <= 0:
            raise RuntimeError("capture gate released more often than held")
        _global_holders -= 1
        _cond.notify_all()


def _enter_global(*, wait: bool) -> bool:
    """Count a call in flight for the process-wide gate, waiting while it is held (or,
    without ``wait``, counting nothing and answering False)."""
    global _global_in_flight
    with _cond:
        while wait and _global_holders:
            _cond.wait()
        if _global_holders:
            return False
        _global_in_flight += 1
        return True


def _exit_global() -> None:
    global _global_in_flight
    with _cond:
        _global_in_flight -= 1
        _cond.notify_all()


@contextmanager
def outside_captures() -> Iterator[None]:
    """For a CUDA call that a capture must not overlap, made from any thread other than
    the capturing one: waits while the process-wide gate is held, and keeps it from being
    taken until the block exits. A graph capture forbids such calls (waiting on or querying
    an event, allocating pinned memory) in every other thread; one that is already waiting
    when the capture begins is allowed, but the gate cannot tell that moment apart."""
    _enter_global(wait=True)
    try:
        yield
    finally:
        _exit_global()


@contextmanager
def unless_capturing() -> Iterator[bool]:
    """:func:`outside_captures` that never waits: yields False, holding nothing, while the
    process-wide gate is held; True otherwise, keeping the gate from being taken until
    the block exits. For a call that may be skipped, made from the event loop."""
    free = _enter_global(wait=False)
    try:
        yield free
    finally:
        if free:
            _exit_global()


def capture_gate() -> PausedContext:
    """Hold back, in every manager of the process, every CUDA call that would break a
    graph capture on this thread: pin and unpin calls, the transfer engine's waits on
    events, copies through pageable memory, and a manager's device set-up at open
    (``with`` or ``async with``). The pack method's staging, where it is allocated on
    first use, is not allocated meanwhile: that transfer uses batch. Transfers may still
    be queued meanwhile, but none is reported done until the gate is released: do not
    await one inside it, nor close a manager (close waits for its transfers).

    Wrap a serving engine's whole CUDA-graph warm-up and capture in it (never a pin
    backend's ``warm_up``, which it holds back: refused with LifecycleError)."""
    return PausedContext(_hold_all, _unhold_all, None)


@contextmanager
def _patched(cls: Any) -> Iterator[None]:
    begin, end = cls.capture_begin, cls.capture_end

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        _hold_all()
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            _unhold_all()
            raise

    def capture_end(self: Any) -> Any:
        try:
            return end(self)
        finally:
            _unhold_all()

    cls.capture_begin, cls.capture_end = capture_begin, capture_end
    try:
        yield
    finally:
        cls.capture_begin, cls.capture_end = begin, end


class _Installed:
    """Handle returned by :func:`install_capture_gate`; ``uninstall()`` restores torch."""

    def __init__(self) -> None:
        import torch

        self._cm = _patched(torch.cuda.CUDAGraph)
        self._cm.__enter__()

    def uninstall(self) -> None:
        self._cm.__exit__(None, None, None)


def install_capture_gate() -> _Installed:
    """Make every ``torch.cuda.CUDAGraph`` capture (``torch.cuda.graph(...)`` included)
    hold the process-wide gate from ``capture_begin`` to ``capture_end``.

    Install once at start-up; returns a handle whose ``uninstall()`` undoes it.
    """
    return _Installed()
