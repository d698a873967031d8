"""KV layouts engines really use, on a real GPU (`pytest -m cuda`): every method moves
every array's blocks byte for byte (HND views, mixed block sizes and dtypes, odd sizes),
a range of arrays alone, and a layer-wise load's groups each with an event that orders
compute after that group only. No code is loaded after open, whatever range of arrays a
transfer moves."""

from __future__ import annotations

import random
import threading
from typing import Any

import anyio
import pytest
import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin.tier import KVTier
from tests.layouts import CASES, build, round_trip

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]

TIMEOUT_S = 60
BLOCKS, HOST_BLOCKS = 96, 80
METHODS = ["batch", "pack", "kernel"]


@pytest.mark.parametrize("n", [5, 40], ids=["small", "large"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", sorted(CASES))
async def test_every_layout_round_trips_by_every_method(case: str, method: Any, n: int) -> None:
    layout = build(case, BLOCKS, "cuda", seed=n)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend="cuda") as mgr:
            await mgr.pinned
            await round_trip(mgr, layout, n, method=method, seed=n)
            probe = mgr.store([0], [0], method=method)
            await probe
            if case == "odd_bytes":  # blocks not in 8-byte words: DMA only
                assert probe.method == "batch"


async def test_layer_groups_each_have_an_event_that_orders_compute() -> None:
    """A load of 32 layers in groups: each group's event, waited on by the compute stream,
    makes that layer's blocks readable there, with no host-side wait."""
    layers, blocks = 32, 256
    kv = [
        torch.randn(2, blocks, 16, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(layers)
    ]
    layout = KVLayout.from_tensors(kv, block_dim=1)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, blocks, backend="cuda") as mgr:
            await mgr.pinned
            tier = KVTier(mgr)
            hashes = list(range(1000, 1000 + 128))
            await tier.store(hashes, list(range(128))).transfer
            expected = [t[:, :128].clone() for t in kv]
            for t in kv:
                t.zero_()
            dest = list(range(128, 256))
            compute = torch.cuda.Stream()
            load = tier.load_layers(hashes, dest)
            assert len(load.transfers) == layers
            sums = []
            with torch.cuda.stream(compute):
                for i, transfer in enumerate(load.transfers):
                    assert transfer.event is not None
                    compute.wait_event(transfer.event)
                    sums.append(torch.equal(kv[i][:, 128:], expected[i]))
            await load
            compute.synchronize()
            assert all(sums)


async def test_no_kernel_is_loaded_after_open_for_any_range(
    kernel_loads: list[threading.Thread],
    kernel_launches: list[tuple[threading.Thread, int]],
) -> None:
    layout = build("mla_indexer", 256, "cuda")
    rng = random.Random(0)
    async with OffloadManager.for_kv(layout, 256, backend="cuda") as mgr:
        await mgr.pinned
        # Loaded, and onto the device by a launch over no segment per direction.
        assert len(kernel_loads) == 1
        assert [n for _, n in kernel_launches] == [0, 0]
        for n in (1, 17, 65, 255):
            for method in ("pack", "kernel"):
                for arrays in (range(0, 4), range(1, 2), range(1, 4), range(3, 4)):
                    gpu, cpu = rng.sample(range(256), n), rng.sample(range(256), n)
                    await mgr.store(gpu, cpu, method=method, arrays=arrays)
                    await mgr.load(cpu, gpu, method=method, arrays=arrays)
        assert len(kernel_loads) == 1


@pytest.mark.parametrize("method", METHODS)
async def test_tensor_parallel_ranks_share_host_blocks(method: Any, shm_name: str) -> None:
    """Two ranks (their own KV arrays) over one shared region, ``host_slice=(rank, 2)``:
    the same host block ids, each rank's part in place, by every method."""
    layouts = [build("joined", BLOCKS, "cuda", seed=rank) for rank in range(2)]
    kept = [[raw.clone() for raw in layout.byte_arrays()] for layout in layouts]
    gpu, cpu = list(range(0, 80, 2)), list(range(40))
    with anyio.fail_after(TIMEOUT_S):
        async with (
            OffloadManager.for_kv(
                layouts[0],
                HOST_BLOCKS,
                backend="cuda",
                backing="shared",
                name=shm_name,
                host_slice=(0, 2),
            ) as first,
            OffloadManager.attached(
                shm_name,
                backend="cuda",
                kv_layout=layouts[1],
                num_host_blocks=HOST_BLOCKS,
                host_slice=(1, 2),
            ) as second,
        ):
            managers = [first, second]
            for mgr in managers:
                await mgr.pinned
            for mgr in managers:
                await mgr.store(gpu, cpu, method=method)
            hb = layouts[0].host_block_bytes
            region = first.host_view()
            for rank in range(2):
                for g, c in zip(gpu, cpu, strict=True):
                    part = region[(2 * c + rank) * hb :][:hb].cuda()
                    assert torch.equal(part, torch.cat([raw[g] for raw in kept[rank]]))
            del region
            for layout in layouts:
                for raw in layout.byte_arrays():
                    raw.zero_()
            dest = list(range(1, 81, 2))
            for mgr in managers:
                await mgr.load(cpu, dest, method=method)
            for rank, layout in enumerate(layouts):
                for a, raw in enumerate(layout.byte_arrays()):
                    assert torch.equal(raw[dest], kept[rank][a][gpu])


async def test_layer_stores_wait_for_the_compute_that_writes_each_layer() -> None:
    """Prefill writes layer i on the compute stream, then queues group i's store: each
    copy waits for that work (the caller's stream at submission), never reading a layer
    before it is written."""
    layers, blocks = 8, 64
    kv = [
        torch.zeros(2, blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        for _ in range(layers)
    ]
    layout = KVLayout.from_tensors(kv, block_dim=1)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, blocks, backend="cuda") as mgr:
            await mgr.pinned
            tier = KVTier(mgr)
            compute = torch.cuda.Stream()
            ids = list(range(32))
            store = tier.store_layers(list(range(500, 532)), ids)
            with torch.cuda.stream(compute):
                for i, t in enumerate(kv):
                    torch.cuda._sleep(2_000_000)  # a slow layer: the copy must wait for it
                    t[:, :32].fill_(i + 1)
                    store.store_group(i)
            await store
            assert tier.lookup(list(range(500, 532))) == 32
            host = mgr.host_blocks()
            for i in range(layers):
                assert bool((host[list(store.plan.host_blocks), 2 * i : 2 * i + 2] == i + 1).all())
