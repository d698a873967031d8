"""The engine is chosen in one place and can be injected (``engine=``); the router is the
one place where an engine's error becomes a TransferError naming the transfer."""

from __future__ import annotations

from typing import Any, ClassVar

import anyio
import pytest
import torch

from asyncpin import ConfigError, KVLayout, OffloadManager, TransferError
from asyncpin.abc import EngineSetup, TransferEngine
from asyncpin.engines.host import HostTransferEngine
from asyncpin.errors import BackendCallError
from asyncpin.testing import FakeBackend
from asyncpin.transfers import TransferJob

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
            assert setup.host_blocks.shape == (4, 1, 64)
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
    ("engine", "match"),
    [
        ("cuda", "the cuda engine needs KV arrays on a GPU"),
        (lambda setup: object(), "not a TransferEngine"),
    ],
)
async def test_an_engine_that_cannot_serve_is_refused_on_entry(engine: Any, match: str) -> None:
    backend = FakeBackend()
    mgr = OffloadManager.for_kv(_layout(), 4, backend=backend, engine=engine)
    with anyio.fail_after(TIMEOUT_S), pytest.raises(ConfigError, match=match):
        await mgr.__aenter__()
    assert backend.calls == []  # nothing was pinned; the region was released (no_leaks)
