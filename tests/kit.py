"""The KV kit: CPU tensors standing in for an engine's device KV arrays, and the checks
that every transfer test makes with them.

Data is random bytes (never zeros: a copy that moved nothing must not pass) reinterpreted
as the layout's dtype; :class:`KVModel` holds what the host blocks and the device arrays
must contain, untouched blocks included, and :meth:`KVModel.check` compares byte for byte.

The "small" layout (:func:`small_kv`, :func:`small_manager`) is the one the pinning,
close and bad-input tests share: one layer, K and V split, 256-byte blocks, so one host
block is 512 bytes and a one-page chunk holds 8 of them. :class:`CopyGate` (the
``copy_gate`` fixture in ``conftest.py``) holds host-engine copies in their worker thread.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import anyio
import anyio.to_thread
import pytest
import torch

from asyncpin import KVLayout, ManagerStats, OffloadManager, PinBackend, Transfer, _sys
from asyncpin.abc import EngineSetup
from asyncpin.engines.host import HostTransferEngine
from asyncpin.transfers import TransferJob
from tests.helpers import TIMEOUT_S

PAGE = _sys.PAGE_SIZE

Kind = Literal["joined", "split", "block_major"]
Direction = Literal["store", "load"]
Ids = Sequence[int] | torch.Tensor

SMALL_BLOCKS = 64  # device blocks of the small layout
SMALL_BLOCK_BYTES = 256  # bytes of one block of one of K or V
SMALL_CHUNKS = 8  # one page each
SMALL_HOST_BLOCKS = SMALL_CHUNKS * (PAGE // (2 * SMALL_BLOCK_BYTES))
STALL_AT = 3  # pinning is held at this chunk: chunks 0..STALL_AT-1 are pinned


def random_bytes(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    """Uniform random bytes, drawn 8 at a time (3x faster than uint8 draws)."""
    nbytes = math.prod(shape)
    words = torch.randint(-(2**63), 2**63 - 1, (-(-nbytes // 8),), dtype=torch.int64, generator=gen)
    return words.view(torch.uint8)[:nbytes].view(*shape)


def random_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaN and denormal patterns included)."""
    return random_bytes((math.prod(shape) * dtype.itemsize,), gen).view(dtype).view(*shape)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def randomize(tensor: torch.Tensor, gen: torch.Generator) -> None:
    """Overwrite ``tensor`` in place with random bytes."""
    raw = tensor.view(torch.uint8)
    raw.copy_(random_bytes(raw.shape, gen))


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a, e = as_bytes(actual), as_bytes(expected)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    if not torch.equal(a, e):
        differ = (a != e).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten()
        pytest.fail(f"{what}: {differ.numel()} blocks differ, first {differ[:8].tolist()}")


