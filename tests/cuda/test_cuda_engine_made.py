"""The CUDA engine is made off the event loop while a KV manager enters (run with
`pytest -m cuda` on the GPU machine), and serves from the loop it was given."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin.abc import EngineSetup
from asyncpin.engines.cuda import CudaTransferEngine

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_made_in_a_worker_thread_and_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    made_in: list[int] = []
    init = CudaTransferEngine.__init__

    def recorded_init(self: CudaTransferEngine, setup: EngineSetup) -> None:
        made_in.append(threading.get_ident())
        init(self, setup)

    monkeypatch.setattr(CudaTransferEngine, "__init__", recorded_init)
    arrays = [torch.randint(0, 255, (16, 4096), dtype=torch.uint8, device="cuda") for _ in range(2)]
    sent = [a.clone() for a in arrays]
    with anyio.fail_after(120):
        async with OffloadManager.for_kv(
            KVLayout.from_tensors(arrays), 64, chunk_bytes=64 << 10
        ) as mgr:
            await mgr.pinned
            await mgr.store(range(16), range(16, 32))
            for a in arrays:
                a.zero_()
            await mgr.load(range(16, 32), range(16))
            torch.cuda.synchronize()
    assert len(made_in) == 1 and made_in[0] != threading.get_ident()
    assert all(torch.equal(a, b) for a, b in zip(arrays, sent, strict=True))
