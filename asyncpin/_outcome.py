"""Outcome: a one-shot result that coroutines await: done, or failed with an error."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import anyio

__all__ = ["Outcome"]


class Outcome:
    """Settled once, from the event loop. ``await outcome`` (or ``await outcome.wait()``)
    returns when it is settled and raises its error if it failed; any number of tasks may
    wait, and cancelling one of them changes nothing for the others."""

    __slots__ = ("_error", "_event")

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._error: BaseException | None = None

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
        self._event.set()
        return True

    async def wait(self) -> None:
        await self._event.wait()
        if self._error is not None:
            raise self._error

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()
