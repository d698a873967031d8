"""Prometheus metrics for an OffloadManager and a KV tier (the optional extra
``asyncpin[metrics]``).

``import asyncpin`` never imports this module nor prometheus-client; importing it without
prometheus-client installed raises an ImportError that says what to install. It imports
no torch itself: :class:`TierCollector` over a bare block index runs in a scheduler
process without it.

::

    registry.register(OffloadCollector(mgr))   # before `async with mgr` to see every transfer
    registry.register(TierCollector(tier))     # a KVTier over that manager

    # an engine's scheduler process, with the index alone (no manager, no torch):
    registry.register(TierCollector(index, host_block_bytes=layout_host_block_bytes))

Two collectors, one a source: a process that has both a manager and a tier registers
both, and a scheduler process with only the index registers the tier's alone. A registry
takes one of each (the metric names would collide): for several tiers, use a registry
each.

**Manager** (``OffloadCollector``).

Everything but the transfer counters is read from ``mgr.stats()`` at scrape time. The
counters by direction and path, the transfer bytes and the latency histogram are kept by
an observer the collector adds to the manager (``add_transfer_observer``): they count the
transfers that finish after the collector was made.

Gauges: ``asyncpin_region_bytes`` and ``asyncpin_pinned_bytes`` (size of the region,
bytes pinned now), ``asyncpin_faulted_bytes`` (bytes faulted in: pinning begins once
all are), ``asyncpin_region_chunks``, ``asyncpin_pinned_chunks``,
``asyncpin_leaked_chunks`` (left mapped because their unpin failed), ``asyncpin_pinned``
(1 while every chunk is pinned), ``asyncpin_pin_failed`` (1 if pinning or the engine's
set-up failed: the manager will not be ready),
``asyncpin_transfers_in_flight``; in seconds: ``asyncpin_enter_seconds``,
``asyncpin_time_to_pinned_seconds``, ``asyncpin_slowest_pin_seconds`` (one pin call),
``asyncpin_unpin_seconds`` and ``asyncpin_close_seconds`` (no sample until known).

Counters: ``asyncpin_transfers_submitted_total{direction}`` (stores and loads accepted),
``asyncpin_transfers_waited_for_pinning_total``, ``asyncpin_transfers_total{direction,
path, outcome}`` (finished), ``asyncpin_transfer_bytes_total{direction, path}``.

Histogram: ``asyncpin_transfer_seconds{direction, path}``, from submission to completion.
Info: ``asyncpin_manager_info{backend, backing, hugepages}``.

``direction`` is ``store`` or ``load``; ``path`` is ``pinned`` or ``pageable`` (a
transfer that went through pageable memory because its chunks were not pinned yet);
``outcome`` is ``ok`` or ``failed``. Bytes and latency count successful transfers only.

**Tier** (``TierCollector``), read from ``tier.stats()`` (a :class:`~asyncpin.TierStats`)
at scrape time, every value O(1) to read. Counters, since the index was made:
``asyncpin_tier_lookups_total`` (``lookup`` calls), ``asyncpin_tier_looked_up_blocks_total``
and ``asyncpin_tier_hit_blocks_total`` (hashes looked up, and found: their ratio is the
hit rate), ``asyncpin_tier_stores_total`` (``store`` / ``begin_store`` calls),
``asyncpin_tier_stored_blocks_total`` (blocks made loadable),
``asyncpin_tier_skipped_blocks_total`` (hashes a store left out: every block in use by a
copy), ``asyncpin_tier_failed_blocks_total`` (blocks of failed or cancelled copies, freed),
``asyncpin_tier_evicted_blocks_total``, ``asyncpin_tier_removed_blocks_total`` (by
``remove`` and ``clear``), ``asyncpin_tier_dropped_events_total`` (events a subscriber's
full buffer lost; 0 for a bare index). Gauges: ``asyncpin_tier_resident_blocks``,
``asyncpin_tier_resident_bytes`` (no sample for a bare index without
``host_block_bytes``), ``asyncpin_tier_free_blocks``, ``asyncpin_tier_host_blocks`` (the
capacity). Info: ``asyncpin_tier_info{policy}``.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from asyncpin._text import shown
from asyncpin.errors import ConfigError
from asyncpin.stats import TierStats
from asyncpin.tier.index import BlockIndex

try:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
    )
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "asyncpin.metrics needs prometheus-client: pip install 'asyncpin[metrics]'"
    ) from exc

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from asyncpin.manager import OffloadManager
    from asyncpin.tier import KVTier
    from asyncpin.tier.remote import RemoteStats
    from asyncpin.transfers import Transfer

__all__ = ["DEFAULT_LATENCY_BUCKETS", "OffloadCollector", "TierCollector"]

# From a host copy of a few blocks (tens of µs) to a transfer that waited for its chunks
# to be pinned (seconds).
DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class _Histogram:
    """Bucket counts of one label set (not cumulative; summed at scrape)."""

    __slots__ = ("counts", "sum")

    def __init__(self, nbuckets: int) -> None:
        self.counts = [0] * (nbuckets + 1)  # the last one is +Inf
        self.sum = 0.0


class OffloadCollector(Collector):
    """A Prometheus collector over ``mgr.stats()`` and the manager's finished transfers.

    Register it on a ``CollectorRegistry``; it holds no other resource and needs no
    closing. Scraping is safe from any thread (the transfer counts are kept under a
    lock); ``stats()`` is a snapshot, so a scrape from another thread than the event
    loop's may see one field a moment older than another.
    """

    def __init__(
        self, manager: OffloadManager, *, buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS
    ) -> None:
        bounds = sorted(float(b) for b in buckets if b != math.inf)
        if (
            not bounds
            or len(set(bounds)) != len(bounds)
            or not all(0 < b < math.inf for b in bounds)  # NaN fails both
        ):
            raise ValueError(f"buckets must be distinct positive numbers, got {shown(buckets)}")
        self._manager = manager
        self._bounds = tuple(bounds)
        self._lock = threading.Lock()
        self._transfers: dict[tuple[str, str, str], int] = {}
        self._bytes: dict[tuple[str, str], int] = {}
        self._latency: dict[tuple[str, str], _Histogram] = {}
        manager.add_transfer_observer(self._observe)

    def _observe(self, transfer: Transfer) -> None:
        outcome = "ok" if transfer.error is None else "failed"
        key = (transfer.direction, transfer.path)
        with self._lock:
            counted = (*key, outcome)
            self._transfers[counted] = self._transfers.get(counted, 0) + 1
            if transfer.error is not None or transfer.elapsed_s is None:
                return
            self._bytes[key] = self._bytes.get(key, 0) + transfer.nbytes
            histogram = self._latency.get(key)
            if histogram is None:
                histogram = self._latency[key] = _Histogram(len(self._bounds))
            histogram.counts[bisect.bisect_left(self._bounds, transfer.elapsed_s)] += 1
            histogram.sum += transfer.elapsed_s

    def collect(self) -> Iterator[Metric]:
        s = self._manager.stats()

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"asyncpin_{name}", doc)
            if value is not None:
                family.add_metric([], value)
            return family

        info = InfoMetricFamily(
            "asyncpin_manager", "How the manager was configured", labels=["backend", "backing"]
        )
        info.add_metric([s.backend, s.backing], {"hugepages": s.hugepages})
        yield info
        yield gauge("region_bytes", "Size of the host region in bytes", s.nbytes)
        yield gauge("pinned_bytes", "Bytes of the region pinned now", s.pinned_bytes)
        yield gauge(
            "faulted_bytes",
            "Bytes of the region faulted in (pinning begins once all are)",
            s.faulted_bytes,
        )
        yield gauge("region_chunks", "Chunks of the region", s.chunks_total)
        yield gauge("pinned_chunks", "Chunks pinned now", s.chunks_pinned)
        yield gauge(
            "leaked_chunks", "Chunks left mapped because their unpin failed", s.chunks_leaked
        )
        every_chunk = s.chunks_total > 0 and s.chunks_pinned == s.chunks_total
        yield gauge("pinned", "1 while every chunk is pinned", float(every_chunk))
        yield gauge(
            "pin_failed",
            "1 if pinning or the engine's set-up failed",
            float(s.error is not None),
        )
        yield gauge("enter_seconds", "Seconds the manager took to enter", s.seconds_to_enter)
        yield gauge(
            "time_to_pinned_seconds",
            "Seconds from entering to every chunk pinned",
            s.seconds_to_pinned,
        )
        yield gauge(
            "slowest_pin_seconds", "Seconds of the longest single pin call", s.slowest_pin_seconds
        )
        yield gauge("unpin_seconds", "Seconds the unpins at close took", s.unpin_seconds)
        yield gauge("close_seconds", "Seconds aclose() took", s.close_seconds)

        submitted = CounterMetricFamily(
            "asyncpin_transfers_submitted", "Transfers accepted", labels=["direction"]
        )
        submitted.add_metric(["store"], s.transfers_stored)
        submitted.add_metric(["load"], s.transfers_loaded)
        yield submitted
        waited = CounterMetricFamily(
            "asyncpin_transfers_waited_for_pinning",
            "Transfers that waited for their host chunks to be pinned",
        )
        waited.add_metric([], s.transfers_waited_for_pinning)
        yield waited
        yield gauge("transfers_in_flight", "Transfers not finished yet", s.transfers_in_flight)

        transfers = CounterMetricFamily(
            "asyncpin_transfers",
            "Transfers finished, by direction, path and outcome",
            labels=["direction", "path", "outcome"],
        )
        moved = CounterMetricFamily(
            "asyncpin_transfer_bytes",
            "Bytes moved by successful transfers",
            labels=["direction", "path"],
        )
        latency = HistogramMetricFamily(
            "asyncpin_transfer_seconds",
            "Seconds from submission to completion of successful transfers",
            labels=["direction", "path"],
        )
        with self._lock:
            for labels, count in sorted(self._transfers.items()):
                transfers.add_metric(list(labels), count)
            for key, nbytes in sorted(self._bytes.items()):
                moved.add_metric(list(key), nbytes)
            for key, histogram in sorted(self._latency.items()):
                cumulative, buckets = 0, []
                for bound, count in zip((*self._bounds, math.inf), histogram.counts, strict=True):
                    cumulative += count
                    buckets.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
                latency.add_metric(list(key), buckets, histogram.sum)
        yield transfers
        yield moved
        yield latency

    def __repr__(self) -> str:
        with self._lock:
            finished = sum(self._transfers.values())
        return f"<OffloadCollector {self._manager!r} transfers_seen={finished}>"


class TierCollector(Collector):
    """A Prometheus collector over a KV tier's counters (``tier.stats()``), or over a bare
    :class:`~asyncpin.tier.index.BlockIndex` (an engine's scheduler process, which has no
    manager): pass the size of one host block as ``host_block_bytes`` there to export
    ``asyncpin_tier_resident_bytes`` (a :class:`~asyncpin.tier.KVTier` knows its own).

    It holds nothing but the reference and needs no closing. Scraping is safe from any
    thread; a scrape from another thread than the event loop's may see one counter a
    moment older than another.
    """

    def __init__(self, tier: KVTier | BlockIndex, *, host_block_bytes: int | None = None) -> None:
        from asyncpin.tier import KVTier  # no torch: see asyncpin.tier

        if isinstance(tier, BlockIndex):
            if host_block_bytes is not None and (
                isinstance(host_block_bytes, bool)
                or not isinstance(host_block_bytes, int)
                or host_block_bytes < 1
            ):
                raise ConfigError(
                    f"host_block_bytes must be an int >= 1 or None, got {shown(host_block_bytes)}"
                )
        elif not isinstance(tier, KVTier):
            raise ConfigError(f"a TierCollector reads a KVTier or a BlockIndex, not {tier!r}")
        elif host_block_bytes is not None:
            raise ConfigError("host_block_bytes is for a bare BlockIndex: a KVTier knows its own")
        self._source = tier
        self._host_block_bytes = host_block_bytes

    def stats(self) -> TierStats:
        """What a scrape reads."""
        source = self._source
        if isinstance(source, BlockIndex):
            return TierStats.from_index(source, host_block_bytes=self._host_block_bytes)
        return source.stats()

    def describe(self) -> Iterator[Metric]:
        """The metrics' names, so that a registry refuses a second collector of them
        (two tiers on one registry would export the same names twice)."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        info = InfoMetricFamily("asyncpin_tier", "The KV tier's eviction policy")
        info.add_metric([], {"policy": s.policy})
        yield info
        for name, doc, count in (
            ("lookups", "Lookups of block hashes", s.lookups),
            ("looked_up_blocks", "Block hashes looked up", s.looked_up_blocks),
            ("hit_blocks", "Block hashes looked up and found loadable", s.hit_blocks),
            ("stores", "Stores of block hashes", s.stores),
            ("stored_blocks", "Blocks whose store completed: loadable", s.stored_blocks),
            (
                "skipped_blocks",
                "Block hashes a store left out: every host block in use by a copy",
                s.skipped_blocks,
            ),
            (
                "failed_blocks",
                "Blocks of stores that failed or were cancelled: freed, never loadable",
                s.failed_blocks,
            ),
            ("evicted_blocks", "Loadable blocks evicted to make room", s.evicted_blocks),
            ("removed_blocks", "Loadable blocks removed or cleared", s.removed_blocks),
            (
                "dropped_events",
                "Block events a subscriber's full buffer dropped",
                s.dropped_events,
            ),
        ):
            yield CounterMetricFamily(f"asyncpin_tier_{name}", doc, value=count)
        for name, doc, value in (
            ("resident_blocks", "Loadable blocks on the host", s.resident_blocks),
            ("resident_bytes", "Bytes of the loadable blocks on the host", s.resident_bytes),
            ("free_blocks", "Host blocks neither indexed nor used by a copy", s.free_blocks),
            ("host_blocks", "Host blocks the tier manages", s.num_host_blocks),
        ):
            family = GaugeMetricFamily(f"asyncpin_tier_{name}", doc)
            if value is not None:
                family.add_metric([], value)
            yield family
        if s.remote is not None:
            yield from _remote_metrics(s.remote)

    def __repr__(self) -> str:
        return f"<TierCollector {self._source!r}>"


