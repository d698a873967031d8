"""BlockIndex: a model-based test against a plain reference model, and the edge cases.

The state machine drives one index with begin_store (a few hashes, some repeated or
already present), end_store of an outstanding plan (ok or not: a failed or cancelled copy
is ``ok=False`` at any later point), begin_load of loadable hashes (and of lists with one
that is not), end_load, lookup, touch, remove and clear. The model keeps the hashes (block,
ready, loads in flight), the copies in flight, the recency order, what each host block
holds, and the counters. After every step it checks:

(a) no wrong block: each loadable hash has a block of its own, and that block holds the
    hash's bytes (a store's copy writes every block of its plan when it ends, the hash on
    success and garbage on failure, whether or not the hash is still indexed; a load checks
    that its block kept the hash's bytes all along);
(b) no eviction of a protected block: a begin_store evicts only ready hashes with no load
    in flight, and only when no block is free; remove and clear are the only other
    "removed" events;
(c) capacity: the blocks in use (indexed, or used by a copy in flight) are at most
    ``num_host_blocks`` and, with the free ones, exactly that; a plan never gets a block
    that is in use;
(d) lookup is the model's count of leading loadable hashes;
(e) with "lru" the victim is the least recently stored, touched or loaded evictable hash;
(f) a store skips exactly the hashes for which no block is free and none can be evicted;
(g) the stats counters are the model's, and ``resident_blocks`` (a counter the index
    keeps, O(1) to read) is the number of ready entries and of the policy's resident keys.

Properties that do not depend on which victim a policy picks run for every policy in
``POLICY_NAMES``; with another policy the model takes the victim from the index's event
and checks that it was evictable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from structlog.testing import capture_logs

from asyncpin.errors import InvalidTransferError
from asyncpin.tier.index import BlockEvent, BlockHash, BlockIndex, IndexStats, StorePlan
from asyncpin.tier.policies import POLICY_NAMES

# Few hashes for few blocks: stores collide, evict and skip often. 1 and b"\x01" are
# different hashes.
HASHES: tuple[BlockHash, ...] = (0, 1, 2, 2**64 + 1, b"", b"\x01")
hash_lists = st.lists(st.sampled_from(HASHES), max_size=5)
short_hash_lists = st.lists(st.sampled_from(HASHES), max_size=3)
picks = st.integers(0, 1 << 16)

Event = tuple[str, BlockHash, int]


def _event(e: BlockEvent) -> Event:
    return (e.kind, e.block_hash, e.host_block)


@dataclass(slots=True)
class _Entry:
    block: int
    ready: bool = False
    readers: int = 0


@dataclass(slots=True)
class _Counts:
    lookups: int = 0
    hit_blocks: int = 0
    looked_up_blocks: int = 0
    stores: int = 0
    stored_blocks: int = 0
    skipped_blocks: int = 0
    failed_blocks: int = 0
    evicted_blocks: int = 0
    removed_blocks: int = 0


class IndexMachine(RuleBasedStateMachine):
    """One BlockIndex against the model; see the module docstring."""

    POLICY = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.policy = self.POLICY
        self.n = 1
        self.index = BlockIndex(1, policy=self.policy)
        self.events: list[BlockEvent] = []
        self.entries: dict[BlockHash, _Entry] = {}
        self.recency: list[BlockHash] = []  # ready hashes, least recent first
        self.stores: list[StorePlan] = []  # copies in flight
        self.loads: list[tuple[list[BlockHash], list[int]]] = []
        self.content: dict[int, BlockHash | None] = {}  # None: garbage
        self.counts = _Counts()

    @initialize(n=st.integers(1, 4))
    def open(self, n: int) -> None:
        self.n = n
        self.index = BlockIndex(n, policy=self.policy)
        self.index.add_listener(self.events.append)

    # -- the model --------------------------------------------------------------------

    def loadable(self) -> list[BlockHash]:
        return list(self.recency)

    def evictable(self, keep: Iterable[BlockHash] = ()) -> list[BlockHash]:
        """Hashes a store may evict: loadable, no load in flight, not named present by
        the store itself (``keep``)."""
        kept = set(keep)
        return [h for h in self.recency if self.entries[h].readers == 0 and h not in kept]

    def copy_blocks(self) -> set[int]:
        """Blocks a copy in flight still writes or reads."""
        used = {b for plan in self.stores for b in plan.host_blocks}
        used.update(b for _, blocks in self.loads for b in blocks)
        return used

    def in_use(self) -> set[int]:
        return {e.block for e in self.entries.values()} | self.copy_blocks()

    def take_events(self) -> list[Event]:
        out = [_event(e) for e in self.events]
        self.events.clear()
        return out

    def touch_model(self, h: BlockHash) -> None:
        self.recency.remove(h)
        self.recency.append(h)

    def drop_model(self, h: BlockHash) -> Event | None:
        entry = self.entries.pop(h)
        if not entry.ready:
            return None
        self.recency.remove(h)
        self.counts.removed_blocks += 1
        return ("removed", h, entry.block)

    # -- rules ------------------------------------------------------------------------

    @rule(hashes=short_hash_lists)
    def begin_store(self, hashes: list[BlockHash]) -> None:
        self.start_store(hashes)

    @rule(hashes=hash_lists)
    def store(self, hashes: list[BlockHash]) -> None:
        """A store whose copy ends (successfully) before the next step."""
        self.start_store(hashes)
        self.finish_store(len(self.stores) - 1, ok=True)

    def start_store(self, hashes: list[BlockHash]) -> None:
        used_before = self.in_use()
        copies_before = self.copy_blocks()
        plan = self.index.begin_store(hashes)
        evictions = self.take_events()
        assert all(kind == "removed" for kind, _, _ in evictions), evictions

        todo: list[BlockHash] = []
        positions: list[int] = []
        present: list[BlockHash] = []
        skipped: list[BlockHash] = []
        forced: list[int | None] = []  # the victim's block, or None for a free block
        free = self.n - len(used_before)
        pending = iter(evictions)
        kept = [h for h in hashes if h in self.entries]  # present before the call
        for i, h in enumerate(hashes):
            if h in self.entries or h in todo:
                present.append(h)
                continue
            if free > 0:
                free -= 1
                forced.append(None)
            else:
                candidates = self.evictable(kept)
                if not candidates:
                    # (b) every ready hash has a load in flight, every other is storing.
                    left = list(pending)
                    assert not left, f"evicted {left}, all protected: {self.entries}"
                    skipped.append(h)
                    event("begin_store: skipped")
                    continue
                ev = next(pending, None)
                assert ev is not None, f"{h!r} needed an eviction, none happened: {plan}"
                _, victim, block = ev
                # (b) only an evictable hash, (e) the least recent one under LRU.
                assert victim in candidates, f"evicted {victim!r}, protected: {self.entries}"
                if self.policy == "lru":
                    assert victim == candidates[0], (victim, candidates)
                assert block == self.entries[victim].block, (ev, self.entries[victim])
                assert block not in copies_before, f"evicted block {block} a copy uses"
                del self.entries[victim]
                self.recency.remove(victim)
                self.counts.evicted_blocks += 1
                forced.append(block)
                event("begin_store: evicted")
            todo.append(h)
            positions.append(i)
        assert next(pending, None) is None, f"evictions not needed: {evictions}, {plan}"
        # (f) exactly the hashes that did not fit are skipped, and the plan says so.
        assert plan.hashes == tuple(todo), (plan, todo)
        assert plan.positions == tuple(positions), (plan, positions)
        assert plan.present == tuple(present), (plan, present)
        assert plan.skipped == tuple(skipped), (plan, skipped)
        # (c) each new hash has a block no one uses.
        assert len(plan.host_blocks) == len(todo)
        assert len(set(plan.host_blocks)) == len(plan.host_blocks), plan
        for h, block, want in zip(todo, plan.host_blocks, forced, strict=True):
            assert 0 <= block < self.n
            if want is None:
                assert block not in used_before, f"{h!r} got block {block}, in use"
            else:
                assert block == want, f"{h!r} got block {block}, the victim's was {want}"
            self.entries[h] = _Entry(block)
        self.stores.append(plan)
        self.counts.stores += 1
        self.counts.skipped_blocks += len(skipped)

    @precondition(lambda self: bool(self.stores))
    @rule(pick=picks, ok=st.booleans())
    def end_store(self, pick: int, ok: bool) -> None:
        self.finish_store(pick % len(self.stores), ok=ok)

    def finish_store(self, i: int, *, ok: bool) -> None:
        plan = self.stores.pop(i)
        self.index.end_store(plan, ok=ok)
        expected: list[Event] = []
        for h, block in zip(plan.hashes, plan.host_blocks, strict=True):
            # The copy wrote the block, whether or not its hash is still indexed.
            self.content[block] = h if ok else None
            entry = self.entries.get(h)
            if entry is None or entry.block != block:
                event(f"end_store(ok={ok}) of a removed hash")
                continue
            assert not entry.ready
            if ok:
                entry.ready = True
                self.recency.append(h)
                self.counts.stored_blocks += 1
                expected.append(("stored", h, block))
            else:
                del self.entries[h]
                self.counts.failed_blocks += 1
        assert self.take_events() == expected

    @precondition(lambda self: bool(self.recency))
    @rule(data=st.data())
    def begin_load(self, data: st.DataObject) -> None:
        self.start_load(data)

    @precondition(lambda self: bool(self.recency))
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        """A load whose copy ends before the next step."""
        self.start_load(data)
        self.finish_load(len(self.loads) - 1)

    def start_load(self, data: st.DataObject) -> None:
        hashes = data.draw(st.lists(st.sampled_from(self.loadable()), min_size=1, max_size=3))
        blocks = self.index.begin_load(hashes)
        assert blocks == [self.entries[h].block for h in hashes]
        for h in hashes:
            self.entries[h].readers += 1
            self.touch_model(h)
        self.loads.append((hashes, blocks))
        assert self.take_events() == []

    @rule(data=st.data())
    def begin_load_refused(self, data: st.DataObject) -> None:
        bad = [h for h in HASHES if h not in self.recency]
        loadable = self.loadable()
        good = data.draw(st.lists(st.sampled_from(loadable), max_size=2)) if loadable else []
        at = data.draw(st.integers(0, len(good)))
        hashes = [*good[:at], data.draw(st.sampled_from(bad)), *good[at:]]
        before = self.index.stats()
        try:
            self.index.begin_load(hashes)
        except InvalidTransferError:
            pass
        else:
            raise AssertionError(f"begin_load({hashes!r}) took a hash that is not loadable")
        assert self.index.stats() == before
        assert self.take_events() == []

    @precondition(lambda self: bool(self.loads))
    @rule(pick=picks)
    def end_load(self, pick: int) -> None:
        self.finish_load(pick % len(self.loads))

    def finish_load(self, i: int) -> None:
        hashes, blocks = self.loads.pop(i)
        for h, block in zip(hashes, blocks, strict=True):
            # (a) the block kept the hash's bytes while the load read it.
            assert self.content.get(block) == h, f"load of {h!r}: block {block} changed"
        self.index.end_load(hashes, blocks)
        for h, block in zip(hashes, blocks, strict=True):
            entry = self.entries.get(h)
            if entry is not None and entry.block == block:
                entry.readers -= 1
            else:
                event("end_load of a removed hash")
        assert self.take_events() == []

    @rule(hashes=hash_lists)
    def lookup(self, hashes: list[BlockHash]) -> None:
        n = 0
        for h in hashes:
            if h not in self.recency:
                break
            n += 1
        # (d)
        assert self.index.lookup(hashes) == n, (hashes, self.recency)
        self.counts.lookups += 1
        self.counts.looked_up_blocks += len(hashes)
        self.counts.hit_blocks += n
        assert self.take_events() == []

    @rule(hashes=hash_lists)
    def touch(self, hashes: list[BlockHash]) -> None:
        self.index.touch(hashes)
        for h in hashes:
            if h in self.recency:
                self.touch_model(h)
        assert self.take_events() == []

    @rule(hashes=hash_lists)
    def remove(self, hashes: list[BlockHash]) -> None:
        self.remove_hashes(hashes)

    @rule(h=st.sampled_from(HASHES))
    def store_again_while_copying(self, h: BlockHash) -> None:
        """Store, remove and store one hash again, the first copy still running."""
        self.start_store([h])
        self.remove_hashes([h])
        self.start_store([h])

    def remove_hashes(self, hashes: list[BlockHash]) -> None:
        n = self.index.remove(hashes)
        expected: list[Event] = []
        dropped = 0
        for h in hashes:
            if h in self.entries:
                dropped += 1
                dropped_event = self.drop_model(h)
                if dropped_event is not None:
                    expected.append(dropped_event)
        assert n == dropped
        assert self.take_events() == expected

    @rule()
    def clear(self) -> None:
        self.index.clear()
        expected = [self.drop_model(h) for h in list(self.entries)]
        got = self.take_events()
        assert sorted(map(repr, got)) == sorted(repr(e) for e in expected if e is not None)

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def blocks_hold_their_hashes(self) -> None:
        owners: dict[int, BlockHash] = {}
        for h in HASHES:
            block = self.index.host_block(h)
            entry = self.entries.get(h)
            want = entry.block if entry is not None and entry.ready else None
            assert block == want, f"host_block({h!r}) = {block}, model: {want}"
            assert (h in self.index) == (want is not None)
            if block is None:
                continue
            # (a) a block of its own, holding this hash's bytes.
            assert block not in owners, f"{h!r} and {owners.get(block)!r} share block {block}"
            owners[block] = h
            assert self.content.get(block) == h, f"{h!r} -> block {block}: {self.content}"
        assert len(self.index) == len(self.entries)

    @invariant()
    def capacity(self) -> None:
        used = self.in_use()
        blocks = [e.block for e in self.entries.values()]
        assert len(set(blocks)) == len(blocks), self.entries
        # (c)
        assert len(used) <= self.n
        free = self.index.stats().free_blocks
        assert free + len(used) == self.n, f"free {free} + in use {sorted(used)} != {self.n}"

    @invariant()
    def stats_agree(self) -> None:
        c = self.counts
        want = IndexStats(
            lookups=c.lookups,
            hit_blocks=c.hit_blocks,
            looked_up_blocks=c.looked_up_blocks,
            stores=c.stores,
            stored_blocks=c.stored_blocks,
            skipped_blocks=c.skipped_blocks,
            failed_blocks=c.failed_blocks,
            evicted_blocks=c.evicted_blocks,
            removed_blocks=c.removed_blocks,
            resident_blocks=len(self.recency),
            free_blocks=self.n - len(self.in_use()),
        )
        # (g)
        assert self.index.stats() == want
        # The kept counter, against the index's own entries and its policy.
        ready = sum(1 for e in self.index._entries.values() if e.ready)
        assert self.index.stats().resident_blocks == ready == len(self.index._policy)

    @invariant()
    def room_agrees(self) -> None:
        """``room()``: the free blocks and the evictable ones (loadable, no reader)."""
        evictable = sum(1 for e in self.index._entries.values() if e.ready and e.readers == 0)
        assert self.index.room() == self.index.stats().free_blocks + evictable


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_index_against_model(policy: str) -> None:
    class Machine(IndexMachine):
        POLICY = policy

    run_state_machine_as_test(
        Machine,
        settings=settings(max_examples=120, stateful_step_count=50, deadline=None),
    )


# -- examples ---------------------------------------------------------------------------


def fresh(n: int, policy: str = "lru") -> tuple[BlockIndex, list[Event]]:
    index = BlockIndex(n, policy=policy)
    events: list[Event] = []
    index.add_listener(lambda e: events.append(_event(e)))
    return index, events


def stored(index: BlockIndex, hashes: Sequence[BlockHash]) -> StorePlan:
    plan = index.begin_store(hashes)
    index.end_store(plan, ok=True)
    return plan


BAD_HASHES = [True, False, "a", 1.0]


@pytest.mark.parametrize("bad", BAD_HASHES, ids=repr)
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_bad_hash_refused_with_nothing_changed(policy: str, bad: object) -> None:
    index, events = fresh(2, policy)
    stored(index, [1])
    events.clear()
    before = index.stats()
    calls: list[Callable[[], object]] = [
        lambda: index.begin_store([2, bad]),  # type: ignore[list-item]
        lambda: index.begin_store([bad]),  # type: ignore[list-item]
        lambda: index.begin_load([1, bad]),  # type: ignore[list-item]
        lambda: index.lookup([bad]),  # type: ignore[list-item]
        lambda: index.lookup([1, bad]),  # type: ignore[list-item]
        lambda: index.host_block(bad),  # type: ignore[arg-type]
        lambda: index.touch([bad]),  # type: ignore[list-item]
        lambda: index.remove([bad]),  # type: ignore[list-item]
    ]
    for call in calls:
        with pytest.raises(InvalidTransferError):
            call()
        assert index.stats() == before
        assert events == []
        assert len(index) == 1 and index.host_block(1) == 0
    if not isinstance(bad, bool):
        assert bad not in index
    # begin_load protected nothing: 1 is still evictable.
    plan = index.begin_store([2, 3])
    assert plan.skipped == () and plan.hashes == (2, 3)


@pytest.mark.parametrize("hashes", [None, 7, b"\x01\x02", "ab", bytearray(b"\x01")], ids=repr)
@pytest.mark.parametrize("call", ["begin_store", "begin_load", "lookup", "touch", "remove"])
def test_hashes_that_are_no_sequence_of_hashes_are_refused(call: str, hashes: object) -> None:
    """Not an iterable, or a single bytes (which would be taken for its bytes' ints, one
    hash each): InvalidTransferError, nothing changed (a newcomer's trial: lookup(None)
    raised a bare TypeError)."""
    index, events = fresh(4)
    stored(index, [1, 2])
    before = index.stats()
    with pytest.raises(InvalidTransferError, match="a sequence of ints or bytes"):
        getattr(index, call)(hashes)
    assert index.stats() == before and events == [("stored", 1, 0), ("stored", 2, 1)]


@pytest.mark.parametrize("call", ["remove", "touch"])
def test_bad_hash_after_good_ones_changes_nothing(call: str) -> None:
    index, events = fresh(2)
    stored(index, [1, 2])  # 1 is the least recent
    events.clear()
    with pytest.raises(InvalidTransferError):
        getattr(index, call)([1, "x"])
    assert events == [] and index.host_block(1) == 0
    index.begin_store([3])
    assert events == [("removed", 1, 0)]  # touch([1, "x"]) made 2 the least recent


def test_lookup_refuses_a_bad_hash_after_a_miss() -> None:
    index, _ = fresh(2)
    with pytest.raises(InvalidTransferError):
        index.lookup([7, "x"])  # type: ignore[list-item]


def test_a_bool_is_not_in_the_index() -> None:
    index, _ = fresh(2)
    stored(index, [1, 0])
    assert True not in index
    assert False not in index


class _Liar(int):
    """An int that says it equals anything, and hashes as 0."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0


