"""``degraded`` when a remote operation fails and another, begun before that failure,
succeeds: the tier stays degraded, in whichever order the two end (on trio, two writers
whose writes end in one turn run in either order). Only an operation begun after the last
failure clears it.

The store is an in-memory ``RemoteStore`` whose writes each wait for a gate the test
opens, for the order; the remote tier on real servers is tested in test_remote_*.py."""

from __future__ import annotations

from collections.abc import Sequence

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
