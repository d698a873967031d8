"""The CUDA engine's streams are its own (run with `pytest -m cuda` on the GPU machine).

``torch.cuda.Stream()`` hands out the streams of a pool of 32 per priority, in turn, to
whoever asks in the process. An engine that took its streams there shared them, sooner
or later, with a model's side stream or a graph capture's: in a full CUDA run (run 140)
a capture on another thread took in the engine's copies, which failed
(``cudaErrorStreamCaptureIsolation``, then ``cudaErrorStreamCaptureInvalidated``), and
broke torch's capture state for the rest of the process. The engine's streams are given
back at close for later engines, never destroyed."""

from __future__ import annotations

import anyio
import pytest
import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin.engines.cuda import CudaTransferEngine

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]

POOL = 32  # torch's streams per priority and device


def _torch_streams() -> set[int]:
    """Every stream torch hands out on this device: both ends of its priority range, a
    pool's worth and more each, and the default and current streams."""
    least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
    streams = {
        torch.cuda.Stream(priority=priority).cuda_stream
        for priority in {least, greatest}
        for _ in range(2 * POOL)
    }
    return streams | {
        torch.cuda.default_stream().cuda_stream,
        torch.cuda.current_stream().cuda_stream,
    }


def _layout() -> KVLayout:
    arrays = [torch.randint(0, 255, (16, 4096), dtype=torch.uint8, device="cuda") for _ in range(2)]
    return KVLayout.from_tensors(arrays)


async def test_none_is_a_stream_torch_hands_out() -> None:
    with anyio.fail_after(120):
        mgr = OffloadManager.for_kv(_layout(), 64, chunk_bytes=64 << 10, unpinned_policy="pageable")
        try:
            # Entered while pinning is paused: the store copies through pageable memory
            # (a stream of its own) before its chunks are pinned.
            async with mgr.pinning_paused():
                await mgr.__aenter__()
                stored = mgr.store([0], [1])
                await stored
            assert stored.path == "pageable"
            await mgr.pinned
            await mgr.store([1], [2])
            await mgr.load([2], [3])
            assert mgr._opened is not None
            engine = mgr._opened.engine
            assert isinstance(engine, CudaTransferEngine)
            streams = engine.streams()
            # Three per direction, and the pageable store's.
            assert len(set(streams)) == len(streams) == 7
            assert not set(streams) & _torch_streams()
        finally:
            await mgr.aclose()
        assert engine.streams() == []
        # Given back at close, never destroyed (torch's allocator keeps the stream of
        # the memory allocated on it): the next engine takes them.
        async with OffloadManager.for_kv(_layout(), 64, chunk_bytes=64 << 10) as again:
            await again.pinned
            await again.store([0], [0])
            assert again._opened is not None
            second = again._opened.engine
            assert isinstance(second, CudaTransferEngine)
            assert len(second.streams()) == 6 and set(second.streams()) <= set(streams)