class _Bytes(bytes):
    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash(b"")

    def __buffer__(self, flags: int) -> memoryview:  # read for memoryview() from 3.12
        return memoryview(b"other")


def test_a_subclass_of_int_or_bytes_is_keyed_by_its_value() -> None:
    """A hostile trial: an int subclass whose comparisons lie was found as hash 0, and a
    load of it read hash 0's block."""
    index, events = fresh(4)
    stored(index, [0, b""])
    assert index.lookup([_Liar(5)]) == 0 and index.lookup([_Bytes(b"x")]) == 0
    assert _Liar(5) not in index and _Bytes(b"x") not in index
    stored(index, [_Liar(5), _Bytes(b"x")])
    assert index.lookup([5, b"x"]) == 2 and _Liar(5) in index
    assert [(type(h), h) for _, h, _ in events] == [
        (int, 0),
        (bytes, b""),
        (int, 5),
        (bytes, b"x"),
    ]
    blocks = index.begin_load([_Liar(5), _Bytes(b"x")])
    index.end_load([_Liar(5), _Bytes(b"x")], blocks)  # their blocks, not 0's and b""'s
    assert index.stats().free_blocks == 4 - len(index) == 0 and index.room() == 4


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_begin_load_of_a_hash_not_loadable_protects_nothing(policy: str) -> None:
    index, events = fresh(2, policy)
    stored(index, [1])
    storing = index.begin_store([2])  # not loadable until end_store
    for missing in (2, 3):
        with pytest.raises(InvalidTransferError, match="not loadable"):
            index.begin_load([1, missing])
    assert index.lookup([1, 2]) == 1
    # 1 has no load in flight: a store may evict it (the other block is storing).
    events.clear()
    plan = index.begin_store([4])
    assert plan.hashes == (4,) and plan.host_blocks == (0,)
    assert events == [("removed", 1, 0)]
    index.end_store(storing, ok=True)
    assert index.begin_load([2]) == [storing.host_blocks[0]]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_duplicate_hashes_in_one_store(policy: str) -> None:
    index, events = fresh(4, policy)
    stored(index, [9])
    events.clear()
    plan = index.begin_store([1, 1, 2, 9, 1, b"\x01"])
    assert plan.hashes == (1, 2, b"\x01")
    assert plan.positions == (0, 2, 5)
    assert plan.present == (1, 9, 1)
    assert plan.skipped == ()
    assert len(set(plan.host_blocks)) == 3 and 0 not in plan.host_blocks
    index.end_store(plan, ok=True)
    assert events == [("stored", h, b) for h, b in zip(plan.hashes, plan.host_blocks, strict=True)]
    assert index.lookup([9, 1, 2, b"\x01"]) == 4
    s = index.stats()
    assert (s.stored_blocks, s.resident_blocks, s.free_blocks) == (4, 4, 0)


