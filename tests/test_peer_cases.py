"""The test cases vLLM, LMCache and SGLang run on their own KV offload and prefix-cache
paths, re-expressed through asyncpin's public API (host engine, CPU tensors; the remote
ones on the real Redis of ``tests/redis_servers.py``). The cases that move bytes run
again on the GPU (the ``device`` fixture's ``cuda`` cases: the CUDA engine, blocks in
GPU memory, the host region pinned for real; ``pytest -m cuda`` on the GPU machine).

Each test's docstring names the peer test it re-expresses (repository and file / test).
Where asyncpin's documented contract differs from the peer's on purpose (a store that
finds no room for all of its blocks stores what fits instead of nothing: README "KV
tier"), the test asserts asyncpin's contract and says where it departs. A peer case that
asyncpin failed was fixed at its root; the test stayed, and now passes.

Synchronisation is on events only (the ``copy_gate`` fixture, ``FakeEngine.finish_next``,
``FakeBackend.stalled``); every wait is bounded by ``anyio.fail_after``.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from asyncpin import ConfigError, InvalidTransferError, KVLayout, OffloadManager, TransferError
from asyncpin.manager import ManagerState
from asyncpin.testing import FakeBackend, FakeEngine
from asyncpin.tier import POLICY_NAMES, BlockEvent, BlockIndex, KVTier, RedisStore
from tests.helpers import TIMEOUT_S, releasing, wait_thread_event
from tests.kit import (
    CopyGate,
    as_bytes,
    blocks_per_chunk,
    engines_made,
    random_tensor,
    small_kv,
    small_manager,
)
from tests.redis_servers import RedisCluster, RedisServer

pytestmark = pytest.mark.anyio

BLOCKS = 32  # device blocks of the tier layout
HOST_BLOCKS = 4


# --- helpers --------------------------------------------------------------------------------


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Where a byte-moving case's blocks live: CPU tensors moved by the host engine over
    a fake pinning backend, or the GPU's, moved by the CUDA engine to and from a region
    pinned with cudaHostRegister."""
    return torch.device(request.param)


def pinning(layout: KVLayout) -> dict[str, Any]:
    """The manager's backend for ``layout``'s device: the fake one on the CPU, the real
    one (``auto``: CUDA registration) on the GPU."""
    return {"backend": FakeBackend()} if layout.device.type == "cpu" else {}


def on(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device)


def tier_layout(
    gen: torch.Generator, blocks: int = BLOCKS, device: torch.device | None = None
) -> KVLayout:
    """vLLM's FlashAttention layout, two layers of ``[2, blocks, 4, 2, 8]`` fp16, random
    bytes (every block differs)."""
    at = device or torch.device("cpu")
    kv = [on(at, random_tensor((2, blocks, 4, 2, 8), torch.float16, gen)) for _ in range(2)]
    return KVLayout.from_tensors(kv, block_dim=1)


def rows(layout: KVLayout, ids: list[int]) -> list[torch.Tensor]:
    """The bytes of device blocks ``ids`` of every array (copies, in CPU memory)."""
    return [raw[ids].cpu() for raw in layout.byte_arrays()]


def same_rows(layout: KVLayout, ids: list[int], expected: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(raw[ids].cpu(), e)
        for raw, e in zip(layout.byte_arrays(), expected, strict=True)
    )


def kinds(events: list[BlockEvent]) -> list[tuple[str, int | bytes]]:
    return [(e.kind, e.block_hash) for e in events]


@asynccontextmanager
async def open_tier(
    layout: KVLayout, host_blocks: int = HOST_BLOCKS, *, policy: str = "lru", **kwargs: Any
) -> AsyncIterator[tuple[OffloadManager, KVTier]]:
    async with OffloadManager.for_kv(layout, host_blocks, **pinning(layout), **kwargs) as mgr:
        await mgr.pinned
        yield mgr, KVTier(mgr, policy=policy)


# --- prefix lookup, LRU, eviction: the index ----------------------------------------------


