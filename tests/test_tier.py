"""The KV tier over a manager (host engine; asyncio and trio): blocks stored under their
hashes are found by lookup and loaded back byte for byte; a failed copy indexes nothing;
a block a load is reading is never evicted; a store with no room says what it skipped."""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

from asyncpin import ConfigError, InvalidTransferError, KVLayout, OffloadManager
from asyncpin.engines.host import HostTransferEngine
from asyncpin.testing import FakeBackend, FakeEngine
from asyncpin.tier import BlockEvent, BlockIndex, KVTier
from asyncpin.transfers import TransferJob
from tests.kit import engines_made

pytestmark = pytest.mark.anyio

TIMEOUT_S = 10
BLOCKS = 16  # device blocks
HOST_BLOCKS = 4


def _layout() -> KVLayout:
    """Two arrays of 16 blocks of 64 bytes, each block filled with its id."""
    arrays = [torch.arange(BLOCKS, dtype=torch.uint8).repeat_interleave(64).view(BLOCKS, 64)]
    arrays.append(arrays[0] + 100)
    return KVLayout.from_tensors(arrays)


def _tier(mgr: OffloadManager) -> KVTier:
    return KVTier(mgr)


async def test_stored_blocks_are_found_and_loaded_back() -> None:
    layout = _layout()
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
            chain = [11, 22, 33]
            assert tier.lookup(chain) == 0
            stored = tier.store(chain, [5, 6, 7])
            await stored.transfer
            assert stored.skipped == () and stored.plan.present == ()
            assert tier.lookup([*chain, 44]) == 3
            again = tier.store([11, 22, 44], [5, 6, 8])  # two present, one new
            await again.transfer
            assert again.plan.present == (11, 22) and again.plan.hashes == (44,)
            for array in layout.arrays:
                array.zero_()
            await tier.load([22, 44], [0, 1])
            assert bool((layout.arrays[0][0] == 6).all()) and bool((layout.arrays[0][1] == 8).all())
            assert bool((layout.arrays[1][1] == 108).all())
            stats = tier.index.stats()
            assert (stats.stored_blocks, stats.resident_blocks) == (4, 4)


class FailingEngine(HostTransferEngine):
    def _copy(self, job: TransferJob) -> None:
        raise RuntimeError("the copy failed")


async def test_a_failed_store_leaves_nothing_indexed() -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(
            _layout(), HOST_BLOCKS, backend=FakeBackend(), engine=FailingEngine
        ) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
            stored = tier.store([1, 2], [3, 4])
            with pytest.raises(Exception, match="the copy failed"):
                await stored.transfer
            assert tier.lookup([1]) == 0 and len(tier.index) == 0
            assert tier.index.stats().free_blocks == HOST_BLOCKS


async def test_a_block_being_loaded_is_never_evicted_and_a_full_store_says_what_it_skipped() -> (
    None
):
    engines, make = engines_made(lambda setup: FakeEngine(setup, copy=True))

    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(
            _layout(), HOST_BLOCKS, backend=FakeBackend(), engine=make
        ) as mgr:
            await mgr.pinned
            (engine,) = engines
            tier = _tier(mgr)
            events: list[BlockEvent] = []
            tier.add_listener(events.append)
            stored = tier.store([1, 2, 3, 4], [1, 2, 3, 4])
            engine.finish_next("store")
            await stored.transfer
            load = tier.load([1, 2, 3, 4], [8, 9, 10, 11])  # held: every block protected
            full = tier.store([5], [5])
            assert full.skipped == (5,) and full.plan.hashes == ()
            engine.finish_next("store")  # an empty copy, still a transfer of its own
            await full.transfer
            engine.finish_next("load")
            await load
            evicting = tier.store([5], [5])  # now the least recently used block goes
            engine.finish_next("store")
            await evicting.transfer
            assert [(e.kind, e.block_hash) for e in events] == [
                ("stored", 1),
                ("stored", 2),
                ("stored", 3),
                ("stored", 4),
                ("removed", 1),
                ("stored", 5),
            ]
            assert tier.lookup([1]) == 0 and tier.lookup([2, 3, 4]) == 3 and 5 in tier.index


