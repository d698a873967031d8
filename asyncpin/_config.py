"""A manager's configuration: every argument checked once, here, into a frozen value."""

from __future__ import annotations

import math
import numbers
import operator
import os
from dataclasses import dataclass
from typing import Any, Literal

from asyncpin import _sys
from asyncpin._mapping import HUGE_PAGE
from asyncpin._text import shown
from asyncpin.abc import EngineFactory
from asyncpin.engines import check_engine_choice, engine_factory
from asyncpin.errors import ConfigError
from asyncpin.kv import KVLayout
from asyncpin.region import (
    Backing,
    HugePages,
    validate_nbytes,
    validate_region_options,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_THREADS",
    "ManagerConfig",
    "UnpinnedPolicy",
    "check_num_host_blocks",
    "default_chunk_bytes",
    "default_prefault_threads",
]

# Measured on the H200 with registrations in torch's context (bench/RESULTS.md#pinning-h200):
# 16 MiB chunks keep each cudaHostRegister short enough that a concurrent 24 ms GPU step
# stretches by ~15% at most, at full pinning speed; 256 MiB chunks stretched it 2.6x.
DEFAULT_CHUNK_BYTES = 16 << 20
# A larger region gets larger chunks by default (``default_chunk_bytes``).
_MAX_DEFAULT_CHUNKS = 1024
_MAX_DEFAULT_CHUNK_BYTES = 64 << 20


