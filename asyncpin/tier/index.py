"""The block index: which host block holds the KV of which block hash.

Keys are the engine's block hashes (ints or bytes: the chained prefix hashes engines
already compute). Host blocks are ids ``0 .. num_host_blocks - 1`` of a manager's
region, so the index needs neither a GPU nor torch: it can run in an engine's scheduler
process and hand host block ids to the workers that move the bytes.

Every call is synchronous and O(number of hashes) (an eviction may step over blocks a
copy still uses). The life of a block:

- ``begin_store(hashes)`` gives each new hash a host block (a free one, or one the
  policy evicts); the block is *storing*: not loadable, not evictable. Hashes already
  present are skipped, and so are the ones for which no block can be freed (every
  block in use by a copy).
- ``end_store(plan, ok)``: on success the blocks become *ready* (``lookup`` sees them);
  on failure, or a cancelled copy, they are freed and nothing of them stays indexed.
- ``begin_load(hashes)`` protects ready blocks from eviction until ``end_load``.
- ``remove`` and ``clear`` drop hashes at once; a block a copy still uses is freed
  when its last copy ends.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, cast

import structlog

from asyncpin._log import ShieldedLog
from asyncpin._text import shown
from asyncpin.errors import ConfigError, InvalidTransferError
from asyncpin.tier.policies import EvictionPolicy, make_policy

__all__ = ["BlockEvent", "BlockHash", "BlockIndex", "IndexStats", "StorePlan", "all_checked"]

BlockHash: TypeAlias = int | bytes

_log = ShieldedLog(structlog.get_logger("asyncpin"))


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """A block stored (now loadable) or removed (evicted, removed, cleared)."""

    kind: Literal["stored", "removed"]
    block_hash: BlockHash
    host_block: int
    tier: str = "cpu"


@dataclass(frozen=True, slots=True)
class StorePlan:
    """What one ``begin_store`` decided: the hashes to copy and their host blocks (in the
    order asked), the hashes already present, and those left out for want of room."""

    hashes: tuple[BlockHash, ...]
    host_blocks: tuple[int, ...]
    #: Positions in the hashes asked for, of each hash to copy (to pick device blocks).
    positions: tuple[int, ...]
    present: tuple[BlockHash, ...]
    skipped: tuple[BlockHash, ...]


@dataclass(slots=True)
class _Entry:
    host_block: int
    ready: bool = False
    readers: int = 0  # loads in flight


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot of a :class:`BlockIndex`'s counters (every one since it was made) and of
    its blocks now. Counts are of blocks unless named otherwise."""

    #: ``lookup`` calls; of the hashes they asked for (``looked_up_blocks``), those found:
    #: the leading loadable ones (``hit_blocks``).
    lookups: int
    hit_blocks: int
    looked_up_blocks: int
    #: ``begin_store`` calls; blocks whose store ended ok (now loadable); hashes left out
    #: for want of room; blocks whose store ended not ok (freed, never loadable).
    stores: int
    stored_blocks: int
    skipped_blocks: int
    failed_blocks: int
    #: Loadable blocks dropped to make room, and by ``remove`` / ``clear``.
    evicted_blocks: int
    removed_blocks: int
    #: Loadable blocks now, and host blocks neither indexed nor used by a copy.
    resident_blocks: int
    free_blocks: int


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