async def test_bad_input_changes_nothing() -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
            with pytest.raises(InvalidTransferError, match="one device block a hash"):
                tier.store([1, 2], [3])
            with pytest.raises(InvalidTransferError, match="outside"):
                tier.store([1], [BLOCKS])
            # Told from the hashes' count, before a list is made of them.
            with pytest.raises(InvalidTransferError, match=f"2 hashes and {2**62} gpu_block_ids"):
                tier.store([1, 2], range(2**62))
            with pytest.raises(InvalidTransferError, match="more ids than the 2 blocks"):
                tier.store([1, 2], range(2**64))  # no len(): told from the first three
            with pytest.raises(InvalidTransferError, match="more ids than the 1 block this"):
                tier.store([1], itertools.count())  # type: ignore[arg-type]
            with pytest.raises(InvalidTransferError, match="int or bytes"):
                tier.store(["a"], [1])  # type: ignore[list-item]
            with pytest.raises(InvalidTransferError, match="not loadable"):
                tier.load([9], [1])
            assert len(tier.index) == 0 and tier.index.stats().free_blocks == HOST_BLOCKS


def test_a_tier_needs_a_kv_layout() -> None:
    with pytest.raises(ConfigError, match="KV layout"):
        KVTier(OffloadManager(1 << 20, backend=FakeBackend()))


async def test_events_as_an_async_iterator_and_a_slow_reader_loses_only_new_ones() -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
            with tier.subscribe(max_buffer=2) as events:
                await tier.store([1, 2, 3], [1, 2, 3]).transfer
                got = [events.receive_nowait(), events.receive_nowait()]
                assert [(e.kind, e.block_hash) for e in got] == [("stored", 1), ("stored", 2)]
                assert tier.dropped_events == 1  # the third did not fit
                tier.remove([1])
                event = await events.receive()
                assert (event.kind, event.block_hash) == ("removed", 1)
            tier.remove([2])  # after the subscription: nobody listens, nothing dropped
            assert tier.dropped_events == 1


@pytest.mark.parametrize(
    "bad", [-1, 1.5, True, "8", None, 2**70, pytest.param(10**5000, id="10**5000")]
)
async def test_a_bad_event_buffer_is_refused_with_no_listener_left(bad: object) -> None:
    """A hostile trial: -1 and 1.5 raised the async library's bare ValueError."""
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
            with (
                pytest.raises(ConfigError, match="max_buffer"),
                tier.subscribe(max_buffer=bad),  # type: ignore[arg-type]
            ):
                pass
            assert tier.index._listeners == []  # none was left behind
            with tier.subscribe(max_buffer=0):  # every event dropped unless awaited
                await tier.store([1], [1]).transfer
                assert tier.dropped_events == 1
            with tier.subscribe(max_buffer=math.inf) as events:  # anyio's "no limit"
                tier.remove([1])
                assert events.receive_nowait().kind == "removed"
            assert tier.index._listeners == []


async def test_an_int_too_large_to_write_is_refused_as_any_bad_value() -> None:
    """A review: such an int in a message raised ValueError (the interpreter's limit on
    ints written in decimal) in place of the typed error."""
    huge = 10**5000
    with pytest.raises(ConfigError, match="nbytes"):
        OffloadManager(huge, backend=FakeBackend())
    with pytest.raises(ConfigError, match="num_host_blocks"):
        BlockIndex(-huge)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
            for bad in (huge, -huge):
                with pytest.raises(InvalidTransferError, match="outside"):
                    tier.store([1], [bad])
                with pytest.raises(InvalidTransferError, match="outside"):
                    mgr.load([bad], [1])
            with pytest.raises(InvalidTransferError, match="arrays"):
                mgr.store([1], [1], arrays=range(0, huge))
            assert len(tier.index) == 0