@pytest.mark.parametrize("ok", [True, False])
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_remove_during_a_store_frees_the_block_when_the_copy_ends(policy: str, ok: bool) -> None:
    index, events = fresh(1, policy)
    plan = index.begin_store([1])
    assert index.remove([1]) == 1
    assert 1 not in index and len(index) == 0
    # The copy still writes block 0: no store may have it.
    assert index.begin_store([2]).skipped == (2,)
    assert index.stats().free_blocks == 0
    index.end_store(plan, ok=ok)
    assert events == []
    assert 1 not in index and index.lookup([1]) == 0 and len(index) == 0
    s = index.stats()
    assert (s.free_blocks, s.stored_blocks, s.failed_blocks, s.resident_blocks) == (1, 0, 0, 0)
    assert index.begin_store([2]).host_blocks == (0,)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_end_load_once_per_load(policy: str) -> None:
    """A second end_load of one load, one never begun, or a wrong block is a
    RuntimeError that changes nothing: a block another load is reading stays protected
    (a duplicate end used to let the next store evict it and write over it)."""
    index, _ = fresh(2, policy)
    stored(index, [1, 2])
    index.end_load([1], index.begin_load([1]))
    reading = index.begin_load([1])  # a load in flight on host block `reading[0]`
    for hashes, blocks in (([1, 1], reading * 2), ([2], [1]), ([1], [reading[0] + 7])):
        with pytest.raises(RuntimeError, match="no load under way"):
            index.end_load(hashes, blocks)
    plan = index.begin_store([3, 4])  # one block may go; the one being read may not
    assert reading[0] not in plan.host_blocks and plan.skipped == (4,)
    index.end_store(plan, ok=True)
    index.end_load([1], reading)
    removed = index.begin_load([1])
    index.remove([1])  # the block drains with the load
    with pytest.raises(RuntimeError, match="no load under way"):
        index.end_load([1, 1], removed * 2)
    index.end_load([1], removed)
    assert index.stats().free_blocks == 1


