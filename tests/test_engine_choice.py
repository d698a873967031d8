"""The engine is chosen in one place and can be injected (``engine=``); the router is the
one place where an engine's error becomes a TransferError naming the transfer."""

from __future__ import annotations

import threading
from typing import ClassVar

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from asyncpin import ConfigError, KVLayout, OffloadManager, TransferError
from asyncpin.abc import EngineSetup, TransferEngine
from asyncpin.engines.host import HostTransferEngine
from asyncpin.errors import BackendCallError
from asyncpin.testing import FakeBackend
from asyncpin.transfers import TransferJob
from tests.helpers import MadeRegions

pytestmark = pytest.mark.anyio

TIMEOUT_S = 10


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _layout() -> KVLayout:
    return KVLayout.from_tensors([torch.arange(8 * 64, dtype=torch.uint8).view(8, 64)])


class RecordingEngine(HostTransferEngine):
    """The host engine, recording what it was made from and given."""

    made: ClassVar[list[EngineSetup]] = []

    def __init__(self, setup: EngineSetup) -> None:
        super().__init__(setup)
        RecordingEngine.made.append(setup)
        self.jobs: list[TransferJob] = []

    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        self.jobs.append(job)
        super().submit(job, pageable=pageable)


class FailingEngine(HostTransferEngine):
    """Its copies fail as a CUDA call would (a code and its name)."""

    def _copy(self, job: TransferJob) -> None:
        raise BackendCallError("cudaMemcpyBatchAsync", 700, "cudaErrorIllegalAddress", "boom")


async def test_an_injected_engine_class_makes_the_engine() -> None:
    RecordingEngine.made.clear()
    layout = _layout()
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(
            layout, 4, backend=FakeBackend(), engine=RecordingEngine
        ) as mgr:
            await mgr.pinned
            await mgr.store([1, 2], [0, 3])
            (setup,) = RecordingEngine.made
            assert setup.layout is layout
            assert setup.host_blocks.shape == (4, 64)
            assert isinstance(mgr._engine, RecordingEngine)
            assert isinstance(mgr._engine, TransferEngine)
            assert [job.cpu_ids for job in mgr._engine.jobs] == [[0, 3]]
            assert torch.equal(mgr.host_blocks()[3, 0], layout.arrays[0][2])


async def test_an_engine_error_becomes_a_transfer_error_with_its_fields() -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(
            _layout(), 4, backend=FakeBackend(), engine=FailingEngine
        ) as mgr:
            await mgr.pinned
            transfer = mgr.store([1], [0])
            with pytest.raises(TransferError) as caught:
                await transfer
            error = caught.value
            assert (error.direction, error.method) == ("store", "host")
            assert (error.code, error.code_name) == (700, "cudaErrorIllegalAddress")
            assert isinstance(error.__cause__, BackendCallError)
            assert mgr.stats().transfers_failed == 1


def test_an_unknown_engine_name_is_refused_before_anything_is_mapped() -> None:
    with pytest.raises(ConfigError, match="unknown engine 'gpu'"):
        OffloadManager.for_kv(_layout(), 4, engine="gpu")
    with pytest.raises(ConfigError, match="engine must be a name or a callable"):
        OffloadManager.for_kv(_layout(), 4, engine=42)


@pytest.mark.parametrize(
    ("engine", "device", "match"),
    [
        ("cuda", "cpu", "the cuda engine needs KV arrays on a GPU"),
        ("host", "meta", "the host engine copies between CPU tensors"),
        ("auto", "meta", "KV arrays on meta are not supported"),
    ],
)
def test_a_named_engine_that_cannot_serve_the_arrays_is_refused_before_anything_is_mapped(
    engine: str, device: str, match: str, made_regions: MadeRegions
) -> None:
    """A hostile trial: these were refused only at entry, after the region was mapped
    (and a stale shared region of the name reclaimed)."""
    layout = KVLayout.from_tensors([torch.zeros(4, 64, device=device)])
    with pytest.raises(ConfigError, match=match):
        OffloadManager.for_kv(layout, 4, engine=engine)
    assert made_regions.made == []