def make_kv(
    kind: Kind,
    dtype: torch.dtype,
    *,
    layers: int,
    num_blocks: int,
    block_bytes: int,
    gen: torch.Generator,
) -> KVLayout:
    """Random per-layer KV tensors in one of the engines' layouts, described by a layout.

    ``block_bytes`` is the size of one block of one of K or V.
    """
    block = (block_bytes // dtype.itemsize // 16, 16)
    if kind == "joined":  # vLLM's [2, num_blocks, ...] per layer
        joined = [random_tensor((2, num_blocks, *block), dtype, gen) for _ in range(layers)]
        return KVLayout.from_tensors(joined, block_dim=1)
    if kind == "split":  # a K tensor and a V tensor per layer
        split = [random_tensor((num_blocks, *block), dtype, gen) for _ in range(2 * layers)]
        return KVLayout.from_tensors(split, block_dim=0)
    # block-major [num_blocks, 2, ...]: one block holds K and V back to back
    major = [random_tensor((num_blocks, 2, *block), dtype, gen) for _ in range(layers)]
    return KVLayout.from_tensors(major, block_dim=0)


def small_kv(gen: torch.Generator) -> KVLayout:
    return make_kv(
        "split",
        torch.uint8,
        layers=1,
        num_blocks=SMALL_BLOCKS,
        block_bytes=SMALL_BLOCK_BYTES,
        gen=gen,
    )


def blocks_per_chunk(layout: KVLayout) -> int:
    return PAGE // layout.host_block_bytes


def small_manager(layout: KVLayout, backend: str | PinBackend, **kwargs: Any) -> OffloadManager:
    """One page per chunk, pinned one at a time in index order."""
    return OffloadManager.for_kv(
        layout,
        SMALL_CHUNKS * blocks_per_chunk(layout),
        backend=backend,
        chunk_bytes=PAGE,
        prefault_threads=1,
        pin_threads=1,
        **kwargs,
    )


def chunk_ids(layout: KVLayout, chunk: int, count: int | None = None) -> list[int]:
    """Host block ids that lie in ``chunk`` (the first ``count`` of them)."""
    per = blocks_per_chunk(layout)
    return list(range(chunk * per, chunk * per + (per if count is None else count)))


def gather(layout: KVLayout, gpu_ids: Ids) -> torch.Tensor:
    """``[len(ids), num_arrays, *block_shape]``: what a store of ``gpu_ids`` writes."""
    ids = torch.as_tensor(gpu_ids, dtype=torch.int64)
    return torch.stack([array[ids] for array in layout.arrays], dim=1)


def randomize_host(mgr: OffloadManager, gen: torch.Generator) -> torch.Tensor:
    """Fill the host blocks with random bytes; returns a copy to model them with."""
    host = mgr.host_blocks()
    randomize(host, gen)
    return host.clone()


def submit(mgr: OffloadManager, direction: Direction, gpu_ids: Any, cpu_ids: Any) -> Transfer:
    """``store(gpu, cpu)`` or ``load(cpu, gpu)``, with the ids named by role either way."""
    if direction == "store":
        return mgr.store(gpu_ids, cpu_ids)
    return mgr.load(cpu_ids, gpu_ids)


class KVModel:
    """The expected contents of the host blocks and the device arrays."""

    def __init__(self, mgr: OffloadManager, layout: KVLayout) -> None:
        self.mgr = mgr
        self.layout = layout
        self.host = mgr.host_blocks().clone()
        self.arrays = [array.clone() for array in layout.arrays]

    def store(self, gpu_ids: Ids, cpu_ids: Ids) -> None:
        self.host[torch.as_tensor(cpu_ids, dtype=torch.int64)] = torch.stack(
            [array[torch.as_tensor(gpu_ids, dtype=torch.int64)] for array in self.arrays], dim=1
        )

    def load(self, cpu_ids: Ids, gpu_ids: Ids) -> None:
        cpu = torch.as_tensor(cpu_ids, dtype=torch.int64)
        gpu = torch.as_tensor(gpu_ids, dtype=torch.int64)
        for a, array in enumerate(self.arrays):
            array[gpu] = self.host[cpu, a]

    def apply(self, direction: Direction, gpu_ids: Ids, cpu_ids: Ids) -> None:
        """What ``submit(mgr, direction, gpu_ids, cpu_ids)`` does."""
        if direction == "store":
            self.store(gpu_ids, cpu_ids)
        else:
            self.load(cpu_ids, gpu_ids)

    def check(self) -> None:
        assert_same_bytes(self.mgr.host_blocks(), self.host, "host blocks")
        for a, (array, expected) in enumerate(zip(self.layout.arrays, self.arrays, strict=True)):
            assert_same_bytes(array, expected, f"device array {a}")


def check_stored(mgr: OffloadManager, layout: KVLayout, gpu_ids: Ids, cpu_ids: Ids) -> None:
    """host_blocks()[c, a] == arrays[a][g] for every pair."""
    host = mgr.host_blocks()
    cpu = torch.as_tensor(cpu_ids, dtype=torch.int64)
    gpu = torch.as_tensor(gpu_ids, dtype=torch.int64)
    for a, array in enumerate(layout.arrays):
        assert_same_bytes(host[cpu, a], array[gpu], f"array {a} after store")


def transfer_counters(stats: ManagerStats) -> tuple[int, ...]:
    return (
        stats.transfers_stored,
        stats.transfers_loaded,
        stats.bytes_stored,
        stats.bytes_loaded,
        stats.transfers_waited_for_pinning,
        stats.transfers_pageable,
        stats.transfers_failed,
        stats.transfers_in_flight,
    )


class CopyGate:
    """Holds every host-engine copy in its worker thread until :meth:`release`: the
    deterministic way to have a copy in flight. ``on_copied(job)`` runs in that thread
    right after each copy. :meth:`install` puts it in place for one test."""

    def __init__(self) -> None:
        self.on_copied: Callable[[TransferJob], None] | None = None
        self.entered = threading.Semaphore(0)
        self.released = threading.Event()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_copy = HostTransferEngine._copy

        def held_copy(engine: HostTransferEngine, job: TransferJob) -> None:
            self.entered.release()
            if not self.released.wait(TIMEOUT_S):
                raise TimeoutError("the copy gate was never released")
            real_copy(engine, job)
            if self.on_copied is not None:
                self.on_copied(job)

        monkeypatch.setattr(HostTransferEngine, "_copy", held_copy)

    def release(self) -> None:
        self.released.set()

    async def wait_entered(self, copies: int = 1) -> None:
        for _ in range(copies):
            ok = await anyio.to_thread.run_sync(self.entered.acquire, True, TIMEOUT_S)
            assert ok, "no copy reached the gate"


EngineT = TypeVar("EngineT")


def engines_made(
    make_one: Callable[[EngineSetup], EngineT],
) -> tuple[list[EngineT], Callable[[EngineSetup], EngineT]]:
    """An engine factory for ``engine=`` that keeps what it made, for a test to drive:
    ``engines, make = engines_made(lambda setup: FakeEngine(setup, copy=True))``."""
    engines: list[EngineT] = []

    def make(setup: EngineSetup) -> EngineT:
        engines.append(make_one(setup))
        return engines[-1]

    return engines, make
