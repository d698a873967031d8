"""Test doubles and conformance checks for asyncpin's two seams (``asyncpin.abc``).

- :class:`FakeBackend`: a pin backend that records every call and fails or stalls on
  command (alone it pins nothing; around a real backend it pins for real).
- :class:`FakeEngine`: a transfer engine that records every job and finishes them on
  command, in order; it fails submission or a copy on command.
- :func:`check_pin_backend` and :func:`check_transfer_engine`: async conformance checks
  (anyio: asyncio or trio) of the written contracts, which every real backend and engine
  passes; a violation raises AssertionError naming the clause.
"""

from __future__ import annotations

from asyncpin.testing._backend import BackendCall, FakeBackend, is_mapped
from asyncpin.testing._check_backend import check_pin_backend
from asyncpin.testing._check_engine import check_transfer_engine
from asyncpin.testing._engine import FakeEngine, SubmittedJob

__all__ = [
    "BackendCall",
    "FakeBackend",
    "FakeEngine",
    "SubmittedJob",
    "check_pin_backend",
    "check_transfer_engine",
    "is_mapped",
]
