"""Eviction policies (placeholder: LRU only)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Protocol

from asyncpin.errors import ConfigError

POLICY_NAMES = ("lru",)


class EvictionPolicy(Protocol):
    name: str

    def insert(self, key: Hashable) -> None: ...
    def touch(self, key: Hashable) -> None: ...
    def remove(self, key: Hashable) -> None: ...
    def evict(self, evictable: Callable[[Hashable], bool]) -> Hashable | None: ...
    def __len__(self) -> int: ...


class _LRU:
    name = "lru"

    def __init__(self) -> None:
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._keys[key] = None

    def touch(self, key: Hashable) -> None:
        self._keys.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._keys[key]

    def evict(self, evictable: Callable[[Hashable], bool]) -> Hashable | None:
        for key in self._keys:
            if evictable(key):
                del self._keys[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._keys)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    if name != "lru":
        raise ConfigError(f"unknown policy {name!r}")
    return _LRU()