async def test_a_refused_call_evicts_nothing_and_touches_nothing() -> None:
    """Everything the manager would refuse (the method, duplicate destinations, another
    thread) is checked before the index changes: a full tier keeps its blocks and their
    order."""
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
            await tier.store([1, 2, 3, 4], [1, 2, 3, 4]).transfer  # full; 1 is the LRU
            before = tier.stats()
            with pytest.raises(InvalidTransferError, match="method"):
                tier.store([5], [5], method="bogus")  # type: ignore[arg-type]
            with pytest.raises(InvalidTransferError, match="method"):
                tier.store_layers([5], [5], method="bogus")  # type: ignore[arg-type]
            with pytest.raises(InvalidTransferError, match="duplicate"):
                tier.load([1, 2], [7, 7])
            with pytest.raises(InvalidTransferError, match="duplicate"):
                tier.load_layers([1, 2], [7, 7])
            with pytest.raises(RuntimeError, match="event loop's thread"):
                await anyio.to_thread.run_sync(tier.store, [5], [5])
            assert tier.stats() == before and tier.lookup([1, 2, 3, 4]) == 4
            stored = tier.store([5], [5])  # 1 is still the least recently used
            await stored.transfer
            assert tier.lookup([1]) == 0 and tier.lookup([2, 3, 4, 5]) == 4


@pytest.mark.parametrize("hashes", [b"\x01\x02", None, 7, "ab"], ids=repr)
async def test_hashes_that_are_no_sequence_are_refused_by_every_call(hashes: Any) -> None:
    """Not a sequence of hashes (a single bytes would be read as its bytes' ints):
    InvalidTransferError from every call that takes hashes, nothing changed (review: the
    tier's own calls listed them before the index saw them)."""
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
            await tier.store([1, 2], [1, 2]).transfer
            before = tier.stats()
            calls: list[Callable[[], object]] = [
                lambda: tier.store(hashes, [0, 1]),
                lambda: tier.store_layers(hashes, [0, 1]),
                lambda: tier.load(hashes, [0, 1]),
                lambda: tier.load_layers(hashes, [0, 1]),
                lambda: tier.lookup(hashes),
            ]
            for call in calls:
                with pytest.raises(InvalidTransferError, match="sequence of ints or bytes"):
                    call()
            waits: list[Callable[[], Awaitable[int]]] = [
                lambda: tier.restore(hashes, [0, 1]),
                lambda: tier.lookup_remote(hashes),
            ]
            for wait in waits:
                with pytest.raises(InvalidTransferError, match="sequence of ints or bytes"):
                    await wait()
            assert tier.stats() == before and tier.lookup([1, 2]) == 2


async def test_a_closed_manager_refuses_stores_with_nothing_changed() -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
        for store in (tier.store, tier.store_layers):
            with pytest.raises(anyio.ClosedResourceError):
                store([1], [1])
        assert tier.stats().stores == 0 and len(tier.index) == 0


async def test_hashes_may_come_from_any_iterable() -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
            await tier.store((h for h in [1, 2]), [1, 2]).transfer
            assert tier.lookup(h for h in [1, 2, 3]) == 2
            await tier.load(iter([1, 2]), [5, 6])


async def test_a_layer_store_group_from_another_thread_is_refused_and_the_store_goes_on() -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = _tier(mgr)
            store = tier.store_layers([1], [1])
            with pytest.raises(RuntimeError, match="event loop's thread"):
                await anyio.to_thread.run_sync(store.store_group, 0)
            for i in range(len(store.groups)):
                store.store_group(i)
            await store
            assert tier.lookup([1]) == 1


