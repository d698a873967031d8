"""A pin backend that records every call in order and fails or stalls on command. For
testing faults and ordering only: it pins nothing unless it wraps a real backend."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncpin.errors import BackendCallError

if TYPE_CHECKING:
    from asyncpin.backends import PinBackend

__all__ = ["BackendCall", "FakeBackend", "is_mapped"]


def is_mapped(address: int, nbytes: int) -> bool:
    """Whether ``[address, address+nbytes)`` lies inside mappings of this process."""
    covered = address
    end = address + nbytes
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
        ranges.append((lo, hi))
    for lo, hi in sorted(ranges):
        if lo <= covered < hi:
            covered = hi
            if covered >= end:
                return True
    return False


@dataclass(frozen=True, slots=True)
class BackendCall:
    """One recorded call: ``op`` is ``pin`` or ``unpin``; ``ok`` whether it succeeded;
    ``mapped`` whether the span was still mapped when the call was made."""

    op: str
    address: int
    nbytes: int
    ok: bool
    mapped: bool


class FakeBackend:
    """Records pin/unpin calls; fails or stalls the n-th call (0-based) on command.

    - ``fail_pin_at``: the n-th pin call raises BackendCallError (code ``EFAKE`` = 9999).
    - ``stall_pin_at``: the n-th pin call sets :attr:`stalled` and blocks until
      :meth:`release` is called.
    - ``fail_unpin_at``: the n-th unpin call raises BackendCallError.
    - ``fail_before_unpin``: :meth:`before_unpin` raises BackendCallError.
    - ``fail_warm_up``: :meth:`warm_up` raises BackendCallError.
    - ``inner``: a real backend to delegate to (then it records and injects faults around
      real pins, and :meth:`warm_up` and :meth:`before_unpin` call the inner one's,
      where it has one);
      ``before_pin(n, address, nbytes)`` runs before the n-th pin is made.

    :attr:`warm_up_at` and :attr:`before_unpin_at` list, for each :meth:`warm_up` and
    :meth:`before_unpin` call, how many pin and unpin calls were recorded when it came.
    """

    name = "fake"
    max_pin_bytes = 1 << 62
    FAKE_CODE = 9999

    def __init__(
        self,
        *,
        fail_pin_at: int | None = None,
        stall_pin_at: int | None = None,
        fail_unpin_at: int | None = None,
        max_pin_bytes: int | None = None,
        inner: PinBackend | None = None,
        before_pin: Callable[[int, int, int], None] | None = None,
        fail_before_unpin: bool = False,
        fail_warm_up: bool = False,
    ) -> None:
        self.inner = inner
        self.before_pin = before_pin
        self.fail_pin_at = fail_pin_at
        self.stall_pin_at = stall_pin_at
        self.fail_unpin_at = fail_unpin_at
        self.fail_before_unpin = fail_before_unpin
        self.fail_warm_up = fail_warm_up
        self.before_unpin_at: list[int] = []
        self.warm_up_at: list[int] = []
        if max_pin_bytes is not None:
            self.max_pin_bytes = max_pin_bytes
        elif inner is not None:
            self.max_pin_bytes = inner.max_pin_bytes
        self.calls: list[BackendCall] = []
        self.stalled = threading.Event()
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._counts = {"pin": 0, "unpin": 0}

    def release(self) -> None:
        """Let a stalled pin call return."""
        self._released.set()

    def preflight(self, nbytes: int) -> None:
        if self.inner is not None:
            self.inner.preflight(nbytes)

    def pin(self, address: int, nbytes: int) -> None:
        n = self._count("pin")
        if n == self.stall_pin_at:
            self.stalled.set()
            self._released.wait()
        if self.before_pin is not None:
            self.before_pin(n, address, nbytes)
        self._call("pin", n, n == self.fail_pin_at, address, nbytes)

    def unpin(self, address: int, nbytes: int) -> None:
        n = self._count("unpin")
        self._call("unpin", n, n == self.fail_unpin_at, address, nbytes)

    def warm_up(self) -> None:
        self._run_hook("warm_up", self.warm_up_at, self.fail_warm_up)

    def before_unpin(self) -> None:
        self._run_hook("before_unpin", self.before_unpin_at, self.fail_before_unpin)

    def _run_hook(self, name: str, at: list[int], fail: bool) -> None:
        """Record the hook's call, call the inner backend's, then fail if told to."""
        with self._lock:
            at.append(len(self.calls))
        inner = getattr(self.inner, name, None)
        if callable(inner):
            inner()
        if fail:
            raise BackendCallError(
                f"fake_{name}", self.FAKE_CODE, "EFAKE", f"injected failure in {name}"
            )

    def _count(self, op: str) -> int:
        """The number (0-based) of this ``op`` call."""
        with self._lock:
            n = self._counts[op]
            self._counts[op] += 1
        return n

    def _call(self, op: str, n: int, fail: bool, address: int, nbytes: int) -> None:
        """Make the n-th ``op`` call: through ``inner`` (if any) unless it is to ``fail``,
        record it, then raise the injected failure if it is."""
        if not fail and self.inner is not None:
            real = self.inner.pin if op == "pin" else self.inner.unpin
            try:
                real(address, nbytes)
            except BaseException:
                self._record(op, address, nbytes, False)
                raise
        self._record(op, address, nbytes, not fail)
        if fail:
            raise BackendCallError(
                f"fake_{op}", self.FAKE_CODE, "EFAKE", f"injected failure at {op} {n}"
            )

    def _record(self, op: str, address: int, nbytes: int, ok: bool) -> None:
        call = BackendCall(op, address, nbytes, ok, is_mapped(address, nbytes))
        with self._lock:
            self.calls.append(call)

    # -- views for assertions ---------------------------------------------------------

    def pinned_spans(self) -> list[tuple[int, int]]:
        return [(c.address, c.nbytes) for c in self.calls if c.op == "pin" and c.ok]

    def unpinned_spans(self) -> list[tuple[int, int]]:
        return [(c.address, c.nbytes) for c in self.calls if c.op == "unpin"]

    def __repr__(self) -> str:
        return f"<FakeBackend calls={len(self.calls)} stalled={self.stalled.is_set()}>"