def _remote_metrics(r: RemoteStats) -> Iterator[Metric]:
    """A tier's remote counters: ``asyncpin_tier_remote_*``."""
    for name, doc, count in (
        ("looked_up_blocks", "Blocks looked for on the remote tier (host misses)", r.lookups),
        ("hit_blocks", "Of those, found there with a valid value", r.hit_blocks),
        ("missed_blocks", "Of those, not found, not valid, or the server failed", r.missed_blocks),
        ("fetched_blocks", "Blocks fetched into host blocks", r.fetched_blocks),
        ("fetched_bytes", "Bytes fetched into host blocks", r.fetched_bytes),
        ("written_blocks", "Blocks written to the remote tier", r.written_blocks),
        ("written_bytes", "Bytes written to the remote tier", r.written_bytes),
        (
            "dropped_blocks",
            "Blocks not written: queue full, or cut short at close",
            r.dropped_blocks,
        ),
        (
            "skipped_blocks",
            "Blocks not written: they left the host before their turn",
            r.skipped_blocks,
        ),
        ("failed_writes", "Blocks whose write the server failed", r.failed_writes),
        ("errors", "Operations the server failed (refused, timed out, full)", r.errors),
    ):
        counter = CounterMetricFamily(f"asyncpin_tier_remote_{name}", doc)
        counter.add_metric([], count)
        yield counter
    invalid = CounterMetricFamily(
        "asyncpin_tier_remote_invalid_blocks",
        "Values that were not data (truncated, corrupted, foreign, stale), by reason",
        labels=["reason"],
    )
    for reason, count in sorted(r.invalid_by_reason.items()):
        invalid.add_metric([reason], count)
    yield invalid
    for name, doc, value in (
        ("degraded", "1 while the remote tier's server fails", int(r.degraded)),
        ("queued_blocks", "Blocks waiting to be written", r.queued_blocks),
    ):
        gauge = GaugeMetricFamily(f"asyncpin_tier_remote_{name}", doc)
        gauge.add_metric([], value)
        yield gauge
