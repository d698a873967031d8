"""KV layouts engines really use, through the host engine (asyncio and trio): FlashInfer's
HND view, K and V of different head sizes, MLA beside an fp8 indexer, hybrid attention,
blocks of odd sizes. Every array's blocks round-trip byte for byte in one id space, and a
range of arrays moves alone. Bad ranges are refused with nothing enqueued."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
import torch

from asyncpin import ConfigError, InvalidTransferError, KVLayout, OffloadManager, TransferError
from asyncpin.abc import EngineSetup
from asyncpin.engines.host import HostTransferEngine
from asyncpin.testing import FakeBackend, FakeEngine
from asyncpin.tier import KVTier
from asyncpin.transfers import TransferJob
from tests.kit import engines_made
from tests.layouts import CASES, block_bytes, build, randomize_arrays, round_trip

pytestmark = pytest.mark.anyio


class FailingSecondCopy(HostTransferEngine):
    """The host engine, whose second copy fails."""

    def __init__(self, setup: EngineSetup) -> None:
        super().__init__(setup)
        self.copies = 0

    def _copy(self, job: TransferJob) -> None:
        self.copies += 1
        if self.copies == 2:
            raise RuntimeError("the copy failed")
        super()._copy(job)


TIMEOUT_S = 10
BLOCKS, HOST_BLOCKS = 12, 10


@pytest.mark.parametrize("case", sorted(CASES))
async def test_every_layout_round_trips(case: str) -> None:
    layout = build(case, BLOCKS, "cpu")
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            await round_trip(mgr, layout, 6)


def test_an_hnd_view_is_taken_and_its_blocks_are_its_memory() -> None:
    layout = build("flashinfer_hnd", BLOCKS, "cpu")
    array = layout.arrays[0]
    assert not array[0].is_contiguous()  # the view: refused before
    physical = array.permute(0, 1, 3, 2, 4)  # back to [blocks, 2, heads, tokens, dim]
    assert torch.equal(
        block_bytes(layout, 0, 5), physical[5].contiguous().view(torch.uint8).flatten()
    )


def test_heterogeneous_layouts_describe_each_array() -> None:
    layout = build("mla_indexer", BLOCKS, "cpu")
    assert not layout.uniform
    assert layout.array_block_bytes == (576, 136, 576, 136)
    assert layout.array_offsets == (0, 576, 712, 1288)
    assert layout.host_block_bytes == 1424
    assert layout.tensor_arrays == (range(0, 1), range(1, 2), range(2, 3), range(3, 4))
    for what in ("block_shape", "dtype", "block_bytes"):
        with pytest.raises(ConfigError, match="differ"):
            getattr(layout, what)
    joined = build("joined", BLOCKS, "cpu")
    assert joined.uniform and joined.tensor_arrays == (range(0, 2), range(2, 4))


@pytest.mark.parametrize("case", ["mla_indexer", "hybrid", "flashinfer_hnd"])
async def test_host_array_views_read_what_was_stored(case: str) -> None:
    layout = build(case, BLOCKS, "cpu")
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            await mgr.store([3, 7], [9, 0])
            for a, array in enumerate(layout.arrays):
                view = mgr.host_array(a)
                assert view.shape == (HOST_BLOCKS, *layout.array_shapes[a])
                # Compared as bytes: fp8 and random float patterns (NaN) included.
                assert torch.equal(
                    view[9].contiguous().view(torch.uint8), array[3].contiguous().view(torch.uint8)
                )
                assert torch.equal(
                    view[0].contiguous().view(torch.uint8), array[7].contiguous().view(torch.uint8)
                )
            if not layout.uniform:
                with pytest.raises(ConfigError, match="differ"):
                    mgr.host_blocks()
            for bad in (-1, layout.num_arrays, True, "0"):
                with pytest.raises(ConfigError):
                    mgr.host_array(bad)  # type: ignore[arg-type]


async def test_a_misaligned_array_is_read_as_bytes() -> None:
    layout = build("odd_bytes", BLOCKS, "cpu")  # a float16 array 15 bytes into a block
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            assert mgr.host_array(0).shape == (HOST_BLOCKS, 3, 5)
            with pytest.raises(ConfigError, match="bytes"):
                mgr.host_array(1)
            assert mgr.host_bytes().shape == (HOST_BLOCKS, 29)


@pytest.mark.parametrize(
    "arrays",
    [range(0), range(0, 4, 2), range(3, 1, -1), range(-1, 1), range(2, 5), [0, 1], slice(0, 1), 1],
    ids=repr,
)
async def test_a_bad_range_of_arrays_is_refused_with_nothing_enqueued(arrays: object) -> None:
    layout = build("joined", BLOCKS, "cpu")  # 4 arrays
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            for submit in (mgr.store, mgr.load):
                with pytest.raises(InvalidTransferError, match="arrays"):
                    submit([0], [0], arrays=arrays)  # type: ignore[arg-type]
            stats = mgr.stats()
            assert (stats.transfers_stored, stats.transfers_loaded) == (0, 0)


async def test_a_range_of_arrays_counts_its_bytes() -> None:
    layout = build("mla_indexer", BLOCKS, "cpu")
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            part = mgr.store([1, 2], [1, 2], arrays=range(1, 3))
            whole = mgr.store([1, 2], [3, 4], arrays=range(0, 4))
            await part
            await whole
            assert part.nbytes == 2 * (136 + 576) and whole.nbytes == 2 * 1424


class TestLayerLoads:
    """``KVTier.load_layers``: one transfer per group, in order, the blocks protected
    until the last is done."""

    async def test_groups_load_their_arrays_and_release_the_blocks_at_the_end(self) -> None:
        layout = build("joined", BLOCKS, "cpu")
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
                await mgr.pinned
                tier = KVTier(mgr)
                await tier.store([1, 2, 3], [4, 5, 6]).transfer
                kept = [raw[[4, 5, 6]].clone() for raw in layout.byte_arrays()]
                randomize_arrays(layout, 9)
                load = tier.load_layers([1, 2, 3], [0, 1, 2])
                assert load.groups == layout.tensor_arrays == (range(0, 2), range(2, 4))
                assert [t.nbytes for t in load.transfers] == [3 * 2 * 128] * 2
                await load
                assert load.done()
                for a, raw in enumerate(layout.byte_arrays()):
                    assert torch.equal(raw[[0, 1, 2]], kept[a])
                # Nothing is protected any more: a full store may evict all three.
                stored = tier.store(list(range(100, 100 + HOST_BLOCKS)), list(range(HOST_BLOCKS)))
                await stored.transfer
                assert stored.skipped == () and tier.lookup([1]) == 0

    async def test_blocks_stay_protected_until_every_group_is_done(self) -> None:
        layout = build("joined", BLOCKS, "cpu")
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, 2, backend=FakeBackend()) as mgr:
                await mgr.pinned
                tier = KVTier(mgr)
                await tier.store([1, 2], [4, 5]).transfer
                load = tier.load_layers([1, 2], [0, 1], [range(0, 1), range(1, 4)])
                # Both groups queued, none awaited: a store finds no block to evict.
                full = tier.store([7, 8], [6, 7])
                assert full.skipped == (7, 8)
                await full.transfer
                await load
                after = tier.store([7], [6])
                await after.transfer
                assert after.skipped == ()

    @pytest.mark.parametrize(
        "groups",
        [
            [],
            range(0, 2),
            [range(0, 2), range(3, 5)],
            [range(0, 2), [2, 3]],
            3,  # a hostile trial: TypeError, and numpy's ValueError for an array
            object(),
            np.array([1, 2]),
            iter([range(0, 2), range(2, 4)]),
        ],
        ids=repr,
    )
    async def test_bad_groups_are_refused_with_nothing_protected(self, groups: object) -> None:
        layout = build("joined", BLOCKS, "cpu")
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, 2, backend=FakeBackend()) as mgr:
                await mgr.pinned
                tier = KVTier(mgr)
                await tier.store([1, 2], [4, 5]).transfer
                with pytest.raises(InvalidTransferError):
                    tier.load_layers([1, 2], [0, 1], groups)  # type: ignore[arg-type]
                assert mgr.stats().transfers_loaded == 0
                full = tier.store([7, 8], [6, 7])  # both blocks evictable: nothing held
                await full.transfer
                assert full.skipped == ()


class TestLayerStores:
    """``KVTier.store_layers``: host blocks given at once, a copy per group as prefill
    finishes each layer, loadable only when every group is in."""

    async def test_a_block_is_loadable_only_when_every_group_is_stored(self) -> None:
        layout = build("mla_indexer", BLOCKS, "cpu")  # 4 arrays, one group each
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
                await mgr.pinned
                tier = KVTier(mgr)
                kept = [raw[[2, 3]].clone() for raw in layout.byte_arrays()]
                store = tier.store_layers([7, 8], [2, 3])
                assert store.plan.hashes == (7, 8) and len(store.groups) == 4
                for i in range(3):
                    await store.store_group(i)
                    assert tier.lookup([7, 8]) == 0  # a part of the block is not in
                with pytest.raises(RuntimeError, match="not queued"):
                    await store
                await store.store_group(3)
                await store
                assert tier.lookup([7, 8]) == 2
                randomize_arrays(layout, 5)
                await tier.load([7, 8], [0, 1])
                for a, raw in enumerate(layout.byte_arrays()):
                    assert torch.equal(raw[[0, 1]], kept[a])

    async def test_an_aborted_store_frees_its_blocks_once_its_copies_are_over(self) -> None:
        layout = build("joined", BLOCKS, "cpu")
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
                await mgr.pinned
                tier = KVTier(mgr)
                store = tier.store_layers([1, 2, 3], [0, 1, 2])
                first = store.store_group(0)
                store.abort()
                with pytest.raises(InvalidTransferError, match="aborted"):
                    store.store_group(1)
                await first
                await store
                assert len(tier.index) == 0 and tier.index.stats().free_blocks == HOST_BLOCKS

    async def test_an_abort_after_every_group_is_queued_frees_the_blocks(self) -> None:
        """As before the last group (a hostile trial: it did nothing once every group was
        queued, and the blocks became loadable); after the store ended it changes
        nothing."""
        layout = build("joined", BLOCKS, "cpu")
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
                await mgr.pinned
                tier = KVTier(mgr)
                store = tier.store_layers([1, 2], [0, 1])
                copies = [store.store_group(i) for i in range(len(store.groups))]
                assert not any(copy.done() for copy in copies)
                store.abort()
                await store
                assert len(tier.index) == 0 and tier.index.stats().free_blocks == HOST_BLOCKS
                kept = tier.store_layers([3], [2])
                for i in range(len(kept.groups)):
                    kept.store_group(i)
                await kept
                kept.abort()  # over: the block stays
                assert tier.lookup([3]) == 1

    async def test_a_failed_group_leaves_nothing_indexed(self) -> None:
        layout = build("joined", BLOCKS, "cpu")
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(
                layout, HOST_BLOCKS, backend=FakeBackend(), engine=FailingSecondCopy
            ) as mgr:
                await mgr.pinned
                tier = KVTier(mgr)
                store = tier.store_layers([1, 2], [0, 1])
                store.store_group(0)
                store.store_group(1)
                with pytest.raises(TransferError):
                    await store
                assert tier.lookup([1]) == 0 and len(tier.index) == 0
                assert tier.index.stats().failed_blocks == 2

    async def test_bad_groups_and_repeats_are_refused(self) -> None:
        layout = build("joined", BLOCKS, "cpu")  # 4 arrays
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
                await mgr.pinned
                tier = KVTier(mgr)
                for groups in (
                    [range(0, 2)],
                    [range(0, 2), range(1, 4)],
                    [range(0, 4), range(0, 1)],
                ):
                    with pytest.raises(InvalidTransferError, match="every array once"):
                        tier.store_layers([1], [0], groups)
                assert len(tier.index) == 0
                store = tier.store_layers([1], [0])
                await store.store_group(1)
                for bad in (1, 2, -1):
                    with pytest.raises(InvalidTransferError, match="group"):
                        store.store_group(bad)
                await store.store_group(0)
                await store
                assert tier.lookup([1]) == 1
                again = tier.store_layers([1], [0])  # present: nothing to copy
                assert again.plan.present == (1,) and again.plan.hashes == ()
                for i in range(2):  # the prefill loop runs as ever: each group copies none
                    empty = again.store_group(i)
                    await empty
                    assert empty.num_blocks == 0
                await again
                fresh = tier.store_layers([2], [1])
                for bad_index in (True, 1.0, None, "0"):
                    with pytest.raises(InvalidTransferError, match="group"):
                        fresh.store_group(bad_index)  # type: ignore[arg-type]
                fresh.abort()
                await fresh
                assert tier.lookup([2]) == 0

    async def test_a_store_in_a_block_never_outlives_it(self) -> None:
        """``async with tier.store_layers(...)``: a body that raises, is cancelled or
        skips a group aborts the store (its host blocks come back once the copies
        queued are over); one that queues every group ends with the blocks loadable."""
        layout = build("joined", BLOCKS, "cpu")  # 2 groups
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
                await mgr.pinned
                tier = KVTier(mgr)

                def all_free() -> bool:
                    return len(tier.index) == 0 and tier.index.stats().free_blocks == HOST_BLOCKS

                with pytest.raises(ValueError, match="prefill failed"):
                    async with tier.store_layers([1, 2], [0, 1]) as store:
                        first = store.store_group(0)
                        raise ValueError("prefill failed")
                await first
                assert all_free()
                with anyio.CancelScope() as scope:
                    async with tier.store_layers([1, 2], [0, 1]) as store:
                        first = store.store_group(0)
                        scope.cancel()
                        await anyio.sleep_forever()
                await first
                assert all_free()
                async with tier.store_layers([1, 2], [0, 1]) as store:
                    first = store.store_group(1)  # group 0 never queued
                await first
                assert all_free() and tier.lookup([1]) == 0
                async with tier.store_layers([1, 2], [0, 1]) as store:
                    store.store_group(0)
                    store.store_group(1)
                assert store.transfers[1] is not None and store.transfers[1].done()
                assert tier.lookup([1, 2]) == 2


class TestRefusedLayouts:
    """Tensors whose bytes are not their values, and arrays that overlap, are refused."""

    @pytest.mark.parametrize(
        ("make", "words"),
        [
            (lambda: torch.ones(4, 8).to_sparse_csr(), "sparse_csr"),
            (lambda: torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(2, 3)]), "nested"),
            (
                lambda: torch.quantize_per_tensor(torch.ones(4, 8), 0.1, 0, torch.qint8),
                "quantized",
            ),
            (lambda: torch.ones(4, 8, dtype=torch.complex64).conj(), "conjugate"),
        ],
        ids=["sparse", "nested", "quantized", "conj"],
    )
    @pytest.mark.filterwarnings("ignore::UserWarning")  # torch's beta and deprecation notes
    def test_tensors_whose_bytes_are_not_their_values(self, make: Any, words: str) -> None:
        with pytest.raises(ConfigError, match=words):
            KVLayout.from_tensors([make()])

    @pytest.mark.parametrize("block_dim", [True, 1.0, "0"])
    def test_block_dim_is_an_int(self, block_dim: object) -> None:
        with pytest.raises(ConfigError, match="block_dim"):
            KVLayout.from_tensors([torch.ones(2, 4, 8)], block_dim=block_dim)  # type: ignore[arg-type]

    def test_arrays_whose_blocks_overlap_are_refused(self) -> None:
        y = torch.zeros(9, 4)
        with pytest.raises(ConfigError, match="overlap"):
            KVLayout.from_tensors([y[:8], y[1:]])  # block g of one is block g+1 of the other
        base = torch.zeros(8, 6)
        with pytest.raises(ConfigError, match="overlap"):
            KVLayout.from_tensors([base[:, :4], base[:, 2:]])  # half of each block shared

    def test_the_same_memory_through_two_storages_is_compared_too(self) -> None:
        """Two storages over one buffer (``from_numpy`` of two views of an array; DLPack,
        ``frombuffer`` alike): overlapping blocks are refused, apart ones taken (a hostile
        trial: overlapping arrays of two storages were taken, and a load of one wrote the
        other's blocks)."""
        buf = np.zeros((16, 64), np.float32)
        with pytest.raises(ConfigError, match="overlap"):
            KVLayout.from_tensors([torch.from_numpy(buf[:, :40]), torch.from_numpy(buf[:, 32:])])
        apart = KVLayout.from_tensors(
            [torch.from_numpy(buf[:, :32]), torch.from_numpy(buf[:, 32:])]
        )
        assert apart.num_arrays == 2
        same = KVLayout.from_tensors([torch.from_numpy(buf), torch.from_numpy(buf)])
        assert same.num_arrays == 2  # one cache two layers share

    def test_arrays_side_by_side_or_the_same_memory_are_taken(self) -> None:
        major = torch.zeros(8, 2, 4)  # block-major: K and V of a block side by side
        assert KVLayout.from_tensors([major[:, 0], major[:, 1]]).num_arrays == 2
        shared = torch.zeros(8, 4)  # one cache two layers share
        assert KVLayout.from_tensors([shared, shared]).num_arrays == 2
        joined = torch.zeros(2, 8, 4)  # vLLM's [2, blocks, ...]: K, then V
        assert KVLayout.from_tensors([joined], block_dim=1).num_arrays == 2


class TestReviewFindings:
    """Each failed before its fix."""

    def test_a_tensor_that_holds_no_array_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="holds no KV array"):
            KVLayout.from_tensors([torch.zeros(2, 4, 8), torch.zeros(0, 4, 8)], block_dim=1)

    async def test_host_blocks_ignore_the_strides_of_size_one_dimensions(self) -> None:
        a = torch.zeros(BLOCKS, 1, 64)
        b = torch.zeros(BLOCKS, 64, 1).transpose(1, 2)  # the same order of elements
        layout = KVLayout.from_tensors([a, b])
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
                await mgr.pinned
                b[3].fill_(7)
                await mgr.store([3], [2])
                assert bool((mgr.host_blocks()[2, 1] == 7).all())
                assert bool((mgr.host_array(np.int64(1))[2] == 7).all())

    def test_ranks_need_a_region_they_can_share(self) -> None:
        layout = build("joined", BLOCKS, "cpu")
        with pytest.raises(ConfigError, match="backing='shared'"):
            OffloadManager.for_kv(layout, HOST_BLOCKS, host_slice=(0, 2))

    async def test_a_layer_load_waits_for_every_group_before_it_raises(self) -> None:
        layout = build("joined", BLOCKS, "cpu")
        engines, make = engines_made(lambda setup: FakeEngine(setup, copy=True))

        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(
                layout, HOST_BLOCKS, backend=FakeBackend(), engine=make
            ) as mgr:
                await mgr.pinned
                (engine,) = engines
                tier = KVTier(mgr)
                stored = tier.store([1], [1])
                engine.finish_next("store")
                await stored.transfer
                load = tier.load_layers([1], [2])
                engine.finish_next("load", RuntimeError("group 0 failed"))
                outcome: list[BaseException] = []

                async def waiter() -> None:
                    try:
                        await load
                    except Exception as exc:
                        outcome.append(exc)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    await anyio.wait_all_tasks_blocked()
                    assert outcome == [] and not load.transfers[1].done()  # group 1 held
                    engine.finish_next("load")
                assert len(outcome) == 1 and "group 0 failed" in str(outcome[0])
                assert load.done()
