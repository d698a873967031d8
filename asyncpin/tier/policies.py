"""Eviction policies of the KV tier: which resident host block to drop when one is needed.

The block index calls a policy synchronously, under its own bookkeeping, with the engine's
block hashes as keys:

- ``insert(key)`` once a block's store completed (the key is not resident);
- ``touch(key)`` on a use of a resident key: ``begin_load`` (unless ``touch=False``) and
  ``touch``; ``lookup`` only counts hits and leaves the order alone;
- ``remove(key)`` when the user removes a resident key (no history is kept for it);
- ``evict(evictable)`` when the index needs a free host block. The policy drops and returns
  its least valuable resident key for which ``evictable(key)`` is true, or ``None`` when
  there is none. Keys for which it is false are protected (a copy still reads or writes
  them): they are never returned, and are skipped as described per policy.

Every call is O(1) amortised (dicts and ``OrderedDict``), except that ``evict`` also steps
over the protected keys in its way, which the copies in flight bound. Policies hold keys
only, never host block ids or bytes, so the index can run without a GPU. A policy is not
thread-safe: the index serialises its calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

from asyncpin._text import shown
from asyncpin.errors import ConfigError

__all__ = [
    "POLICY_NAMES",
    "ARCPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "make_policy",
]

Evictable = Callable[[Hashable], bool]


class EvictionPolicy(Protocol):
    """What the block index asks of a policy (see the module doc for the call contract)."""

    name: str

    def insert(self, key: Hashable) -> None:
        """A block became resident, after its store completed. ``key`` is not resident."""

    def touch(self, key: Hashable) -> None:
        """A hit on the resident ``key``."""

    def remove(self, key: Hashable) -> None:
        """The user removed the resident ``key``; it leaves no history behind."""

    def evict(self, evictable: Evictable) -> Hashable | None:
        """Choose and drop the least valuable resident key for which ``evictable(key)`` is
        true, record it in whatever history the policy keeps, and return it; ``None`` (and
        nothing changed but the order of protected keys, where the policy says so) when no
        resident key is evictable."""

    def __len__(self) -> int:
        """The number of resident keys."""


def _first_evictable(keys: OrderedDict[Hashable, None], evictable: Evictable) -> Hashable | None:
    """The oldest key of ``keys`` that may go; protected keys stay where they are."""
    for key in keys:
        if evictable(key):
            return key
    return None


class LRUPolicy:
    """Least recently inserted or touched goes first. Keeps no history.

    A protected key keeps its place: eviction takes the oldest key that is not protected.
    """

    __slots__ = ("_keys", "capacity")
    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    def insert(self, key: Hashable) -> None:
        self._keys[key] = None

    def touch(self, key: Hashable) -> None:
        self._keys.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._keys[key]

    def evict(self, evictable: Evictable) -> Hashable | None:
        key = _first_evictable(self._keys, evictable)
        if key is not None:
            del self._keys[key]
        return key

    def queues(self) -> dict[str, list[Hashable]]:
        """A snapshot of the policy's lists, each in eviction order (first goes first)."""
        return {"resident": list(self._keys)}

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"<LRUPolicy resident={len(self._keys)}/{self.capacity}>"


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03), for a cache of ``capacity`` keys.

    T1 holds keys seen once since they became resident, T2 keys hit since; B1 and B2 are
    ghosts of keys evicted from T1 and T2. ``target_t1`` (the paper's p) moves towards
    recency when a key from B1 comes back and towards frequency when one from B2 does; such a
    key goes to T2. The directory keeps the paper's bounds: ``|T1| + |B1| <= capacity`` and
    ``|T1| + |T2| + |B1| + |B2| <= 2 * capacity``, trimmed (oldest ghost first) when a key
    new to the directory is inserted.

    The paper replaces on a miss, knowing the incoming key; here eviction comes first and
    does not know it, so the paper's tie-break (evict from T1 when ``|T1| == p`` and the
    incoming key is in B2) is left out: eviction takes T1's oldest key when ``|T1| > p``,
    else T2's, and the other list when the chosen one has no evictable key. Protected keys
    keep their place in their list.
    """

    __slots__ = ("_b1", "_b2", "_t1", "_t2", "capacity", "target_t1")
    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target_t1 = 0
        # Oldest first; values unused.
        self._t1: OrderedDict[Hashable, None] = OrderedDict()
        self._t2: OrderedDict[Hashable, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        if key in self._b1:
            step = max(1, len(self._b2) // len(self._b1))
            self.target_t1 = min(self.capacity, self.target_t1 + step)
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            step = max(1, len(self._b1) // len(self._b2))
            self.target_t1 = max(0, self.target_t1 - step)
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
            while self._b1 and len(self._t1) + len(self._b1) > self.capacity:
                self._b1.popitem(last=False)
            while self._b2 and self._directory_size() > 2 * self.capacity:
                self._b2.popitem(last=False)

    def touch(self, key: Hashable) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        if self._t1.pop(key, self) is self:
            del self._t2[key]

    def evict(self, evictable: Evictable) -> Hashable | None:
        from_t1 = ((self._t1, self._b1), (self._t2, self._b2))
        order = from_t1 if len(self._t1) > self.target_t1 else from_t1[::-1]
        for resident, ghosts in order:
            key = _first_evictable(resident, evictable)
            if key is not None:
                del resident[key]
                ghosts[key] = None
                return key
        return None

    def queues(self) -> dict[str, list[Hashable]]:
        """A snapshot of T1, T2, B1 and B2, each oldest first."""
        return {
            "t1": list(self._t1),
            "t2": list(self._t2),
            "b1": list(self._b1),
            "b2": list(self._b2),
        }

    def _directory_size(self) -> int:
        return len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __repr__(self) -> str:
        return (
            f"<ARCPolicy resident={len(self)}/{self.capacity} t1={len(self._t1)} "
            f"t2={len(self._t2)} b1={len(self._b1)} b2={len(self._b2)} "
            f"target_t1={self.target_t1}>"
        )


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO, a main FIFO and a ghost FIFO.

    ``small_capacity`` is 10% of the capacity (at least 1); the ghost queue remembers as
    many keys as main is meant to hold (``capacity - small_capacity``, at least 1). Each
    resident key has a frequency of 0 to 3, raised by a hit. A key in the ghost queue is
    inserted into main, any other into small, with frequency 0.

    Eviction works on small while it holds ``small_capacity`` keys or more (or main is
    empty), else on main; and on the other queue when the first has no evictable key.
    From small's head: a key with frequency above 0 moves to main's tail (its frequency
    kept), a key with 0 is evicted into the ghost queue. From main's head: a key with
    frequency above 0 goes back to main's tail with its frequency less one, a key with 0
    is evicted (main keeps no ghosts). One call evicts exactly one key: moving keys from
    small into main never evicts from main on the way (the paper's nested eviction); main
    may then hold more than its share for a while, and small correspondingly less, until
    the next calls take from main.

    A protected key met at a queue's head moves to that queue's tail with its frequency
    unchanged: FIFO queues have no other place to leave it, and the move costs O(1). So
    a key a copy holds ages as if it had just been inserted into its queue.
    """

    __slots__ = (
        "_freq",
        "_ghost",
        "_main",
        "_small",
        "capacity",
        "ghost_capacity",
        "small_capacity",
    )
    name = "s3fifo"
    MAX_FREQ = 3

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.small_capacity = max(1, capacity // 10)
        self.ghost_capacity = max(1, capacity - self.small_capacity)
        # Head (next to leave) first; values unused.
        self._small: OrderedDict[Hashable, None] = OrderedDict()
        self._main: OrderedDict[Hashable, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[Hashable, int] = {}  # resident keys only

    def insert(self, key: Hashable) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: Hashable) -> None:
        freq = self._freq[key]
        if freq < self.MAX_FREQ:
            self._freq[key] = freq + 1

    def remove(self, key: Hashable) -> None:
        del self._freq[key]
        if self._small.pop(key, self) is self:
            del self._main[key]

    def evict(self, evictable: Evictable) -> Hashable | None:
        if len(self._small) >= self.small_capacity or not self._main:
            key = self._evict_small(evictable)
            return key if key is not None else self._evict_main(evictable)
        key = self._evict_main(evictable)
        return key if key is not None else self._evict_small(evictable)

    def _evict_small(self, evictable: Evictable) -> Hashable | None:
        small = self._small
        for _ in range(len(small)):  # each key met once; what is left is protected
            key = next(iter(small))
            if not evictable(key):
                small.move_to_end(key)
                continue
            del small[key]
            if self._freq[key] > 0:
                self._main[key] = None
                continue
            del self._freq[key]
            self._ghost[key] = None
            if len(self._ghost) > self.ghost_capacity:
                self._ghost.popitem(last=False)
            return key
        return None

    def _evict_main(self, evictable: Evictable) -> Hashable | None:
        main, freq = self._main, self._freq
        protected_in_a_row = 0
        # Each evictable key's frequency falls on every visit, so this ends within four
        # rounds, or once a whole round met protected keys only.
        while protected_in_a_row < len(main):
            key = next(iter(main))
            main.move_to_end(key)
            if not evictable(key):
                protected_in_a_row += 1
                continue
            protected_in_a_row = 0
            if freq[key] > 0:
                freq[key] -= 1
                continue
            del main[key]
            del freq[key]
            return key
        return None

    def queues(self) -> dict[str, list[Hashable]]:
        """A snapshot of small, main and ghost, each head (next to leave) first."""
        return {"small": list(self._small), "main": list(self._main), "ghost": list(self._ghost)}

    def frequency(self, key: Hashable) -> int:
        """The resident ``key``'s frequency (0-3)."""
        return self._freq[key]

    def __len__(self) -> int:
        return len(self._freq)

    def __repr__(self) -> str:
        return (
            f"<S3FIFOPolicy resident={len(self)}/{self.capacity} small={len(self._small)} "
            f"main={len(self._main)} ghost={len(self._ghost)}>"
        )


_POLICIES: dict[str, type[LRUPolicy | ARCPolicy | S3FIFOPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    ARCPolicy.name: ARCPolicy,
    S3FIFOPolicy.name: S3FIFOPolicy,
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A new, empty policy ``name`` (one of :data:`POLICY_NAMES`) for ``capacity`` host blocks.

    Raises :class:`~asyncpin.errors.ConfigError` for an unknown name, or a capacity that is
    not an integer of at least 1.
    """
    cls = _POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown eviction policy {name!r} (choose from {POLICY_NAMES})")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ConfigError(
            f"a policy's capacity is a number of blocks, at least 1: {shown(capacity)}"
        )
    return cls(capacity)
