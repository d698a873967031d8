"""The library's loggers never raise: a log sink that fails (stdout a closed pipe, a full
disk) must not change what the library does. (A pin pipeline whose first log line met a
closed pipe never settled ``pinned``: the application waited for it without end.)"""

from __future__ import annotations

import contextlib
from typing import Any


class ShieldedLog:
    """A structlog (bound) logger whose calls swallow the sink's errors; ``bind`` and
    ``new`` give shielded loggers too."""

    __slots__ = ("_log",)

    def __init__(self, log: Any) -> None:
        self._log = log.wrapped if isinstance(log, ShieldedLog) else log

    @property
    def wrapped(self) -> Any:
        return self._log

    def bind(self, **values: Any) -> ShieldedLog:
        return ShieldedLog(self._log.bind(**values))

    def new(self, **values: Any) -> ShieldedLog:
        return ShieldedLog(self._log.new(**values))

    def _emit(self, level: str, event: str, **values: Any) -> None:
        with contextlib.suppress(Exception):  # the sink failed: nothing to tell it with
            getattr(self._log, level)(event, **values)

    def debug(self, event: str, **values: Any) -> None:
        self._emit("debug", event, **values)

    def info(self, event: str, **values: Any) -> None:
        self._emit("info", event, **values)

    def warning(self, event: str, **values: Any) -> None:
        self._emit("warning", event, **values)

    def error(self, event: str, **values: Any) -> None:
        self._emit("error", event, **values)

    def exception(self, event: str, **values: Any) -> None:
        self._emit("exception", event, **values)

    def critical(self, event: str, **values: Any) -> None:
        self._emit("critical", event, **values)