def default_chunk_bytes(nbytes: int) -> int:
    """The chunk size when none is given: 16 MiB, and for a region over 16 GiB as much as
    keeps it to 1024 chunks, up to 64 MiB (a multiple of 2 MiB). Chosen (on the H200)
    when chunks were registered in torch's context, as ``CudaBackend(own_context=False)``
    still does: there each unregister at close waits for the whole device to go idle, so
    fewer chunks stall a running model less and close sooner (64 GiB: 2.8 s in 1024
    chunks against 7.2 s in 4096), and a larger chunk holds up other threads' launches
    longer while it is registered (about 1 ms per 16 MiB), which is why it stays bounded.
    From the backend's own context (the default) neither happens; 64 GiB in 1024 chunks
    closed in 1.8-2.0 s there (bench/RESULTS.md#startup). 100 GiB in 16 MiB chunks was
    pinned later than in 64 MiB ones in three of five runs (11.9-13.5 s against
    7.1-11.4 s: four times the calls, about 1 ms each), so the default stayed (runs
    106-110)."""
    per_chunk = -(-nbytes // _MAX_DEFAULT_CHUNKS)
    chunk = min(max(DEFAULT_CHUNK_BYTES, per_chunk), _MAX_DEFAULT_CHUNK_BYTES)
    return -(-chunk // HUGE_PAGE) * HUGE_PAGE


# Bound on prefault_threads and pin_threads: each is an OS thread, and page faulting
# stops scaling long before this (and the defaults stay at 8 and 1).
MAX_THREADS = 64

UnpinnedPolicy = Literal["wait", "pageable"]


def default_prefault_threads() -> int:
    """Up to 8 fault threads, always leaving one core to the event loop: on a 2-core VM,
    2 threads faulting cold huge pages stalled the loop for ~0.5 s
    (bench/RESULTS.md#pinning-host). Fewer on the H200 (16 cores) only made start-up
    longer: 64 GiB was ready in 5.4 s with 4 and 7.1 s with 2, against 3.1 s with 8
    (run 146, bench/RESULTS.md#startup)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, (cores or 1) - 1))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_num_host_blocks(value: Any) -> int:
    """``value`` as an int (any integer type, NumPy's too, as block ids take them; never a
    bool or a tensor), or ConfigError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"num_host_blocks must be an int >= 1, got {shown(value)}")
    # The int it is, whatever an int subclass's comparisons say.
    count = int.__index__(value) if isinstance(value, int) else operator.index(value)
    if count < 1:
        raise ConfigError(f"num_host_blocks must be an int >= 1, got {shown(value)}")
    return count


def _check_threads(knob: str, value: Any) -> int:
    if not _is_int(value) or not 1 <= value <= MAX_THREADS:
        raise ConfigError(
            f"{knob} must be an int >= 1 and <= {MAX_THREADS} (each is a thread), "
            f"got {shown(value)}"
        )
    return int(value)


def _check_chunk_bytes(chunk_bytes: Any, hugepages: HugePages) -> int:
    if hugepages == "hugetlb" and _is_int(chunk_bytes) and chunk_bytes % HUGE_PAGE:
        raise ConfigError(
            f"chunk_bytes={chunk_bytes} must be a multiple of 2 MiB with hugepages='hugetlb' "
            "(huge pages cannot be split between chunks)"
        )
    if not _is_int(chunk_bytes) or chunk_bytes <= 0 or chunk_bytes % _sys.PAGE_SIZE:
        raise ConfigError(
            f"chunk_bytes={shown(chunk_bytes)} must be a positive multiple of the page size "
            f"({_sys.PAGE_SIZE})"
        )
    return int(chunk_bytes)


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """What a manager was asked for, validated. ``nbytes`` is 0 for an attacher (it
    learns the region's size when it enters)."""

    nbytes: int
    backing: Backing
    name: str | None
    chunk_bytes: int
    prefault_threads: int
    pin_threads: int
    pin_interval_s: float
    hugepages: HugePages
    kv_layout: KVLayout | None
    num_host_blocks: int
    unpinned_policy: UnpinnedPolicy
    engine: str | EngineFactory
    attach: bool
    #: (rank, ranks): this manager's part of host blocks that ``ranks`` managers share.
    host_slice: tuple[int, int] = (0, 1)
    #: No chunk_bytes was given: an attacher sizes chunks from the region it finds.
    chunk_default: bool = False

    @property
    def host_block_stride(self) -> int:
        """Bytes from one host block to the next in the region (every rank's part)."""
        layout = self.kv_layout
        return 0 if layout is None else layout.host_block_bytes * self.host_slice[1]

    @classmethod
    def validated(
        cls,
        nbytes: int,
        *,
        backing: Backing,
        name: str | None,
        chunk_bytes: int | None,
        prefault_threads: int | None,
        pin_threads: int,
        pin_interval_s: float,
        hugepages: HugePages,
        kv_layout: KVLayout | None,
        num_host_blocks: int | None,
        unpinned_policy: UnpinnedPolicy,
        engine: str | EngineFactory,
        attach: bool,
        host_slice: tuple[int, int] | None = None,
    ) -> ManagerConfig:
        """Raises ConfigError, naming the argument, for the first one out of range."""
        # In the order the arguments are documented: the first one out of range is named.
        size = 0 if attach else validate_nbytes(nbytes)
        # Refused when the manager is made, not first when it is entered.
        validate_region_options(backing, name, hugepages)
        chunk_default = chunk_bytes is None
        if chunk_bytes is None:
            chunk_bytes = default_chunk_bytes(size)
        chunk = _check_chunk_bytes(chunk_bytes, hugepages)
        if prefault_threads is None:
            prefault_threads = default_prefault_threads()
        prefault = _check_threads("prefault_threads", prefault_threads)
        pinners = _check_threads("pin_threads", pin_threads)
        if (
            not isinstance(pin_interval_s, int | float)
            or isinstance(pin_interval_s, bool)
            or not 0 <= pin_interval_s < math.inf
        ):
            raise ConfigError(
                f"pin_interval_s must be a finite number >= 0, got {shown(pin_interval_s)}"
            )
        if (kv_layout is None) != (num_host_blocks is None):
            raise ConfigError("kv_layout and num_host_blocks go together")
        blocks = 0
        if kv_layout is not None:
            if not isinstance(kv_layout, KVLayout):
                raise ConfigError("kv_layout must be a KVLayout (KVLayout.from_tensors(...))")
            blocks = check_num_host_blocks(num_host_blocks)
            ranks = check_host_slice(host_slice)[1]
            if ranks > 1 and backing != "shared":
                raise ConfigError(
                    "host_slice with ranks > 1 is for a region the ranks share: "
                    "backing='shared' (the other ranks attach to it)"
                )
            # An attacher learns the region's size when it enters and checks it there.
            if not attach and size < blocks * kv_layout.host_block_bytes * ranks:
                raise ConfigError(
                    f"{blocks} host blocks of {kv_layout.host_block_bytes} bytes"
                    + (f" x {ranks} ranks" if ranks > 1 else "")
                    + f" do not fit in nbytes={nbytes}; use OffloadManager.for_kv(layout, "
                    "num_host_blocks)"
                )
        elif host_slice is not None:
            raise ConfigError("host_slice is for a KV manager (OffloadManager.for_kv)")
        if unpinned_policy not in ("wait", "pageable"):
            raise ConfigError(
                f"unpinned_policy must be 'wait' or 'pageable', not {shown(unpinned_policy)}"
            )
        engine = check_engine_choice(engine)
        if kv_layout is not None:
            engine_factory(engine, kv_layout)  # a named engine that cannot serve the arrays
        return cls(
            nbytes=size,
            backing=backing,
            name=name,
            chunk_bytes=chunk,
            chunk_default=chunk_default,
            prefault_threads=prefault,
            pin_threads=pinners,
            pin_interval_s=float(pin_interval_s),
            hugepages=hugepages,
            kv_layout=kv_layout,
            num_host_blocks=blocks,
            unpinned_policy=unpinned_policy,
            engine=engine,
            attach=attach,
            host_slice=check_host_slice(host_slice),
        )

    def layout_description(self) -> dict[str, Any] | None:
        """What the bytes of a shared region mean, recorded in its header and checked by
        an attacher."""
        layout = self.kv_layout
        if layout is None:
            return None
        return {
            **layout.description(),
            "num_host_blocks": self.num_host_blocks,
            "ranks": self.host_slice[1],
        }


def check_host_slice(host_slice: object) -> tuple[int, int]:
    """``(rank, ranks)`` with ``0 <= rank < ranks``; None is ``(0, 1)``."""
    if host_slice is None:
        return (0, 1)
    if (
        not isinstance(host_slice, tuple)
        or len(host_slice) != 2
        or not all(_is_int(v) for v in host_slice)
        or not 0 <= host_slice[0] < host_slice[1]
    ):
        raise ConfigError(
            f"host_slice must be (rank, ranks) with 0 <= rank < ranks, got {shown(host_slice)}"
        )
    return (int(host_slice[0]), int(host_slice[1]))