def test_vllm_cpu_manager_lru_sequence() -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_manager.py::test_cpu_manager.

    The same sequence on a ``BlockIndex`` of 4 blocks: a store is not visible to lookup
    (and emits no event) until it completes; lookups count leading hits; a store evicts
    the least recently used block and says so; blocks being loaded are never evicted;
    ``touch`` reorders; a failed store of [7, 9] leaves 7 (already stored) in place.
    Departure: vLLM's ``prepare_store`` returns None when all of it cannot fit;
    asyncpin stores what fits and lists the rest in ``skipped``."""
    index = BlockIndex(4, policy="lru")
    events: list[BlockEvent] = []
    index.add_listener(events.append)

    plan = index.begin_store([1, 2])
    assert (plan.hashes, plan.host_blocks) == ((1, 2), (0, 1))
    assert index.lookup([1, 2]) == 0  # not ready
    assert events == []
    index.end_store(plan, ok=True)
    assert kinds(events) == [("stored", 1), ("stored", 2)]
    events.clear()
    assert (index.lookup([1]), index.lookup([1, 2]), index.lookup([1, 2, 3])) == (1, 2, 2)
    # store [2, 3, 4, 5]: 2 present, 3 and 4 take the free blocks, 5 evicts 1 (block 0)
    plan = index.begin_store([2, 3, 4, 5])
    assert (plan.hashes, plan.host_blocks, plan.present) == ((3, 4, 5), (2, 3, 0), (2,))
    assert [(e.kind, e.block_hash, e.host_block) for e in events] == [("removed", 1, 0)]
    events.clear()
    index.end_store(plan, ok=True)
    assert index.begin_load([2, 3]) == [1, 2]  # a hit: 2 and 3 most recently used now
    # store [6, 7, 8] with 2, 3 being loaded: only 4 and 5 may go (vLLM: None)
    plan = index.begin_store([6, 7, 8])
    assert (plan.hashes, plan.host_blocks, plan.skipped) == ((6, 7), (3, 0), (8,))
    assert index.lookup([2, 3]) == 2
    index.end_store(plan, ok=True)
    index.end_load([2, 3], [1, 2])
    index.touch([5, 6, 7])  # 5 is gone: ignored; order now 2, 3, 6, 7
    plan = index.begin_store([7, 9])  # 7 present; 9 evicts 2
    assert (plan.hashes, plan.present) == ((9,), (7,))
    index.end_store(plan, ok=False)  # the copy failed
    assert index.lookup([7]) == 1 and index.lookup([9]) == 0
    assert kinds(events) == [
        ("stored", 3),
        ("stored", 4),
        ("stored", 5),
        ("removed", 4),
        ("removed", 5),
        ("stored", 6),
        ("stored", 7),
        ("removed", 2),
    ]
    stats = index.stats()
    assert (stats.stored_blocks, stats.failed_blocks, stats.evicted_blocks) == (7, 1, 4)
    assert (stats.skipped_blocks, stats.resident_blocks, stats.free_blocks) == (1, 3, 1)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_vllm_block_being_loaded_never_evicted(policy: str) -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_manager.py::
    test_arc_manager_eviction_with_load (and the LRU case of test_cpu_manager), for every
    policy: while [2, 3] are loading, a store needing three blocks gets only the two the
    others free; once the load ends, they may go."""
    index = BlockIndex(4, policy=policy)
    index.end_store(index.begin_store([1, 2, 3, 4]), ok=True)
    host = index.begin_load([2, 3])
    plan = index.begin_store([5, 6, 7])
    assert plan.skipped == (7,) and set(plan.host_blocks) == {0, 3}
    assert index.lookup([2, 3]) == 2
    index.end_store(plan, ok=True)
    index.end_load([2, 3], host)
    plan = index.begin_store([7])  # the policy's pick; none is held now
    assert plan.skipped == () and index.stats().evicted_blocks == 3
    index.end_store(plan, ok=True)


def test_vllm_lookup_does_not_count_as_a_use() -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_manager.py::test_cpu_manager (lookup
    then prepare_store evicts by store order: ``lookup`` is no use, ``touch`` is)."""
    index = BlockIndex(3)
    for h in (1, 2, 3):
        index.end_store(index.begin_store([h]), ok=True)
    for _ in range(3):
        assert index.lookup([1]) == 1  # idempotent, and no use
    plan = index.begin_store([4])
    assert plan.host_blocks == (0,) and 1 not in index
    index.touch([2])
    plan2 = index.begin_store([5])
    assert plan2.host_blocks == (2,) and 3 not in index and 2 in index


# --- prefix lookup, LRU, eviction: the tier over a manager -------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_vllm_already_stored_block_not_evicted_during_store(
    policy: str, gen: torch.Generator
) -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_manager.py::
    test_already_stored_block_not_evicted_during_prepare_store, through ``KVTier`` with
    the bytes checked: block 2, present and the LRU candidate, survives a store of
    [2, 3, 4, 5] and still loads byte for byte."""
    layout = tier_layout(gen)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout, policy=policy) as (_, tier):
            await tier.store([1, 2], [1, 2]).transfer
            tier.touch([1])
            kept = rows(layout, [2])
            stored = tier.store([2, 3, 4, 5], [2, 3, 4, 5])
            await stored.transfer
            assert stored.plan.present == (2,) and stored.plan.hashes == (3, 4, 5)
            assert stored.skipped == ()
            assert tier.lookup([2]) == 1 and tier.lookup([1]) == 0
            await tier.load([2, 5], [20, 21])
            assert same_rows(layout, [20], kept)
            assert same_rows(layout, [21], rows(layout, [5]))


async def test_longest_prefix_hit_stops_at_the_first_miss(gen: torch.Generator) -> None:
    """vllm-project/vllm tests/v1/core/test_prefix_caching.py (find_longest_cache_hit
    stops at the first block not cached) and sgl-project/sglang
    test/srt/test_radix_cache_unit.py::test_insert_and_match_basic (partial match): a
    chain whose middle block was evicted hits only up to it, though later blocks are
    still resident; a load of the hit moves exactly those blocks."""
    layout = tier_layout(gen)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout) as (_, tier):
            await tier.store([1, 2, 3], [1, 2, 3]).transfer
            tier.touch([1, 3])  # 2 is now the least recently used
            await tier.store([9], [9]).transfer  # the last free block
            await tier.store([10], [10]).transfer  # evicts 2
            assert 2 not in tier.index and 3 in tier.index
            assert tier.lookup([1, 2, 3]) == 1
            assert tier.lookup([3]) == 1 and tier.lookup([4, 3]) == 0
            assert tier.lookup([]) == 0
            before = rows(layout, [21])
            hit = tier.lookup([1, 2, 3])
            await tier.load([1, 2, 3][:hit], [20, 21][:hit])
            assert same_rows(layout, [20], rows(layout, [1]))
            assert same_rows(layout, [21], before)  # untouched


async def test_lmcache_reinsert_keeps_the_first_value(gen: torch.Generator) -> None:
    """LMCache/LMCache tests/v1/storage_backend/test_local_cpu_backend.py::
    test_submit_put_task_reinsert: a second put under a key already present keeps the
    first object. Here: storing hash 7 again from another device block copies nothing and
    the block loads as first stored."""
    layout = tier_layout(gen)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout) as (mgr, tier):
            first = rows(layout, [1])
            await tier.store([7], [1]).transfer
            stored_bytes = mgr.stats().bytes_stored
            again = tier.store([7], [2])
            await again.transfer
            assert again.plan.present == (7,) and again.plan.hashes == ()
            assert mgr.stats().bytes_stored == stored_bytes
            await tier.load([7], [30])
            assert same_rows(layout, [30], first)
            assert tier.stats().stored_blocks == 1


