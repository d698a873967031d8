"""The KV tier's eviction policies against slow reference models written apart from them.

Hypothesis draws sequences of the calls the block index makes (insert of a key not
resident, touch and remove of a resident one, evict with a random set of protected keys,
and an eviction before each insert into a full policy), runs them on a policy and on its
reference model, and requires the same victims in the same order, the same lists after
every call, no protected victim, the right ``len``, and ghost lists within their bounds.
The references keep plain lists and recompute what they need on every call: LRU's is a
list in use order; ARC's follows the paper's lists step by step; S3-FIFO's computes each
eviction's result in one go (who moves to main, who is evicted, how the queues rotate)
instead of stepping through the queues as the policy does.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from asyncpin.errors import ConfigError
from asyncpin.tier.policies import (
    POLICY_NAMES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)

Evictable = Callable[[Hashable], bool]
EXAMPLES = 400


# -- reference models -------------------------------------------------------------------


class Reference(Protocol):
    def insert(self, key: int) -> None: ...
    def touch(self, key: int) -> None: ...
    def remove(self, key: int) -> None: ...
    def evict(self, evictable: Evictable) -> int | None: ...
    def queues(self) -> dict[str, list[int]]: ...


class RefLRU:
    """A list in use order: the front was used longest ago."""

    def __init__(self, capacity: int) -> None:
        self.order: list[int] = []

    def insert(self, key: int) -> None:
        self.order.append(key)

    def touch(self, key: int) -> None:
        self.order.remove(key)
        self.order.append(key)

    def remove(self, key: int) -> None:
        self.order.remove(key)

    def evict(self, evictable: Evictable) -> int | None:
        victims = [key for key in self.order if evictable(key)]
        if not victims:
            return None
        self.order.remove(victims[0])
        return victims[0]

    def queues(self) -> dict[str, list[int]]:
        return {"resident": list(self.order)}


class RefARC:
    """ARC's four lists (front: least recent) and target p, as the paper states them."""

    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0
        self.t1: list[int] = []
        self.t2: list[int] = []
        self.b1: list[int] = []
        self.b2: list[int] = []

    def insert(self, key: int) -> None:
        if key in self.b1:  # a recency ghost: grow T1's share
            self.p = min(self.c, self.p + max(1, len(self.b2) // len(self.b1)))
            self.b1.remove(key)
            self.t2.append(key)
        elif key in self.b2:  # a frequency ghost: shrink it
            self.p = max(0, self.p - max(1, len(self.b1) // len(self.b2)))
            self.b2.remove(key)
            self.t2.append(key)
        else:
            self.t1.append(key)
            if len(self.t1) + len(self.b1) > self.c:
                del self.b1[: len(self.t1) + len(self.b1) - self.c]
            excess = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) - 2 * self.c
            if excess > 0:
                del self.b2[:excess]

    def touch(self, key: int) -> None:
        (self.t1 if key in self.t1 else self.t2).remove(key)
        self.t2.append(key)

    def remove(self, key: int) -> None:
        (self.t1 if key in self.t1 else self.t2).remove(key)

    def evict(self, evictable: Evictable) -> int | None:
        pairs = [(self.t1, self.b1), (self.t2, self.b2)]
        if len(self.t1) <= self.p:
            pairs.reverse()
        for resident, ghosts in pairs:
            candidates = [key for key in resident if evictable(key)]
            if candidates:
                resident.remove(candidates[0])
                ghosts.append(candidates[0])
                return candidates[0]
        return None

    def queues(self) -> dict[str, list[int]]:
        return {"t1": self.t1[:], "t2": self.t2[:], "b1": self.b1[:], "b2": self.b2[:]}


class RefS3FIFO:
    """S3-FIFO's queues (front: next to leave), each eviction worked out in one go."""

    def __init__(self, capacity: int) -> None:
        self.small_capacity = max(1, capacity // 10)
        self.ghost_capacity = max(1, capacity - self.small_capacity)
        self.small: list[int] = []
        self.main: list[int] = []
        self.ghost: list[int] = []
        self.freq: dict[int, int] = {}

    def insert(self, key: int) -> None:
        self.freq[key] = 0
        if key in self.ghost:
            self.ghost.remove(key)
            self.main.append(key)
        else:
            self.small.append(key)

    def touch(self, key: int) -> None:
        self.freq[key] = min(3, self.freq[key] + 1)

    def remove(self, key: int) -> None:
        del self.freq[key]
        (self.small if key in self.small else self.main).remove(key)

    def evict(self, evictable: Evictable) -> int | None:
        phases = [self._from_small, self._from_main]
        if len(self.small) < self.small_capacity and self.main:
            phases.reverse()
        for phase in phases:
            victim = phase(evictable)
            if victim is not None:
                return victim
        return None

    def _from_small(self, evictable: Evictable) -> int | None:
        # Small is read once from its front: protected keys go round to the back, hit keys
        # leave for main, and the first key never hit is the victim.
        order = self.small
        at = next(
            (i for i, key in enumerate(order) if evictable(key) and self.freq[key] == 0), None
        )
        seen = order if at is None else order[:at]
        self.main += [key for key in seen if evictable(key)]
        self.small = ([] if at is None else order[at + 1 :]) + [
            key for key in seen if not evictable(key)
        ]
        if at is None:
            return None
        victim = order[at]
        del self.freq[victim]
        self.ghost = [*self.ghost, victim][-self.ghost_capacity :]
        return victim

    def _from_main(self, evictable: Evictable) -> int | None:
        # Round after round every evictable key loses one frequency; the first to be met at
        # 0 goes. That is the first key of least frequency, after min-frequency rounds; the
        # rotation leaves main in its old cyclic order, starting after the victim.
        free = [i for i, key in enumerate(self.main) if evictable(key)]
        if not free:
            return None
        rounds = min(self.freq[self.main[i]] for i in free)
        at = next(i for i in free if self.freq[self.main[i]] == rounds)
        for i in free:
            self.freq[self.main[i]] -= rounds + (i < at)
        victim = self.main[at]
        self.main = self.main[at + 1 :] + self.main[:at]
        del self.freq[victim]
        return victim

    def queues(self) -> dict[str, list[int]]:
        return {"small": self.small[:], "main": self.main[:], "ghost": self.ghost[:]}


REFERENCES: dict[str, Callable[[int], Reference]] = {
    "lru": RefLRU,
    "arc": RefARC,
    "s3fifo": RefS3FIFO,
}

# -- the index's calls, drawn ----------------------------------------------------------

# (call, which key among the candidates, which resident keys are protected: positions in
# key order, a few as copies in flight would hold, or all of them now and then). Inserts
# come first in the list so that shrinking favours them.
Op = tuple[str, int, frozenset[int]]
ALL = frozenset(range(64))
ops_strategy = st.lists(
    st.tuples(
        st.sampled_from(["insert", "insert", "insert", "touch", "touch", "remove", "evict"]),
        st.integers(0, 63),
        st.frozensets(st.integers(0, 24), max_size=4) | st.just(ALL),
    ),
    # Hypothesis draws short lists unless told; a policy shows its cases once it is full.
    min_size=40,
    max_size=200,
)


def check_state(name: str, policy: EvictionPolicy, ref: Reference, resident: set[int]) -> None:
    """Same lists as the reference, the right length, and ghosts within their bounds."""
    queues: dict[str, list[Hashable]] = policy.queues()  # type: ignore[attr-defined]
    assert queues == ref.queues()
    assert len(policy) == len(resident)
    capacity: int = policy.capacity  # type: ignore[attr-defined]
    if name == "arc":
        t1, t2, b1, b2 = (len(queues[k]) for k in ("t1", "t2", "b1", "b2"))
        assert 0 <= policy.target_t1 <= capacity  # type: ignore[attr-defined]
        assert policy.target_t1 == ref.p  # type: ignore[attr-defined]
        assert t1 + b1 <= capacity and t1 + t2 + b1 + b2 <= 2 * capacity
        assert set(queues["b1"] + queues["b2"]).isdisjoint(resident)
    if name == "s3fifo":
        assert isinstance(policy, S3FIFOPolicy) and isinstance(ref, RefS3FIFO)
        assert len(queues["ghost"]) <= policy.ghost_capacity
        assert set(queues["ghost"]).isdisjoint(resident)
        assert {key: policy.frequency(key) for key in resident} == ref.freq


def run_ops(
    name: str,
    capacity: int,
    ops: list[Op],
    factory: Callable[[str, int], EvictionPolicy] = make_policy,
) -> list[int | None]:
    """Drive a policy and its reference through ``ops`` as the index would; the victims."""
    policy, ref = factory(name, capacity), REFERENCES[name](capacity)
    universe = range(2 * capacity + 3)
    resident: set[int] = set()
    victims: list[int | None] = []

    def evict(positions: frozenset[int]) -> int | None:
        protected = {key for i, key in enumerate(sorted(resident)) if i in positions}
        victim = policy.evict(lambda key: key not in protected)
        assert victim == ref.evict(lambda key: key not in protected)
        assert victim is None or isinstance(victim, int)
        if victim is None:
            assert protected == resident
        else:
            assert victim in resident and victim not in protected
            resident.remove(victim)
        victims.append(victim)
        return victim

    for call, pick, positions in ops:
        if call == "insert":
            absent = [key for key in universe if key not in resident]
            if len(resident) >= capacity and evict(positions) is None:
                continue  # the index stores what fits
            key = absent[pick % len(absent)]
            policy.insert(key)
            ref.insert(key)
            resident.add(key)
        elif call == "evict":
            evict(positions)
        elif resident:
            key = sorted(resident)[pick % len(resident)]
            if call == "touch":
                policy.touch(key)
                ref.touch(key)
            else:
                policy.remove(key)
                ref.remove(key)
                resident.remove(key)
        check_state(name, policy, ref, resident)
    return victims


# -- tests ------------------------------------------------------------------------------


class TestAgainstReference:
    """Every policy makes its reference model's choices, call for call."""

    @pytest.mark.parametrize("name", POLICY_NAMES)
    @settings(max_examples=EXAMPLES, deadline=None)
    @given(capacity=st.integers(1, 12), ops=ops_strategy)
    def test_same_victims_and_lists(self, name: str, capacity: int, ops: list[Op]) -> None:
        run_ops(name, capacity, ops)

    @pytest.mark.parametrize("name", POLICY_NAMES)
    def test_a_long_run_at_a_larger_capacity(self, name: str) -> None:
        # Past what hypothesis draws: S3-FIFO's small queue above one key, ARC's p far from 0.
        import random

        rng = random.Random(7)
        calls = ["insert"] * 4 + ["touch"] * 3 + ["remove", "evict"]
        ops = [
            (rng.choice(calls), rng.randrange(64), frozenset(rng.sample(range(40), 3)))
            for _ in range(3000)
        ]
        victims = run_ops(name, 40, ops)
        assert sum(v is not None for v in victims) > 500


class _NoTouchLRU(LRUPolicy):
    def touch(self, key: Hashable) -> None:
        pass


class _NoAdaptARC(ARCPolicy):
    def insert(self, key: Hashable) -> None:
        target = self.target_t1
        super().insert(key)
        self.target_t1 = target


class _ThresholdTwoS3FIFO(S3FIFOPolicy):
    def _evict_small(self, evictable: Evictable) -> Hashable | None:
        ones = [k for k in self._small if self._freq[k] == 1]
        for key in ones:  # treat a single hit as none
            self._freq[key] = 0
        victim = super()._evict_small(evictable)
        for key in ones:
            if key in self._freq and key != victim:
                self._freq[key] = 1
        return victim


class TestTheChecksCanFail:
    """The property test catches a policy that strays from its reference."""

    @pytest.mark.filterwarnings("ignore:Generating overly large repr")
    @pytest.mark.parametrize(
        ("name", "broken"),
        [("lru", _NoTouchLRU), ("arc", _NoAdaptARC), ("s3fifo", _ThresholdTwoS3FIFO)],
    )
    def test_a_broken_variant_is_caught(self, name: str, broken: type[Any]) -> None:
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            report_multiple_bugs=False,
            phases=[Phase.generate],  # found is enough: no shrinking
            database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(capacity=st.integers(1, 12), ops=ops_strategy)
        def check(capacity: int, ops: list[Op]) -> None:
            run_ops(name, capacity, ops, factory=lambda _, c: broken(c))

        with pytest.raises(AssertionError):
            check()


class TestProtectedKeys:
    """A protected key is never evicted, and eviction says None when all are protected."""

    @pytest.mark.parametrize("name", POLICY_NAMES)
    def test_all_protected_gives_none_and_changes_nothing(self, name: str) -> None:
        policy = make_policy(name, 4)
        for key in range(4):
            policy.insert(key)
        policy.touch(1)
        before = policy.queues()  # type: ignore[attr-defined]
        assert policy.evict(lambda key: False) is None
        assert policy.queues() == before  # type: ignore[attr-defined]
        assert len(policy) == 4

    @pytest.mark.parametrize("name", POLICY_NAMES)
    def test_the_one_unprotected_key_goes(self, name: str) -> None:
        policy = make_policy(name, 5)
        for key in range(5):
            policy.insert(key)
            policy.touch(key)
        assert policy.evict(lambda key: key == 3) == 3
        assert len(policy) == 4

    def test_lru_skips_a_protected_key_in_place(self) -> None:
        policy = LRUPolicy(3)
        for key in "abc":
            policy.insert(key)
        assert policy.evict(lambda key: key != "a") == "b"
        assert policy.queues() == {"resident": ["a", "c"]}

    def test_s3fifo_moves_a_protected_key_to_the_back_with_its_frequency(self) -> None:
        policy = S3FIFOPolicy(10)  # small holds 1
        policy.insert("a")
        policy.touch("a")
        policy.insert("b")
        assert policy.evict(lambda key: key != "a") == "b"
        assert policy.queues()["small"] == ["a"]
        assert policy.frequency("a") == 1


class TestLRU:
    """LRU evicts the least recently inserted or touched key and keeps no history."""

    def test_order(self) -> None:
        policy = make_policy("lru", 3)
        for key in "abc":
            policy.insert(key)
        policy.touch("a")
        assert [policy.evict(lambda _: True) for _ in range(4)] == ["b", "c", "a", None]
        assert len(policy) == 0


class TestARC:
    """ARC promotes hit keys to T2, remembers evicted ones, and adapts p on their return."""

    def test_a_hit_promotes_and_t1_goes_first(self) -> None:
        policy = ARCPolicy(2)
        policy.insert("a")
        policy.insert("b")
        policy.touch("a")
        assert policy.queues() == {"t1": ["b"], "t2": ["a"], "b1": [], "b2": []}
        assert policy.evict(lambda _: True) == "b"
        assert policy.queues()["b1"] == ["b"]

    def test_a_recency_ghost_raises_p_and_returns_to_t2(self) -> None:
        policy = ARCPolicy(2)
        policy.insert("a")
        policy.insert("b")
        assert policy.evict(lambda _: True) == "a"
        policy.insert("a")
        assert policy.target_t1 == 1
        assert policy.queues() == {"t1": ["b"], "t2": ["a"], "b1": [], "b2": []}

    def test_a_frequency_ghost_lowers_p(self) -> None:
        policy = ARCPolicy(2)
        policy.insert("a")
        policy.insert("b")
        policy.evict(lambda _: True)
        policy.insert("a")  # from B1: p = 1, a in T2
        policy.insert("c")  # new: T1 = [b, c] > p, so T1 goes first
        assert policy.evict(lambda key: key != "b") == "c"
        policy.touch("b")  # T1 empty now: T2 is next
        assert policy.evict(lambda _: True) == "a"
        policy.insert("a")  # from B2
        assert policy.target_t1 == 0

    def test_remove_leaves_no_ghost(self) -> None:
        policy = ARCPolicy(2)
        policy.insert("a")
        policy.remove("a")
        policy.insert("a")
        assert policy.queues()["t1"] == ["a"] and policy.target_t1 == 0

    def test_ghosts_stay_within_the_directory(self) -> None:
        policy = ARCPolicy(3)
        for key in range(100):
            if len(policy) == 3:
                policy.evict(lambda _: True)
            policy.insert(key)
        queues = policy.queues()
        assert len(queues["t1"]) + len(queues["b1"]) <= 3


class TestS3FIFO:
    """S3-FIFO filters one-hit keys through small, and ghosts send returning ones to main."""

    def test_a_scan_passes_through_small_and_spares_main(self) -> None:
        policy = S3FIFOPolicy(10)
        for key in range(9):
            policy.insert(key)
            policy.touch(key)
        victims = []
        for key in range(100, 130):  # one-off keys
            if len(policy) == 10:
                victims.append(policy.evict(lambda _: True))
            policy.insert(key)
        assert victims == list(range(100, 129))
        assert policy.queues() == {"small": [129], "main": list(range(9)), "ghost": victims[-9:]}

    def test_a_ghost_returns_to_main_and_remove_forgets(self) -> None:
        policy = S3FIFOPolicy(10)
        policy.insert("a")
        assert policy.evict(lambda _: True) == "a"
        assert policy.queues()["ghost"] == ["a"]
        policy.insert("a")
        assert policy.queues() == {"small": [], "main": ["a"], "ghost": []}
        policy.remove("a")
        policy.insert("a")
        assert policy.queues()["small"] == ["a"]

    def test_main_gives_second_chances_and_frequency_is_two_bits(self) -> None:
        policy = S3FIFOPolicy(10)
        for key in "ab":
            policy.insert(key)
            for _ in range(5):
                policy.touch(key)
        assert policy.frequency("a") == 3
        policy.insert("c")
        # small holds 3 keys >= 1: a and b move to main with their frequency, c goes.
        assert policy.evict(lambda _: True) == "c"
        # Now main: a (3), b (3); three rounds take them to 0, then a goes.
        assert policy.evict(lambda _: True) == "a"
        assert policy.frequency("b") == 0


class TestMakePolicy:
    """make_policy builds each named policy and refuses bad names and capacities."""

    @pytest.mark.parametrize("name", POLICY_NAMES)
    def test_builds(self, name: str) -> None:
        policy = make_policy(name, 8)
        assert policy.name == name and len(policy) == 0
        assert name in repr(policy).lower().replace("-", "")

    def test_names(self) -> None:
        assert POLICY_NAMES == ("lru", "arc", "s3fifo")

    @pytest.mark.parametrize("name", ["LRU", "fifo", ""])
    def test_unknown_name(self, name: str) -> None:
        with pytest.raises(ConfigError, match="unknown eviction policy"):
            make_policy(name, 8)

    @pytest.mark.parametrize("capacity", [0, -1, 2.5, True, "8"])
    def test_bad_capacity(self, capacity: Any) -> None:
        with pytest.raises(ConfigError, match="capacity"):
            make_policy("lru", capacity)
