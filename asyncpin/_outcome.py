"""Outcome: a one-shot result that coroutines await: done, or failed with an error."""

from __future__ import annotations

from collections.abc import Generator
from types import TracebackType
from typing import Any

import anyio

__all__ = ["Outcome"]


class Outcome:
    """Settled once, from the event loop. ``await outcome`` (or ``await outcome.wait()``)
    returns when it is settled and raises its error if it failed; any number of tasks may
    wait, and cancelling one of them changes nothing for the others.

    Each raise starts from the error as it was settled: its traceback does not grow with
    every waiter's frames, and one waiter's exception context does not carry over to the
    next."""

    __slots__ = ("_cause", "_context", "_error", "_event", "_suppress", "_traceback")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._error: BaseException | None = None
        self._traceback: TracebackType | None = None
        self._context: BaseException | None = None
        self._cause: BaseException | None = None
        self._suppress = False

    def is_set(self) -> bool:
        return self._event.is_set()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _settle(self, error: BaseException | None) -> bool:
        """Settle with ``error`` (None for success); False if it was settled already."""
        if self._event.is_set():
            return False
        self._error = error
        if error is not None:
            self._traceback = error.__traceback__
            self._context = error.__context__
            self._cause, self._suppress = error.__cause__, error.__suppress_context__
        self._event.set()
        return True

    async def wait(self) -> None:
        await self._event.wait()
        error = self._error
        if error is not None:
            # A raise adds this call's frames to the error's traceback, one inside an
            # except block sets its __context__, and a waiter's `raise ... from` its
            # __cause__: start each raise from the settled ones.
            error.__context__, error.__cause__ = self._context, self._cause
            error.__suppress_context__ = self._suppress
            raise error.with_traceback(self._traceback)

    async def settled(self) -> None:
        """Return once it is settled, whichever way, without raising its error."""
        await self._event.wait()

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()