async def test_lmcache_lru_ordering_a_load_is_a_use(gen: torch.Generator) -> None:
    """LMCache/LMCache tests/v1/storage_backend/test_local_cpu_backend.py::test_lru_ordering
    (a get moves the key to the most recently used end): after loading 1, storing a new
    block evicts 2, the oldest not used since."""
    layout = tier_layout(gen)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout, 3) as (_, tier):
            events: list[BlockEvent] = []
            tier.add_listener(events.append)
            for h in (1, 2, 3):
                await tier.store([h], [h]).transfer
            await tier.load([1], [20])
            await tier.store([4], [4]).transfer
            assert ("removed", 2) in kinds(events) and ("removed", 1) not in kinds(events)
            assert tier.lookup([1]) == 1 and tier.lookup([2]) == 0


async def test_lmcache_remove_and_usage_accounting(gen: torch.Generator) -> None:
    """LMCache/LMCache tests/v1/storage_backend/test_local_cpu_backend.py::test_remove,
    test_remove_non_existent, test_memory_usage_tracking, test_get_keys_empty: a removed
    key is gone, a second remove finds nothing, usage returns to where it was."""
    layout = tier_layout(gen)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout) as (_, tier):
            empty = tier.stats()
            assert (empty.resident_blocks, empty.resident_bytes) == (0, 0)
            await tier.store([1, 2], [1, 2]).transfer
            stats = tier.stats()
            assert stats.resident_bytes == 2 * layout.host_block_bytes
            assert stats.free_blocks == HOST_BLOCKS - 2
            assert tier.remove([1]) == 1
            assert tier.remove([1]) == 0 and tier.remove([999]) == 0
            assert tier.lookup([1]) == 0 and tier.lookup([2]) == 1
            tier.clear()
            stats = tier.stats()
            assert (stats.resident_blocks, stats.resident_bytes) == (0, 0)
            assert stats.free_blocks == HOST_BLOCKS and len(tier.index) == 0
            assert stats.removed_blocks == 2


async def test_duplicate_hashes_in_one_store_copy_one_block(gen: torch.Generator) -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_manager.py (prepare_store filters
    hashes already stored) with a hash repeated in one call: it is copied once, from its
    first device block."""
    layout = tier_layout(gen)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout) as (mgr, tier):
            stored = tier.store([5, 5, 6], [1, 2, 3])
            await stored.transfer
            assert stored.plan.hashes == (5, 6) and stored.plan.positions == (0, 2)
            assert mgr.stats().bytes_stored == 2 * layout.host_block_bytes
            await tier.load([5, 6], [10, 11])
            assert same_rows(layout, [10, 11], rows(layout, [1, 3]))


async def test_hash_types_never_collide(gen: torch.Generator) -> None:
    """vllm-project/vllm tests/v1/core/test_kv_cache_utils.py (block hashes: bytes of a
    sha256 chain in v1, signed Python ints before): int and bytes hashes of the same
    "value" are different blocks; negative and 256-bit ints are hashes like any other."""
    layout = tier_layout(gen)
    keys: list[int | bytes] = [1, b"\x01", b"1", -(2**63), 2**256 - 1]
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout, 8) as (_, tier):
            await tier.store(keys, [1, 2, 3, 4, 5]).transfer
            assert tier.lookup(keys) == 5 and len(tier.index) == 5
            await tier.load(keys, [11, 12, 13, 14, 15])
            assert same_rows(layout, [11, 12, 13, 14, 15], rows(layout, [1, 2, 3, 4, 5]))


# --- events -------------------------------------------------------------------------------


async def test_events_on_store_complete_and_on_eviction(
    copy_gate: CopyGate, gen: torch.Generator
) -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_manager.py::test_cpu_manager
    (verify_events: no event before complete_store; eviction events at prepare_store) and
    sgl-project/sglang test/srt/test_radix_cache_unit.py::
    test_kv_cache_events_with_eviction: "stored" only once the copy is over, "removed"
    when a store evicts, with the host block; a subscriber sees the same events."""
    layout = tier_layout(gen)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout, 2) as (_, tier):
            events: list[BlockEvent] = []
            tier.add_listener(events.append)
            with tier.subscribe() as stream, releasing(copy_gate):
                stored = tier.store([1, 2], [1, 2])
                await copy_gate.wait_entered()
                assert events == [] and tier.lookup([1]) == 0
                copy_gate.release()
                await stored.transfer
                assert [(e.kind, e.block_hash, e.host_block) for e in events] == [
                    ("stored", 1, 0),
                    ("stored", 2, 1),
                ]
                tier.touch([1])
                third = tier.store([3], [3])
                assert kinds(events)[2:] == [("removed", 2)]  # at the call, before the copy
                await third.transfer
                assert kinds(events)[3:] == [("stored", 3)]
                assert events[3].host_block == events[2].host_block == 1
                received = [await stream.receive() for _ in range(len(events))]
                assert received == events
            assert tier.dropped_events == 0


# --- failures and close ---------------------------------------------------------------------