def test_end_load_takes_one_host_block_a_hash() -> None:
    """Blocks of another count, or not a sequence: InvalidTransferError naming what was
    given, nothing changed (a hostile trial: a bare ValueError from zip())."""
    index, _ = fresh(2, "lru")
    stored(index, [1, 2])
    reading = index.begin_load([1, 2])
    for blocks in (reading[:1], [*reading, 0], None, 7):
        with pytest.raises(InvalidTransferError, match="takes their 2 host blocks"):
            index.end_load([1, 2], blocks)  # type: ignore[arg-type]
    plan = index.begin_store([3])  # both still read: no room
    assert plan.skipped == (3,)
    index.end_store(plan, ok=True)
    index.end_load([1, 2], np.array(reading))  # type: ignore[arg-type]  # an array is as good
    assert index.room() == 2
    index.end_load([1], torch.tensor(index.begin_load([1])))  # type: ignore[arg-type]
    assert index.room() == 2


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_remove_during_a_load_frees_the_block_after_end_load(policy: str) -> None:
    index, events = fresh(1, policy)
    stored(index, [1])
    blocks = index.begin_load([1, 1])  # two loads of it in flight
    assert blocks == [0, 0]
    events.clear()
    assert index.remove([1]) == 1
    assert events == [("removed", 1, 0)]
    assert index.begin_store([2]).skipped == (2,)
    index.end_load([1], [0])
    assert index.stats().free_blocks == 0
    assert index.begin_store([2]).skipped == (2,)
    index.end_load([1], [0])
    assert index.stats().free_blocks == 1
    plan = index.begin_store([2])
    assert plan.host_blocks == (0,) and plan.skipped == ()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_store_skips_what_does_not_fit(policy: str) -> None:
    index, events = fresh(3, policy)
    stored(index, [1, 2])
    loading = index.begin_load([1, 2])
    storing = index.begin_store([3])
    events.clear()
    plan = index.begin_store([4, 1, 5, 3])
    assert plan.hashes == () and plan.present == (1, 3) and plan.skipped == (4, 5)
    assert events == []
    s = index.stats()
    assert (s.skipped_blocks, s.evicted_blocks, s.free_blocks) == (2, 0, 0)
    index.end_load([1, 2], loading)
    plan = index.begin_store([4, 5, 6])
    assert plan.hashes == (4, 5) and plan.skipped == (6,)
    assert sorted(plan.host_blocks) == [0, 1]
    assert sorted(h for _, h, _ in events) == [1, 2]
    index.end_store(storing, ok=False)
    assert index.stats().failed_blocks == 1 and index.stats().free_blocks == 1


