"""The CUDA engine's completion waiters, and its one allocation after open, keep out of
CUDA graph captures (no GPU needed).

A capture in torch's default mode forbids waiting on an event from any other thread: the
wait fails and the capture is invalidated (bench/capture_probe.py, on the H200). So a
waiter does not begin a wait while the process-wide capture gate is held, and a capture
does not begin while a waiter is inside one. Stand-in events record what the gate looked
like when they were waited on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

import asyncpin.engines.cuda as ct
import asyncpin.gate
from asyncpin import capture_gate
from asyncpin.engines.cuda import CudaTransferEngine
from asyncpin.engines.cuda.completion import Waiter
from asyncpin.transfers import Transfer, TransferJob
from tests.cuda_engine_cpu import cpu_engine, offset_layout

TIMEOUT_S = 10.0
# How long a wait that must not happen is given to happen anyway. Without the gate the
# waiter thread would reach it in well under a millisecond.
NEGATIVE_S = 0.2


class _Event:
    """Records whether the capture gate was held when it was waited on."""

    def __init__(self, block: threading.Event | None = None) -> None:
        self.entered = threading.Event()
        self.held_when_entered: bool | None = None
        self._block = block

    def synchronize(self) -> None:
        self.held_when_entered = asyncpin.gate._global_holders > 0
        self.entered.set()
        if self._block is not None:
            assert self._block.wait(TIMEOUT_S)


@pytest.fixture
def waiter() -> Any:
    w = Waiter("test-waiter")
    w.start()
    yield w
    w.close()


def test_a_wait_waits_for_the_capture_gate(waiter: Waiter) -> None:
    event, reported = _Event(), threading.Event()
    errors: list[BaseException | None] = []

    def report(error: BaseException | None) -> None:
        errors.append(error)
        reported.set()

    with capture_gate():
        waiter.submit(event, report)
        assert not event.entered.wait(NEGATIVE_S), "waited on an event during a capture"
    assert reported.wait(TIMEOUT_S)
    assert event.held_when_entered is False and errors == [None]


def test_a_capture_waits_for_a_wait_under_way(waiter: Waiter) -> None:
    release = threading.Event()
    event, reported = _Event(block=release), threading.Event()
    waiter.submit(event, lambda error: reported.set())
    assert event.entered.wait(TIMEOUT_S)

    held = threading.Event()

    def capture() -> None:
        with capture_gate():
            held.set()

    thread = threading.Thread(target=capture)
    thread.start()
    assert not held.wait(NEGATIVE_S), "the gate was taken while a wait was under way"
    release.set()
    assert held.wait(TIMEOUT_S) and reported.wait(TIMEOUT_S)
    thread.join(TIMEOUT_S)
    assert event.held_when_entered is False
    assert asyncpin.gate._global_in_flight == 0 and asyncpin.gate._global_holders == 0


class _Lane:
    """A lane without pack staging; records, for each allocation asked of it, how many
    calls the process-wide gate counted in flight (the allocation must be one of them, so
    that no capture can begin during it)."""

    def __init__(self, fail: bool = False) -> None:
        self.staging: object | None = None
        self.allocations: list[int] = []
        self._fail = fail

    def allocate_staging(self, rt: Any, host_block_bytes: int) -> object:
        self.allocations.append(asyncpin.gate._global_in_flight)
        if self._fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")
        self.staging = object()
        return self.staging


@contextlib.contextmanager
def _staging_engine(monkeypatch: pytest.MonkeyPatch, lane: _Lane) -> Iterator[CudaTransferEngine]:
    """An engine of 2 MiB blocks (batch by default), with a copy kernel, whose store lane
    is ``lane``."""
    layout = offset_layout(0, 2 << 20, blocks=2, arrays=4)
    with cpu_engine(monkeypatch, layout, kernel=object(), host_blocks=2) as engine:
        monkeypatch.setattr(ct, "on_device", lambda index: contextlib.nullcontext())
        engine._lanes = {"store": lane, "load": _Lane()}  # type: ignore[dict-item]
        yield engine


def _pack_job(blocks: int = 100, method: Any = "pack") -> TransferJob:
    ids = list(range(blocks))
    return TransferJob(Transfer("store", blocks, blocks << 23), ids, ids, method)


async def test_pack_staging_is_not_allocated_during_a_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 2 MiB blocks pack is not the default, so its staging is allocated by the first
    pack job; while the gate is held, that job uses batch and allocates nothing."""
    lane = _Lane()
    with _staging_engine(monkeypatch, lane) as engine:
        _pack_staging_waits_for_captures(engine, lane)


def _pack_staging_waits_for_captures(engine: CudaTransferEngine, lane: _Lane) -> None:
    job, auto = _pack_job(), _pack_job(method="auto")
    with capture_gate():
        assert engine._choose(job, pageable=False) == "batch"
    assert lane.allocations == [] and lane.staging is None
    assert engine._choose(auto, pageable=False) == "batch"  # the default allocates nothing
    assert engine._choose(_pack_job(blocks=0), pageable=False) == "pack"  # nor does nothing
    assert lane.allocations == []
    assert engine._choose(job, pageable=False) == "pack"
    assert engine._choose(job, pageable=False) == "pack"
    assert lane.allocations == [1]  # once, counted in flight: a capture would wait for it
    assert asyncpin.gate._global_in_flight == 0


async def test_no_room_for_pack_staging_means_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of device memory (next to a server's preallocated KV cache): the transfer uses
    batch, and store() does not raise."""
    lane = _Lane(fail=True)
    with _staging_engine(monkeypatch, lane) as engine, capture_logs() as logs:
        assert engine._choose(_pack_job(), pageable=False) == "batch"
    assert lane.allocations == [1] and lane.staging is None
    assert [e["event"] for e in logs] == ["transfer.staging_failed"]
    assert asyncpin.gate._global_in_flight == 0
