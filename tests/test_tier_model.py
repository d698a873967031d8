"""Model-based test of KVTier over a real manager whose copies the test controls.

The manager (``OffloadManager.for_kv``, FakeBackend) has few host blocks, so stores evict
and skip often; its engine is a :class:`~asyncpin.testing.FakeEngine` with ``copy=True``:
every store and load is held until the test hands it on, then its bytes really move
(through the host engine) and the test awaits its end before the next step. A session is
a list of steps, drawn by hypothesis and replayed in one event loop (asyncio or trio):

- store hashes from device blocks that first get a byte pattern of their hash (so the bytes
  a hash must have are known), sometimes with the engine's submit failing;
- load loadable hashes into device blocks, whole (``load``) or by groups of arrays
  (``load_layers``: the layout's tensors, halves, every array, overlapping groups,
  reversed), sometimes with a hash that is not loadable, or with the submit of the k-th
  group failing (the groups before it stay queued);
- finish the oldest held store or load: ok, with an error (``finish_next(d, error)``), or
  failing because ``fail_copy`` was armed by an earlier step; sometimes a task awaiting it
  is cancelled while its copy runs;
- cancel a task that awaits a held transfer or layer load (nothing changes for the copy);
- remove, clear, touch, lookup;
- at the end, close the manager with copies still held: the close waits for the copies
  the engine holds (it interrupts none of them: the test finishes them, ok or not, while
  the manager is CLOSING and the close has not ended; stores and loads asked for meanwhile
  are refused), then every copy has ended and the index is consistent.

Each session draws its event loop and the tier's policy (every one of ``POLICY_NAMES``),
on a layout of arrays of different sizes and dtypes ("mla_indexer") or of one size
("joined").

Device blocks used by a copy in flight are never rewritten by the test (a store's source,
a load's destination), as an engine's caller must not. The model keeps the loadable hashes
and their host blocks, the hashes being stored, the copies in flight and the loads'
protected hashes; it learns which victims the policy chose from the index's "removed"
events (``tier.add_listener``), and predicts everything else. After every step:

- no wrong byte: a load that completed ok wrote exactly the hash's pattern into each
  device block of its arrays; every loadable hash's host block holds its pattern;
- no eviction of a protected block: a victim is loadable, read by no load in flight and
  not present in the store that evicts it; a hash being loaded stays indexed at its block
  until the load ends unless removed or cleared; a store's host blocks are free or its
  victims' (never a block a copy in flight uses, nor a loadable one);
- capacity: ``len(index) <= H`` and ``resident_blocks + free_blocks + (blocks held by
  copies in flight, not resident) == H``;
- lookup is the model's count of leading loadable hashes; ``present``, ``skipped`` and the
  number of evictions of a store are the model's;
- a failed store (copy or submit) leaves nothing of it indexed; a failed load leaves its
  hashes loadable; the index's counters of skipped, failed, evicted and removed blocks;
- the engine holds exactly the copies the model expects, and hands them on oldest first;
  once every group of a layer load is done, awaiting it raises its first failure, if any.

The random sessions must reach evictions, skips, failed stores and loads, layer loads,
removals while loading and storing, cancelled waiters and a close with copies held (a
change of the strategies that made them vacuous fails). The two defects it found (a
layer load awaited returned before its last groups; a group that could not be queued
raised, leaving earlier groups queued with no handle) have tests at the end.

It does not repeat tests/test_tier_index.py (the bare index against a full model, the
victim order of each policy): here the index sits behind a real manager and real copies.
CI runs a fixed (derandomized) set of examples; for more, random ones::

    ASYNCPIN_TIER_MODEL_EXAMPLES=1000 python -m pytest tests/test_tier_model.py
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import traceback
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
import structlog.testing
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncpin import InvalidTransferError, KVLayout, ManagerState, OffloadManager, TransferError
from asyncpin.abc import EngineSetup
from asyncpin.testing import FakeBackend, FakeEngine
from asyncpin.tier import BlockEvent, BlockHash, KVTier, LayerLoad, StorePlan
from asyncpin.tier.policies import POLICY_NAMES
from asyncpin.transfers import Direction, Transfer, TransferJob
from tests.layouts import build

HOST_BLOCKS = 5
DEVICE_BLOCKS = 12
# Nine hashes for five host blocks; 1 and b"\x01" are different hashes.
HASHES: tuple[BlockHash, ...] = (0, 1, 2, 3, 4, 5, 2**64 + 1, b"", b"\x01")
DIRECTIONS: tuple[Direction, ...] = ("store", "load")
BACKENDS = ("asyncio", "trio")
LAYOUTS = ("mla_indexer", "joined")  # heterogeneous arrays; uniform ones
STEP_TIMEOUT_S = 10.0
EXAMPLE_TIMEOUT_S = 60.0
MIN_STEPS = 20
MAX_STEPS = 60
EXAMPLES_ENV = "ASYNCPIN_TIER_MODEL_EXAMPLES"
CI_EXAMPLES = 200  # per layout

# -- steps -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Store:
    """``tier.store`` of HASHES[i] for i in ``hashes``, from device blocks picked by
    ``pick``; ``submit_fails``: the engine's submit raises; ``finish``: then finish the
    oldest held store (this one, unless older ones are held)."""

    hashes: tuple[int, ...]
    pick: int
    submit_fails: bool = False
    finish: bool = False


GroupKind: TypeAlias = Literal["tensors", "halves", "all", "overlap", "reversed"]


@dataclass(frozen=True)
class Load:
    """Load loadable hashes (``picks`` among them) into device blocks picked by ``pick``:
    ``tier.load`` (``groups`` None) or ``tier.load_layers``. ``fail_submit``: the submit
    of the k-th transfer of the call raises; ``not_loadable``: a hash that is not loadable
    is added (InvalidTransferError, nothing protected)."""

    picks: tuple[int, ...]
    pick: int
    groups: GroupKind | None = None
    fail_submit: int | None = None
    not_loadable: bool = False


@dataclass(frozen=True)
class Finish:
    """Hand on the oldest held copy of ``direction`` (of the other one if none is held;
    ``error``: finished with an error) and await its end; ``cancel_waiter``: a task
    awaiting it is cancelled meanwhile."""

    direction: Direction
    error: bool = False
    cancel_waiter: bool = False


@dataclass(frozen=True)
class ArmFailure:
    """``engine.fail_copy(direction=...)``: the next copy of ``direction`` handed on fails."""

    direction: Direction


@dataclass(frozen=True)
class CancelWaiter:
    """A task awaits a held transfer, or a whole layer load, and is cancelled."""

    pick: int


@dataclass(frozen=True)
class Remove:
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class Clear:
    pass


@dataclass(frozen=True)
class Touch:
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class Lookup:
    hashes: tuple[int, ...]


Step: TypeAlias = (
    Store | Load | Finish | ArmFailure | CancelWaiter | Remove | Clear | Touch | Lookup
)


@dataclass(frozen=True)
class Close:
    """The end of every session: close while copies are held, and finish them in this
    order (direction wanted, with an error) while the close waits (the rest: ok, oldest
    first); ``refuse``: a store and a load asked for meanwhile are refused."""

    order: tuple[tuple[Direction, bool], ...] = ()
    refuse: bool = False


# -- the engine ----------------------------------------------------------------------------


class ModelEngine(FakeEngine):
    """FakeEngine moving real bytes, whose submit can fail at the k-th call from now."""

    def __init__(self, setup: EngineSetup) -> None:
        super().__init__(setup, copy=True)
        self.submits_before_failure: int | None = None

    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        left = self.submits_before_failure
        if left is not None:
            if left == 0:
                self.submits_before_failure = None
                raise RuntimeError("injected submit failure")
            self.submits_before_failure = left - 1
        super().submit(job, pageable=pageable)


# -- the model ------------------------------------------------------------------------------


def pattern(h: BlockHash, a: int, nbytes: int) -> torch.Tensor:
    """The bytes of array ``a`` of a device block holding hash ``h``."""
    seed = HASHES.index(h)
    values = torch.arange(nbytes, dtype=torch.int64) * (2 * seed + 1) + 37 * seed + 101 * a
    return (values % 256).to(torch.uint8)


@dataclass(eq=False)
class StoreFlight:
    transfer: Transfer
    plan: StorePlan
    device: list[int]


@dataclass(eq=False)
class LoadFlight:
    hashes: list[BlockHash]
    blocks: list[int]  # host
    device: list[int]
    groups: list[range]  # of each transfer
    transfers: list[Transfer]
    handle: LayerLoad | None
    pending: int
    removed: set[BlockHash] = field(default_factory=set)  # removed since it began


Event: TypeAlias = tuple[str, BlockHash, int]


def _event(e: BlockEvent) -> Event:
    return (e.kind, e.block_hash, e.host_block)


async def settle(awaitable: Transfer | LayerLoad) -> None:
    """Wait for the end of a transfer (or every group of a layer load), whatever it is."""
    with anyio.fail_after(STEP_TIMEOUT_S), contextlib.suppress(Exception):
        await awaitable


class Session:
    """One tier over one open manager, driven step by step against the model."""

    def __init__(
        self,
        mgr: OffloadManager,
        engine: ModelEngine,
        layout: KVLayout,
        policy: str,
        counts: Counter[str],
    ) -> None:
        self.mgr = mgr
        self.engine = engine
        self.layout = layout
        self.tier = KVTier(mgr, policy=policy)
        self.counts = counts
        self.raw = layout.byte_arrays()
        self.sizes = layout.array_block_bytes
        self.offsets = layout.array_offsets
        self.patterns = {
            (h, a): pattern(h, a, self.sizes[a]) for h in HASHES for a in range(layout.num_arrays)
        }
        self.events: list[BlockEvent] = []
        self.tier.add_listener(self.events.append)
        # The model.
        self.ready: dict[BlockHash, int] = {}  # loadable: host block
        self.storing: dict[BlockHash, int] = {}  # indexed, its store in flight
        self.stores: dict[Transfer, StoreFlight] = {}
        self.loads: dict[Transfer, tuple[LoadFlight, int]] = {}
        self.load_flights: list[LoadFlight] = []
        self.held: dict[Direction, deque[Transfer]] = {d: deque() for d in DIRECTIONS}
        self.armed: dict[Direction, int] = dict.fromkeys(DIRECTIONS, 0)
        self.skipped = self.failed = self.evicted = self.removed = 0
        self.where = "open"

    # -- what the model derives --------------------------------------------------------

    def protected(self) -> set[BlockHash]:
        """Hashes a load in flight reads (and that were not removed since it began)."""
        return {h for lf in self.load_flights for h in lf.hashes if h not in lf.removed}

    def in_flight_blocks(self) -> set[int]:
        blocks = {b for sf in self.stores.values() for b in sf.plan.host_blocks}
        return blocks | {b for lf in self.load_flights for b in lf.blocks}

    def used_blocks(self) -> set[int]:
        return set(self.ready.values()) | self.in_flight_blocks()

    def busy_device(self) -> set[int]:
        busy = {g for sf in self.stores.values() for g in sf.device}
        return busy | {g for lf in self.load_flights for g in lf.device}

    def pick_device(self, n: int, pick: int) -> list[int] | None:
        free = [g for g in range(DEVICE_BLOCKS) if g not in self.busy_device()]
        if len(free) < n:
            return None
        return random.Random(pick).sample(free, n)

    def leading(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self.ready:
                break
            n += 1
        return n

    def take_events(self) -> list[BlockEvent]:
        events = list(self.events)
        self.events.clear()
        return events

    # -- invariants after every step ---------------------------------------------------

    def check(self) -> None:
        index = self.tier.index
        stats = self.tier.stats()
        assert not self.events, f"events no step accounts for: {self.events}"
        assert len(index) <= HOST_BLOCKS
        assert len(index) == len(self.ready) + len(self.storing)
        assert len(set(self.ready.values())) == len(self.ready), "two hashes share a block"
        assert not set(self.storing.values()) & set(self.ready.values())
        held_by_copies = self.in_flight_blocks() - set(self.ready.values())
        assert stats.resident_blocks == len(self.ready)
        assert stats.resident_blocks + stats.free_blocks + len(held_by_copies) == HOST_BLOCKS, (
            stats,
            self.ready,
            held_by_copies,
        )
        counters = (
            stats.skipped_blocks,
            stats.failed_blocks,
            stats.evicted_blocks,
            stats.removed_blocks,
        )
        assert counters == (self.skipped, self.failed, self.evicted, self.removed)
        for h in HASHES:
            assert index.host_block(h) == self.ready.get(h), h
            assert (h in index) == (h in self.ready)
        assert index.leading(HASHES) == self.leading(HASHES)
        # Loadable: the index's leading hits while the manager is open, none after.
        loadable = self.leading(HASHES) if self.mgr.state is ManagerState.OPEN else 0
        assert self.tier.lookup(HASHES) == loadable
        for lf in self.load_flights:  # protected blocks stay where the load reads them
            for h, b in zip(lf.hashes, lf.blocks, strict=True):
                if h not in lf.removed:
                    assert self.ready.get(h) == b, f"{h!r} evicted while a load reads it"
        for d in DIRECTIONS:
            assert [job.transfer for job in self.engine.held(d)] == list(self.held[d])
        if self.mgr.state is ManagerState.OPEN:
            host = self.mgr.host_bytes()
            for h, b in self.ready.items():
                for a, (offset, size) in enumerate(zip(self.offsets, self.sizes, strict=True)):
                    got = host[b, offset : offset + size]
                    assert torch.equal(got, self.patterns[h, a]), f"host block {b} of {h!r}"

    # -- steps -------------------------------------------------------------------------

    async def run(self, steps: Sequence[Step], close: Close) -> None:
        self.check()
        for i, step in enumerate(steps):
            self.where = f"step {i}: {step}"
            await self.step(step)
            self.check()
        self.where = f"close: {close}"
        await self.close(close)

    async def step(self, step: Step) -> None:
        self.counts[type(step).__name__] += 1
        if isinstance(step, Store):
            self.store([HASHES[i] for i in step.hashes], step.pick, step.submit_fails)
            if step.finish:
                await self.finish("store", False, cancel_waiter=False)
        elif isinstance(step, Load):
            self.load(step)
        elif isinstance(step, Finish):
            direction = step.direction
            if not self.held[direction]:
                direction = "load" if direction == "store" else "store"
            await self.finish(direction, step.error, cancel_waiter=step.cancel_waiter)
        elif isinstance(step, ArmFailure):
            self.engine.fail_copy(direction=step.direction)
            self.armed[step.direction] += 1
        elif isinstance(step, CancelWaiter):
            await self.cancel_waiter(step.pick)
        elif isinstance(step, Remove):
            self.remove([HASHES[i] for i in step.hashes])
        elif isinstance(step, Clear):
            self.clear()
        elif isinstance(step, Touch):
            self.tier.touch([HASHES[i] for i in step.hashes])
        else:
            hashes = [HASHES[i] for i in step.hashes]
            assert self.tier.lookup(hashes) == self.leading(hashes)

    def store(
        self,
        hashes: list[BlockHash],
        pick: int,
        submit_fails: bool,
        refused: bool = False,
    ) -> None:
        device = self.pick_device(len(hashes), pick)
        if device is None:
            self.counts["store: no free device blocks"] += 1
            return
        for h, g in zip(hashes, device, strict=True):
            for a, raw in enumerate(self.raw):
                raw[g].copy_(self.patterns[h, a])
        # What the index must decide: the present hashes, how many new ones get a block
        # (free, or evicted: loadable, not being loaded, not present in this call).
        entries = set(self.ready) | set(self.storing)
        keep = {h for h in hashes if h in entries}
        protected = self.protected()
        used_before = self.used_blocks()
        free = HOST_BLOCKS - len(used_before)
        evictable = [h for h in self.ready if h not in protected and h not in keep]
        room = free + len(evictable)
        todo: list[BlockHash] = []
        present: list[BlockHash] = []
        skipped: list[BlockHash] = []
        for h in hashes:
            if h in entries:
                present.append(h)
            elif room:
                room -= 1
                entries.add(h)
                todo.append(h)
            else:
                skipped.append(h)
        evictions = max(0, len(todo) - free)
        if submit_fails:
            self.engine.submits_before_failure = 0
        stored = None
        try:
            stored = self.tier.store(hashes, device)
        except TransferError:
            assert submit_fails and not refused
            self.counts["store: submit failed"] += 1
        except anyio.ClosedResourceError:
            assert refused  # the manager is closing: refused before the index changed
            assert self.take_events() == []
            return
        else:
            assert not submit_fails and not refused
        finally:
            self.engine.submits_before_failure = None
        events = self.take_events()
        assert [e.kind for e in events] == ["removed"] * evictions, events
        for e in events:
            victim = e.block_hash
            assert self.ready.get(victim) == e.host_block, f"evicted {victim!r}: not loadable"
            assert victim not in protected, f"evicted {victim!r} while a load reads it"
            assert victim not in keep, f"evicted {victim!r}, present in the same store"
            del self.ready[victim]
            self.mark_removed(victim)
        self.evicted += evictions
        self.skipped += len(skipped)
        self.counts["evictions"] += evictions
        self.counts["skipped"] += len(skipped)
        if stored is None:  # its submit failed (its victims stay evicted): nothing indexed
            self.failed += len(todo)
            for h in todo:
                assert h not in self.tier.index and self.tier.index.host_block(h) is None
            return
        plan = stored.plan
        assert list(plan.hashes) == todo
        assert list(plan.present) == present and list(stored.skipped) == skipped
        assert [hashes[i] for i in plan.positions] == todo
        victims = {e.host_block for e in events}
        mine = set(plan.host_blocks)
        assert len(mine) == len(plan.host_blocks), f"one block twice: {plan}"
        handed = mine - victims
        assert not handed & used_before, f"blocks in use handed to a store: {handed & used_before}"
        for h, b in zip(plan.hashes, plan.host_blocks, strict=True):
            self.storing[h] = b
        self.stores[stored.transfer] = StoreFlight(stored.transfer, plan, device)
        self.held["store"].append(stored.transfer)

    def mark_removed(self, h: BlockHash) -> None:
        for lf in self.load_flights:
            if h in lf.hashes:
                lf.removed.add(h)

    def groups(self, kind: GroupKind) -> list[range]:
        n = self.layout.num_arrays
        tensors = list(self.layout.tensor_arrays)
        return {
            "tensors": tensors,  # load_layers' default (passed as None)
            "halves": [range(0, n // 2), range(n // 2, n)],
            "all": [range(0, n)],
            "overlap": [range(1, n), range(0, 2)],
            "reversed": tensors[::-1],
        }[kind]

    def load(self, step: Load) -> None:
        if not self.ready:
            self.counts["load: nothing loadable"] += 1
            return
        pool = sorted(self.ready, key=HASHES.index)
        hashes = [pool[p % len(pool)] for p in step.picks]
        if step.not_loadable:
            absent = [h for h in HASHES if h not in self.ready]
            if not absent:
                return
            hashes.insert(step.pick % (len(hashes) + 1), absent[step.pick % len(absent)])
        device = self.pick_device(len(hashes), step.pick)
        if device is None:
            self.counts["load: no free device blocks"] += 1
            return
        layered = step.groups is not None
        ranges = [range(self.layout.num_arrays)]
        groups: list[range] | None = None
        if step.groups is not None:
            ranges = self.groups(step.groups)
            groups = None if step.groups == "tensors" else ranges
        if step.not_loadable:
            with pytest.raises(InvalidTransferError, match="not loadable"):
                if layered:
                    self.tier.load_layers(hashes, device, groups)
                else:
                    self.tier.load(hashes, device)
            self.counts["load: not loadable"] += 1
            return
        blocks = [self.ready[h] for h in hashes]
        failing = step.fail_submit is not None and step.fail_submit < len(ranges)
        self.engine.submits_before_failure = step.fail_submit
        submitted_before = len(self.engine.submitted)
        handle: LayerLoad | None = None
        try:
            if layered:
                handle = self.tier.load_layers(hashes, device, groups)
                transfers = list(handle.transfers)
                assert handle.groups == tuple(ranges)
                if failing:
                    # Groups queued before the failed submit stay in flight, protected;
                    # that group and the rest failed through the handle.
                    assert step.fail_submit
                    queued = [j.job.transfer for j in self.engine.submitted[submitted_before:]]
                    assert transfers[: len(queued)] == queued
                    for t in transfers[len(queued) :]:
                        assert t.done() and isinstance(t.error, TransferError)
                    transfers = queued
                    self.counts["load_layers: groups queued before a failed submit"] += 1
            else:
                transfers = [self.tier.load(hashes, device)]
                assert not failing
        except TransferError:
            assert failing and not self.engine.submitted[submitted_before:]
            transfers = []  # nothing queued: the call failed
            self.counts["load: submit failed"] += 1
        finally:
            self.engine.submits_before_failure = None
        assert self.take_events() == []
        if not transfers:
            return
        flight = LoadFlight(
            hashes, blocks, device, ranges[: len(transfers)], transfers, handle, len(transfers)
        )
        self.load_flights.append(flight)
        for i, transfer in enumerate(transfers):
            self.loads[transfer] = (flight, i)
            self.held["load"].append(transfer)
        self.counts["load_layers" if layered else "load"] += 1

    async def finish(self, direction: Direction, error: bool, *, cancel_waiter: bool) -> None:
        held = self.held[direction]
        if not held:
            self.counts["finish: nothing held"] += 1
            return
        transfer = held.popleft()
        fails = error or self.armed[direction] > 0
        if not error and self.armed[direction]:
            self.armed[direction] -= 1  # an explicit error leaves the armed one for later
        job = self.engine.finish_next(direction, OSError("injected") if error else None)
        assert job.transfer is transfer, "the engine handed on another copy than the oldest"
        if cancel_waiter:
            await self.cancel_awaiting(transfer, held=False)
        await settle(transfer)
        assert transfer.done()
        assert (transfer.error is not None) == fails, transfer.error
        if fails:
            assert isinstance(transfer.error, TransferError), repr(transfer.error)
        ended = self.completed(transfer)
        if ended is not None and ended.handle is not None:
            # Every group done: awaiting the layer load raises its first failure, if any.
            failures = [t.error for t in ended.handle.transfers if t.error is not None]
            try:
                with anyio.fail_after(STEP_TIMEOUT_S):
                    await ended.handle
            except TransferError as exc:
                assert failures and exc is failures[0]
            else:
                assert not failures

    def completed(self, transfer: Transfer) -> LoadFlight | None:
        """The model's part of a copy's end; returns a load whose last copy it was."""
        ok = transfer.error is None
        events = [_event(e) for e in self.take_events()]
        self.counts[f"{transfer.direction} {'ok' if ok else 'failed'}"] += 1
        flight = self.stores.pop(transfer, None)
        if flight is not None:
            expected: list[Event] = []
            for h, b in zip(flight.plan.hashes, flight.plan.host_blocks, strict=True):
                if self.storing.get(h) != b:
                    self.counts["store ended after its hash was removed"] += 1
                    continue
                del self.storing[h]
                if ok:
                    self.ready[h] = b
                    expected.append(("stored", h, b))
                else:
                    self.failed += 1
            assert events == expected
            if not ok:  # nothing of a failed store indexed
                for h, b in zip(flight.plan.hashes, flight.plan.host_blocks, strict=True):
                    assert self.tier.index.host_block(h) != b
            return None
        load, i = self.loads.pop(transfer)
        assert events == []
        if ok:  # every byte it wrote is the hash's
            for h, g in zip(load.hashes, load.device, strict=True):
                for a in load.groups[i]:
                    got = self.raw[a][g]
                    assert torch.equal(got, self.patterns[h, a]), (
                        f"device block {g}, array {a}: not the bytes of {h!r}"
                    )
            if load.removed:
                self.counts["load ok after its hash was removed"] += 1
        else:  # a failed load leaves the hashes loadable
            for h, b in zip(load.hashes, load.blocks, strict=True):
                if h not in load.removed:
                    assert self.tier.index.host_block(h) == b
        load.pending -= 1
        if load.pending:
            return None
        self.load_flights.remove(load)
        if load.handle is not None:
            assert load.handle.done()
        return load

    async def cancel_waiter(self, pick: int) -> None:
        awaitables: list[Transfer | LayerLoad] = [*self.held["store"], *self.held["load"]]
        # Not a layer load with a failed group: awaiting it raises at once, while later
        # groups are in flight (test_awaiting_a_layer_load_with_a_failed_group_...).
        awaitables += [
            lf.handle
            for lf in self.load_flights
            if lf.handle is not None and all(t.error is None for t in lf.transfers)
        ]
        if not awaitables:
            return
        await self.cancel_awaiting(awaitables[pick % len(awaitables)], held=True)

    async def cancel_awaiting(self, awaitable: Transfer | LayerLoad, *, held: bool) -> None:
        """A task awaits ``awaitable`` and is cancelled: the copy goes on regardless."""
        outcome: list[str] = []

        async def waiter(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            task_status.started()
            try:
                await awaitable
            except anyio.get_cancelled_exc_class():
                outcome.append("cancelled")
                raise
            except Exception:
                outcome.append("failed")
            else:
                outcome.append("done")

        with anyio.fail_after(STEP_TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                await tg.start(waiter)
                await anyio.lowlevel.checkpoint()  # it waits (wait_all_tasks_blocked is slow)
                tg.cancel_scope.cancel()
        if held:  # nothing was handed on: the cancel ended the wait, nothing else
            assert outcome == ["cancelled"] and not awaitable.done()
        self.counts["waiter cancelled"] += 1

    def remove(self, hashes: list[BlockHash]) -> None:
        expected: list[Event] = []
        n = 0
        protected = self.protected()
        for h in dict.fromkeys(hashes):
            if h in protected:
                self.counts["removed while loading"] += 1
            if h in self.ready:
                expected.append(("removed", h, self.ready.pop(h)))
                self.mark_removed(h)
                n += 1
            elif h in self.storing:
                del self.storing[h]
                self.counts["removed while storing"] += 1
                n += 1
        assert self.tier.remove(hashes) == n
        assert [_event(e) for e in self.take_events()] == expected
        self.removed += len(expected)

    def clear(self) -> None:
        expected = sorted((("removed", h, b) for h, b in self.ready.items()), key=lambda e: e[2])
        for h in self.ready:
            self.mark_removed(h)
        self.ready.clear()
        self.storing.clear()
        self.tier.clear()
        assert sorted((_event(e) for e in self.take_events()), key=lambda e: e[2]) == expected
        self.removed += len(expected)

    # -- the close -----------------------------------------------------------------------

    async def close(self, close: Close) -> None:
        held_at_close = sum(len(q) for q in self.held.values())
        closed = anyio.Event()

        async def closer() -> None:
            await self.mgr.aclose()
            closed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(closer)
            try:
                await self.close_steps(close, held_at_close, closed)
            except BaseException:
                self.release_all()  # the close task waits for them: let it end
                raise
        # Every copy ended; nothing is being stored or loaded; every block is free or
        # loadable.
        assert self.mgr.state is ManagerState.CLOSED and self.engine.closed
        assert not self.stores and not self.loads and not self.load_flights
        assert not self.storing
        self.check()
        stats = self.tier.stats()
        assert stats.resident_blocks + stats.free_blocks == HOST_BLOCKS
        assert len(self.tier.index) == len(self.ready)

    async def close_steps(self, close: Close, held_at_close: int, closed: anyio.Event) -> None:
        with anyio.fail_after(STEP_TIMEOUT_S):
            while self.mgr.state is ManagerState.OPEN:
                await anyio.lowlevel.checkpoint()
        if held_at_close:
            self.counts["close with copies held"] += 1
            # The close waits for the copies in flight, refusing new ones.
            assert self.mgr.state is ManagerState.CLOSING and not closed.is_set()
            if close.refuse:
                self.counts["refused while closing"] += 1
                self.store([HASHES[0], HASHES[-1]], 0, False, refused=True)
                device = self.pick_device(1, 0)
                if self.ready and device is not None:
                    h = next(iter(self.ready))
                    with pytest.raises(anyio.ClosedResourceError):
                        self.tier.load([h], device)
                    with pytest.raises(anyio.ClosedResourceError):
                        self.tier.load_layers([h], device)
                self.check()
        for direction, error in close.order:
            if not any(self.held.values()):
                break
            if not self.held[direction]:
                direction = "load" if direction == "store" else "store"
            self.where = f"close: finishing a {direction}"
            await self.finish(direction, error, cancel_waiter=False)
            self.check()
            assert not closed.is_set() or not any(self.held.values()), "closed with copies held"
        for direction in DIRECTIONS:
            while self.held[direction]:
                await self.finish(direction, False, cancel_waiter=False)
                assert not closed.is_set() or not any(self.held.values())
        with anyio.fail_after(STEP_TIMEOUT_S):
            await closed.wait()

    def release_all(self) -> None:
        """After a failed check: hand on every held copy, so that the close can end."""
        for direction in DIRECTIONS:
            while self.engine.held(direction):
                self.engine.finish_next(direction)


# -- running an example ------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    loop: str
    layout: str
    policy: str
    steps: tuple[Step, ...]
    close: Close


def run_example(example: Example, counts: Counter[str]) -> None:
    """One session in its own event loop and thread: a hang fails it, naming the step."""
    errors: list[BaseException] = []
    where = ["start"]

    async def main() -> None:
        layout = build(example.layout, DEVICE_BLOCKS, "cpu")
        engines: list[ModelEngine] = []

        def make(setup: EngineSetup) -> ModelEngine:
            engines.append(ModelEngine(setup))
            return engines[-1]

        mgr = OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend(), engine=make)
        with anyio.fail_after(STEP_TIMEOUT_S):
            await mgr.__aenter__()
        session: Session | None = None
        try:
            with anyio.fail_after(STEP_TIMEOUT_S):
                await mgr.pinned
            (engine,) = engines
            session = Session(mgr, engine, layout, example.policy, counts)
            try:
                await session.run(example.steps, example.close)
            finally:
                where[0] = session.where
        finally:
            if session is not None:
                session.release_all()
            await mgr.aclose()

    def target() -> None:
        try:
            anyio.run(main, backend=example.loop)
        except BaseException as exc:
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            errors.append(exc)

    counts["examples"] += 1
    with structlog.testing.capture_logs():
        thread = threading.Thread(target=target, name="tier-model-example", daemon=True)
        thread.start()
        thread.join(EXAMPLE_TIMEOUT_S)
        if thread.is_alive():
            frames = sys._current_frames()
            ident = thread.ident
            stack = "".join(traceback.format_stack(frames[ident])) if ident in frames else ""
            raise AssertionError(f"the example hung at {where[0]}\n{stack}")
    if errors:
        error = errors[0]
        error.add_note(f"at {where[0]}")
        raise error


# -- strategies ----------------------------------------------------------------------------


def rare(one_in: int) -> st.SearchStrategy[bool]:
    """True about once in ``one_in`` draws (integers would favour the edges)."""
    return st.sampled_from((False,) * (one_in - 1) + (True,))


hash_ids = st.lists(st.integers(0, len(HASHES) - 1), min_size=1, max_size=4).map(tuple)
picks = st.integers(0, 1 << 16)
directions = st.sampled_from(DIRECTIONS)
group_kinds: st.SearchStrategy[GroupKind | None] = st.sampled_from(
    (None, None, "tensors", "halves", "all", "overlap", "reversed")
)

STORE = st.builds(Store, hash_ids, picks, rare(8), st.booleans())
LOAD = st.builds(
    Load,
    st.lists(picks, min_size=1, max_size=3).map(tuple),
    picks,
    group_kinds,
    st.sampled_from((None, None, None, None, None, 0, 1, 2)),
    rare(10),
)
FINISH = st.builds(Finish, directions, rare(6), rare(6))
# Weights of the kinds of steps (``one_of`` would draw each distinct branch about as often):
# mostly stores, loads and finishes, so that copies pile up, evict and skip.
KINDS: dict[str, tuple[int, st.SearchStrategy[Step]]] = {
    "store": (6, STORE),
    "load": (5, LOAD),
    "finish": (6, FINISH),
    "arm": (1, st.builds(ArmFailure, directions)),
    "cancel": (1, st.builds(CancelWaiter, picks)),
    "remove": (2, st.builds(Remove, hash_ids)),
    "clear": (1, st.just(Clear())),
    "touch": (1, st.builds(Touch, hash_ids)),
    "lookup": (1, st.builds(Lookup, hash_ids)),
}
STEPS: st.SearchStrategy[Step] = st.sampled_from(
    [kind for kind, (weight, _) in KINDS.items() for _ in range(weight)]
).flatmap(lambda kind: KINDS[kind][1])
CLOSE = st.builds(
    Close,
    st.lists(st.tuples(directions, rare(3)), max_size=6).map(tuple),
    st.booleans(),
)

# -- the tests -----------------------------------------------------------------------------

# Sessions replayed on every run: each reaches a case for sure that drawn ones reach by
# chance.
KNOWN: dict[str, tuple[tuple[Step, ...], Close]] = {
    # A hash removed while a load reads it, re-stored elsewhere meanwhile: the load still
    # gets the old block's bytes, and the old block is free only once the load ends.
    "removed-while-loading-then-restored": (
        (
            Store((0, 1, 2, 3, 4), 1),
            Finish("store"),
            Load((0, 1), 2),
            Remove((0,)),
            Store((0, 5), 3),
            Finish("load"),
            Finish("store"),
            Lookup((0, 5)),
        ),
        Close(),
    ),
    # Every block loaded or storing: a store skips all; then a failed store and a failed
    # load (armed), the loaded hashes stay loadable.
    "full-then-failures": (
        (
            Store((0, 1, 2), 1),
            Finish("store"),
            Load((0, 1, 2), 2, "tensors"),
            Store((3, 4, 5), 3),
            Store((6,), 4),
            ArmFailure("store"),
            Finish("store"),
            ArmFailure("load"),
            Finish("load"),
            Finish("store", error=True, cancel_waiter=True),
            Lookup((0, 1, 2)),
        ),
        Close((("load", False), ("load", True), ("load", False))),
    ),
    # The third group's submit fails: two groups stay queued, their hashes protected; a
    # store in flight removed; the close waits for held copies of both directions, and
    # refuses new ones meanwhile.
    "layer-load-partly-queued-then-close": (
        (
            Store((0, 1, 2, 3), 1),
            Finish("store"),
            Load((0, 1), 2, "tensors", fail_submit=2),
            Store((4, 5, 6), 3),
            Remove((4,)),
            CancelWaiter(0),
            Store((7,), 5, submit_fails=True),
        ),
        Close((("store", True), ("load", False)), refuse=True),
    ),
}


@pytest.mark.parametrize("loop", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_session(name: str, layout: str, loop: str) -> None:
    steps, close = KNOWN[name]
    run_example(Example(loop, layout, "lru", steps, close), Counter())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_sessions(layout: str) -> None:
    counts: Counter[str] = Counter()
    examples = int(os.environ.get(EXAMPLES_ENV, CI_EXAMPLES))

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=EXAMPLES_ENV not in os.environ,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        loop=st.sampled_from(BACKENDS),
        policy=st.sampled_from(POLICY_NAMES),
        steps=st.lists(STEPS, min_size=MIN_STEPS, max_size=MAX_STEPS).map(tuple),
        close=CLOSE,
    )
    def session(loop: str, policy: str, steps: tuple[Step, ...], close: Close) -> None:
        run_example(Example(loop, layout, policy, steps, close), counts)

    session()
    print(f"\n{layout}:", *(f"{k}: {v}" for k, v in sorted(counts.items())), sep="\n  ")
    # The sessions reach what they are for (a change that made them vacuous fails here).
    for reached in (
        "evictions",
        "skipped",
        "store failed",
        "load failed",
        "load_layers",
        "removed while loading",
        "removed while storing",
        "close with copies held",
        "waiter cancelled",
    ):
        assert counts[reached] > 0, (reached, counts)


# -- defects found (each test failed before its fix) ----------------------------------------


@asynccontextmanager
async def two_blocks_stored() -> AsyncIterator[tuple[KVTier, ModelEngine]]:
    """A tier over a manager on the "joined" layout, hashes 1 and 2 stored (device blocks 0
    and 1); every copy held on the way out is handed on, so that the close ends."""
    layout = build("joined", DEVICE_BLOCKS, "cpu")
    engines: list[ModelEngine] = []

    def make(setup: EngineSetup) -> ModelEngine:
        engines.append(ModelEngine(setup))
        return engines[-1]

    with anyio.fail_after(STEP_TIMEOUT_S):
        async with OffloadManager.for_kv(
            layout, HOST_BLOCKS, backend=FakeBackend(), engine=make
        ) as mgr:
            await mgr.pinned
            (engine,) = engines
            tier = KVTier(mgr)
            stored = tier.store([1, 2], [0, 1])
            engine.finish_next("store")
            await stored.transfer
            try:
                yield tier, engine
            finally:
                while engine.held("load"):
                    await settle(engine.finish_next("load").transfer)


@pytest.mark.anyio
async def test_awaiting_a_layer_load_with_a_failed_group_waits_for_every_group() -> None:
    async with two_blocks_stored() as (tier, engine):
        load = tier.load_layers([1, 2], [5, 6], [range(0, 2), range(2, 4)])
        engine.finish_next("load", OSError("group 0 failed"))
        await settle(load.transfers[0])
        assert load.transfers[0].error is not None and not load.transfers[1].done()
        with anyio.move_on_after(0.2):  # expected: still waiting for group 1
            with contextlib.suppress(TransferError):
                await load
            assert load.transfers[1].done(), "`await load` ended while group 1 is in flight"


@pytest.mark.anyio
async def test_a_group_that_cannot_be_queued_fails_through_the_handle() -> None:
    """Group 0 queued, group 1's submit fails: the call returns the handle (it raised,
    leaving group 0 queued with nothing to await it by), group 1 failed, and awaiting it
    waits for group 0 before it raises."""
    async with two_blocks_stored() as (tier, engine):
        engine.submits_before_failure = 1  # group 0 is queued, group 1's submit fails
        load = tier.load_layers([1, 2], [5, 6], [range(0, 2), range(2, 4)])
        assert isinstance(load.transfers[1].error, TransferError)
        assert len(engine.held("load")) == 1 and not load.transfers[0].done()
        engine.finish_next("load")
        with pytest.raises(TransferError):
            await load
        assert load.done() and tier.lookup([1, 2]) == 2
