"""The remote tier over a store of the user's own (``RemoteStore``), asyncio and trio:

- ``degraded`` when a remote operation fails and another, begun before that failure,
  succeeds: the tier stays degraded, in whichever order the two end (on trio, two
  writers whose writes end in one turn run in either order). Only an operation begun
  after the last failure clears it.
- A store that breaks its contract (``get`` or ``exists`` answering the wrong number of
  items, or items of the wrong type) fails as a failing server does: counted, the tier
  degraded, the host's hits restored; never a bare error or a longer prefix than asked.
- A restore counts one lookup, of the host, whatever it fetches.

The stores are in memory, for the order and the faults; the remote tier on real servers
is tested in test_remote_*.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin.testing import FakeBackend
from asyncpin.tier import KVTier, RemoteError
from tests.helpers import TIMEOUT_S

pytestmark = pytest.mark.anyio
BLOCKS = 8


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class GatedStore:
    """Each ``put`` waits for the gate of its batch's first key, then fails if its batch
    holds the ``failing`` key."""

    name = "gated"

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.gates: dict[str, anyio.Event] = {}
        self.waiting: list[str] = []
        self.two_waiting = anyio.Event()
        self.failing: str | None = None

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        await anyio.lowlevel.checkpoint()
        return [self.values.get(key) for key in keys]

    async def put(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        first = items[0][0]
        self.waiting.append(first)
        if len(self.waiting) == 2:
            self.two_waiting.set()
        await self.gates.setdefault(first, anyio.Event()).wait()
        if any(key == self.failing for key, _ in items):
            raise RemoteError("the node holding this key is down")
        for key, parts in items:
            self.values[key] = b"".join(bytes(part) for part in parts)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        await anyio.lowlevel.checkpoint()
        return [key in self.values for key in keys]

    async def aclose(self) -> None:
        pass


def _layout() -> KVLayout:
    return KVLayout.from_tensors([torch.arange(BLOCKS * 64, dtype=torch.uint8).view(BLOCKS, 64)])


@pytest.mark.parametrize("failure_first", [True, False])
async def test_a_success_begun_before_a_failure_does_not_clear_degraded(
    failure_first: bool,
) -> None:
    store = GatedStore()
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            async with KVTier(mgr, remote=store) as tier:
                remote = tier.remote
                assert remote is not None and remote.write_batch == 4
                hashes = list(range(0xD0, 0xD5))
                keys = [remote.key_of(h) for h in hashes]
                store.failing = keys[4]  # the second batch's: blocks 0-3, then 4
                await anyio.wait_all_tasks_blocked()  # the writers wait at the queue
                await tier.store(hashes, list(range(5))).transfer
                await store.two_waiting.wait()  # both writes begun
                assert sorted(store.waiting) == sorted([keys[0], keys[4]])
                order = [keys[4], keys[0]] if failure_first else [keys[0], keys[4]]
                for key in order:
                    store.gates[key].set()
                    await anyio.wait_all_tasks_blocked()  # that write's outcome is in
                await tier.remote_written()
                stats = tier.stats().remote
                assert stats is not None
                assert (stats.written_blocks, stats.failed_writes, stats.errors) == (4, 1, 1)
                assert stats.degraded
                # An operation begun after the failure clears it.
                assert await remote.exists(hashes[:4]) == 4
                stats = tier.stats().remote
                assert stats is not None and not stats.degraded


class ShapedStore(GatedStore):
    """Answers ``get`` and ``exists`` through ``shape(call, keys, answer)``, once the
    test sets it; writes go through at once."""

    def __init__(self) -> None:
        super().__init__()
        self.shape: Callable[[str, Sequence[str], list[Any]], Any] | None = None

    async def put(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        self.gates.setdefault(items[0][0], anyio.Event()).set()
        await super().put(items)

    async def get(self, keys: Sequence[str]) -> list[bytes | None]:
        answer = await super().get(keys)
        return answer if self.shape is None else self.shape("get", keys, answer)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        answer = await super().exists(keys)
        return answer if self.shape is None else self.shape("exists", keys, answer)


BROKEN: dict[str, Callable[[str, Sequence[str], list[Any]], Any]] = {
    "one-short": lambda call, keys, answer: answer[:-1],
    "one-more": lambda call, keys, answer: [*answer, answer[0]],
    "many-more": lambda call, keys, answer: answer * 5,
    "none": lambda call, keys, answer: None,
    "ints": lambda call, keys, answer: list(range(len(keys))) if call == "get" else answer,
    "text": lambda call, keys, answer: ["x" * 5000] * len(keys) if call == "get" else answer,
}


@pytest.mark.parametrize("broken", list(BROKEN))
async def test_a_store_that_answers_out_of_shape_fails_as_a_failing_server(broken: str) -> None:
    store = ShapedStore()
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            async with KVTier(mgr, remote=store) as tier:
                remote = tier.remote
                assert remote is not None
                hashes = list(range(0xE0, 0xE4))
                await tier.store(hashes, [0, 1, 2, 3]).transfer
                await tier.remote_written()
                assert tier.remove(hashes[1:]) == 3  # the host keeps the first only
                store.shape = BROKEN[broken]
                got = await tier.lookup_remote(hashes)
                assert 1 <= got <= len(hashes)  # never more than asked
                layout = mgr.kv_layout
                assert layout is not None
                layout.arrays[0][4:8].zero_()
                assert await tier.restore(hashes, [4, 5, 6, 7]) == 1  # the host's hit
                assert bool((layout.arrays[0][4] == layout.arrays[0][0]).all())
                stats = tier.stats().remote
                assert stats is not None and stats.degraded and stats.errors >= 1


async def test_a_restore_counts_one_lookup_of_the_host() -> None:
    store = ShapedStore()
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            async with KVTier(mgr, remote=store) as tier:
                hashes = list(range(0xF0, 0xF3))
                await tier.store(hashes, [0, 1, 2]).transfer
                await tier.remote_written()
                tier.clear()
                before = tier.stats()
                assert await tier.restore(hashes, [4, 5, 6]) == 3  # all from the remote
                after = tier.stats()
                assert after.lookups - before.lookups == 1
                assert after.looked_up_blocks - before.looked_up_blocks == 3
                assert after.hit_blocks - before.hit_blocks == 0  # none was on the host


async def test_an_error_in_the_tiers_block_comes_out_as_itself() -> None:
    """Not in an ExceptionGroup (the writer's task group's), as without a remote store:
    ``except ValueError`` around the block catches it."""
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(_layout(), BLOCKS, backend=FakeBackend()) as mgr:
            await mgr.pinned
            for remote in (None, ShapedStore()):
                with pytest.raises(ValueError, match="the body's own") as info:
                    async with KVTier(mgr, remote=remote):
                        raise ValueError("the body's own")
                assert type(info.value) is ValueError
