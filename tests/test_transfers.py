"""KV block transfers (store: device → host, load: host → device) through the host engine.

The "device" KV arrays are CPU tensors, so every test runs without a GPU. Data is random
bytes (never zeros: a copy that moved nothing must not pass) reinterpreted as the layout's
dtype, and every check compares bytes against a model of what the host blocks and the
device arrays must hold, including the blocks a transfer must leave untouched.

Synchronisation is on events only: ``FakeBackend.stalled`` (a pin call is held), the
:class:`CopyGate` (a copy is held in its worker thread) and
``anyio.wait_all_tasks_blocked()``. Every wait is bounded by ``anyio.fail_after`` and
every hold is released in a ``finally``, so a failed check fails the test instead of
hanging a shielded close.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
import torch

from asyncpin import (
    ConfigError,
    HostBackend,
    InvalidTransferError,
    KVLayout,
    ManagerState,
    ManagerStats,
    OffloadManager,
    PinBackend,
    PinError,
    Transfer,
    TransferError,
    _sys,
)
from asyncpin.engines.host import HostTransferEngine
from asyncpin.region import HostRegion
from asyncpin.testing import FakeBackend, is_mapped
from asyncpin.transfers import TransferJob
from tests.helpers import releasing, wait_thread_event

TIMEOUT_S = 30.0
PAGE = _sys.PAGE_SIZE

Kind = Literal["joined", "split", "block_major"]
Direction = Literal["store", "load"]
Ids = Sequence[int] | torch.Tensor

# The small layout of the pinning, close and bad-input tests: one layer, K and V split,
# 256-byte blocks, so one host block is 512 bytes and a one-page chunk holds 8 of them.
SMALL_BLOCKS = 64
SMALL_BLOCK_BYTES = 256
SMALL_CHUNKS = 8
STALL_AT = 3  # pinning is held at this chunk: chunks 0..STALL_AT-1 are pinned


# -- helpers ----------------------------------------------------------------------------


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
    right after each copy."""

    def __init__(self) -> None:
        self.on_copied: Callable[[TransferJob], None] | None = None
        self.entered = threading.Semaphore(0)
        self.released = threading.Event()

    def release(self) -> None:
        self.released.set()

    async def wait_entered(self, copies: int = 1) -> None:
        for _ in range(copies):
            ok = await anyio.to_thread.run_sync(self.entered.acquire, True, TIMEOUT_S)
            assert ok, "no copy reached the gate"


@pytest.fixture
def copy_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[CopyGate]:
    gate = CopyGate()
    real_copy = HostTransferEngine._copy

    def held_copy(engine: HostTransferEngine, job: TransferJob) -> None:
        gate.entered.release()
        if not gate.released.wait(TIMEOUT_S):
            raise TimeoutError("the copy gate was never released")
        real_copy(engine, job)
        if gate.on_copied is not None:
            gate.on_copied(job)

    monkeypatch.setattr(HostTransferEngine, "_copy", held_copy)
    yield gate
    gate.release()


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20240607)


# -- round trips ------------------------------------------------------------------------

ROUND_TRIP_CASES = [
    ("joined", torch.uint8),
    ("joined", torch.float16),
    ("joined", torch.bfloat16),
    ("joined", torch.float32),
    ("split", torch.uint8),
    ("split", torch.float16),
    ("split", torch.bfloat16),
    ("split", torch.float32),
    ("block_major", torch.uint8),
    ("block_major", torch.float16),
    ("block_major", torch.bfloat16),
    ("block_major", torch.float32),
]


class TestRoundTrip:
    """Stores and loads of thousands of random block ids move exactly the right bytes."""

    LAYERS = 32
    NUM_BLOCKS = 4096
    HOST_BLOCKS = 3000
    BLOCK_BYTES = 256

    @pytest.mark.parametrize(("kind", "dtype"), ROUND_TRIP_CASES, ids=str)
    async def test_store_then_load(
        self, kind: Kind, dtype: torch.dtype, gen: torch.Generator
    ) -> None:
        layout = make_kv(
            kind,
            dtype,
            layers=self.LAYERS,
            num_blocks=self.NUM_BLOCKS,
            block_bytes=self.BLOCK_BYTES,
            gen=gen,
        )
        assert layout.dtype == dtype
        assert layout.num_blocks == self.NUM_BLOCKS
        assert layout.host_block_bytes == 2 * self.LAYERS * self.BLOCK_BYTES
        # A FakeBackend pins nothing: this test locks no memory.
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(
                layout, self.HOST_BLOCKS, backend=FakeBackend()
            ) as mgr:
                await mgr.pinned
                host = mgr.host_blocks()
                assert host.shape == (self.HOST_BLOCKS, layout.num_arrays, *layout.block_shape)
                assert host.dtype == dtype
                randomize_host(mgr, gen)
                model = KVModel(mgr, layout)

                # Two stores (ids as an int64 tensor, then as a list), overlapping in host
                # blocks: the second overwrites part of the first; others stay untouched.
                for count, as_list in ((2000, False), (1500, True)):
                    gpu = torch.randperm(self.NUM_BLOCKS, generator=gen)[:count]
                    cpu = torch.randperm(self.HOST_BLOCKS, generator=gen)[:count]
                    if as_list:
                        await mgr.store(gpu.tolist(), cpu.tolist())
                    else:
                        await mgr.store(gpu, cpu)
                    model.store(gpu, cpu)
                    check_stored(mgr, layout, gpu, cpu)
                    model.check()

                # Fresh device contents, then load every host block (ids as int32) into
                # random distinct device blocks; the other device blocks stay as they are.
                for array in layout.arrays:
                    randomize(array, gen)
                model = KVModel(mgr, layout)
                cpu = torch.randperm(self.HOST_BLOCKS, generator=gen)
                gpu = torch.randperm(self.NUM_BLOCKS, generator=gen)[: self.HOST_BLOCKS]
                await mgr.load(cpu.to(torch.int32), gpu.to(torch.int32))
                model.load(cpu, gpu)
                model.check()

                stats = mgr.stats()
                assert (stats.transfers_stored, stats.transfers_loaded) == (2, 1)
                assert stats.bytes_stored == 3500 * layout.host_block_bytes
                assert stats.bytes_loaded == self.HOST_BLOCKS * layout.host_block_bytes
                assert stats.transfers_failed == 0
                assert stats.transfers_in_flight == 0

    async def test_real_mlock_round_trip(self, gen: torch.Generator) -> None:
        baseline = _sys.vm_locked_bytes()
        layout = make_kv(
            "joined", torch.bfloat16, layers=4, num_blocks=512, block_bytes=256, gen=gen
        )
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(
                layout, 256, backend="host", chunk_bytes=16 * PAGE
            ) as mgr:
                await mgr.pinned
                assert _sys.vm_locked_bytes() == baseline + mgr.nbytes
                randomize_host(mgr, gen)
                model = KVModel(mgr, layout)
                gpu = torch.randperm(512, generator=gen)[:200]
                cpu = torch.randperm(256, generator=gen)[:200]
                await mgr.store(gpu, cpu)
                model.store(gpu, cpu)
                for array in layout.arrays:
                    randomize(array, gen)
                model.arrays = [array.clone() for array in layout.arrays]
                back = torch.randperm(512, generator=gen)[:200]
                await mgr.load(cpu, back)
                model.load(cpu, back)
                model.check()
        assert _sys.vm_locked_bytes() == baseline