async def test_vllm_failed_store_keeps_blocks_already_stored(gen: torch.Generator) -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_manager.py::test_cpu_manager
    (complete_store([7, 9], success=False): 7 is still stored, 9 is not) and
    test_arc_manager_failed_store: a failed copy indexes nothing new, frees its block,
    and leaves the blocks it reported present loadable, bytes intact."""
    layout = tier_layout(gen)
    engines, make = engines_made(lambda setup: FakeEngine(setup, copy=True))
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout, engine=make) as (_, tier):
            (engine,) = engines
            first = tier.store([7], [7])
            engine.finish_next("store")
            await first.transfer
            kept = rows(layout, [7])
            failing = tier.store([7, 9], [1, 9])
            assert failing.plan.present == (7,) and failing.plan.hashes == (9,)
            engine.finish_next("store", OSError("the copy failed"))
            with pytest.raises(TransferError):
                await failing.transfer
            assert tier.lookup([7]) == 1 and tier.lookup([9]) == 0 and 9 not in tier.index
            stats = tier.stats()
            assert (stats.failed_blocks, stats.free_blocks) == (1, HOST_BLOCKS - 1)
            load = tier.load([7], [20])
            engine.finish_next("load")
            await load
            assert same_rows(layout, [20], kept)


async def test_close_while_tier_stores_are_pending(gen: torch.Generator) -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_sleep_offload_race.py and LMCache
    tests/v1/distributed/test_abort_write.py (shutdown / abort while writes are in
    flight): at close, a store whose host chunk pins completes and is indexed; one
    waiting for a chunk that never pins fails, and nothing of it stays indexed."""
    layout = small_kv(gen)
    backend = FakeBackend(stall_pin_at=0)  # chunk 0's pin is held: nothing is pinned
    mgr = small_manager(layout, backend)
    per = blocks_per_chunk(layout)
    with anyio.fail_after(TIMEOUT_S):
        async with mgr:
            tier = KVTier(mgr)
            with releasing(backend):
                await wait_thread_event(backend.stalled)
                in_chunk0 = tier.store(range(100, 100 + per), list(range(per)))
                in_chunk1 = tier.store(range(200, 200 + per), list(range(per, 2 * per)))
                assert in_chunk0.plan.host_blocks == tuple(range(per))
                assert in_chunk1.plan.host_blocks == tuple(range(per, 2 * per))
                async with anyio.create_task_group() as tg:
                    tg.start_soon(mgr.aclose)
                    await anyio.wait_all_tasks_blocked()
                    assert mgr.state is ManagerState.CLOSING
                    assert not in_chunk0.transfer.done() and not in_chunk1.transfer.done()
                    backend.release()
    assert mgr.state is ManagerState.CLOSED
    await in_chunk0.transfer
    with pytest.raises(TransferError):
        await in_chunk1.transfer
    assert tier.index.lookup(range(100, 100 + per)) == per  # indexed
    assert tier.lookup(range(100, 100 + per)) == 0  # but not loadable: the manager closed
    assert tier.index.lookup([200]) == 0 and len(tier.index) == per
    stats = tier.stats()
    assert stats.failed_blocks == per and stats.free_blocks == tier.index.num_host_blocks - per
    with pytest.raises(anyio.ClosedResourceError):
        tier.store([300], [0])
    assert len(tier.index) == per and 300 not in tier.index


# --- bad input ------------------------------------------------------------------------------


BAD_TIER_CALLS: list[tuple[str, str, Callable[[KVTier], object]]] = [
    ("store-str-hash", "int or bytes", lambda t: t.store(["a"], [1])),  # type: ignore[list-item]
    ("store-float-hash", "int or bytes", lambda t: t.store([1.5], [1])),  # type: ignore[list-item]
    ("store-none-hash", "int or bytes", lambda t: t.store([None], [1])),  # type: ignore[list-item]
    ("store-bool-hash", "int or bytes", lambda t: t.store([True, 3], [1, 2])),
    ("store-good-then-bad-hash", "int or bytes", lambda t: t.store([3, "x"], [1, 2])),  # type: ignore[list-item]
    ("store-float-ids", "float", lambda t: t.store([3], torch.tensor([1.0]))),
    ("store-2d-ids", "1-D", lambda t: t.store([3, 4], torch.tensor([[1, 2]]))),
    ("store-ids-off-cpu", "meta", lambda t: t.store([3], torch.tensor([1], device="meta"))),
    ("store-numpy-float-ids", "float", lambda t: t.store([3], np.array([1.0]))),
    ("store-id-out-of-range", str(BLOCKS), lambda t: t.store([3], [BLOCKS])),
    ("store-negative-id", "-1", lambda t: t.store([3], [-1])),
    ("store-lengths-differ", "one device block a hash", lambda t: t.store([3, 4], [1])),
    ("load-duplicate-dest", "duplicate", lambda t: t.load([100, 101], [5, 5])),
    ("load-not-loadable", "not loadable", lambda t: t.load([100, 555], [5, 6])),
    ("load-lengths-differ", "one device block a hash", lambda t: t.load([100, 101], [5])),
    ("load-layers-bad-hash", "not loadable", lambda t: t.load_layers([100, 555], [5, 6])),
    ("store-layers-bad-id", str(BLOCKS), lambda t: t.store_layers([3], [BLOCKS])),
]


