"""The manager under both of anyio's backends: asyncio and trio.

Each test is a plain function that runs its scenario with ``anyio.run(...,
backend=...)``, parametrised over both backends, so no pytest plugin decides the loop;
every scenario checks that it runs on the library it was given.
"""

from __future__ import annotations

import anyio
import pytest
import sniffio
import torch

from asyncpin import KVLayout, ManagerState, OffloadManager, PinError
from asyncpin.testing import FakeBackend, is_mapped

BACKENDS = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])

CHUNK = 64 << 10
NCHUNKS = 8
TIMEOUT_S = 30.0


def assert_runs_on(anyio_backend: str) -> None:
    assert sniffio.current_async_library() == anyio_backend


def kv_layout(num_blocks: int = 16) -> KVLayout:
    """Two layers of K and V on the CPU, standing in for device KV arrays."""
    return KVLayout.from_tensors(
        [torch.zeros(2, num_blocks, 8, 64, dtype=torch.bfloat16) for _ in range(2)], block_dim=1
    )


def random_blocks(layout: KVLayout, ids: list[int], generator: torch.Generator) -> None:
    """Fill blocks ``ids`` of every array with random non-zero bytes."""
    for array in layout.arrays:
        raw = array[ids].view(torch.uint8)
        filled = torch.randint(1, 256, raw.shape, dtype=torch.uint8, generator=generator)
        array[ids] = filled.view(array.dtype)


def block_bytes(layout: KVLayout, ids: list[int]) -> list[bytes]:
    return [array[ids].view(torch.uint8).numpy().tobytes() for array in layout.arrays]


class TestLifecycleOnEveryBackend:
    """Open, pin, move KV blocks and close in order, on asyncio and on trio alike."""

    @BACKENDS
    def test_open_pin_round_trip_close(self, anyio_backend: str) -> None:
        anyio.run(self._open_pin_round_trip_close, anyio_backend, backend=anyio_backend)

    async def _open_pin_round_trip_close(self, anyio_backend: str) -> None:
        assert_runs_on(anyio_backend)
        layout = kv_layout()
        generator = torch.Generator().manual_seed(7)
        random_blocks(layout, [0, 1, 2, 3], generator)
        stored = block_bytes(layout, [0, 1, 2, 3])
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(
                layout, 32, backend="host", chunk_bytes=CHUNK, prefault_threads=1
            ) as mgr:
                address, nbytes = mgr.host_view().data_ptr(), mgr.nbytes
                await mgr.pinned
                assert mgr.is_pinned()
                assert mgr.stats().pinned_bytes == nbytes
                await mgr.store([0, 1, 2, 3], [30, 4, 17, 0])
                for array in layout.arrays:
                    array.zero_()
                await mgr.load([30, 4, 17, 0], [8, 9, 10, 11])
                assert block_bytes(layout, [8, 9, 10, 11]) == stored
                stats = mgr.stats()
                assert (stats.transfers_stored, stats.transfers_loaded) == (1, 1)
                assert stats.bytes_stored == stats.bytes_loaded == 4 * layout.host_block_bytes
                assert stats.transfers_pageable == stats.transfers_failed == 0
        assert mgr.state is ManagerState.CLOSED
        assert mgr.stats().pinned_bytes == 0
        assert not is_mapped(address, nbytes)
        with pytest.raises(anyio.ClosedResourceError):
            mgr.store([0], [0])

    @BACKENDS
    def test_close_waits_for_a_stalled_pin(self, anyio_backend: str) -> None:
        anyio.run(self._close_waits_for_a_stalled_pin, anyio_backend, backend=anyio_backend)

    async def _close_waits_for_a_stalled_pin(self, anyio_backend: str) -> None:
        assert_runs_on(anyio_backend)
        fake = FakeBackend(stall_pin_at=2)
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager(
                CHUNK * NCHUNKS, backend=fake, chunk_bytes=CHUNK, prefault_threads=1
            ) as mgr:
                address = mgr.host_view().data_ptr()
                try:
                    assert await anyio.to_thread.run_sync(fake.stalled.wait, TIMEOUT_S)
                    assert not mgr.is_pinned()
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(mgr.aclose)
                        await anyio.wait_all_tasks_blocked()
                        # Close stopped the pipeline and waits for the pin call in flight.
                        assert mgr.state is ManagerState.CLOSING
                        assert fake.unpinned_spans() == []
                        fake.release()
                finally:
                    fake.release()
        assert mgr.state is ManagerState.CLOSED
        # The stalled pin succeeded once released, so it was unpinned too, while mapped.
        assert sorted(fake.unpinned_spans()) == sorted(fake.pinned_spans())
        assert len(fake.pinned_spans()) == 3
        assert all(call.mapped for call in fake.calls)
        assert not is_mapped(address, CHUNK * NCHUNKS)
        with pytest.raises(anyio.ClosedResourceError):
            await mgr.pinned

    @BACKENDS
    def test_pin_failure_is_raised(self, anyio_backend: str) -> None:
        anyio.run(self._pin_failure_is_raised, anyio_backend, backend=anyio_backend)

    async def _pin_failure_is_raised(self, anyio_backend: str) -> None:
        assert_runs_on(anyio_backend)
        fake = FakeBackend(fail_pin_at=1)
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager(
                CHUNK * NCHUNKS, backend=fake, chunk_bytes=CHUNK, prefault_threads=1
            ) as mgr:
                with pytest.raises(PinError) as info:
                    await mgr.pinned
                assert info.value.chunk_index == 1
                assert info.value.code == FakeBackend.FAKE_CODE
                assert mgr.pin_error is info.value
                assert not mgr.is_pinned()
        assert sorted(fake.unpinned_spans()) == sorted(fake.pinned_spans())
