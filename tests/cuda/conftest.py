"""Fixtures of the CUDA tests."""

from __future__ import annotations

import threading
from typing import Any

import pytest


@pytest.fixture
def kernel_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[threading.Thread, int]]:
    """The copy kernel's launches from now on: (thread, segment count)."""
    import asyncpin.engines.cuda.kernel as kernel_module

    launches: list[tuple[threading.Thread, int]] = []
    launch = kernel_module.CopyKernel.launch

    def counted(self: Any, stream: int, grid: int, args: tuple[int, ...], **kw: Any) -> None:
        launches.append((threading.current_thread(), args[9]))  # n_segments
        launch(self, stream, grid, args, **kw)

    monkeypatch.setattr(kernel_module.CopyKernel, "launch", counted)
    return launches


@pytest.fixture
def kernel_loads(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The threads that loaded the copy kernel from now on, the process made to look as
    if no manager had loaded it yet."""
    import asyncpin.engines.cuda.kernel as kernel_module

    loads: list[threading.Thread] = []
    load = kernel_module.CopyKernel._load

    def counted(rt: Any) -> int:
        loads.append(threading.current_thread())
        return load(rt)

    monkeypatch.setattr(kernel_module, "_loaded", {})
    monkeypatch.setattr(kernel_module.CopyKernel, "_load", staticmethod(counted))
    return loads