@pytest.mark.parametrize(
    ("name", "words", "call"), BAD_TIER_CALLS, ids=[c[0] for c in BAD_TIER_CALLS]
)
async def test_bad_input_is_refused_and_enqueues_nothing(
    name: str, words: str, call: Callable[[KVTier], object], gen: torch.Generator
) -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_gpu.py and LMCache
    tests/v1/test_mem_kernels.py exercise only valid mappings; asyncpin's DESIGN promises
    a typed error before anything is enqueued. Each bad call (wrong id dtype, shape,
    device, range, lengths, duplicate destinations, a hash that is not int/bytes, a hash
    not loadable) raises InvalidTransferError: no transfer, no index change, no block
    left protected (a full store afterwards evicts every old block)."""
    layout = tier_layout(gen)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout) as (mgr, tier):
            await tier.store([100, 101], [1, 2]).transfer
            before_tier, before_mgr = tier.stats(), mgr.stats()
            with pytest.raises(InvalidTransferError, match=words):
                call(tier)
            after_tier, after_mgr = tier.stats(), mgr.stats()
            assert (after_mgr.transfers_stored, after_mgr.transfers_loaded) == (
                before_mgr.transfers_stored,
                before_mgr.transfers_loaded,
            )
            assert after_mgr.transfers_in_flight == 0 == after_mgr.transfers_failed
            for field in ("stores", "stored_blocks", "resident_blocks", "free_blocks"):
                assert getattr(after_tier, field) == getattr(before_tier, field), field
            assert len(tier.index) == 2 and 3 not in tier.index
            full = tier.store([1, 2, 3, 4], [3, 4, 5, 6])  # needs every block: none held
            await full.transfer
            assert full.skipped == () and tier.lookup([100]) == 0 and tier.lookup([101]) == 0


async def test_empty_calls_are_no_ops(gen: torch.Generator) -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_manager.py (prepare_store / lookup
    of nothing) and LMCache tests/v1/test_cache_engine.py (store/retrieve of zero
    chunks): empty stores, loads and lookups complete and change nothing."""
    layout = tier_layout(gen)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout) as (mgr, tier):
            before = rows(layout, list(range(BLOCKS)))
            stored = tier.store([], [])
            await stored.transfer
            assert stored.plan.hashes == () and stored.transfer.nbytes == 0
            await tier.load([], [])
            await tier.load_layers([], [])
            await mgr.store([], [])
            await mgr.load([], [])
            assert tier.lookup([]) == 0
            assert same_rows(layout, list(range(BLOCKS)), before)
            stats = tier.stats()
            assert (stats.resident_blocks, stats.free_blocks) == (0, HOST_BLOCKS)


def test_non_dense_layouts_are_refused() -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_gpu.py (layouts of the attention
    backends) on the side asyncpin guards: a transposed view (gaps between a block's
    elements) and an expanded one (blocks overlapping) are refused with ConfigError; so
    are arrays that disagree on the number of blocks."""
    transposed = torch.zeros(8, BLOCKS, dtype=torch.float16).t()  # [blocks, 8], stride (1, B)
    with pytest.raises(ConfigError, match="densely"):
        KVLayout.from_tensors([transposed])
    overlapping = torch.zeros(1, 16, dtype=torch.bfloat16).expand(BLOCKS, 16)
    with pytest.raises(ConfigError):
        KVLayout.from_tensors([overlapping])
    with pytest.raises(ConfigError, match="number of blocks"):
        KVLayout.from_tensors([torch.zeros(BLOCKS, 4), torch.zeros(BLOCKS + 1, 4)])


# --- bytes: layouts, dtypes, alignments -----------------------------------------------------


def _dtypes() -> list[torch.dtype]:
    found = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8]
    found += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
    return found


def host_rows(mgr: OffloadManager, layout: KVLayout, a: int, ids: list[int]) -> torch.Tensor:
    lo = layout.array_offsets[a]
    return mgr.host_bytes()[ids, lo : lo + layout.array_block_bytes[a]].clone()


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
async def test_vllm_transfer_mixed_attention_backends(
    dtype: torch.dtype, direction: str, device: torch.device, gen: torch.Generator
) -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_gpu.py::test_transfer: per-layer
    caches of FlashAttention (``[2, blocks, bs, heads, d]``), FlashInfer
    (``[blocks, 2, bs, heads, d]``) and FlashAttention-MLA (``[blocks, bs, d]``) in one
    layout, random mappings of 5 blocks either way: the destination's mapped blocks equal
    the source's, every other destination block and the whole source are unchanged."""
    n, host = 64, 16
    fa = on(device, random_tensor((2, n, 4, 2, 16), dtype, gen))
    fi = on(device, random_tensor((n, 2, 4, 2, 16), dtype, gen))
    mla = on(device, random_tensor((n, 4, 24), dtype, gen))
    layout = KVLayout.from_tensors([fa[0], fa[1], fi, mla], block_dim=0)
    assert not layout.uniform and layout.num_arrays == 4
    rng = random.Random(0)
    gpu = rng.sample(range(n), 5)
    cpu = rng.sample(range(host), 5)
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(layout, host, **pinning(layout)) as mgr:
            await mgr.pinned
            raw_host = mgr.host_bytes()
            raw_host.copy_(random_tensor(tuple(raw_host.shape), torch.uint8, gen))
            host_before = raw_host.clone()
            dev_before = [raw.clone() for raw in layout.byte_arrays()]
            del raw_host
            if direction == "store":
                await mgr.store(gpu, cpu)
            else:
                await mgr.load(cpu, gpu)
            untouched_gpu = [g for g in range(n) if g not in gpu]
            untouched_cpu = [c for c in range(host) if c not in cpu]
            for a, raw in enumerate(layout.byte_arrays()):
                if direction == "store":
                    assert torch.equal(host_rows(mgr, layout, a, cpu), raw[gpu].cpu()), a
                    assert torch.equal(raw, dev_before[a]), a
                else:
                    assert torch.equal(raw[gpu].cpu(), host_rows(mgr, layout, a, cpu)), a
                    assert torch.equal(raw[untouched_gpu], dev_before[a][untouched_gpu]), a
            if direction == "store":
                assert torch.equal(mgr.host_bytes()[untouched_cpu], host_before[untouched_cpu])
            else:
                assert torch.equal(mgr.host_bytes(), host_before)
            # fa[0] and fa[1] stayed the halves of one tensor: K and V blocks moved apart
            assert layout.tensor_arrays == (range(0, 1), range(1, 2), range(2, 3), range(3, 4))