def test_lru_evicts_the_least_recently_stored_touched_or_loaded() -> None:
    index, events = fresh(3)
    stored(index, [1, 2, 3])
    index.touch([1])  # order: 2 3 1
    events.clear()
    stored(index, [4])
    assert events[0] == ("removed", 2, 1)
    index.end_load([3], index.begin_load([3]))  # order: 1 4 3
    index.touch([7, 2])  # absent hashes change nothing
    events.clear()
    stored(index, [5, 6])
    assert [e for e in events if e[0] == "removed"] == [("removed", 1, 0), ("removed", 4, 1)]


def test_events_in_order() -> None:
    index, events = fresh(2)
    raw: list[BlockEvent] = []
    index.add_listener(raw.append)
    stored(index, [b"a", 7])
    assert events == [("stored", b"a", 0), ("stored", 7, 1)]
    failed = index.begin_store([8])  # evicts b"a", then fails
    index.end_store(failed, ok=False)
    assert events[2:] == [("removed", b"a", 0)]
    stored(index, [9])  # the failed store's block is free again
    assert events[3:] == [("stored", 9, 0)]
    storing = index.begin_store([b"a"])  # evicts 7
    assert events[4:] == [("removed", 7, 1)]
    assert index.remove([9, b"a", 9]) == 2  # b"a" is storing: no event of it
    assert events[5:] == [("removed", 9, 0)]
    index.end_store(storing, ok=True)  # b"a" was removed: nothing stored
    assert len(events) == 6
    index.remove_listener(raw.append)
    block = stored(index, [1]).host_blocks[0]
    index.clear()
    assert events[6:] == [("stored", 1, block), ("removed", 1, block)]
    assert [_event(e) for e in raw] == events[:6]
    assert all(e.tier == "cpu" for e in raw)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_store_does_not_evict_a_hash_it_reports_present(policy: str) -> None:
    index, _ = fresh(1, policy)
    stored(index, [1])
    plan = index.begin_store([1, 2])  # a prefix whose first block is on the host
    assert plan.present == (1,)
    assert 1 in index, f"plan says 1 is present, the same call evicted it: {plan}"


