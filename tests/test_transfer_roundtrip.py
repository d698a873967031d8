"""Data paths: stores (device → host) and loads (host → device) through the host engine
move exactly the bytes they name, and nothing else.

The "device" KV arrays are CPU tensors (see ``tests/kit.py``), so every test runs without
a GPU; each check compares bytes against a model of the host blocks and the device
arrays, the blocks a transfer must leave untouched included.

Synchronisation is on events only: ``FakeBackend.stalled`` (a pin call is held), the
:class:`~tests.kit.CopyGate` (a copy is held in its worker thread) and
``anyio.wait_all_tasks_blocked()``. Every wait is bounded by ``anyio.fail_after`` and
every hold is released in a ``finally``, so a failed check fails the test instead of
hanging a shielded close. Every test runs on asyncio and on trio.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
import torch

from asyncpin import (
    OffloadManager,
    _sys,
)
from asyncpin.testing import FakeBackend
from tests.helpers import TIMEOUT_S
from tests.kit import (
    PAGE,
    SMALL_BLOCKS,
    Kind,
    KVModel,
    assert_same_bytes,
    check_stored,
    make_kv,
    randomize,
    randomize_host,
    small_kv,
    small_manager,
)

pytestmark = pytest.mark.anyio


# Every layout in every dtype. The bytes a copy moves do not depend on the event loop, so
# each case runs on one of them (alternating, so that each layout and each dtype meets
# both) rather than twice: these are the slowest tests of the suite.
_KINDS: list[Kind] = ["joined", "split", "block_major"]
_DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32]
ROUND_TRIP_CASES = [
    (("asyncio", "trio")[(k + d) % 2], kind, dtype)
    for k, kind in enumerate(_KINDS)
    for d, dtype in enumerate(_DTYPES)
]


class TestRoundTrip:
    """Stores and loads of thousands of random block ids move exactly the right bytes."""

    LAYERS = 32
    NUM_BLOCKS = 4096
    HOST_BLOCKS = 3000
    BLOCK_BYTES = 256

    @pytest.mark.parametrize(("anyio_backend", "kind", "dtype"), ROUND_TRIP_CASES, ids=str)
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


class TestWhichBlocksMove:
    """Repeated sources are copied, and ids are the ones given at submission."""

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
                gpu.fill_(SMALL_BLOCKS + 1000)  # out of range: would fault on a device
                cpu.copy_(torch.tensor([20, 21, 22]))
                await transfer
                model.store([1, 2, 3], [10, 11, 12])
                model.check()