@pytest.mark.parametrize(
    "shapes",
    [
        [(torch.int8, (3, 5)), (torch.float16, (3, 3)), (torch.float32, (7,))],  # 15, 18, 28 B
        [(torch.uint8, (1,))],  # 1-byte blocks
        [(torch.bfloat16, (5,)), (torch.int8, (13,))],  # 10, 13 B
    ],
    ids=["15-18-28", "1", "10-13"],
)
async def test_lmcache_round_trip_odd_sizes_and_alignments(
    shapes: list[tuple[torch.dtype, tuple[int, ...]]], device: torch.device, gen: torch.Generator
) -> None:
    """LMCache/LMCache tests/v1/test_mem_kernels.py (multi_layer_kv_transfer round trips
    over chunk sizes that are not a multiple of the block, mixed shapes): arrays whose
    blocks are 1, 10, 13, 15, 18 and 28 bytes (host offsets not 8-byte aligned) go to the
    host and come back byte for byte, through the tier."""
    n = 40
    arrays = [on(device, random_tensor((n, *shape), dtype, gen)) for dtype, shape in shapes]
    layout = KVLayout.from_tensors(arrays)
    ids = [0, 7, 8, 9, 31, 3]
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout, 8) as (mgr, tier):
            kept = rows(layout, ids)
            hashes = [b"chunk-%d" % i for i in range(len(ids))]
            await tier.store(hashes, ids).transfer
            for i, h in enumerate(hashes):
                block = tier.index.host_block(h)
                assert block is not None
                row = mgr.host_bytes()[block]
                for a in range(layout.num_arrays):
                    lo = layout.array_offsets[a]
                    piece = row[lo : lo + layout.array_block_bytes[a]]
                    assert torch.equal(piece, kept[a][i]), (h, a)
            dests = [39, 38, 37, 36, 35, 34]
            await tier.load(hashes, dests)
            assert same_rows(layout, dests, kept)


async def test_flashinfer_hnd_view_round_trips(device: torch.device, gen: torch.Generator) -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_gpu.py with FlashInfer's HND
    layout (``get_kv_cache_stride_order``: heads before tokens in memory, the NHD shape
    seen through a permuted view): the dense, non-contiguous view moves as it lies."""
    n = 16
    hnd = on(
        device, random_tensor((n, 2, 4, 8, 16), torch.bfloat16, gen)
    )  # [blocks, 2, heads, bs, d]
    view = hnd.permute(0, 1, 3, 2, 4)  # [blocks, 2, bs, heads, d], not contiguous
    assert not view.is_contiguous()
    layout = KVLayout.from_tensors([view], block_dim=0)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout) as (_, tier):
            kept = as_bytes(view[[2, 5]])
            await tier.store([1, 2], [2, 5]).transfer
            await tier.load([1, 2], [10, 11])
            assert torch.equal(as_bytes(view[[10, 11]]), kept)
            assert torch.equal(as_bytes(hnd[[10, 11]]), as_bytes(hnd[[2, 5]]))


# --- layer-wise -----------------------------------------------------------------------------


async def test_lmcache_layerwise_store_and_retrieve(
    device: torch.device, gen: torch.Generator
) -> None:
    """LMCache/LMCache tests/v1/test_cache_engine.py (test_layerwise_store_retrieve:
    store layer by layer, retrieve layer by layer, each layer equal) and the aborted
    request of tests/v1/distributed/test_abort_write.py: a layer-wise store is loadable
    only when every layer is in; an aborted one frees its blocks and indexes nothing."""
    layers = [on(device, random_tensor((2, BLOCKS, 4, 2, 8), torch.float16, gen)) for _ in range(3)]
    layout = KVLayout.from_tensors(layers, block_dim=1)
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout) as (_, tier):
            async with tier.store_layers([1, 2], [4, 6]) as store:
                for i in range(len(layers)):
                    assert tier.lookup([1]) == 0
                    store.store_group(i)
            assert tier.lookup([1, 2]) == 2
            load = tier.load_layers([1, 2], [20, 21])
            assert len(load.transfers) == len(layers)
            for i, transfer in enumerate(load.transfers):
                await transfer
                assert torch.equal(as_bytes(layers[i][:, [20, 21]]), as_bytes(layers[i][:, [4, 6]]))
            await load
            aborted = tier.store_layers([3, 4], [7, 8])
            aborted.store_group(0)
            aborted.abort()
            await aborted
            assert tier.lookup([3]) == 0 and 3 not in tier.index
            stats = tier.stats()
            assert (stats.free_blocks, stats.failed_blocks) == (HOST_BLOCKS - 2, 2)


# --- concurrency ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_many_concurrent_stores_and_loads_move_the_right_bytes(
    policy: str, device: torch.device, gen: torch.Generator
) -> None:
    """LMCache/LMCache tests/v1/storage_backend/test_local_cpu_backend.py::
    test_thread_safety / test_concurrent_access and vllm-project/vllm
    tests/v1/kv_offload/e2e/test_stress.py: rounds of concurrent stores (evicting) and
    loads of looked-up prefixes over 8 host blocks; every loaded block equals the device
    block its hash was stored from, and the index's counts stay consistent."""
    n_src, host = 24, 8
    layout = tier_layout(gen, blocks=64, device=device)
    src = {h: rows(layout, [h]) for h in range(n_src)}  # hash h is device block h
    rng = random.Random(1234)
    loads_checked = 0
    with anyio.fail_after(TIMEOUT_S):
        async with open_tier(layout, host, policy=policy) as (_, tier):
            for _ in range(12):
                free_dests = list(range(32, 64))
                rng.shuffle(free_dests)
                checks: list[tuple[list[int], list[int]]] = []
                async with anyio.create_task_group() as tg:
                    for _ in range(6):
                        start = rng.randrange(n_src)
                        chain = [(start + k) % n_src for k in range(rng.randint(1, 4))]
                        if rng.random() < 0.5:
                            tg.start_soon(_await, tier.store(chain, chain).transfer)
                            continue
                        hit = tier.lookup(chain)
                        if not hit:
                            continue
                        dests = [free_dests.pop() for _ in range(hit)]
                        tg.start_soon(_await, tier.load(chain[:hit], dests))
                        checks.append((chain[:hit], dests))
                for hashes, dests in checks:
                    for h, d in zip(hashes, dests, strict=True):
                        assert same_rows(layout, [d], src[h]), (h, d)
                        loads_checked += 1
                stats = tier.stats()
                assert stats.resident_blocks + stats.free_blocks == host
                assert len(tier.index) == stats.resident_blocks
    assert loads_checked > 0