def test_a_raising_listener_leaks_no_block() -> None:
    index = BlockIndex(1)
    stored(index, [1])

    def refuse(event: BlockEvent) -> None:
        raise RuntimeError("listener")

    index.add_listener(refuse)
    with capture_logs() as logs:
        plan = index.begin_store([2])  # evicts 1: the listener's error is logged
        index.end_store(plan, ok=True)
    assert [e["event"] for e in logs] == ["tier.listener_failed"] * 2
    index.remove_listener(refuse)
    s = index.stats()
    assert s.free_blocks + len(index) == 1, s
    assert 2 in index and 1 not in index


def test_a_plan_ends_once() -> None:
    index = BlockIndex(2)
    plan = index.begin_store([1])
    index.end_store(plan, ok=False)
    with pytest.raises(RuntimeError, match="not under way"):
        index.end_store(plan, ok=False)
    assert index.stats().free_blocks == 2


@pytest.mark.parametrize(
    "ok",
    [
        1,
        0,
        "yes",
        None,
        1.0,
        [1, "x"],
        b"\x01",
        # 0-d arrays of numbers: one value, not hashes (a hostile trial: TypeError)
        np.array(1),
        np.array(1.0),
        torch.tensor(1),
        torch.tensor([1, 1]).min(),
    ],
)
def test_end_store_refuses_an_ok_that_is_neither_a_bool_nor_hashes(ok: object) -> None:
    index = BlockIndex(2)
    plan = index.begin_store([1, 2])
    with pytest.raises(InvalidTransferError, match="ok"):
        index.end_store(plan, ok=ok)  # type: ignore[arg-type]
    assert index.lookup([1, 2]) == 0  # nothing changed: the plan is still under way
    index.end_store(plan, ok=True)
    assert index.lookup([1, 2]) == 2 and index.stats().stored_blocks == 2