class BlockIndex:
    """Hashes → host blocks over ``num_host_blocks`` blocks, evicting by ``policy``
    (``"lru"``, ``"arc"``, ``"s3fifo"``)."""

    def __init__(self, num_host_blocks: int, *, policy: str = "lru") -> None:
        if (
            isinstance(num_host_blocks, bool)
            or not isinstance(num_host_blocks, int)
            # the int it is, whatever a subclass's comparisons say
            or int.__index__(num_host_blocks) < 1
        ):
            raise ConfigError(f"num_host_blocks must be an int >= 1, got {shown(num_host_blocks)}")
        self.num_host_blocks = int.__index__(num_host_blocks)
        self._policy: EvictionPolicy = make_policy(policy, self.num_host_blocks)
        self._entries: dict[BlockHash, _Entry] = {}
        # Free host blocks, lowest first out (popped from the end).
        self._free = list(range(self.num_host_blocks - 1, -1, -1))
        # Host blocks dropped from the index whose copies are still running: users left.
        self._draining: dict[int, int] = {}
        self._listeners: list[Callable[[BlockEvent], None]] = []
        # Events of the call under way, given to listeners once the index is consistent.
        self._events: list[BlockEvent] = []
        self._flushing = False  # handing events out (``_flush``)
        # Hashes a store under way reported present: never its eviction victims.
        self._keep: set[BlockHash] = set()
        self._open_plans: set[int] = set()  # id() of the plans not ended yet
        self._counts = _Counts()
        self._resident = 0  # entries that are ready (loadable): kept, not counted at stats()
        self._held = 0  # ready entries a load holds (readers > 0): not evictable

    @property
    def policy(self) -> str:
        return self._policy.name

    # -- queries --------------------------------------------------------------------------

    def lookup(self, hashes: Iterable[BlockHash]) -> int:
        """How many leading hashes are present and loadable. It counts them and leaves the
        policy's order alone: a use is ``begin_load`` (or ``touch``)."""
        checked = all_checked(hashes)
        n = self._leading(checked)
        self._counts.lookups += 1
        self._counts.looked_up_blocks += len(checked)
        self._counts.hit_blocks += n
        return n

    def leading(self, hashes: Iterable[BlockHash]) -> int:
        """How many leading ``hashes`` are present and loadable, not counted as a lookup
        (a caller's second look, after it brought some in)."""
        return self._leading(all_checked(hashes))

    def _leading(self, checked: Sequence[BlockHash]) -> int:
        n = 0
        for h in checked:
            entry = self._entries.get(h)
            if entry is None or not entry.ready:
                break
            n += 1
        return n

    def idle(self) -> bool:
        """No store, load or block left to drain is under way: nothing uses a host block
        but the index itself."""
        return not (self._open_plans or self._draining or self._held)

    def room(self) -> int:
        """Host blocks a store could have now: the free ones and those it could evict
        (loadable, no load under way). O(1)."""
        return len(self._free) + self._resident - self._held

    def host_block(self, block_hash: BlockHash) -> int | None:
        """The host block of a loadable hash, or None."""
        entry = self._entries.get(_checked(block_hash))
        return entry.host_block if entry is not None and entry.ready else None

    def __contains__(self, block_hash: object) -> bool:
        if not isinstance(block_hash, int | bytes) or isinstance(block_hash, bool):
            return False
        entry = self._entries.get(_checked(block_hash))
        return entry is not None and entry.ready

    def __len__(self) -> int:
        """Hashes present (loadable or being stored)."""
        return len(self._entries)

    def stats(self) -> IndexStats:
        """The counters and block counts now: O(1), so a metrics scrape may call it often
        (from another thread, one field may be a moment older than another)."""
        c = self._counts
        return IndexStats(
            lookups=c.lookups,
            hit_blocks=c.hit_blocks,
            looked_up_blocks=c.looked_up_blocks,
            stores=c.stores,
            stored_blocks=c.stored_blocks,
            skipped_blocks=c.skipped_blocks,
            failed_blocks=c.failed_blocks,
            evicted_blocks=c.evicted_blocks,
            removed_blocks=c.removed_blocks,
            resident_blocks=self._resident,
            free_blocks=len(self._free),
        )

    # -- events ---------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[BlockEvent], None]) -> None:
        """Call ``listener(event)`` for each block stored and removed, synchronously, at
        the end of the call that caused it. It must be quick; an exception from it is
        logged (``tier.listener_failed``) and never reaches the index or the caller."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[BlockEvent], None]) -> None:
        self._listeners.remove(listener)

    def _emit(self, kind: Literal["stored", "removed"], h: BlockHash, block: int) -> None:
        if self._listeners:
            self._events.append(BlockEvent(kind, h, block))

    def _flush(self) -> None:
        """Hand the call's events to the listeners, once the index is consistent, in the
        order of the index's changes: a listener that changes the index queues that
        change's events after the ones being handed out (the outer call hands them out,
        not a nested one), and each event goes to the listeners there when it is handed
        out (one that removes itself or another changes no one else's events). At most
        ``_MAX_FLUSH_ROUNDS`` rounds of such changes' events per call: listeners that
        answer their own changes without end get the rest with the next call's events
        (logged, ``tier.listener_cascade``), and the call returns."""
        if self._flushing:
            return
        self._flushing = True
        try:
            for _ in range(_MAX_FLUSH_ROUNDS):
                if not self._events:
                    return
                events, self._events = self._events, []
                for event in events:
                    for listener in tuple(self._listeners):
                        try:
                            listener(event)
                        except Exception as exc:
                            _log.error(
                                "tier.listener_failed", listener=shown(listener), error=shown(exc)
                            )
            if not self._events:
                return
            # Listeners that answer each other's changes with changes without end: the
            # call returns, and what is left goes out with the next call's events.
            _log.error(
                "tier.listener_cascade",
                rounds=_MAX_FLUSH_ROUNDS,
                events_left=len(self._events),
                reason="listeners changed the index in answer to their own events",
            )
        finally:
            self._flushing = False

    # -- stores ---------------------------------------------------------------------------

    def begin_store(self, hashes: Sequence[BlockHash]) -> StorePlan:
        """Give each new hash a host block for a copy about to start; see the module
        docstring. Nothing is loadable until ``end_store(plan, ok=True)``. A hash of the
        call that is present already is never evicted to make room for another."""
        checked = all_checked(hashes)
        todo: list[BlockHash] = []
        blocks: list[int] = []
        positions: list[int] = []
        present: list[BlockHash] = []
        skipped: list[BlockHash] = []
        self._keep = {h for h in checked if h in self._entries}
        try:
            for i, h in enumerate(checked):
                if h in self._entries:  # present, or earlier in this call
                    present.append(h)
                    continue
                block = self._allocate()
                if block is None:
                    skipped.append(h)
                    continue
                self._entries[h] = _Entry(block)
                todo.append(h)
                blocks.append(block)
                positions.append(i)
        finally:
            self._keep = set()
        self._counts.stores += 1
        self._counts.skipped_blocks += len(skipped)
        plan = StorePlan(
            tuple(todo), tuple(blocks), tuple(positions), tuple(present), tuple(skipped)
        )
        self._open_plans.add(id(plan))
        self._flush()
        return plan

    def end_store(self, plan: StorePlan, *, ok: bool | Collection[BlockHash]) -> None:
        """The plan's copy is over: its blocks become loadable (``ok``), or are freed.
        ``ok`` may name the hashes whose copy succeeded (the others are freed); a 0-d
        boolean array (numpy's ``bool_``, a torch ``all()``) counts as its bool. Once per
        plan (RuntimeError, nothing changed, for a plan already ended); an ``ok`` of
        another kind is refused (InvalidTransferError), nothing changed."""
        if id(plan) not in self._open_plans:
            raise RuntimeError("end_store of a plan that is not under way (ended already?)")
        ok = _ok_of(ok)
        self._open_plans.discard(id(plan))
        for h, block in zip(plan.hashes, plan.host_blocks, strict=True):
            entry = self._entries.get(h)
            if entry is None or entry.host_block != block:
                # Removed while its copy ran: the block drained with the copy.
                self._release_user(block)
                continue
            if ok is True or (ok is not False and h in ok):
                entry.ready = True
                self._resident += 1
                self._policy.insert(h)
                self._counts.stored_blocks += 1
                self._emit("stored", h, block)
            else:
                del self._entries[h]
                self._free.append(block)
                self._counts.failed_blocks += 1
        self._flush()

    def _allocate(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = self._policy.evict(self._evictable)
        if victim is None:
            return None
        key = cast(BlockHash, victim)
        entry = self._entries.pop(key)
        self._resident -= 1  # only a ready entry is evictable
        self._counts.evicted_blocks += 1
        self._emit("removed", key, entry.host_block)
        return entry.host_block

    def _evictable(self, key: Hashable) -> bool:
        entry = self._entries.get(cast(BlockHash, key))
        return entry is not None and entry.ready and entry.readers == 0 and key not in self._keep

    # -- loads ----------------------------------------------------------------------------

    def begin_load(self, hashes: Sequence[BlockHash], *, touch: bool = True) -> list[int]:
        """The host blocks of ``hashes``, all loadable, protected from eviction until
        ``end_load``; a hit for the policy (unless ``touch=False``: a reader that is not a
        use, such as a copy to another tier). InvalidTransferError (nothing protected) if
        one is not loadable."""
        entries = []
        for h in all_checked(hashes):
            entry = self._entries.get(h)
            if entry is None or not entry.ready:
                raise InvalidTransferError(f"block hash {shown(h)} is not loadable (lookup first)")
            entries.append((h, entry))
        for h, entry in entries:
            if entry.readers == 0:
                self._held += 1
            entry.readers += 1
            if touch:
                self._policy.touch(h)
        return [entry.host_block for _, entry in entries]

    def end_load(self, hashes: Sequence[BlockHash], host_blocks: Sequence[int]) -> None:
        """A load of ``begin_load(hashes)`` is over (done, failed or cancelled). Once per
        load: a second end would let a block that another load is reading be evicted and
        written over. RuntimeError, nothing changed, where the index can tell: no load
        under way holds the block (ended already, or never begun). It counts a block's
        loads, not which is which: a second end of one load while another load of that
        block is under way goes unseen."""
        keys = all_checked(hashes)
        tolist = getattr(host_blocks, "tolist", None)  # a NumPy array, a tensor
        if callable(tolist):
            host_blocks = tolist()
        if not isinstance(host_blocks, Sequence) or len(host_blocks) != len(keys):
            raise InvalidTransferError(
                f"end_load of {len(keys)} hashes takes their {len(keys)} host blocks "
                f"(as begin_load returned them), got {shown(host_blocks)}"
            )
        matched: list[_Entry] = []  # readers taken off, given back if one is refused
        draining: list[int] = []  # blocks dropped from the index, drained in this order
        users: dict[int, int] = {}
        try:
            for h, block in zip(keys, host_blocks, strict=True):
                entry = self._entries.get(h)
                if entry is not None and entry.host_block == block:
                    held = entry.readers > 0
                    if held:
                        entry.readers -= 1
                        if entry.readers == 0:
                            self._held -= 1
                        matched.append(entry)
                else:
                    users[block] = users.get(block, 0) + 1
                    held = self._draining.get(block, 0) >= users[block]
                    draining.append(block)
                if not held:
                    raise RuntimeError(
                        f"end_load of block hash {shown(h)} in host block {shown(block)}: no load "
                        "under way holds it (ended already?)"
                    )
        except BaseException:
            for entry in matched:
                if entry.readers == 0:
                    self._held += 1
                entry.readers += 1
            raise
        for block in draining:
            self._release_user(block)

    # -- bookkeeping ----------------------------------------------------------------------

    def touch(self, hashes: Iterable[BlockHash]) -> None:
        """Mark loadable hashes as used now (a hit for the policy); others are ignored."""
        for h in all_checked(hashes):
            entry = self._entries.get(h)
            if entry is not None and entry.ready:
                self._policy.touch(h)

    def remove(self, hashes: Iterable[BlockHash]) -> int:
        """Drop hashes from the index now (absent ones are ignored); returns how many were
        dropped. A block a copy still uses is freed when its last copy ends."""
        n = 0
        for h in all_checked(hashes):
            entry = self._entries.pop(h, None)
            if entry is None:
                continue
            n += 1
            self._drop(h, entry)
        self._flush()
        return n

    def clear(self) -> None:
        """Drop every hash (as ``remove``)."""
        for h, entry in list(self._entries.items()):
            del self._entries[h]
            self._drop(h, entry)
        self._flush()

    def _drop(self, h: BlockHash, entry: _Entry) -> None:
        users = entry.readers + (0 if entry.ready else 1)  # a store in flight is a user
        if entry.ready:
            self._resident -= 1
            if entry.readers:
                self._held -= 1
            self._policy.remove(h)
            self._counts.removed_blocks += 1
            self._emit("removed", h, entry.host_block)
        if users:
            self._draining[entry.host_block] = users
        else:
            self._free.append(entry.host_block)

    def _release_user(self, block: int) -> None:
        left = self._draining[block] - 1
        if left:
            self._draining[block] = left
        else:
            del self._draining[block]
            self._free.append(block)


# Rounds of events a call hands out: the call's own, then those of the changes its
# listeners made, and so on.
_MAX_FLUSH_ROUNDS = 64


def _ok_of(ok: object) -> bool | frozenset[BlockHash]:
    """``end_store``'s ``ok``: a bool, a 0-d boolean array's bool, or the set of the hashes
    named."""
    if isinstance(ok, bool):
        return ok
    if getattr(ok, "shape", None) == ():  # a 0-d array: one value, not hashes
        dtype = str(getattr(ok, "dtype", ""))
        if dtype in ("bool", "torch.bool"):
            return bool(ok)
        raise InvalidTransferError(
            f"end_store's ok is a bool or the hashes whose copy succeeded, not a 0-d "
            f"{type(ok).__name__} of {dtype or 'another type'}"
        )
    if isinstance(ok, Collection) and not isinstance(ok, (str, bytes, bytearray, memoryview)):
        try:
            return frozenset(all_checked(ok))
        except InvalidTransferError as e:
            raise InvalidTransferError(f"end_store's ok names a bad hash: {e}") from None
        except TypeError as e:  # a collection that cannot be iterated after all
            raise InvalidTransferError(f"end_store's ok cannot be read as hashes: {e}") from None
    raise InvalidTransferError(
        f"end_store's ok is a bool or the hashes whose copy succeeded, not {type(ok).__name__}"
    )


def all_checked(hashes: Iterable[object]) -> list[BlockHash]:
    """Every hash checked before any is used: a bad one changes nothing."""
    if isinstance(hashes, (str, bytes, bytearray, memoryview)) or not isinstance(hashes, Iterable):
        # bytes would be taken for the ints of its bytes, one hash each.
        raise InvalidTransferError(
            f"block hashes are a sequence of ints or bytes, not {type(hashes).__name__}"
        )
    return [_checked(h) for h in hashes]


def _checked(h: object) -> BlockHash:
    """A hash as a plain int or bytes: a subclass is keyed by its value, whatever its
    comparisons and hash say."""
    if type(h) is int or type(h) is bytes:
        return h
    if isinstance(h, bytes):
        return bytes.__getitem__(h, slice(None))  # its bytes, whatever __buffer__ says
    if isinstance(h, int) and not isinstance(h, bool):
        return int.__index__(h)
    raise InvalidTransferError(f"a block hash is an int or bytes, not {type(h).__name__}")
