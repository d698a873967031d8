"""Fixtures of the CUDA tests."""

from __future__ import annotations

import threading
from typing import Any

import pytest


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