@pytest.mark.parametrize(
    "ok, stored",
    [
        (np.True_, {1, 2}),
        (np.False_, set()),
        (torch.tensor(True), {1, 2}),
        (torch.tensor([True, True]).all(), {1, 2}),
        (torch.tensor(False), set()),
        ([1], {1}),
        ({2}, {2}),
        ((), set()),
    ],
)
def test_end_store_takes_array_bools_and_the_hashes_that_succeeded(
    ok: object, stored: set[int]
) -> None:
    index = BlockIndex(2)
    plan = index.begin_store([1, 2])
    index.end_store(plan, ok=ok)  # type: ignore[arg-type]
    assert {h for h in (1, 2) if h in index} == stored
    s = index.stats()
    assert (s.stored_blocks, s.failed_blocks) == (len(stored), 2 - len(stored))
    assert s.free_blocks + len(index) == 2


def test_messages_name_a_hash_of_any_size() -> None:
    """An int past the interpreter's limit on decimal digits, and a long bytes hash, are
    named in errors without raising anything else (a hostile trial: f"{h!r}" of 10**5000
    raised ValueError in place of the typed error)."""
    index = BlockIndex(2)
    for h in (10**5000, b"\x07" * 100_000):
        with pytest.raises(InvalidTransferError, match="not loadable") as refused:
            index.begin_load([h])
        assert len(str(refused.value)) < 200
        plan = index.begin_store([h])
        index.end_store(plan, ok=True)
        blocks = index.begin_load([h])
        index.end_load([h], blocks)
        with pytest.raises(RuntimeError, match="ended already") as twice:
            index.end_load([h], blocks)
        assert len(str(twice.value)) < 200
    with pytest.raises(RuntimeError, match="ended already"):
        index.end_load([1], [10**5000])