async def test_a_manager_serves_one_tier_at_a_time() -> None:
    """A second tier on a manager would hand out the host blocks the first tier's blocks
    are in (a hostile trial: the first then loaded the second's bytes under its own hash):
    refused while the first serves; once it is left or dropped, a new one takes over and
    the one left refuses calls."""
    layout = _layout()
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            first = KVTier(mgr)
            await first.store([111], [1]).transfer
            with pytest.raises(ConfigError, match="has a KV tier already"):
                KVTier(mgr)
            await first.load([111], [9])
            assert bool((layout.arrays[0][9] == 1).all())
            del first  # dropped: a new one takes over
            second = KVTier(mgr)
            assert second.lookup([111]) == 0
            async with second:
                await second.store([222], [2]).transfer
            third = KVTier(mgr)  # the second was left
            assert third.lookup([222]) == 0
            for call in (
                lambda: second.lookup([222]),
                lambda: second.store([333], [3]),
                lambda: second.load([222], [9]),
                second.clear,
            ):
                with pytest.raises(ConfigError, match="no longer serves its manager"):
                    call()
            await third.store([444], [4]).transfer
            await third.load([444], [9])
            assert bool((layout.arrays[0][9] == 4).all())


async def test_nothing_can_be_loaded_once_the_manager_closed() -> None:
    """``lookup`` counts the hashes that can be loaded now: none once the manager closed
    (a hostile trial: it still counted the stored ones, which ``load`` then refused)."""
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = KVTier(mgr)
            await tier.store([5, 6], [5, 6]).transfer
            assert tier.lookup([5, 6]) == 2 and await tier.lookup_remote([5, 6]) == 2
        assert tier.lookup([5, 6]) == 0 and await tier.lookup_remote([5, 6]) == 0
        with pytest.raises(InvalidTransferError):
            tier.lookup([True])
        with pytest.raises(anyio.ClosedResourceError):
            await tier.load([5], [0])


async def test_a_tier_left_with_a_store_under_way_keeps_its_manager() -> None:
    """Left, but with a layer-wise store not ended: a new tier would hand out that
    store's host block again, so it is refused until the store ended (a review found
    the new tier's block overwritten by the old store's copy)."""
    layout = _layout()
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            async with KVTier(mgr) as first:
                store = first.store_layers([1], [1])
            with pytest.raises(ConfigError, match="has a KV tier already"):
                KVTier(mgr)
            for i in range(len(store.groups)):
                store.store_group(i)
            await store
            second = KVTier(mgr)  # the store ended: the manager is free
            await second.store([2], [2]).transfer
            await second.load([2], [9])
            assert bool((layout.arrays[0][9] == 2).all())


class _ClosedStore:
    name = "closed"
    closed = True

    async def get(self, keys: Any) -> list[bytes | None]:
        return [None] * len(keys)

    async def put(self, items: Any) -> None:
        pass

    async def exists(self, keys: Any) -> list[bool]:
        return [False] * len(keys)

    async def aclose(self) -> None:
        pass


async def test_a_tier_whose_entry_failed_frees_its_manager() -> None:
    """The natural fallback, a host-only tier, is not refused (a review: the tier that
    never entered kept the manager while the caller's name still held it)."""
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = KVTier(mgr, remote=_ClosedStore())
            with pytest.raises(ConfigError, match="is closed or serves another tier"):
                async with tier:
                    pass
            fallback = KVTier(mgr)
            await fallback.store([3], [3]).transfer
            assert fallback.lookup([3]) == 1
            with pytest.raises(ConfigError, match="no longer serves its manager"):
                tier.lookup([3])


async def test_a_layer_store_with_nothing_to_copy_ends_in_a_block_and_on_abort() -> None:
    """Every hash present: the store is over at once; leaving its block and abort() then
    wait for nothing (a review: the first abort() fix left wait() raising)."""
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            tier = KVTier(mgr)
            await tier.store([4], [4]).transfer
            async with tier.store_layers([4], [4]) as present:
                assert present.plan.hashes == ()
            again = tier.store_layers([4], [4])
            again.abort()
            await again
            assert tier.lookup([4]) == 1