async def test_an_engine_that_cannot_serve_is_refused_on_entry() -> None:
    backend = FakeBackend()
    mgr = OffloadManager.for_kv(_layout(), 4, backend=backend, engine=lambda setup: object())
    with anyio.fail_after(TIMEOUT_S), pytest.raises(ConfigError, match="not a TransferEngine"):
        await mgr.__aenter__()
    assert backend.calls == []  # nothing was pinned; the region was released (no_leaks)


class ClosingEngine(HostTransferEngine):
    """Its copies fail with an error of the type a close uses."""

    def _copy(self, job: TransferJob) -> None:
        raise anyio.ClosedResourceError("a resource of the engine's own was closed")


async def test_an_engine_error_of_the_close_type_is_still_a_transfer_error() -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(
            _layout(), 4, backend=FakeBackend(), engine=ClosingEngine
        ) as mgr:
            await mgr.pinned
            with pytest.raises(TransferError) as caught:
                await mgr.store([1], [0])
            assert isinstance(caught.value.__cause__, anyio.ClosedResourceError)


class UnreadyEngine(HostTransferEngine):
    """Cannot mark the caller's stream (``record_ready`` raises)."""

    def record_ready(self) -> None:
        raise RuntimeError("the device is gone")


async def test_a_transfer_refused_by_record_ready_is_not_left_in_flight() -> None:
    backend = FakeBackend(stall_pin_at=0)  # chunk 0 never pins until released
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(
            _layout(), 4, backend=backend, engine=UnreadyEngine
        ) as mgr:
            with pytest.raises(RuntimeError, match="the device is gone"):
                mgr.store([1], [0])  # waits for chunk 0: marks the caller's stream first
            assert mgr.stats().transfers_in_flight == 0
            assert mgr.stats().transfers_stored == 0
            backend.release()
        # the close did not wait for a transfer that was never queued


async def test_the_pin_pipeline_logs_the_chunk_size_asked_for() -> None:
    with capture_logs() as logs, anyio.fail_after(TIMEOUT_S):
        async with OffloadManager(1 << 20, backend=FakeBackend(), chunk_bytes=4 << 20) as mgr:
            await mgr.pinned
    (started,) = [entry for entry in logs if entry["event"] == "pin.started"]
    assert (started["chunks"], started["chunk_bytes"]) == (1, 4 << 20)


async def test_time_to_pinned_is_reported_in_a_forked_childs_view_too() -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager(1 << 20, backend=FakeBackend()) as mgr:
            await mgr.pinned
            assert mgr._opened is not None
            fields = mgr._opened.stats_fields(forked=True)
            assert fields["seconds_to_pinned"] == mgr.stats().seconds_to_pinned is not None
            assert fields["chunks_pinned"] == 0  # the parent's pins are not the child's


class UnpreparedEngine(HostTransferEngine):
    """Its set-up fails; records the thread its close ran on."""

    closed_on: ClassVar[list[int]] = []

    def prepare(self) -> None:
        raise RuntimeError("no room for the staging buffers")

    def close(self) -> None:
        UnpreparedEngine.closed_on.append(threading.get_ident())
        super().close()


async def test_an_engine_whose_setup_failed_is_closed_in_a_worker_thread() -> None:
    UnpreparedEngine.closed_on.clear()
    backend = FakeBackend()
    mgr = OffloadManager.for_kv(_layout(), 4, backend=backend, engine=UnpreparedEngine)
    with anyio.fail_after(TIMEOUT_S), pytest.raises(RuntimeError, match="no room"):
        await mgr.__aenter__()
    assert len(UnpreparedEngine.closed_on) == 1
    assert UnpreparedEngine.closed_on[0] != threading.get_ident()  # not the event loop's
    assert backend.calls == []