def test_a_listener_whose_error_cannot_be_written_reaches_no_caller() -> None:
    """A listener's error is logged, never raised, even one whose repr raises (a review:
    KeyError(10**5000) made the log's repr raise out of the call, the index changed)."""
    index = BlockIndex(2)
    seen: list[BlockEvent] = []

    def raising(event: BlockEvent) -> None:
        raise KeyError(10**5000)

    index.add_listener(raising)
    index.add_listener(seen.append)
    with capture_logs() as logs:
        stored(index, [10**5000, 2])
        index.remove([2])
    assert [e.kind for e in seen] == ["stored", "stored", "removed"]
    assert [log["event"] for log in logs] == ["tier.listener_failed"] * 3


def test_a_listener_that_removes_itself_leaves_the_others_their_events() -> None:
    """A one-shot listener removing itself while an event is handed out (a hostile
    trial: the next listener missed that event)."""
    index = BlockIndex(4)
    got_a: list[BlockEvent] = []
    got_b: list[BlockEvent] = []

    def once(event: BlockEvent) -> None:
        got_a.append(event)
        index.remove_listener(once)

    index.add_listener(once)
    index.add_listener(got_b.append)
    index.end_store(index.begin_store([1]), ok=True)
    index.end_store(index.begin_store([2]), ok=True)
    assert [e.block_hash for e in got_a] == [1]
    assert [e.block_hash for e in got_b] == [1, 2]


def test_events_of_a_listeners_own_change_come_after_the_event_it_handles() -> None:
    """A listener that changes the index: every listener sees the events in the order of
    the index's changes (a hostile trial: the other listener saw "removed" before
    "stored" and was left believing the block stored)."""
    index = BlockIndex(4)
    seen: list[tuple[str, object]] = []

    def evict_one(event: BlockEvent) -> None:
        if event.kind == "stored" and event.block_hash == 1:
            index.remove([1])

    index.add_listener(evict_one)
    index.add_listener(lambda e: seen.append((e.kind, e.block_hash)))
    index.end_store(index.begin_store([1, 2]), ok=True)
    assert seen == [("stored", 1), ("stored", 2), ("removed", 1)]
    assert 1 not in index and 2 in index


def test_listeners_that_answer_their_own_changes_without_end_let_the_call_return() -> None:
    """A listener that stores back each block evicted, in a full index: every store evicts
    another, whose event stores it back... (a review: the call never returned). The call
    returns after a bounded number of rounds, says so, and the index stays whole."""
    index = BlockIndex(4)
    for h in range(4):
        index.end_store(index.begin_store([h]), ok=True)
    answered = [0]

    def store_back(event: BlockEvent) -> None:
        if event.kind == "removed":
            answered[0] += 1
            index.end_store(index.begin_store([event.block_hash]), ok=True)

    index.add_listener(store_back)
    with capture_logs() as logs:
        index.end_store(index.begin_store([99]), ok=True)
    # begin_store's eviction starts it, and end_store goes on with what was left
    assert {e["event"] for e in logs} == {"tier.listener_cascade"} and len(logs) <= 2
    assert 0 < answered[0] < 1000
    s = index.stats()
    assert len(index) == 4 and s.free_blocks == 0


@pytest.mark.parametrize("use", ["lookup", "touch", "load"])
def test_a_lookup_leaves_the_order_alone_a_use_moves_it(use: str) -> None:
    """As the policies' docstring says: ``lookup`` counts, ``touch`` and ``begin_load``
    are uses (a peer-case trial read the docstring's old wording as lookup touching)."""
    index = BlockIndex(2, policy="lru")
    for h in (1, 2):
        index.end_store(index.begin_store([h]), ok=True)
    if use == "lookup":
        assert index.lookup([1]) == 1
    elif use == "touch":
        index.touch([1])
    else:
        index.end_load([1], index.begin_load([1]))
    index.end_store(index.begin_store([3]), ok=True)
    kept = {h for h in (1, 2) if h in index}
    assert kept == ({2} if use == "lookup" else {1})