async def _await(awaitable: Any) -> None:
    await awaitable


# --- remote tier (Redis) --------------------------------------------------------------------


@asynccontextmanager
async def remote(
    url: str,
    keyspace: str,
    gen: torch.Generator,
    device: torch.device | None = None,
    **store_kwargs: Any,
) -> AsyncIterator[tuple[KVTier, KVLayout]]:
    layout = tier_layout(gen, device=device)
    store = RedisStore(url, timeout_s=2.0, **store_kwargs)
    async with OffloadManager.for_kv(layout, 8, **pinning(layout)) as mgr:
        await mgr.pinned
        async with KVTier(mgr, remote=store, model="peer", namespace=keyspace.rstrip(":")) as tier:
            yield tier, layout


def damaged(server: RedisServer, key: str, damage: str) -> None:
    """Put a bad value under ``key`` in place of its own, or none: another type of data
    (``wrong-type``), ``empty``, its own with bytes appended (``trailing-bytes``), its
    header alone (``header-only``), ``foreign`` bytes, or ``missing``."""
    value = server.command("GET", key)
    assert isinstance(value, bytes)
    server.command("DEL", key)
    if damage == "wrong-type":
        server.command("HSET", key, "f", "v")
    elif damage == "empty":
        server.command("SET", key, b"")
    elif damage == "trailing-bytes":
        server.command("SET", key, value + b"\x00" * 8)
    elif damage == "header-only":
        server.command("SET", key, value[:64])
    elif damage == "foreign":
        server.command("SET", key, b"x" * 200)
    else:
        assert damage == "missing", damage


async def _written_and_forgotten(tier: KVTier, hashes: list[int]) -> None:
    await tier.store(hashes, hashes).transfer  # hash h from device block h
    await tier.remote_written()
    tier.clear()
    assert tier.lookup(hashes) == 0


@pytest.mark.redis
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "copied"])
async def test_lmcache_remote_missing_key_ends_the_prefix(
    direct: bool,
    device: torch.device,
    redis_server: RedisServer,
    redis_keyspace: str,
    gen: torch.Generator,
) -> None:
    """LMCache/LMCache tests/v1/storage_backend/test_resp_get_missing_key.py and
    test_redis_connector_prefix.py: a key missing on the server is a miss, and a prefix
    lookup stops there though later keys exist; restore brings back only the run before
    it and indexes nothing after it."""
    with anyio.fail_after(TIMEOUT_S):
        async with remote(redis_server.url, redis_keyspace, gen, device, direct_reads=direct) as (
            tier,
            layout,
        ):
            await _written_and_forgotten(tier, [1, 2, 3, 4])
            assert tier.remote is not None
            assert redis_server.command("DEL", tier.remote.key_of(3)) == 1
            assert await tier.lookup_remote([1, 2, 3, 4]) == 2
            before = rows(layout, [22, 23])
            assert await tier.restore([1, 2, 3, 4], [20, 21, 22, 23]) == 2
            assert same_rows(layout, [20, 21], rows(layout, [1, 2]))
            assert same_rows(layout, [22, 23], before)
            assert tier.lookup([1, 2]) == 2 and 4 not in tier.index


@pytest.mark.redis
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("way", ["direct", "copied", "cluster"])
@pytest.mark.parametrize(
    "damage",
    [
        "wrong-type",
        "empty",
        "trailing-bytes",
        "header-only",
    ],
)
async def test_remote_foreign_values_are_misses(
    damage: str,
    way: str,
    request: pytest.FixtureRequest,
    redis_keyspace: str,
    gen: torch.Generator,
) -> None:
    """LMCache/LMCache tests/v1/distributed/serde/test_checksum.py and
    tests/v1/storage_backend/test_remote_async_deserialization.py (a value that does not
    deserialize is a miss, never data): under block 2's key, a Redis hash (GET answers
    WRONGTYPE), an empty string, the right value with bytes appended, or the header
    alone. Restore stops before block 2, raises nothing, and block 2's device block and
    the index stay as they were."""
    cluster: RedisCluster | None = None
    if way == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
    server: RedisServer = cluster.nodes[0] if cluster else request.getfixturevalue("redis_server")
    options: dict[str, Any] = {"cluster": True} if cluster else {"direct_reads": way == "direct"}
    url = cluster.url if cluster else server.url
    with anyio.fail_after(TIMEOUT_S):
        async with remote(url, redis_keyspace, gen, **options) as (tier, layout):
            await _written_and_forgotten(tier, [1, 2, 3])
            assert tier.remote is not None
            key = tier.remote.key_of(2)
            if cluster:
                server = cluster.node_for_slot(cluster.keyslot(key))
            damaged(server, key, damage)
            before = rows(layout, [21, 22])
            assert await tier.restore([1, 2, 3], [20, 21, 22]) == 1
            assert same_rows(layout, [20], rows(layout, [1]))
            assert same_rows(layout, [21, 22], before)
            assert tier.lookup([1, 2]) == 1 and 2 not in tier.index
            # a value that is not ours: counted, and no fault of the server
            stats = tier.stats().remote
            assert stats is not None and stats.invalid_by_reason == {"truncated": 1}
            assert not stats.degraded
            # the tier serves on: another block stores and restores
            await _written_and_forgotten(tier, [5])
            assert await tier.restore([5], [25]) == 1
            assert same_rows(layout, [25], rows(layout, [5]))


