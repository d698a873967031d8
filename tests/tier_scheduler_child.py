"""The scheduler side of tests/test_tier_scheduler.py: an engine's scheduler process, run
where torch cannot be imported (the test starts it with ``sys.modules["torch"] = None``).

    python tests/tier_scheduler_child.py NUM_HOST_BLOCKS READ_FD WRITE_FD ENDING

It keeps the :class:`~asyncpin.tier.index.BlockIndex`, sends host block ids to the worker
(tests/tier_worker_child.py, one JSON object a line on ``WRITE_FD``) and ends each plan
when the worker reports its copy over (on ``READ_FD``). A worker that dies (end of file)
ends every plan still in flight as failed: nothing of them is indexed. Its scenario ends
with ``ENDING``: ``exit`` (the worker closes) or ``crash`` (the worker dies mid-store).
It checks what it can see itself (lookups, skips, the worker's verified loads), then
prints a JSON report: the resident hashes and their host blocks, the index's stats, the
tier metrics as a Prometheus scrape reads them, and whether torch was imported.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asyncpin.metrics import TierCollector
from asyncpin.tier.index import BlockHash, BlockIndex, StorePlan

Message = dict[str, Any]


class Link:
    """The channel to the worker: JSON lines over two pipes."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self._reader = os.fdopen(read_fd, "r")
        self._writer = os.fdopen(write_fd, "w", buffering=1)

    def send(self, message: Message) -> None:
        self._writer.write(json.dumps(message) + "\n")

    def receive(self) -> Message | None:
        line = self._reader.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        self._writer.close()


class Scheduler:
    """The index, and what it waits for from the worker: a plan, or a load's hashes and
    host blocks, by message id."""

    def __init__(self, index: BlockIndex, link: Link) -> None:
        self.index = index
        self.link = link
        self.pending: dict[int, StorePlan | tuple[list[BlockHash], list[int]]] = {}
        self.replies: dict[int, Message] = {}
        self.worker_gone = False
        self._ids = itertools.count()

    def store(self, hashes: list[int], gpu: list[int], **flags: bool) -> tuple[int, StorePlan]:
        plan = self.index.begin_store(hashes)
        assert plan.hashes, plan  # every store of this scenario has something to copy
        mid = next(self._ids)
        self.pending[mid] = plan
        self.link.send(
            {
                "id": mid,
                "op": "store",
                "hashes": list(plan.hashes),
                "gpu": [gpu[i] for i in plan.positions],
                "host": list(plan.host_blocks),
                **flags,
            }
        )
        return mid, plan

    def load(self, hashes: list[int], gpu: list[int]) -> int:
        keys: list[BlockHash] = list(hashes)
        host = self.index.begin_load(keys)
        mid = next(self._ids)
        self.pending[mid] = (keys, host)
        self.link.send({"id": mid, "op": "load", "hashes": hashes, "gpu": gpu, "host": host})
        return mid

    def wait(self, *ids: int) -> None:
        """End plans and loads as the worker reports them, until ``ids`` are reported
        (or the worker is gone: then every one in flight ends as failed)."""
        while any(i not in self.replies for i in ids) and not self.worker_gone:
            reply = self.link.receive()
            if reply is None:
                self.worker_gone = True
                for mid in list(self.pending):
                    self.end(mid, {"id": mid, "ok": False, "error": "the worker is gone"})
                return
            self.end(reply["id"], reply)

    def end(self, mid: int, reply: Message) -> None:
        self.replies[mid] = reply
        what = self.pending.pop(mid)
        if isinstance(what, StorePlan):
            self.index.end_store(what, ok=reply["ok"])
        else:
            self.index.end_load(*what)


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def main(num_host_blocks: int, read_fd: int, write_fd: int, ending: str) -> None:
    link = Link(read_fd, write_fd)
    hello = link.receive()
    assert hello is not None and hello["hello"], hello
    index = BlockIndex(num_host_blocks, policy="lru")
    registry = CollectorRegistry()
    registry.register(TierCollector(index, host_block_bytes=hello["host_block_bytes"]))
    s = Scheduler(index, link)
    prompt = [101, 102, 2**70 + 3]  # block hashes, any ints (or bytes)

    # A request's blocks go to the host; a later request finds them and loads them.
    mid, _ = s.store(prompt, [1, 2, 3])
    s.wait(mid)
    assert s.replies[mid]["ok"], s.replies[mid]
    assert index.lookup([*prompt, 104]) == 3
    mid = s.load(prompt, [8, 9, 10])
    s.wait(mid)
    assert s.replies[mid]["ok"] and s.replies[mid]["verified"], s.replies[mid]

    # A load and a store in flight at once: the load's blocks are kept from eviction;
    # 201 takes the free block, 202 evicts 101, 203 finds no block it may take.
    loading = s.load(prompt[1:], [11, 12])
    storing, plan = s.store([201, 202, 203], [4, 5, 6])
    assert plan.skipped == (203,), plan
    s.wait(loading, storing)
    assert s.replies[loading]["verified"] and s.replies[storing]["ok"], s.replies
    assert index.lookup([201, 202]) == 2 and index.lookup([101]) == 0

    # A failed copy: its block (evicted for it) is freed, nothing is indexed.
    failing, _ = s.store([301], [7], fail=True)
    s.wait(failing)
    assert not s.replies[failing]["ok"] and "injected" in s.replies[failing]["error"]
    assert index.lookup([301]) == 0

    if ending == "crash":
        # The worker dies with its copy in flight: the plan ends as failed.
        crashed, _ = s.store([401, 402], [13, 14], crash=True)
        s.wait(crashed)
        assert s.worker_gone and not s.replies[crashed]["ok"], s.replies[crashed]
        assert index.lookup([401]) == 0 and index.lookup([402]) == 0
    else:
        link.send({"op": "exit"})
        assert link.receive() is None  # the worker closed: nothing was left to report
    assert not s.pending, s.pending
    link.close()

    known = [*prompt, 104, 201, 202, 203, 301, 401, 402]
    resident = {str(h): index.host_block(h) for h in known if h in index}
    report = {
        "resident": resident,
        "stats": dataclasses.asdict(index.stats()),
        "metrics": scrape(registry),
        "torch": repr(sys.modules.get("torch", "absent")),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    blocks, read_fd, write_fd, ending = sys.argv[1:5]
    main(int(blocks), int(read_fd), int(write_fd), ending)
