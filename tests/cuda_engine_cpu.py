"""The CUDA engine made on the CPU, for tests of its logic without a GPU: a stand-in
runtime and copy kernel, KV arrays that are CPU tensors (the engine only reads their
addresses until it is prepared)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import asyncpin.engines.cuda as ct
from asyncpin import KVLayout
from asyncpin.abc import EngineSetup
from asyncpin.engines.cuda import CudaTransferEngine


def offset_layout(offset: int, block: int, *, blocks: int = 256, arrays: int = 4) -> KVLayout:
    """``arrays`` arrays of ``block``-byte blocks, back to back in one buffer from byte
    ``offset``."""
    span = blocks * block
    buffer = torch.zeros(offset + arrays * span, dtype=torch.uint8)
    views = [
        buffer[offset + a * span : offset + (a + 1) * span].view(blocks, block)
        for a in range(arrays)
    ]
    return KVLayout.from_tensors(views)


@contextmanager
def cpu_engine(
    monkeypatch: pytest.MonkeyPatch,
    layout: KVLayout,
    *,
    kernel: Any = None,
    host_blocks: int = 256,
    chunk_bytes: int = 1 << 30,
    start_soon: Callable[..., object] = lambda *args: None,
    host_registered: bool = True,
) -> Iterator[CudaTransferEngine]:
    """The engine as the manager makes it (call it on the event loop), its copy kernel
    ``kernel`` (None: a runtime without the call to load one; an exception: its load
    raises it). Its threads end on exit."""
    monkeypatch.setattr(ct, "Runtime", lambda: SimpleNamespace())

    def load_kernel(rt: Any) -> Any:
        if isinstance(kernel, BaseException):
            raise kernel
        return kernel

    monkeypatch.setattr(ct, "load_kernel", load_kernel)
    monkeypatch.setattr(ct, "kernel_available", lambda rt: kernel is not None)
    host = torch.zeros(host_blocks, layout.host_block_bytes, dtype=torch.uint8)
    assert host.data_ptr() % 16 == 0  # as the region is (page-aligned)
    setup = EngineSetup(layout, host, chunk_bytes, start_soon, host_registered=host_registered)
    engine = CudaTransferEngine(setup)
    engine._load()  # what prepare() does without a device
    threads = engine._submitter, engine._completion  # a test may stand others in
    try:
        yield engine
    finally:
        for owner in threads:
            owner.close()