@pytest.mark.redis
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("damage", ["wrong-type", "empty", "header-only", "foreign", "missing"])
async def test_a_run_broken_by_a_bad_value_evicts_nothing_for_the_values_after_it(
    damage: str, redis_server: RedisServer, redis_keyspace: str, gen: torch.Generator
) -> None:
    """Block 2 of a run of five is bad or missing; five other blocks fill the host but
    for three free ones. The direct fetch restores block 1 and reserves no host block
    for blocks 3-5 (review: a value with no body to read, missing, empty, of another
    type or no longer than its header, did not end the run, and the values after it
    evicted resident blocks for nothing)."""
    with anyio.fail_after(TIMEOUT_S):
        async with remote(redis_server.url, redis_keyspace, gen, direct_reads=True) as (
            tier,
            _,
        ):
            await _written_and_forgotten(tier, [1, 2, 3, 4, 5])
            assert tier.remote is not None
            key = tier.remote.key_of(2)
            damaged(redis_server, key, damage)
            resident = [11, 12, 13, 14, 15]
            await tier.store(resident, resident).transfer
            await tier.remote_written()
            assert await tier.restore([1, 2, 3, 4, 5], [20, 21, 22, 23, 24]) == 1
            assert [h for h in resident if h in tier.index] == resident
            assert tier.stats().evicted_blocks == 0


@pytest.mark.redis
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_lmcache_redis_ttl_is_set_on_every_value(
    redis_server: RedisServer, redis_keyspace: str, gen: torch.Generator
) -> None:
    """LMCache/LMCache tests/v1/storage_backend/test_redis_ttl.py: with a TTL configured
    every value written has an expiry no longer than it; without, none."""
    with anyio.fail_after(TIMEOUT_S):
        async with remote(redis_server.url, redis_keyspace, gen, ttl_s=600) as (tier, _):
            await tier.store([1, 2], [1, 2]).transfer
            await tier.remote_written()
            assert tier.remote is not None
            for h in (1, 2):
                ttl = redis_server.command("PTTL", tier.remote.key_of(h))
                assert isinstance(ttl, int) and 0 < ttl <= 600_000, ttl
        async with remote(redis_server.url, redis_keyspace + "n:", gen) as (tier, _):
            await tier.store([1], [1]).transfer
            await tier.remote_written()
            assert tier.remote is not None
            assert redis_server.command("PTTL", tier.remote.key_of(1)) == -1


def test_peer_layout_shapes_are_described() -> None:
    """vllm-project/vllm tests/v1/kv_offload/test_cpu_gpu.py (the handler's block sizes per
    backend): a layout's per-array block bytes and offsets add up to the host block."""
    fa = torch.zeros(2, 8, 4, 2, 16, dtype=torch.bfloat16)
    mla = torch.zeros(8, 4, 24, dtype=torch.float16)
    layout = KVLayout.from_tensors([fa[0], fa[1], mla], block_dim=0)
    sizes = [4 * 2 * 16 * 2, 4 * 2 * 16 * 2, 4 * 24 * 2]
    assert list(layout.array_block_bytes) == sizes
    assert list(layout.array_offsets) == [0, sizes[0], sizes[0] + sizes[1]]
    assert layout.host_block_bytes == math.fsum(sizes)


@pytest.mark.redis
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "copied"])
async def test_sglang_hicache_restore_with_repeated_hashes_and_host_gaps(
    direct: bool,
    device: torch.device,
    redis_server: RedisServer,
    redis_keyspace: str,
    gen: torch.Generator,
) -> None:
    """sgl-project/sglang test/srt/hicache (HiRadixCache: a prefix matched across the
    device, host and storage tiers, prefetched from storage into host then loaded):
    restore of [1, 2, 3] with 1 and 3 on the host and 2 only on the server brings all
    three; a prompt that repeats a block hash ([5, 5]) restores both positions."""
    with anyio.fail_after(TIMEOUT_S):
        async with remote(redis_server.url, redis_keyspace, gen, device, direct_reads=direct) as (
            tier,
            layout,
        ):
            await _written_and_forgotten(tier, [1, 2, 3, 5])
            await tier.store([1, 3], [1, 3]).transfer
            assert tier.lookup([1, 2, 3]) == 1
            assert await tier.lookup_remote([1, 2, 3]) == 3
            assert await tier.restore([1, 2, 3], [20, 21, 22]) == 3
            assert same_rows(layout, [20, 21, 22], rows(layout, [1, 2, 3]))
            assert await tier.restore([5, 5], [23, 24]) == 2
            assert same_rows(layout, [23, 24], rows(layout, [5, 5]))
            stats = tier.stats()
            assert stats.resident_blocks + stats.free_blocks == tier.index.num_host_blocks


@pytest.mark.redis
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_restore_with_no_host_room_returns_the_host_hits(
    copy_gate: CopyGate, redis_server: RedisServer, redis_keyspace: str, gen: torch.Generator
) -> None:
    """vllm-project/vllm tests/v1/kv_offload/tiering/test_backpressure.py (a lower tier's
    load with no room in the upper one is refused, not waited for): with every host
    block held by a load in flight, a restore of a block only on the server fetches
    nothing, raises nothing and returns 0."""
    with anyio.fail_after(TIMEOUT_S):
        async with remote(redis_server.url, redis_keyspace, gen) as (tier, _):
            with releasing(copy_gate):
                copy_gate.release()  # the first copies go through
                await _written_and_forgotten(tier, [9])
                held = list(range(100, 108))
                await tier.store(held, list(range(8))).transfer
                # Written to the server first: the write-behind keeps each block from
                # eviction while it reads it, which would leave no room after the load.
                await tier.remote_written()
                copy_gate.released.clear()  # the load is held in its copy
                load = tier.load(held, list(range(8, 16)))
                await copy_gate.wait_entered(3)  # two stores, then the load
                assert await tier.restore([9], [20]) == 0
                assert 9 not in tier.index
                copy_gate.release()
                await load
            assert await tier.restore([9], [20]) == 1
