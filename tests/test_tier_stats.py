"""The KV tier's counters: ``KVTier.stats()`` (a TierStats) after real operations on the
host engine (stores, lookups that hit and miss, evictions, skips, a failed copy, removes,
dropped events), and the same counts in the Prometheus text of ``TierCollector``, over a
tier and over a bare BlockIndex (a scheduler process's, with no manager)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NoReturn

import anyio
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from asyncpin import ConfigError, KVLayout, OffloadManager, TierStats, TransferError
from asyncpin.abc import EngineSetup
from asyncpin.engines.host import HostTransferEngine
from asyncpin.metrics import OffloadCollector, TierCollector
from asyncpin.testing import FakeBackend
from asyncpin.tier import BlockIndex, KVTier
from asyncpin.transfers import TransferJob
from tests.helpers import TIMEOUT_S
from tests.kit import engines_made

pytestmark = pytest.mark.anyio

BLOCKS = 16  # device blocks
HOST_BLOCKS = 4
BLOCK_BYTES = 64  # of one array's block: a host block is 2 x 64 bytes

COUNTERS = (
    "lookups",
    "looked_up_blocks",
    "hit_blocks",
    "stores",
    "stored_blocks",
    "skipped_blocks",
    "failed_blocks",
    "evicted_blocks",
    "removed_blocks",
    "dropped_events",
)
GAUGES = ("resident_blocks", "resident_bytes", "free_blocks", "host_blocks")


def _layout() -> KVLayout:
    """Two arrays of 16 blocks of 64 bytes, each block filled with its id."""
    arrays = [
        torch.arange(BLOCKS, dtype=torch.uint8).repeat_interleave(BLOCK_BYTES).view(BLOCKS, -1)
    ]
    arrays.append(arrays[0] + 100)
    return KVLayout.from_tensors(arrays)


class FlakyEngine(HostTransferEngine):
    """The host engine; the copy of the next store fails once ``fail_next_store`` is set."""

    def __init__(self, setup: EngineSetup) -> None:
        super().__init__(setup)
        self.fail_next_store = False

    def _copy(self, job: TransferJob) -> None:
        if job.transfer.direction == "store" and self.fail_next_store:
            self.fail_next_store = False
            raise RuntimeError("the copy failed")
        super()._copy(job)


def scrape(registry: CollectorRegistry) -> dict[str, list[Sample]]:
    text = generate_latest(registry).decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def tier_metrics(registry: CollectorRegistry) -> dict[str, float | None]:
    """Every tier counter and gauge by its short name (None: a family with no sample),
    and the policy from the info metric."""
    families = scrape(registry)
    out: dict[str, float | None] = {}
    for name in COUNTERS:
        (sample,) = families[f"asyncpin_tier_{name}"]
        assert sample.name == f"asyncpin_tier_{name}_total" and sample.labels == {}
        out[name] = sample.value
    for name in GAUGES:
        samples = families[f"asyncpin_tier_{name}"]
        assert len(samples) <= 1, samples
        out[name] = samples[0].value if samples else None
    return out


def policy_of(registry: CollectorRegistry) -> str:
    (info,) = scrape(registry)["asyncpin_tier_info"]
    assert info.name == "asyncpin_tier_info" and info.value == 1
    return info.labels["policy"]


def expected(stats: TierStats) -> dict[str, float | None]:
    values: dict[str, float | None] = {name: getattr(stats, name) for name in COUNTERS}
    values.update({name: getattr(stats, name) for name in GAUGES[:-1]})
    values["host_blocks"] = stats.num_host_blocks
    return values


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    yield CollectorRegistry()


async def test_counts_after_real_operations(registry: CollectorRegistry) -> None:
    engines, make = engines_made(FlakyEngine)

    layout = _layout()
    host_block_bytes = layout.host_block_bytes
    assert host_block_bytes == 2 * BLOCK_BYTES
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(
            layout, HOST_BLOCKS, backend=FakeBackend(), engine=make
        ) as mgr:
            await mgr.pinned
            (engine,) = engines
            tier = KVTier(mgr, policy="lru")
            registry.register(TierCollector(tier))
            registry.register(OffloadCollector(mgr))  # both on one registry: no collision

            def check(**want: int) -> TierStats:
                s = tier.stats()
                zero = dict.fromkeys(
                    (*COUNTERS, "resident_blocks"), 0
                )  # what is not named is still 0
                assert {k: getattr(s, k) for k in zero} == {**zero, **want}, s
                assert s.free_blocks + s.resident_blocks == HOST_BLOCKS  # nothing in flight
                assert s.resident_bytes == s.resident_blocks * host_block_bytes
                assert (s.policy, s.num_host_blocks, s.host_block_bytes) == (
                    "lru",
                    HOST_BLOCKS,
                    host_block_bytes,
                )
                assert tier_metrics(registry) == expected(s)
                return s

            s = check()
            assert s.free_blocks == HOST_BLOCKS and s.hit_rate == 0.0
            assert policy_of(registry) == "lru"

            await tier.store([1, 2, 3], [1, 2, 3]).transfer
            check(stores=1, stored_blocks=3, resident_blocks=3)

            assert tier.lookup([1, 2, 9]) == 2  # a hit of 2, then a miss
            assert tier.lookup([9, 1]) == 0  # a miss at the first hash
            s = check(
                stores=1,
                stored_blocks=3,
                resident_blocks=3,
                lookups=2,
                looked_up_blocks=5,
                hit_blocks=2,
            )
            assert s.hit_rate == 2 / 5

            # 1 is present; 4 takes the free block; 5 evicts 2 (least recent, 1 is kept).
            again = tier.store([1, 4, 5], [1, 4, 5])
            await again.transfer
            assert again.plan.present == (1,) and again.plan.hashes == (4, 5)
            assert tier.lookup([2]) == 0
            counts = dict(lookups=3, looked_up_blocks=6, hit_blocks=2)
            check(stores=2, stored_blocks=5, evicted_blocks=1, resident_blocks=4, **counts)

            # Every block is being loaded (nothing awaited yet): a store has no room.
            loading = tier.load([1, 3, 4, 5], [8, 9, 10, 11])
            full = tier.store([6], [6])
            assert full.skipped == (6,)
            await full.transfer
            await loading
            assert bool((layout.arrays[0][8:12] == torch.tensor([1, 3, 4, 5])[:, None]).all())
            counts.update(stores=3, stored_blocks=5, evicted_blocks=1, skipped_blocks=1)
            check(resident_blocks=4, **counts)

            # A failed copy: its block is evicted for it, then freed; nothing is indexed.
            engine.fail_next_store = True
            failed = tier.store([7], [7])
            with pytest.raises(TransferError, match="the copy failed"):
                await failed.transfer
            assert tier.lookup([7]) == 0
            counts.update(stores=4, evicted_blocks=2, failed_blocks=1, lookups=4)
            counts.update(looked_up_blocks=7)
            check(resident_blocks=3, **counts)

            assert tier.remove([3, 42]) == 1
            counts.update(removed_blocks=1)
            check(resident_blocks=2, **counts)

            # A subscriber that reads nothing, with room for one event: the second drops.
            with tier.subscribe(max_buffer=1):
                await tier.store([8, 9], [8, 9]).transfer
            counts.update(stores=5, stored_blocks=7, dropped_events=1)
            s = check(resident_blocks=4, **counts)
            assert s.resident_bytes == 4 * host_block_bytes

            tier.clear()
            counts.update(removed_blocks=5)
            check(**counts)


async def test_a_bare_index_without_and_with_the_block_size(
    registry: CollectorRegistry,
) -> None:
    index = BlockIndex(3, policy="s3fifo")
    registry.register(TierCollector(index))
    sized = CollectorRegistry()
    sized.register(TierCollector(index, host_block_bytes=4096))
    plan = index.begin_store([b"a", b"b"])
    in_flight = tier_metrics(registry)
    assert (in_flight["stores"], in_flight["resident_blocks"], in_flight["free_blocks"]) == (
        1,
        0,
        1,
    )
    index.end_store(plan, ok=True)
    failed = index.begin_store([b"c", b"d"])  # c takes the free block, d evicts a
    index.end_store(failed, ok=False)
    index.lookup([b"b", b"a"])
    got = tier_metrics(registry)
    assert got == {
        "lookups": 1,
        "looked_up_blocks": 2,
        "hit_blocks": 1,
        "stores": 2,
        "stored_blocks": 2,
        "skipped_blocks": 0,
        "failed_blocks": 2,
        "evicted_blocks": 1,
        "removed_blocks": 0,
        "dropped_events": 0,
        "resident_blocks": 1,
        "resident_bytes": None,  # no block size: no sample
        "free_blocks": 2,
        "host_blocks": 3,
    }
    assert tier_metrics(sized) == {**got, "resident_bytes": 4096}
    assert policy_of(registry) == "s3fifo"
    assert TierStats.from_index(index).resident_bytes is None


async def test_collector_arguments() -> None:
    index = BlockIndex(2)
    for bad in (0, -1, True, 1.5, "4096"):
        with pytest.raises(ValueError, match="host_block_bytes"):
            TierCollector(index, host_block_bytes=bad)  # type: ignore[arg-type]
    async with OffloadManager.for_kv(_layout(), HOST_BLOCKS, backend=FakeBackend()) as mgr:
        tier = KVTier(mgr)
        with pytest.raises(ValueError, match="KVTier knows its own"):
            TierCollector(tier, host_block_bytes=128)
        assert TierCollector(tier).stats() == tier.stats()


def test_stats_reads_counters_and_never_walks_the_entries() -> None:
    """resident_blocks is kept as blocks come and go: stats() is O(1)."""

    class Unwalkable(dict[Any, Any]):
        def values(self) -> NoReturn:
            raise AssertionError("stats() walked the entries")

        def items(self) -> NoReturn:
            raise AssertionError("stats() walked the entries")

        def __iter__(self) -> NoReturn:
            raise AssertionError("stats() walked the entries")

    index = BlockIndex(8)
    index.end_store(index.begin_store(list(range(5))), ok=True)
    index._entries = Unwalkable(index._entries)
    s = index.stats()
    assert (s.resident_blocks, s.free_blocks) == (5, 3)


class TestCollectorInput:
    """A TierCollector reads a tier or an index, and one registry takes one of them."""

    @pytest.mark.parametrize("source", [None, object(), 16], ids=repr)
    def test_anything_else_is_refused_at_once(self, source: object) -> None:
        with pytest.raises(ConfigError, match="KVTier or a BlockIndex"):
            TierCollector(source)  # type: ignore[arg-type]

    def test_a_second_collector_on_one_registry_is_refused(self) -> None:
        registry = CollectorRegistry()
        registry.register(TierCollector(BlockIndex(4)))
        with pytest.raises(ValueError, match="Duplicated"):
            registry.register(TierCollector(BlockIndex(8)))
