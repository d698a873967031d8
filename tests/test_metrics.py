"""The Prometheus collector (asyncpin.metrics) and the manager's transfer observer."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator

import anyio
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from structlog.testing import capture_logs

from asyncpin import OffloadManager, PinError, Transfer, TransferError
from asyncpin.engines.host import HostTransferEngine
from asyncpin.metrics import DEFAULT_LATENCY_BUCKETS, OffloadCollector
from asyncpin.testing import FakeBackend
from asyncpin.transfers import TransferJob
from tests.helpers import TIMEOUT_S, wait_thread_event
from tests.kit import small_kv

CHUNK = 64 << 10
NCHUNKS = 8


def scrape(registry: CollectorRegistry) -> dict[str, list[Sample]]:
    """The registry's text exposition, parsed back: samples by family name."""
    text = generate_latest(registry).decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(
    families: dict[str, list[Sample]], family: str, sample: str | None = None, **labels: str
) -> float:
    """The one sample of ``family`` named ``sample`` (the family's name by default) whose
    labels include ``labels``."""
    name = sample or family
    found = [
        s.value for s in families[family] if s.name == name and labels.items() <= s.labels.items()
    ]
    assert len(found) == 1, f"{name}{labels}: {families[family]}"
    return found[0]


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    yield CollectorRegistry()


class TestPinningMetrics:
    """Gauges follow stats(): region and pinned bytes, chunks, readiness, durations."""

    async def test_before_during_and_after_pinning(self, registry: CollectorRegistry) -> None:
        fake = FakeBackend(stall_pin_at=3)
        mgr = OffloadManager(CHUNK * NCHUNKS, backend=fake, chunk_bytes=CHUNK, prefault_threads=1)
        registry.register(OffloadCollector(mgr))
        before = scrape(registry)
        assert value(before, "asyncpin_pinned_bytes") == 0
        assert value(before, "asyncpin_faulted_bytes") == 0
        assert value(before, "asyncpin_pinned") == 0
        assert before["asyncpin_time_to_pinned_seconds"] == []
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                try:
                    await wait_thread_event(fake.stalled)
                    during = scrape(registry)
                    assert value(during, "asyncpin_region_bytes") == CHUNK * NCHUNKS
                    assert value(during, "asyncpin_region_chunks") == NCHUNKS
                    assert value(during, "asyncpin_pinned_chunks") == 3
                    assert value(during, "asyncpin_pinned_bytes") == 3 * CHUNK
                    # Every chunk was faulted in before the first pin call.
                    assert value(during, "asyncpin_faulted_bytes") == CHUNK * NCHUNKS
                    assert value(during, "asyncpin_pinned") == 0
                    assert value(during, "asyncpin_enter_seconds") >= 0
                    assert during["asyncpin_time_to_pinned_seconds"] == []
                finally:
                    fake.release()
                await mgr.pinned
                after = scrape(registry)
                assert value(after, "asyncpin_pinned_bytes") == mgr.nbytes
                assert value(after, "asyncpin_pinned_chunks") == NCHUNKS
                assert value(after, "asyncpin_pinned") == 1
                assert value(after, "asyncpin_pin_failed") == 0
                assert value(after, "asyncpin_time_to_pinned_seconds") > 0
                assert value(after, "asyncpin_manager_info", backend="fake", backing="anonymous")
                assert after["asyncpin_close_seconds"] == []
        closed = scrape(registry)
        assert value(closed, "asyncpin_pinned_bytes") == 0
        assert value(closed, "asyncpin_pinned") == 0
        assert value(closed, "asyncpin_close_seconds") >= 0
        assert value(closed, "asyncpin_unpin_seconds") >= 0
        assert value(closed, "asyncpin_leaked_chunks") == 0

    async def test_failed_pinning(self, registry: CollectorRegistry) -> None:
        mgr = OffloadManager(
            CHUNK * NCHUNKS,
            backend=FakeBackend(fail_pin_at=2),
            chunk_bytes=CHUNK,
            prefault_threads=1,
        )
        registry.register(OffloadCollector(mgr))
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                with pytest.raises(PinError, match="injected failure"):
                    await mgr.pinned
                families = scrape(registry)
        assert value(families, "asyncpin_pin_failed") == 1
        assert value(families, "asyncpin_pinned") == 0
        assert value(families, "asyncpin_pinned_chunks") == 2


