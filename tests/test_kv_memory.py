"""The KV arrays' memory while a manager is open: the engine copies to and from the
addresses the arrays had when it opened, so a call that moves an array whose storage was
resized (moved) or freed (``resize_(0)``) is refused with ConfigError, nothing enqueued, on the
host engine and the CUDA engine alike (the ``cuda`` cases run with ``pytest -m cuda``).
Before, the CUDA engine copied to and from the old addresses: freed memory, or memory
torch's allocator had handed to another tensor."""

from __future__ import annotations

import anyio
import pytest
import torch

from asyncpin import ConfigError, KVLayout, OffloadManager
from asyncpin.testing import FakeBackend
from asyncpin.tier import KVTier
from tests.helpers import TIMEOUT_S

pytestmark = pytest.mark.anyio

BLOCKS, HOST_BLOCKS = 16, 8


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def _layout(device: torch.device) -> tuple[KVLayout, list[torch.Tensor]]:
    """Two layers of vLLM's ``[2, blocks, 4, 2, 8]`` fp16: arrays 0-1 and 2-3."""
    gen = torch.Generator().manual_seed(5)
    kv = [torch.randn((2, BLOCKS, 4, 2, 8), generator=gen).half().to(device) for _ in range(2)]
    return KVLayout.from_tensors(kv, block_dim=1), kv


def _manager(layout: KVLayout) -> OffloadManager:
    backend = {"backend": FakeBackend()} if layout.device.type == "cpu" else {}
    return OffloadManager.for_kv(layout, HOST_BLOCKS, **backend)


def _counts(mgr: OffloadManager) -> tuple[int, int, int]:
    stats = mgr.stats()
    return stats.transfers_stored, stats.transfers_loaded, stats.transfers_in_flight


@pytest.mark.parametrize(("how", "layer", "arrays"), [("moved", 1, "2-3"), ("freed", 0, "0-1")])
async def test_a_call_after_an_arrays_memory_moved_is_refused(
    device: torch.device, how: str, layer: int, arrays: str
) -> None:
    layout, kv = _layout(device)
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(layout) as mgr:
            await mgr.pinned
            tier = KVTier(mgr)
            await mgr.store([1, 2], [0, 1])
            await tier.store([11], [3]).transfer
            storage = kv[layer].untyped_storage()
            was = storage.data_ptr()
            storage.resize_(storage.nbytes() * 2 if how == "moved" else 0)
            assert storage.data_ptr() != was
            before = _counts(mgr)
            for call in (
                lambda: mgr.store([4], [2]),
                lambda: mgr.load([0], [5]),
                lambda: tier.store([12], [6]),
                lambda: tier.load([11], [7]),
            ):
                with pytest.raises(ConfigError, match=f"KV tensor {layer}'s memory moved") as info:
                    call()
                assert f"arrays {arrays}" in str(info.value) and "close it" in str(info.value)
            assert _counts(mgr) == before
            await mgr.store([], [])  # moves no block: nothing to refuse
            assert 12 not in tier.index and tier.lookup([11]) == 1  # the index unchanged
        assert mgr.stats().transfers_failed == 0


async def test_a_layer_wise_store_checks_each_group_and_survives_a_refusal(
    device: torch.device,
) -> None:
    """store_group checks the memory of its own group's arrays: a refused group changes
    nothing (the store goes on: the other layer's group stores), and a group whose memory
    moved is refused each time (it aborted the whole store before)."""
    layout, kv = _layout(device)
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(layout) as mgr:
            await mgr.pinned
            tier = KVTier(mgr)
            store = tier.store_layers([21, 22], [1, 2])  # groups: layer 0, layer 1
            storage = kv[0].untyped_storage()
            storage.resize_(storage.nbytes() * 2)
            for _ in range(2):
                with pytest.raises(ConfigError, match="KV tensor 0's memory moved"):
                    store.store_group(0)
            assert store.transfers == [None, None]
            await store.store_group(1)  # layer 1's memory is where it was
            assert tier.lookup([21]) == 0  # not loadable: layer 0 is not stored
            store.abort()
        assert mgr.stats().transfers_failed == 0
