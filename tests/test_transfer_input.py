"""Every transfer call the manager refuses: bad block ids, unknown copy methods, a manager
without a KV layout, a closed manager, a call from outside the event loop's thread.

Each is refused synchronously with a typed error (``InvalidTransferError``, a
``ValueError`` and a ``TransferError``; ``anyio.ClosedResourceError`` after close) before
anything is enqueued: counters unchanged, no block moved.

Synchronisation is on events only: ``FakeBackend.stalled`` (a pin call is held), the
:class:`~tests.kit.CopyGate` (a copy is held in its worker thread) and
``anyio.wait_all_tasks_blocked()``. Every wait is bounded by ``anyio.fail_after`` and
every hold is released in a ``finally``, so a failed check fails the test instead of
hanging a shielded close. Every test runs on asyncio and on trio.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import anyio
import anyio.from_thread
import anyio.to_thread
import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from asyncpin import (
    ConfigError,
    InvalidTransferError,
    OffloadManager,
    Transfer,
    TransferError,
)
from asyncpin.testing import FakeBackend
from asyncpin.transfers import CheckedIds
from tests.helpers import TIMEOUT_S
from tests.kit import (
    PAGE,
    SMALL_BLOCKS,
    SMALL_HOST_BLOCKS,
    Direction,
    KVModel,
    randomize_host,
    small_kv,
    small_manager,
    submit,
    transfer_counters,
)

pytestmark = pytest.mark.anyio


N = SMALL_BLOCKS
H = SMALL_HOST_BLOCKS


def _quantized(values: list[float]) -> torch.Tensor:
    """A quantized tensor (its dtype holds integers, but tolist() cannot read it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        return torch.quantize_per_tensor(torch.tensor(values), 1.0, 0, torch.qint8)


class _StrEqualsAll(str):
    """A str that says it equals anything (a review: ``in`` asked it, not the str)."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = str.__hash__


class _EqualsAll:
    """A method= that says it equals anything."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return "EqualsAll()"


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
    # Unordered (ids pair by position) or bytes rather than ids.
    BadIds("set", {0, 1}, [0, 1], ("gpu_block_ids", "set")),
    BadIds("dict", [0, 1], {0: 0, 1: 1}, ("cpu_block_ids", "dict")),
    BadIds("bytes", b"\x00\x01", [0, 1], ("gpu_block_ids", "bytes")),
    BadIds("memoryview", [0, 1], memoryview(b"\x00\x01"), ("cpu_block_ids", "memoryview")),
    BadIds("sparse-tensor", torch.tensor([0, 1]).to_sparse(), [0, 1], ("dense", "sparse")),
    BadIds("quantized-tensor", [0, 1], _quantized([0.0, 1.0]), ("cpu_block_ids", "qint8")),
    # More ids than a call can move (its destinations are distinct), told before a list
    # is made of them: never built, nor refused only by a MemoryError.
    BadIds("gpu-huge-range", range(2**62), [0, 1], ("gpu_block_ids", "more ids than")),
    BadIds("cpu-beyond-int64-range", [0, 1], range(2**64), ("cpu_block_ids", "more ids than")),
    BadIds("gpu-endless-iterator", itertools.count(), [0], ("gpu_block_ids", "more ids than")),
    BadIds("cpu-long-list", [0], [0] * (N + H + 1), ("cpu_block_ids", f"{N + H + 1} ids")),
    BadIds(
        "gpu-long-tensor", torch.zeros(N + H + 1, dtype=torch.int64), [0], (f"{N + H + 1} ids",)
    ),
    BadIds(
        "cpu-long-broadcast-array",
        [0],
        np.broadcast_to(np.int64(0), (10**12,)),
        ("cpu_block_ids", f"{10**12} ids"),
    ),
    # Ids checked once against a larger bound (a layer-wise load's groups share them): the
    # manager still checks the bound against its own blocks.
    BadIds("checked-gpu-beyond", CheckedIds([0, N], "ids", 1 << 20), [0, 1], (f"{N}, outside",)),
    BadIds("checked-cpu-beyond", [0, 1], CheckedIds([H + 3], "ids", 1 << 20), (f"{H + 3}",)),
]
BAD_IDS: list[tuple[Direction, BadIds]] = [
    (direction, case) for direction in ("store", "load") for case in BAD_IDS_EITHER_WAY
]
# Duplicate destinations: host blocks for a store, device blocks for a load.
BAD_IDS += [
    ("store", BadIds("dup-dst", [0, 1, 2], [4, 5, 4], ("cpu_block_ids", "duplicate"))),
    ("load", BadIds("dup-dst", [7, 3, 7], [4, 5, 6], ("gpu_block_ids", "duplicate"))),
    # Checked ids skip the duplicate check only when they were found unique.
    ("store", BadIds("dup-checked", [0, 1], CheckedIds([4, 4], "c", H), ("duplicate",))),
    ("load", BadIds("dup-checked", CheckedIds([3, 3], "g", N), [4, 5], ("duplicate",))),
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

    @pytest.mark.parametrize(
        "method",
        [
            "bogus",
            "Pack",
            "",
            None,
            3,
            # ``in`` compares with ==: an array answered with numpy's own ValueError, or
            # was taken as "auto"; an object equal to everything was taken as a method.
            np.array(["auto", "host"]),
            np.array(["auto"]),
            _EqualsAll(),
            _StrEqualsAll("no such method"),
        ],
        ids=repr,
    )
    async def test_unknown_method(self, method: str, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                before = transfer_counters(mgr.stats())
                bad: Any = method  # not a Method literal
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

    @pytest.mark.parametrize("method", ["batch", "pack", "kernel"])
    async def test_a_method_the_engine_lacks_runs_as_auto(
        self, method: str, gen: torch.Generator
    ) -> None:
        """The CUDA engine's methods on the host engine run as its own, logged once, so
        that code naming a method runs on a machine without a GPU (a newcomer's trial:
        they were refused there alone)."""
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
            async with small_manager(layout, FakeBackend()) as mgr:
                stored = mgr.store([0], [0], method=method)  # type: ignore[arg-type]
                await stored
                loaded = mgr.load([0], [1], method=method)  # type: ignore[arg-type]
                await loaded
                assert stored.method == loaded.method == "host"
                assert torch.equal(layout.byte_arrays()[0][1], layout.byte_arrays()[0][0])
        fallbacks = [e for e in logs if e["event"] == "transfer.method_fallback"]
        assert [(e["requested"], e["fallback"]) for e in fallbacks] == [(method, "auto")]

    async def test_empty_ids_of_any_dtype_are_no_ids(self, gen: torch.Generator) -> None:
        # np.array([]) is float64 and torch.tensor([]) float32: no ids all the same.
        layout = small_kv(gen)
        with anyio.fail_after(TIMEOUT_S):
            async with small_manager(layout, FakeBackend()) as mgr:
                await mgr.pinned
                for gpu, cpu in ((np.array([]), torch.tensor([])), ([], np.array([]))):
                    transfer = mgr.store(gpu, cpu)
                    await transfer
                    assert transfer.num_blocks == 0 and transfer.nbytes == 0

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


class TestRefusedCalls:
    """A closed manager and a thread other than the event loop's get no transfer."""

    async def test_use_after_close_raises_closed_resource_error(self, gen: torch.Generator) -> None:
        layout = small_kv(gen)
        mgr = small_manager(layout, FakeBackend())
        with pytest.raises(anyio.ClosedResourceError, match=r"not open yet \(enter it first"):
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
            with pytest.raises(
                anyio.ClosedResourceError, match=r"closed to new transfers|the manager is not open$"
            ):
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