class TestTransferMetrics:
    """Transfers are counted by direction, path and outcome, with bytes and latency."""

    async def test_counts_bytes_and_latency_by_direction_and_path(
        self, registry: CollectorRegistry, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        blocks_per_chunk = CHUNK // layout.host_block_bytes
        fake = FakeBackend(stall_pin_at=1)
        mgr = OffloadManager.for_kv(
            layout,
            2 * blocks_per_chunk,
            backend=fake,
            chunk_bytes=CHUNK,
            prefault_threads=1,
            unpinned_policy="pageable",
        )
        registry.register(OffloadCollector(mgr))
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                try:
                    await wait_thread_event(fake.stalled)
                    # Chunk 0 is pinned; chunk 1 (the second half of the blocks) is not yet.
                    await mgr.store([0, 1], [0, 1])
                    await mgr.store([2], [blocks_per_chunk])
                    await mgr.load([0, 1, blocks_per_chunk], [3, 4, 5])
                finally:
                    fake.release()
                await mgr.pinned
                await mgr.load([0], [6])
                stats = mgr.stats()
                families = scrape(registry)
        size = layout.host_block_bytes
        transfers = "asyncpin_transfers"
        for direction, path, count in (
            ("store", "pinned", 1),
            ("store", "pageable", 1),
            ("load", "pinned", 1),
            ("load", "pageable", 1),
        ):
            labels = {"direction": direction, "path": path, "outcome": "ok"}
            assert value(families, transfers, f"{transfers}_total", **labels) == count
        moved = "asyncpin_transfer_bytes"
        assert value(families, moved, f"{moved}_total", direction="store", path="pinned") == (
            2 * size
        )
        assert value(families, moved, f"{moved}_total", direction="load", path="pageable") == (
            3 * size
        )
        stored = sum(
            s.value
            for s in families[moved]
            if s.name == f"{moved}_total" and s.labels["direction"] == "store"
        )
        assert stored == stats.bytes_stored
        submitted = "asyncpin_transfers_submitted"
        assert value(families, submitted, f"{submitted}_total", direction="store") == 2
        assert value(families, submitted, f"{submitted}_total", direction="load") == 2
        assert value(families, "asyncpin_transfers_in_flight") == 0
        latency = "asyncpin_transfer_seconds"
        for direction in ("store", "load"):
            for path in ("pinned", "pageable"):
                labels = {"direction": direction, "path": path}
                assert value(families, latency, f"{latency}_count", **labels) == 1
                assert value(families, latency, f"{latency}_bucket", le="+Inf", **labels) == 1
                assert value(families, latency, f"{latency}_sum", **labels) > 0
                buckets = [
                    s.value
                    for s in families[latency]
                    if s.name == f"{latency}_bucket" and labels.items() <= s.labels.items()
                ]
                assert len(buckets) == len(DEFAULT_LATENCY_BUCKETS) + 1
                assert buckets == sorted(buckets), "buckets are cumulative"

    async def test_failed_transfer_is_counted_as_failed(
        self, registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
    ) -> None:
        def broken(engine: HostTransferEngine, job: TransferJob) -> None:
            raise RuntimeError("copy broke")

        monkeypatch.setattr(HostTransferEngine, "_copy", broken)
        mgr = OffloadManager.for_kv(small_kv(gen), 8, backend=FakeBackend(), chunk_bytes=CHUNK)
        registry.register(OffloadCollector(mgr))
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                await mgr.pinned
                with pytest.raises(TransferError, match="copy broke"):
                    await mgr.store([0], [0])
                families = scrape(registry)
        transfers = "asyncpin_transfers"
        labels = {"direction": "store", "path": "pinned", "outcome": "failed"}
        assert value(families, transfers, f"{transfers}_total", **labels) == 1
        assert families["asyncpin_transfer_bytes"] == []
        assert families["asyncpin_transfer_seconds"] == []

    def test_buckets_must_be_positive_and_distinct(self) -> None:
        mgr = OffloadManager(CHUNK, backend=FakeBackend())
        for buckets in ([], [0.1, 0.1], [-1.0, 1.0], [math.nan, 0.5], [-math.inf, 1.0]):
            with pytest.raises(ValueError, match="buckets"):
                OffloadCollector(mgr, buckets=buckets)


class TestTransferObserver:
    """add_transfer_observer sees every finished transfer; a failing observer is contained."""

    async def test_observer_sees_finished_transfers_and_its_errors_are_logged(
        self, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        mgr = OffloadManager.for_kv(layout, 8, backend=FakeBackend(), chunk_bytes=CHUNK)
        seen: list[tuple[str, bool, float | None]] = []

        def observe(transfer: Transfer) -> None:
            seen.append((transfer.direction, transfer.done(), transfer.elapsed_s))

        def broken(transfer: Transfer) -> None:
            raise RuntimeError("observer broke")

        mgr.add_transfer_observer(broken)
        mgr.add_transfer_observer(observe)
        with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
            async with mgr:
                await mgr.pinned
                await mgr.store([0], [1])
                await mgr.load([1], [2])
                assert mgr.stats().transfers_failed == 0
        assert [(d, done) for d, done, _ in seen] == [("store", True), ("load", True)]
        assert all(elapsed is not None and elapsed >= 0 for _, _, elapsed in seen)
        failures = [e for e in logs if e["event"] == "transfer.observer_failed"]
        assert len(failures) == 2
        assert "observer broke" in failures[0]["error"]


class TestOptionalDependencies:
    """The core imports neither prometheus-client nor the server's packages."""

    def test_import_asyncpin_needs_no_extra(self) -> None:
        code = (
            "import sys, asyncpin\n"
            "extra = {'prometheus_client', 'starlette', 'uvicorn'} & set(sys.modules)\n"
            "assert not extra, extra\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