class TestConcurrentTransfers:
    """Several stores and loads in flight at once each move exactly their own blocks."""

    async def test_stores_and_loads_in_flight_together(self, gen: torch.Generator) -> None:
        num_blocks, host_blocks, parts = 2048, 1536, 6
        layout = make_kv(
            "joined", torch.float16, layers=8, num_blocks=num_blocks, block_bytes=256, gen=gen
        )
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, host_blocks, backend=FakeBackend()) as mgr:
                await mgr.pinned
                randomize_host(mgr, gen)
                model = KVModel(mgr, layout)
                # Stores read device blocks G1 into host blocks H1; loads read host blocks H2
                # into device blocks G2. H1/H2 and G1/G2 are disjoint, so no copy reads what
                # another writes, and each set of destinations is split between transfers.
                gpu = torch.randperm(num_blocks, generator=gen)
                cpu = torch.randperm(host_blocks, generator=gen)
                g1, g2 = gpu[: num_blocks // 2], gpu[num_blocks // 2 :]
                h1, h2 = cpu[: host_blocks // 2], cpu[host_blocks // 2 :]
                stores = [
                    (g[: len(h)], h) for g, h in zip(g1.chunk(parts), h1.chunk(parts), strict=True)
                ]
                loads = [
                    (h, g[: len(h)]) for h, g in zip(h2.chunk(parts), g2.chunk(parts), strict=True)
                ]
                transfers = [mgr.store(g, h) for g, h in stores]
                transfers += [mgr.load(h, g) for h, g in loads]
                assert mgr.stats().transfers_in_flight == 2 * parts
                assert not any(t.done() for t in transfers)
                async with anyio.create_task_group() as tg:
                    for transfer in transfers:
                        tg.start_soon(transfer.wait)
                for g, h in stores:
                    model.store(g, h)
                for h, g in loads:
                    model.load(h, g)
                model.check()
                stats = mgr.stats()
                assert stats.transfers_in_flight == 0
                assert (stats.transfers_stored, stats.transfers_loaded) == (parts, parts)
                assert stats.bytes_stored == len(h1) * layout.host_block_bytes
                assert stats.bytes_loaded == len(h2) * layout.host_block_bytes


# -- transfers during pinning -----------------------------------------------------------


class TestTransfersDuringPinning:
    """Pinned chunks take the fast path at once; an unpinned chunk waits or goes pageable."""

    @pytest.mark.parametrize("direction", ["store", "load"])
    async def test_pinned_chunks_take_the_fast_path(
        self, direction: Direction, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(inner=HostBackend(), stall_pin_at=STALL_AT)
        baseline = _sys.vm_locked_bytes()
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    assert _sys.vm_locked_bytes() == baseline + STALL_AT * PAGE
                    randomize_host(mgr, gen)
                    model = KVModel(mgr, layout)
                    # Host blocks in every pinned chunk (0 .. STALL_AT-1), none beyond.
                    cpu = [c for i in range(STALL_AT) for c in chunk_ids(layout, i, 3)]
                    gpu = torch.randperm(SMALL_BLOCKS, generator=gen)[: len(cpu)].tolist()
                    transfer = submit(mgr, direction, gpu, cpu)
                    await transfer
                    assert transfer.path == "pinned"
                    assert not mgr.is_pinned()
                    assert mgr.stats().chunks_pinned == STALL_AT
                    assert transfer_counters(mgr.stats())[4:6] == (0, 0)  # waited, pageable
                    model.apply(direction, gpu, cpu)
                    model.check()
                await mgr.pinned
        assert _sys.vm_locked_bytes() == baseline

    @pytest.mark.parametrize("chunk", [STALL_AT, STALL_AT + 2])
    @pytest.mark.parametrize("direction", ["store", "load"])
    async def test_unpinned_chunk_waits_for_its_pin(
        self, direction: Direction, chunk: int, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(inner=HostBackend(), stall_pin_at=STALL_AT)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    randomize_host(mgr, gen)
                    model = KVModel(mgr, layout)
                    # One host block in a pinned chunk, one in the chunk waited for.
                    slow_cpu = [chunk_ids(layout, 0)[-1], chunk_ids(layout, chunk)[1]]
                    slow_gpu = [5, 9]
                    fast_cpu, fast_gpu = chunk_ids(layout, 1, 2), [20, 21]
                    slow = submit(mgr, direction, slow_gpu, slow_cpu)
                    fast = submit(mgr, direction, fast_gpu, fast_cpu)
                    assert mgr.stats().transfers_waited_for_pinning == 1
                    await fast
                    await anyio.wait_all_tasks_blocked()
                    assert not slow.done()
                    assert "in flight" in repr(slow)
                    assert mgr.stats().transfers_in_flight == 1
                    backend.release()
                    await slow
                assert slow.path == "pinned"
                stats = mgr.stats()
                assert stats.transfers_waited_for_pinning == 1
                assert stats.transfers_pageable == 0
                assert stats.transfers_failed == 0
                model.apply(direction, fast_gpu, fast_cpu)
                model.apply(direction, slow_gpu, slow_cpu)
                model.check()

    @pytest.mark.parametrize("direction", ["store", "load"])
    async def test_pageable_policy_does_not_wait(
        self, direction: Direction, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend, unpinned_policy="pageable") as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    randomize_host(mgr, gen)
                    model = KVModel(mgr, layout)
                    cpu = chunk_ids(layout, STALL_AT + 2) + chunk_ids(layout, 0, 2)
                    gpu = torch.randperm(SMALL_BLOCKS, generator=gen)[: len(cpu)].tolist()
                    transfer = submit(mgr, direction, gpu, cpu)
                    await transfer
                    assert transfer.path == "pageable"
                    assert "pageable" in repr(transfer)
                    assert not mgr.is_pinned()
                    stats = mgr.stats()
                    assert stats.transfers_pageable == 1
                    assert stats.transfers_waited_for_pinning == 0
                    model.apply(direction, gpu, cpu)
                    model.check()
                    # Blocks wholly in pinned chunks still take the pinned path.
                    fast = submit(mgr, direction, [1], chunk_ids(layout, 1, 1))
                    await fast
                    assert fast.path == "pinned"
                    assert mgr.stats().transfers_pageable == 1

    async def test_empty_transfer_does_not_wait(self, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=0)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    await mgr.store([], [])
                    await mgr.load([], [])
                    stats = mgr.stats()
                    assert stats.transfers_waited_for_pinning == 0
                    assert stats.chunks_pinned == 0


# -- close, failure and cancellation ----------------------------------------------------


class TestCloseWithTransfers:
    """Close waits for copies in flight, fails transfers it strands, then refuses new ones."""

    async def test_close_waits_for_copies_in_flight(
        self, copy_gate: CopyGate, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        fake = FakeBackend()
        mgr = small_manager(layout, fake)
        seen: list[tuple[str, int, bool, torch.Tensor]] = []
        closed = anyio.Event()

        async def close() -> None:
            await mgr.aclose()
            closed.set()

        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                address, nbytes = mgr.host_view().data_ptr(), mgr.nbytes
                await mgr.pinned
                host = mgr.host_blocks()
                randomize(host, gen)

                def on_copied(job: TransferJob) -> None:
                    # In the copy's thread, as it ends: nothing unpinned or unmapped yet.
                    seen.append(
                        (
                            job.transfer.direction,
                            len(fake.unpinned_spans()),
                            is_mapped(address, nbytes),
                            host[job.cpu_ids].clone(),
                        )
                    )

                copy_gate.on_copied = on_copied
                model = KVModel(mgr, layout)
                store_gpu, store_cpu = [3, 1, 4, 15], chunk_ids(layout, 2, 4)
                load_cpu, load_gpu = chunk_ids(layout, 5, 5), [9, 2, 6, 5, 35]
                with releasing(copy_gate):
                    stored = mgr.store(store_gpu, store_cpu)
                    loaded = mgr.load(load_cpu, load_gpu)
                    await copy_gate.wait_entered(2)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(close)
                        await anyio.wait_all_tasks_blocked()
                        assert not closed.is_set()
                        assert mgr.state is ManagerState.CLOSING
                        assert not stored.done() and not loaded.done()
                        assert mgr.stats().transfers_in_flight == 2
                        assert fake.unpinned_spans() == []
                        with pytest.raises(anyio.ClosedResourceError):
                            mgr.store([0], [0])
                        with pytest.raises(anyio.ClosedResourceError):
                            mgr.load([0], [0])
                        copy_gate.release()
                    assert closed.is_set()
        assert stored.done() and stored.error is None
        assert loaded.done() and loaded.error is None
        await stored
        await loaded
        assert sorted((d, u, m) for d, u, m, _ in seen) == [("load", 0, True), ("store", 0, True)]
        # Then every pinned chunk was unpinned, once, and the region unmapped.
        assert sorted(fake.unpinned_spans()) == sorted(fake.pinned_spans())
        assert len(fake.pinned_spans()) == SMALL_CHUNKS
        # The test's own views hold the range past close; with them gone, it is unmapped.
        host = torch.empty(0)
        copy_gate.on_copied = None
        assert mgr.stats().mapped_by_views_bytes == 0
        assert not is_mapped(address, nbytes)
        # The copies moved the right bytes: the store's host blocks as they were when it
        # ended, the load's device blocks now.
        (stored_host,) = [snapshot for d, _, _, snapshot in seen if d == "store"]
        assert_same_bytes(stored_host, gather(layout, store_gpu), "stored blocks")
        model.load(load_cpu, load_gpu)
        for a, (array, expected) in enumerate(zip(layout.arrays, model.arrays, strict=True)):
            assert_same_bytes(array, expected, f"device array {a}")
        stats = mgr.stats()
        assert stats.transfers_in_flight == 0 and stats.transfers_failed == 0
        assert stats.bytes_stored == 4 * layout.host_block_bytes
        assert stats.bytes_loaded == 5 * layout.host_block_bytes

    @pytest.mark.parametrize(
        ("chunk", "completes"),
        [(STALL_AT, True), (STALL_AT + 1, False)],
        ids=["stalled-chunk-pins", "later-chunk-never-pins"],
    )
    async def test_transfer_waiting_for_a_chunk_at_close(
        self, chunk: int, completes: bool, gen: torch.Generator
    ) -> None:
        """The chunk whose pin is in flight still pins (close waits for that call), so a
        transfer waiting for it completes; one waiting for a later chunk fails."""
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT)
        mgr = small_manager(layout, backend)
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                address, nbytes = mgr.host_view().data_ptr(), mgr.nbytes
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    gpu, cpu = [7, 8], chunk_ids(layout, chunk, 2)
                    transfer = mgr.store(gpu, cpu)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(mgr.aclose)
                        await anyio.wait_all_tasks_blocked()
                        assert mgr.state is ManagerState.CLOSING
                        assert not transfer.done()
                        backend.release()
        assert mgr.state is ManagerState.CLOSED
        assert transfer.done()
        assert not is_mapped(address, nbytes)
        assert sorted(backend.unpinned_spans()) == sorted(backend.pinned_spans())
        stats = mgr.stats()
        assert stats.transfers_in_flight == 0
        if completes:
            await transfer
            assert stats.bytes_stored == 2 * layout.host_block_bytes
        else:
            with pytest.raises(TransferError, match="closed") as info:
                await transfer
            assert not isinstance(info.value, InvalidTransferError)
            assert stats.transfers_failed == 1
            assert stats.bytes_stored == 0

    async def test_use_after_close_raises_closed_resource_error(self, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        mgr = small_manager(layout, FakeBackend())
        with pytest.raises(anyio.ClosedResourceError):
            mgr.store([0], [0])  # never entered
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                await mgr.store([0], [0])
        for call in (
            lambda: mgr.store([0], [0]),
            lambda: mgr.load([0], [0]),
            lambda: mgr.store([], []),
            mgr.host_blocks,
        ):
            with pytest.raises(anyio.ClosedResourceError):
                call()
        assert mgr.stats().transfers_stored == 1

    async def test_transfers_from_another_thread_are_refused(self, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                model = KVModel(mgr, layout)
                before = transfer_counters(mgr.stats())
                for call in (lambda: mgr.store([0], [0]), lambda: mgr.load([0], [0])):
                    with pytest.raises(RuntimeError, match="event loop's thread"):
                        await anyio.to_thread.run_sync(call)
                # The way that works: hop to the loop's thread through a portal.
                transfer = await anyio.to_thread.run_sync(
                    lambda: anyio.from_thread.run_sync(mgr.store, [1], [2])
                )
                await transfer
                assert mgr.stats().transfers_stored == before[0] + 1
                model.store([1], [2])
                model.check()

    async def test_failed_pin_fails_the_transfers_that_need_its_chunk(
        self, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT, fail_pin_at=STALL_AT)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    doomed = mgr.store(
                        [1, 2], chunk_ids(layout, 0, 1) + chunk_ids(layout, STALL_AT, 1)
                    )
                    await mgr.store([3], chunk_ids(layout, 1, 1))
                    await anyio.wait_all_tasks_blocked()
                    assert not doomed.done()
                    backend.release()
                    with pytest.raises(TransferError) as info:
                        await doomed
                cause = info.value.__cause__
                assert isinstance(cause, PinError)
                assert cause.chunk_index == STALL_AT
                assert cause.code == FakeBackend.FAKE_CODE
                with pytest.raises(PinError) as pinned:
                    await mgr.pinned
                assert pinned.value is cause
                # Later transfers into a chunk that will never be pinned fail the same way,
                # loads included; the pinned chunks keep working.
                for late in (
                    mgr.store([4], chunk_ids(layout, STALL_AT + 2, 1)),
                    mgr.load(chunk_ids(layout, STALL_AT, 1), [4]),
                ):
                    with pytest.raises(TransferError) as info:
                        await late
                    assert info.value.__cause__ is cause
                model = KVModel(mgr, layout)
                await mgr.load(chunk_ids(layout, 2, 2), [10, 11])
                model.load(chunk_ids(layout, 2, 2), [10, 11])
                model.check()
                stats = mgr.stats()
                assert stats.transfers_failed == 3
                assert stats.transfers_waited_for_pinning == 3
                assert stats.transfers_in_flight == 0


class TestCancellation:
    """Cancelling the task that awaits a transfer stops the waiting, never the copy."""

    async def test_cancelled_waiter_leaves_the_copy_running(
        self, copy_gate: CopyGate, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        scope = anyio.CancelScope()
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                gpu, cpu = [60, 0, 33], chunk_ids(layout, 4, 3)
                transfer = mgr.store(gpu, cpu)

                async def waiter() -> None:
                    with scope:
                        await transfer

                with releasing(copy_gate):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(waiter)
                        await copy_gate.wait_entered()
                        await anyio.wait_all_tasks_blocked()
                        scope.cancel()
                    assert scope.cancelled_caught
                    assert not transfer.done()
                    assert mgr.stats().transfers_in_flight == 1
                await transfer
                assert transfer.error is None
                check_stored(mgr, layout, gpu, cpu)
                stats = mgr.stats()
                assert stats.transfers_in_flight == 0
                assert stats.bytes_stored == 3 * layout.host_block_bytes

    async def test_cancelled_waiter_of_a_transfer_waiting_for_pinning(
        self, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        backend = FakeBackend(stall_pin_at=STALL_AT)
        scope = anyio.CancelScope()
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, backend) as mgr:
                with releasing(backend):
                    await wait_thread_event(backend.stalled)
                    randomize_host(mgr, gen)
                    model = KVModel(mgr, layout)
                    cpu, gpu = chunk_ids(layout, STALL_AT + 1, 4), [12, 13, 14, 15]
                    transfer = mgr.load(cpu, gpu)

                    async def waiter() -> None:
                        with scope:
                            await transfer

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(waiter)
                        await anyio.wait_all_tasks_blocked()
                        scope.cancel()
                    assert scope.cancelled_caught
                    assert not transfer.done()
                    backend.release()
                    await transfer
                model.load(cpu, gpu)
                model.check()
                assert mgr.stats().transfers_in_flight == 0


# -- bad input --------------------------------------------------------------------------

N = SMALL_BLOCKS
H = SMALL_CHUNKS * (PAGE // (2 * SMALL_BLOCK_BYTES))


class BadIds(NamedTuple):
    name: str
    gpu_ids: Any
    cpu_ids: Any
    words: tuple[str, ...]  # what the message must say


# Refused in both directions (ids are named by role: store(gpu, cpu), load(cpu, gpu)).
BAD_IDS_EITHER_WAY = [
    BadIds("gpu-negative", [0, -1], [0, 1], ("gpu_block_ids", "-1", f"[0, {N})")),
    BadIds("gpu-eq-num-blocks", [0, N], [0, 1], ("gpu_block_ids", str(N), f"[0, {N})")),
    BadIds("gpu-far-out-tensor", torch.tensor([N + 100]), [0], ("gpu_block_ids", str(N + 100))),
    BadIds("cpu-negative", [0, 1], [-1, 1], ("cpu_block_ids", "-1", f"[0, {H})")),
    BadIds("cpu-eq-num-blocks", [0, 1], [0, H], ("cpu_block_ids", str(H), f"[0, {H})")),
    BadIds("lengths-differ", [0, 1, 2], [0, 1], ("3 ids", "cpu_block_ids 2")),
    BadIds("lengths-differ-empty", [], [0], ("0 ids", "cpu_block_ids 1")),
    BadIds("float-tensor", torch.tensor([0.0, 1.0]), [0, 1], ("gpu_block_ids", "float32")),
    BadIds("bool-tensor", [0, 1], torch.tensor([True, False]), ("cpu_block_ids", "torch.bool")),
    BadIds("2d-tensor", torch.tensor([[0, 1]]), [0, 1], ("gpu_block_ids", "1-D", "(1, 2)")),
    BadIds("0d-tensor", torch.tensor(3), [0], ("gpu_block_ids", "1-D")),
    BadIds("list-with-float", [0, 1.0], [0, 1], ("gpu_block_ids", "ints")),
    BadIds("list-with-bool", [0, 1], [0, True], ("cpu_block_ids", "ints")),
    BadIds("int-not-sequence", 5, [0], ("gpu_block_ids", "sequence")),
    BadIds("none", [0], None, ("cpu_block_ids", "sequence")),
    BadIds("tensor-off-cpu", torch.tensor([0, 1], device="meta"), [0, 1], ("CPU", "meta")),
]
BAD_IDS: list[tuple[Direction, BadIds]] = [
    (direction, case) for direction in ("store", "load") for case in BAD_IDS_EITHER_WAY
]
# Duplicate destinations: host blocks for a store, device blocks for a load.
BAD_IDS += [
    ("store", BadIds("dup-dst", [0, 1, 2], [4, 5, 4], ("cpu_block_ids", "duplicate"))),
    ("load", BadIds("dup-dst", [7, 3, 7], [4, 5, 6], ("gpu_block_ids", "duplicate"))),
]


class TestBadTransferInput:
    """Bad ids and methods are refused synchronously, typed, before anything is enqueued."""

    @pytest.mark.parametrize(
        ("direction", "case"), BAD_IDS, ids=[f"{d}-{c.name}" for d, c in BAD_IDS]
    )
    async def test_bad_ids_are_refused(
        self, direction: Direction, case: BadIds, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                assert mgr.kv_layout is layout
                assert (layout.num_blocks, mgr.host_blocks().shape[0]) == (N, H)
                randomize_host(mgr, gen)
                model = KVModel(mgr, layout)
                before = transfer_counters(mgr.stats())
                with pytest.raises(InvalidTransferError) as info:
                    submit(mgr, direction, case.gpu_ids, case.cpu_ids)
                assert isinstance(info.value, ValueError)
                assert isinstance(info.value, TransferError)
                for word in case.words:
                    assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"
                assert transfer_counters(mgr.stats()) == before
                assert mgr.stats().transfers_in_flight == 0
                await anyio.wait_all_tasks_blocked()
                model.check()  # nothing moved

    @pytest.mark.parametrize("method", ["bogus", "batch", "kernel", ""])
    async def test_unknown_method(self, method: str, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                before = transfer_counters(mgr.stats())
                bad: Any = method  # not a Method literal, or one the host engine lacks
                calls: list[Callable[[], Transfer]] = [
                    lambda: mgr.store([0], [0], method=bad),
                    lambda: mgr.load([0], [0], method=bad),
                ]
                for call in calls:
                    with pytest.raises(InvalidTransferError, match="method"):
                        call()
                assert transfer_counters(mgr.stats()) == before
                await mgr.store([0], [0], method="host")
                await mgr.load([0], [1], method="auto")

    async def test_duplicate_sources_are_allowed(self, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                randomize_host(mgr, gen)
                model = KVModel(mgr, layout)
                # One device block to three host blocks, then one host block to two
                # device blocks.
                await mgr.store([9, 9, 2, 9], [0, 1, 2, 3])
                model.store([9, 9, 2, 9], [0, 1, 2, 3])
                check_stored(mgr, layout, [9, 9, 2, 9], [0, 1, 2, 3])
                await mgr.load([30, 30], [40, 41])
                model.load([30, 30], [40, 41])
                model.check()
                assert_same_bytes(layout.arrays[0][40], layout.arrays[0][41], "loaded twice")

    async def test_ids_are_captured_at_submission(self, gen: torch.Generator) -> None:
        """Validated ids cannot change under the copy: reusing the caller's id buffer right
        after store() returns (as engines do) neither moves other blocks nor escapes the
        range check."""
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                randomize_host(mgr, gen)
                model = KVModel(mgr, layout)
                gpu = torch.tensor([1, 2, 3])
                cpu = torch.tensor([10, 11, 12])
                transfer = mgr.store(gpu, cpu)
                gpu.fill_(N + 1000)  # out of range: would fault on a device
                cpu.copy_(torch.tensor([20, 21, 22]))
                await transfer
                model.store([1, 2, 3], [10, 11, 12])
                model.check()

    async def test_ids_too_large_for_int64_are_refused(self, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                with pytest.raises(InvalidTransferError, match="gpu_block_ids"):
                    mgr.store([2**70], [0])

    async def test_manager_without_kv_layout(self) -> None:
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager(4 * PAGE, backend=FakeBackend()) as mgr:
                assert mgr.kv_layout is None
                for call in (
                    lambda: mgr.store([0], [0]),
                    lambda: mgr.load([0], [0]),
                    mgr.host_blocks,
                ):
                    with pytest.raises(ConfigError, match="for_kv"):
                        call()
                assert transfer_counters(mgr.stats()) == (0,) * 8


def _tensors_of(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    return [torch.ones(shape, dtype=dtype) for shape in shapes]


BAD_LAYOUTS: list[tuple[str, Callable[[], KVLayout], tuple[str, ...]]] = [
    ("empty list", lambda: KVLayout.from_tensors([]), ("at least one",)),
    (
        "not a tensor",
        lambda: KVLayout.from_tensors([torch.ones(4, 8), [1, 2]]),  # type: ignore[list-item]
        ("tensor 1", "list"),
    ),
    (
        "dtype",
        lambda: KVLayout.from_tensors(
            [torch.ones(4, 8, dtype=torch.float16), torch.ones(4, 8, dtype=torch.bfloat16)]
        ),
        ("dtype", "bfloat16"),
    ),
    (
        "dtype across joined layers",
        lambda: KVLayout.from_tensors(
            [torch.ones(2, 4, 8, dtype=torch.float32), torch.ones(2, 4, 8, dtype=torch.int32)],
            block_dim=1,
        ),
        ("dtype",),
    ),
    (
        "device",
        lambda: KVLayout.from_tensors([torch.ones(4, 8), torch.empty(4, 8, device="meta")]),
        ("device", "meta"),
    ),
    (
        "block shape",
        lambda: KVLayout.from_tensors(_tensors_of((4, 8), (4, 4, 2))),
        ("block shape",),
    ),
    (
        "block shape, same bytes",
        lambda: KVLayout.from_tensors(_tensors_of((4, 8), (4, 2, 4))),
        ("block shape",),
    ),
    (
        "number of blocks",
        lambda: KVLayout.from_tensors(_tensors_of((4, 8), (5, 8))),
        ("number of blocks", "5"),
    ),
    (
        "number of blocks, joined",
        lambda: KVLayout.from_tensors(_tensors_of((2, 4, 8), (2, 6, 8)), block_dim=1),
        ("number of blocks",),
    ),
    (
        "transposed",
        lambda: KVLayout.from_tensors([torch.ones(8, 4).t()]),
        ("contiguous",),
    ),
    (
        "transposed joined",
        lambda: KVLayout.from_tensors([torch.ones(2, 8, 4).transpose(1, 2)], block_dim=1),
        ("contiguous",),
    ),
    (
        "overlapping blocks",
        lambda: KVLayout.from_tensors([torch.ones(16).as_strided((4, 8), (1, 1))]),
        ("contiguous",),
    ),
    (
        "block_dim past the end",
        lambda: KVLayout.from_tensors(_tensors_of((4, 8)), block_dim=2),
        ("block_dim=2", "out of range"),
    ),
    (
        "block_dim negative",
        lambda: KVLayout.from_tensors(_tensors_of((4, 8)), block_dim=-1),
        ("block_dim=-1",),
    ),
    (
        "block_dim of a 0-d tensor",
        lambda: KVLayout.from_tensors([torch.tensor(1.0)]),
        ("block_dim=0",),
    ),
    (
        "empty blocks",
        lambda: KVLayout.from_tensors(_tensors_of((4, 0))),
        ("non-empty",),
    ),
]


class TestBadLayout:
    """KVLayout and OffloadManager.for_kv refuse inconsistent KV descriptions (ConfigError)."""

    @pytest.mark.parametrize(
        ("make", "words"), [c[1:] for c in BAD_LAYOUTS], ids=[c[0] for c in BAD_LAYOUTS]
    )
    def test_from_tensors_refuses(
        self, make: Callable[[], KVLayout], words: tuple[str, ...]
    ) -> None:
        with pytest.raises(ConfigError) as info:
            make()
        for word in words:
            assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"

    def test_from_tensors_refuses_zero_blocks(self) -> None:
        with pytest.raises(ConfigError, match="at least one non-empty block"):
            KVLayout.from_tensors([torch.ones(0, 8)])

    def test_layouts_describe_the_arrays(self) -> None:
        joined = KVLayout.from_tensors(_tensors_of((2, 6, 4, 8), (2, 6, 4, 8)), block_dim=1)
        assert (joined.num_arrays, joined.num_blocks, joined.block_shape) == (4, 6, (4, 8))
        assert joined.block_bytes == 64 and joined.host_block_bytes == 256
        major = KVLayout.from_tensors(_tensors_of((6, 2, 4, 8)))
        assert (major.num_arrays, major.num_blocks, major.block_shape) == (1, 6, (2, 4, 8))
        single = KVLayout.from_tensors(torch.ones(6, 8, dtype=torch.float32))  # type: ignore[arg-type]
        assert (single.num_arrays, single.dtype, single.host_block_bytes) == (1, torch.float32, 32)

    @pytest.mark.parametrize("num_host_blocks", [0, -1, True, False, 2.0, None])
    def test_for_kv_refuses_bad_num_host_blocks(self, num_host_blocks: Any) -> None:
        layout = KVLayout.from_tensors(_tensors_of((4, 8)))
        with pytest.raises(ConfigError, match="num_host_blocks"):
            OffloadManager.for_kv(layout, num_host_blocks, backend=FakeBackend())

    def test_kv_layout_and_num_host_blocks_go_together(self) -> None:
        layout = KVLayout.from_tensors(_tensors_of((4, 8)))
        with pytest.raises(ConfigError, match="together"):
            OffloadManager(PAGE, backend=FakeBackend(), kv_layout=layout)
        with pytest.raises(ConfigError, match="together"):
            OffloadManager(PAGE, backend=FakeBackend(), num_host_blocks=4)
        with pytest.raises(ConfigError, match="num_host_blocks"):
            OffloadManager(PAGE, backend=FakeBackend(), kv_layout=layout, num_host_blocks=0)
        with pytest.raises(ConfigError, match="do not fit"):
            OffloadManager(PAGE, backend=FakeBackend(), kv_layout=layout, num_host_blocks=1000)
        with pytest.raises(ConfigError, match="KVLayout"):
            OffloadManager(
                PAGE,
                backend=FakeBackend(),
                kv_layout=object(),  # type: ignore[arg-type]
                num_host_blocks=4,
            )
        with pytest.raises(ConfigError, match="unpinned_policy"):
            OffloadManager.for_kv(
                layout,
                4,
                backend=FakeBackend(),
                unpinned_policy="sometimes",
            )

    async def test_arrays_on_an_unsupported_device(self) -> None:
        layout = KVLayout.from_tensors([torch.empty(4, 8, device="meta")])
        mgr = OffloadManager.for_kv(layout, 4, backend=FakeBackend())
        with anyio.fail_after(TIMEOUT_S), pytest.raises(ConfigError, match="meta"):
            async with mgr:
                pass  # pragma: no cover
        await mgr.aclose()
        assert mgr.state is ManagerState.CLOSED


# -- empty transfers, the handle, stats -------------------------------------------------


class TestPinDevice:
    """A KV manager pins for its layout's GPU, not whichever device is current."""

    @pytest.mark.parametrize(("given", "expected"), [({}, 1), ({"device": 0}, 0)])
    def test_for_kv_resolves_the_backend_for_the_layout_device(
        self, monkeypatch: pytest.MonkeyPatch, given: dict[str, int], expected: int
    ) -> None:
        asked: list[int | None] = []

        def resolve(backend: Any, device: int | None = None) -> FakeBackend:
            asked.append(device)
            return FakeBackend()

        monkeypatch.setattr("asyncpin.manager.resolve_backend", resolve)
        layout = dataclasses.replace(
            KVLayout.from_tensors([torch.ones(4, 8)]), device=torch.device("cuda", 1)
        )
        OffloadManager.for_kv(layout, 2, backend="cuda", **given)
        assert asked == [expected]


class TestEmptyTransfers:
    """Transfers of zero blocks complete at once and move nothing."""

    @pytest.mark.parametrize(
        "ids", [[], (), torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32)]
    )
    async def test_empty_store_and_load(self, ids: Any, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                randomize_host(mgr, gen)
                model = KVModel(mgr, layout)
                for transfer in (mgr.store(ids, ids), mgr.load(ids, ids)):
                    assert transfer.nbytes == 0 and transfer.num_blocks == 0
                    await transfer
                    assert transfer.done() and transfer.error is None
                model.check()
                stats = mgr.stats()
                assert (stats.transfers_stored, stats.transfers_loaded) == (1, 1)
                assert (stats.bytes_stored, stats.bytes_loaded) == (0, 0)
                assert stats.transfers_in_flight == 0


class TestTransferHandle:
    """A Transfer reports its state, size and time, and can be awaited any number of times."""

    @pytest.mark.parametrize("direction", ["store", "load"])
    async def test_handle_before_and_after(
        self, direction: Direction, gen: torch.Generator
    ) -> None:
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                gpu, cpu = [4, 0, 63], [7, 2, 40]
                transfer = submit(mgr, direction, gpu, cpu)
                assert isinstance(transfer, Transfer)
                assert transfer.direction == direction
                assert not transfer.done()
                assert transfer.elapsed_s is None
                assert transfer.error is None
                assert transfer.num_blocks == 3
                assert transfer.nbytes == 3 * layout.host_block_bytes
                text = repr(transfer)
                assert direction in text and "in flight" in text
                assert f"3 blocks {transfer.nbytes} bytes" in text
                if direction == "store":
                    await transfer
                    await transfer.wait()
                else:
                    await transfer.wait()
                    await transfer
                await transfer  # a third time
                assert transfer.done()
                elapsed = transfer.elapsed_s
                assert isinstance(elapsed, float) and elapsed > 0
                assert transfer.elapsed_s == elapsed  # fixed once done
                text = repr(transfer)
                assert direction in text and "done" in text and "in flight" not in text
                assert "host/pinned" in text


class TestStats:
    """stats() counts transfers and bytes per direction."""

    async def test_counters(self, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        size = layout.host_block_bytes
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                assert transfer_counters(mgr.stats()) == (0,) * 8
                await mgr.store([1, 2, 3], [1, 2, 3])
                await mgr.store([4], [4])
                await mgr.store(list(range(10)), list(range(20, 30)))
                await mgr.load([1, 2], [50, 51])
                await mgr.load(list(range(20, 27)), list(range(30, 37)))
                stats = mgr.stats()
                assert stats.transfers_stored == 3
                assert stats.transfers_loaded == 2
                assert stats.bytes_stored == 14 * size
                assert stats.bytes_loaded == 9 * size
                assert stats.transfers_waited_for_pinning == 0
                assert stats.transfers_pageable == 0
                assert stats.transfers_failed == 0
                assert stats.transfers_in_flight == 0
        assert mgr.stats().bytes_stored == 14 * size  # kept after close


class TestCopyFailure:
    """A copy that fails is reported as a TransferError with the cause chained."""

    async def test_failed_copy_is_a_transfer_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def broken(self: HostTransferEngine, job: TransferJob) -> None:
            raise RuntimeError("injected copy failure")

        monkeypatch.setattr(HostTransferEngine, "_copy", broken)
        layout = KVLayout.from_tensors([torch.randint(1, 255, (8, 64), dtype=torch.uint8)])
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, 8, backend=FakeBackend()) as mgr:
                await mgr.pinned
                with pytest.raises(TransferError, match="injected copy failure") as info:
                    await mgr.store([0], [0])
                assert isinstance(info.value.__cause__, RuntimeError)
                assert mgr.stats().transfers_failed == 1


class TestCancelledManager:
    """Cancelling the task that owns the manager never hands the cancellation to a transfer."""

    async def test_waiting_transfer_is_settled_with_a_closed_error(self) -> None:
        fake = FakeBackend(stall_pin_at=0)
        layout = KVLayout.from_tensors([torch.randint(1, 255, (8, 4096), dtype=torch.uint8)])
        transfer = None
        with anyio.fail_after(TIMEOUT_S):
            with anyio.CancelScope() as scope:
                async with OffloadManager.for_kv(
                    layout, 8, backend=fake, chunk_bytes=4096, prefault_threads=1
                ) as mgr:
                    transfer = mgr.store([0], [5])  # chunk 5 waits: the first pin is stalled
                    await anyio.to_thread.run_sync(fake.stalled.wait)
                    assert not transfer.done()
                    scope.cancel()
                    fake.release()
                    await anyio.sleep_forever()
            assert transfer is not None and transfer.done()
            assert isinstance(transfer.error, anyio.ClosedResourceError | TransferError)
            with pytest.raises((anyio.ClosedResourceError, TransferError)):
                await transfer

    async def test_cancelled_while_the_engine_prepares_releases_everything(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Entering a KV manager prepares the engine in a worker thread, a point where a
        # cancellation is delivered: the region must still be released.
        created: list[tuple[int, int]] = []
        create = HostRegion.create

        def record(*args: Any, **kwargs: Any) -> HostRegion:
            region = create(*args, **kwargs)
            created.append((region.address, region.nbytes))
            return region

        monkeypatch.setattr(HostRegion, "create", record)
        fake = FakeBackend()
        layout = KVLayout.from_tensors([torch.randint(1, 255, (8, 4096), dtype=torch.uint8)])
        mgr = OffloadManager.for_kv(layout, 8, backend=fake, chunk_bytes=4096)
        with anyio.fail_after(TIMEOUT_S):
            with anyio.CancelScope() as scope:
                scope.cancel()
                async with mgr:
                    raise AssertionError("entered a cancelled scope")
        assert scope.cancelled_caught and len(created) == 1
        assert not is_mapped(*created[0])
        assert fake.pinned_spans() == []
