"""Model-based test of OffloadManager: hypothesis draws whole sessions of steps and one
coroutine interprets them against a model of what the manager must do.

A session is a list of steps (open a KV manager, store, load, await a transfer, cancel a
task that awaits one, let pinning progress, pause and resume pinning from a plain thread,
inject a pin or unpin failure, overwrite device blocks, try bad input, close: once,
twice, concurrently or from a cancelled task). Each example runs in its own event loop
(asyncio or trio, drawn with the session; trio when it is installed; the known sessions
run on both) in a thread of its own, so that a hang, even one inside a shielded close,
fails the example instead of the whole run.

After every step the model checks:

- no hang: every step runs under ``anyio.fail_after`` and the whole example under a join
  timeout;
- the recorded backend calls keep the close order pin-stop → unpin → release: every call
  ran on mapped memory, no pin follows the first unpin, no span is unpinned twice or
  without having been pinned, nothing is unpinned while the manager is open, and after
  close each pinned span was unpinned exactly once (a failed unpin leaves exactly that
  chunk mapped and locked, and ``chunks_leaked`` says so);
- every host block holds what the completed stores put there (read through
  ``mgr.host_blocks()``), and every device block what the completed loads brought back,
  byte for byte; a failed transfer changed nothing;
- a pin failure is exactly the one injected; transfers fail only when their host chunk
  can no longer be pinned; bad input raises a typed error and enqueues nothing;
- after close, the locked bytes (VmLck) and the mappings are back to the baseline, and a
  shared region's file is gone.

Pinning progress is a step, not a race: the pipeline may pin chunk k only once the steps
have allowed k + 1 chunks, and fault chunks in only once they have allowed one (a valve
before each pin call, outside the pause gate, and around ``HostRegion.prefault``).
Some sessions also open the manager as on a kernel without ``MADV_POPULATE_WRITE``.

CI runs a fixed set of 50 examples (derandomized: the same every run, well under a
minute). For many more, random ones, run::

    ASYNCPIN_MODEL_EXAMPLES=2000 python -m pytest tests/test_model.py

and hypothesis prints the failing session, shrunk, if one fails. With
``ASYNCPIN_MODEL_REPORT=/path/report.json`` the test also writes counts (examples, steps by
kind, faults injected and triggered, bad inputs tried, transfers, closes) as JSON.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from unittest import mock

import anyio
import anyio.abc
import anyio.to_thread
import pytest
import structlog.testing
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asyncpin.gate
from asyncpin import (
    HostBackend,
    InvalidTransferError,
    KVLayout,
    ManagerState,
    OffloadManager,
    PinError,
    Transfer,
    TransferError,
    _sys,
)
from asyncpin.pinning import PinScheduler
from asyncpin.region import Chunk, HostRegion
from asyncpin.shm import SHM_DIR
from asyncpin.testing import FakeBackend, is_mapped

PAGE = _sys.PAGE_SIZE
CHUNKS = 6
BLOCK_BYTES = PAGE // 8  # one block of one array (K or V)
HOST_BLOCK_BYTES = 2 * BLOCK_BYTES
BLOCKS_PER_CHUNK = PAGE // HOST_BLOCK_BYTES
HOST_BLOCKS = CHUNKS * BLOCKS_PER_CHUNK
DEVICE_BLOCKS = 12
MAX_IDS = 6
MAX_STEPS = 30
STEP_TIMEOUT_S = 10.0
EXAMPLE_TIMEOUT_S = 60.0

EXAMPLES_ENV = "ASYNCPIN_MODEL_EXAMPLES"
REPORT_ENV = "ASYNCPIN_MODEL_REPORT"
CI_EXAMPLES = 50

BACKENDS = ("asyncio", "trio") if importlib.util.find_spec("trio") else ("asyncio",)
Policy = Literal["wait", "pageable"]
Backing = Literal["anonymous", "shared"]
CloseMode = Literal["once", "twice", "concurrent", "cancelled"]
Pairs = tuple[tuple[int, int], ...]  # (gpu block, host block)


# -- steps ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Open:
    """Open a new manager (or, while one is open, try to enter it again: a bad input)."""

    policy: Policy
    backing: Backing
    old_kernel: bool  # MADV_POPULATE_WRITE fails with EINVAL, as before Linux 5.14


@dataclass(frozen=True)
class Store:
    pairs: Pairs


@dataclass(frozen=True)
class Load:
    pairs: Pairs


@dataclass(frozen=True)
class Await:
    """Await a pending transfer (letting pinning reach its chunks if it waits for them)."""

    index: int


@dataclass(frozen=True)
class CancelWait:
    """Cancel a task blocked on a pending transfer (``index``) or on ``mgr.pinned``."""

    index: int | None


@dataclass(frozen=True)
class AwaitPinned:
    pass


@dataclass(frozen=True)
class Pin:
    """Allow ``chunks`` more chunks to be pinned, and wait for them unless paused."""

    chunks: int


@dataclass(frozen=True)
class Pause:
    """Enter ``mgr.pinning_paused()`` in a plain thread and hold it."""


@dataclass(frozen=True)
class Resume:
    """Let the latest pausing thread exit its ``pinning_paused()``."""


@dataclass(frozen=True)
class FailPin:
    """The pin of the ``ahead``-th chunk past those allowed so far will fail."""

    ahead: int


@dataclass(frozen=True)
class FailUnpin:
    """The ``nth`` unpin call (in chunk order, at close) will fail."""

    nth: int


@dataclass(frozen=True)
class Scribble:
    """The engine writes new KV into device block ``gpu``."""

    gpu: int


BadKind = Literal[
    "gpu_out_of_range",
    "host_out_of_range",
    "negative_id",
    "length_mismatch",
    "duplicate_host_destination",
    "duplicate_device_destination",
    "float_ids",
    "two_dim_ids",
    "unknown_method",
    "enter_again",
]
BAD_KINDS: tuple[BadKind, ...] = BadKind.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Bad:
    kind: BadKind


@dataclass(frozen=True)
class Close:
    """Close the manager; ``race`` lets pinning run on while the close starts."""

    mode: CloseMode
    race: bool


Step = (
    Open
    | Store
    | Load
    | Await
    | CancelWait
    | AwaitPinned
    | Pin
    | Pause
    | Resume
    | FailPin
    | FailUnpin
    | Scribble
    | Bad
    | Close
)


def _pairs(unique: Callable[[tuple[int, int]], int]) -> st.SearchStrategy[Pairs]:
    pair = st.tuples(st.integers(0, DEVICE_BLOCKS - 1), st.integers(0, HOST_BLOCKS - 1))
    return st.lists(pair, max_size=MAX_IDS, unique_by=unique).map(tuple)


OPEN = st.builds(
    Open,
    st.sampled_from(("wait", "pageable")),
    st.sampled_from(("anonymous", "shared")),
    st.booleans(),
)
STORES = st.builds(Store, _pairs(lambda p: p[1]))
LOADS = st.builds(Load, _pairs(lambda p: p[0]))
STEPS: st.SearchStrategy[Step] = st.one_of(
    OPEN,
    STORES,
    STORES,  # transfers twice as often as the other steps
    LOADS,
    LOADS,
    st.builds(Await, st.integers(0, 7)),
    st.builds(CancelWait, st.none() | st.integers(0, 7)),
    st.just(AwaitPinned()),
    st.builds(Pin, st.integers(1, CHUNKS)),
    st.just(Pause()),
    st.just(Resume()),
    st.builds(FailPin, st.integers(0, CHUNKS - 1)),
    st.builds(FailUnpin, st.integers(0, CHUNKS - 1)),
    st.builds(Scribble, st.integers(0, DEVICE_BLOCKS - 1)),
    st.builds(Bad, st.sampled_from(BAD_KINDS)),
    st.builds(Close, st.sampled_from(("once", "twice", "concurrent", "cancelled")), st.booleans()),
)


# -- harness ----------------------------------------------------------------------------


class PinValve:
    """Lets the pipeline pin chunk k only once k + 1 chunks are allowed, and fault any
    chunk in only once one is (the pipeline faults the whole region in before its first
    pin call): how far pinning got is decided by the steps, not by thread timing, and
    what a session does before it first lets pinning progress comes before any fault."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.allowed = 0

    def allow(self, chunks: int) -> None:
        with self._cond:
            self.allowed = max(self.allowed, min(chunks, CHUNKS))
            self._cond.notify_all()

    def wait_turn(self, index: int, what: str = "pin") -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: index < self.allowed, timeout=EXAMPLE_TIMEOUT_S):
                raise TimeoutError(f"the {what} of chunk {index} was never allowed")


class Holder(threading.Thread):
    """Holds ``mgr.pinning_paused()`` from plain sync code until :meth:`let_go`."""

    def __init__(self, mgr: OffloadManager) -> None:
        super().__init__(daemon=True, name="model-pause-holder")
        self._mgr = mgr
        self.holding = threading.Event()
        self._let_go = threading.Event()

    def run(self) -> None:
        with self._mgr.pinning_paused():
            self.holding.set()
            self._let_go.wait(EXAMPLE_TIMEOUT_S)

    def let_go(self) -> None:
        self._let_go.set()


@dataclass
class Pending:
    transfer: Transfer
    direction: Literal["store", "load"]
    pairs: Pairs


@dataclass
class Counts:
    """What the examples exercised; written as JSON when ASYNCPIN_MODEL_REPORT is set."""

    examples: int = 0
    steps: int = 0
    steps_by_kind: Counter[str] = field(default_factory=Counter)
    skipped_steps: Counter[str] = field(default_factory=Counter)
    event_loops: Counter[str] = field(default_factory=Counter)
    managers_opened: Counter[str] = field(default_factory=Counter)
    faults_injected: Counter[str] = field(default_factory=Counter)
    faults_triggered: Counter[str] = field(default_factory=Counter)
    bad_inputs: Counter[str] = field(default_factory=Counter)
    transfers: Counter[str] = field(default_factory=Counter)
    closes: Counter[str] = field(default_factory=Counter)

    def as_json(self) -> dict[str, Any]:
        return {
            key: dict(sorted(value.items())) if isinstance(value, Counter) else value
            for key, value in vars(self).items()
        }


async def wait_in_thread(fn: Callable[[], bool], what: str) -> None:
    """Run a blocking wait (bounded inside ``fn``) off the event loop; it must succeed."""
    assert await anyio.to_thread.run_sync(fn), what


def block_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().view(torch.uint8).numpy().tobytes())


# -- the interpreter --------------------------------------------------------------------


class Session:
    """Runs one example's steps and checks the model after each."""

    def __init__(self, counts: Counts, old_kernel_flag: list[bool]) -> None:
        self.counts = counts
        self._old_kernel = old_kernel_flag
        gen = torch.Generator().manual_seed(20240607)
        shape = (DEVICE_BLOCKS, BLOCK_BYTES)
        self.arrays = [
            torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(2)
        ]
        self.layout = KVLayout.from_tensors(self.arrays)
        assert self.layout.host_block_bytes == HOST_BLOCK_BYTES
        self.device = {g: self._device_bytes(g) for g in range(DEVICE_BLOCKS)}
        self.scribbles = 0
        self.opened = 0
        self.baseline_locked = _sys.vm_locked_bytes()
        self.valve = PinValve()
        self.mgr: OffloadManager | None = None
        self._owners: anyio.abc.TaskGroup | None = None
        self._exit = anyio.Event()
        self._left = anyio.Event()
        self.fake = FakeBackend()
        self.policy: Policy = "wait"
        self.shm_path: Path | None = None
        self.address = 0
        self.host: dict[int, bytes] = {}
        # (address, nbytes, backend calls made before it) of every munmap in the process
        self.munmaps: list[tuple[int, int, int]] = []
        self.leaked: list[tuple[int, int]] = []
        self.pending: list[Pending] = []
        self.holders: list[Holder] = []
        self.where = "start"

    # -- helpers ------------------------------------------------------------------------

    def _device_bytes(self, gpu: int) -> bytes:
        return b"".join(block_bytes(array[gpu]) for array in self.arrays)

    def _host_bytes(self, mgr: OffloadManager, cpu: int) -> bytes:
        return block_bytes(mgr.host_blocks()[cpu])

    @property
    def is_open(self) -> bool:
        return self.mgr is not None and self.mgr.state is ManagerState.OPEN

    def _pin_calls(self) -> list[Any]:
        return [call for call in self.fake.calls if call.op == "pin"]

    def _ok_pins(self) -> int:
        return sum(call.ok for call in self._pin_calls())

    def _pin_failed(self) -> bool:
        return any(not call.ok for call in self._pin_calls())

    def _span(self, chunk: int) -> tuple[int, int]:
        return self.address + chunk * PAGE, PAGE

    def _pending_sets(self) -> tuple[set[int], set[int], set[int], set[int]]:
        """(device reads, device writes, host reads, host writes) of pending transfers."""
        dev_r: set[int] = set()
        dev_w: set[int] = set()
        host_r: set[int] = set()
        host_w: set[int] = set()
        for p in self.pending:
            gpus = {g for g, _ in p.pairs}
            cpus = {c for _, c in p.pairs}
            if p.direction == "store":
                dev_r |= gpus
                host_w |= cpus
            else:
                host_r |= cpus
                dev_w |= gpus
        return dev_r, dev_w, host_r, host_w

    def _needs_pinning(self, pairs: Pairs) -> bool:
        """Whether a transfer of ``pairs`` must wait for chunks that are not pinned."""
        pinned = self._ok_pins()  # chunks are pinned in order: 0 .. pinned-1
        return pinned < CHUNKS and any(c // BLOCKS_PER_CHUNK >= pinned for _, c in pairs)

    # -- checks -------------------------------------------------------------------------

    def settle(self) -> None:
        """Apply the effects of the transfers that completed; check the failed ones."""
        mgr = self.mgr
        for p in [p for p in self.pending if p.transfer.done()]:
            self.pending.remove(p)
            error = p.transfer.error
            if error is None:
                self.counts.transfers["completed"] += 1
                for g, c in p.pairs:
                    if p.direction == "store":
                        self.host[c] = self.device[g]
                    else:
                        self.device[g] = self.host[c]
                continue
            self.counts.transfers["failed"] += 1
            # Only a transfer that waited for a chunk that will not be pinned may fail,
            # and it then moved nothing.
            assert isinstance(error, TransferError), repr(error)
            assert "will not be pinned" in str(error), str(error)
            assert self.policy == "wait"
            assert mgr is not None
            assert mgr.pin_error is not None or mgr.state is not ManagerState.OPEN

    def check_calls(self) -> None:
        """The close order, read off the recorded backend calls."""
        calls = list(self.fake.calls)
        assert all(call.mapped for call in calls), f"a backend call on unmapped memory: {calls}"
        ops = [call.op for call in calls]
        first_unpin = ops.index("unpin") if "unpin" in ops else len(ops)
        assert "pin" not in ops[first_unpin:], f"a pin came after an unpin: {ops}"
        pins = [call for call in calls if call.op == "pin"]
        # Pins run in chunk order, one call per chunk, only for allowed chunks.
        assert [(c.address, c.nbytes) for c in pins] == [self._span(i) for i in range(len(pins))]
        assert len(pins) <= self.valve.allowed
        assert sum(not c.ok for c in pins) <= 1 and all(c.ok for c in pins[:-1])
        pinned = Counter(self.fake.pinned_spans())
        unpinned = Counter(self.fake.unpinned_spans())
        assert all(n == 1 for n in unpinned.values()), f"a span was unpinned twice: {unpinned}"
        assert not unpinned - pinned, "a span was unpinned without having been pinned"
        if self.is_open:
            assert not unpinned, "an unpin call while the manager is open"

    def check(self) -> None:
        self.check_calls()
        mgr = self.mgr
        if mgr is None:
            return
        # The only pin failure is the injected one.
        error = mgr.pin_error
        if error is not None:
            assert self.fake.fail_pin_at == error.chunk_index, str(error)
            assert error.code == FakeBackend.FAKE_CODE and error.code_name == "EFAKE"
            assert isinstance(error.__cause__, Exception)
        # Every completed transfer is accounted for; none is lost.
        in_flight = mgr.stats().transfers_in_flight
        assert in_flight == len(self.pending), (in_flight, self.pending)
        _, dev_w, _, host_w = self._pending_sets()
        for g in range(DEVICE_BLOCKS):
            if g not in dev_w:
                assert self._device_bytes(g) == self.device[g], f"device block {g} differs"
        if mgr.state is ManagerState.OPEN:
            for c in range(HOST_BLOCKS):
                if c not in host_w:
                    assert self._host_bytes(mgr, c) == self.host[c], f"host block {c} differs"

    async def check_after_close(self, mgr: OffloadManager) -> None:
        """Pinned spans unpinned exactly once (but a failed one); mapping and locks back."""
        calls = list(self.fake.calls)
        pinned = self.fake.pinned_spans()
        failed = [(c.address, c.nbytes) for c in calls if c.op == "unpin" and not c.ok]
        self.leaked = failed  # ours to give back, whatever the checks say
        assert mgr.state is ManagerState.CLOSED
        assert not self.pending, "close returned with transfers in flight"
        assert Counter(self.fake.unpinned_spans()) == Counter(pinned)
        nth = self.fake.fail_unpin_at
        expected = [pinned[nth]] if nth is not None and nth < len(pinned) else []
        assert failed == expected
        if failed:
            self.counts.faults_triggered["unpin"] += 1
        stats = mgr.stats()
        assert stats.chunks_leaked == len(failed)
        assert stats.chunks_pinned == len(failed)
        assert stats.transfers_in_flight == 0
        # Released: every page of the region was unmapped, after the last backend call,
        # except the leaked chunks, which stay mapped. (The munmap calls are the evidence:
        # once unmapped, an address may be reused by any other mapping of the process.)
        lo, hi = self.address, self.address + CHUNKS * PAGE
        freed: set[int] = set()
        for address, nbytes, calls_before in self.munmaps:
            if address < hi and address + nbytes > lo:
                assert calls_before == len(calls), "a backend call came after the munmap"
                freed.update(range(max(address, lo), min(address + nbytes, hi), PAGE))
        kept = {address for address, _ in failed}
        assert freed == set(range(lo, hi, PAGE)) - kept, "the region was not released exactly"
        assert all(is_mapped(address, nbytes) for address, nbytes in failed)
        leaked_bytes = sum(nbytes for _, nbytes in failed)
        assert _sys.vm_locked_bytes() == self.baseline_locked + leaked_bytes
        if self.shm_path is not None:
            assert not self.shm_path.exists(), "the creator did not unlink its shared file"
        # The readiness signal settles for good: the pin error, done, or closed.
        try:
            await mgr.pinned
        except PinError as exc:
            assert exc is mgr.pin_error
        except anyio.ClosedResourceError:
            assert self._ok_pins() < CHUNKS
        else:
            assert self._ok_pins() == CHUNKS
        self.give_back_leaks()
        assert _sys.vm_locked_bytes() == self.baseline_locked

    def give_back_leaks(self) -> None:
        """Unlock and unmap the chunks a close leaked on purpose (they are ours now)."""
        while self.leaked:
            address, nbytes = self.leaked.pop()
            _sys.libc_munlock(address, nbytes)
            _sys.libc_munmap(address, nbytes)

    # -- steps --------------------------------------------------------------------------

    async def run(self, steps: list[Step]) -> None:
        # Managers are entered and exited by owner tasks of this group, which outlives
        # each step's own cancel scope (a task group must exit where it was entered).
        async with anyio.create_task_group() as self._owners:
            try:
                for n, step in enumerate(steps):
                    self.where = f"step {n}: {step}"
                    self.counts.steps += 1
                    self.counts.steps_by_kind[type(step).__name__] += 1
                    with anyio.fail_after(STEP_TIMEOUT_S):
                        await self.step(step)
                    self.settle()
                    self.check()
                self.where = "final close"
                if self.is_open:
                    with anyio.fail_after(STEP_TIMEOUT_S):
                        await self.close(Close("once", race=False), final=True)
                    self.check()
            finally:
                self.where = "cleanup"
                # However the example ended (a failed check included), nothing may stay
                # held: the owners' closes must be able to finish.
                for holder in self.holders:
                    holder.let_go()
                self.valve.allow(CHUNKS)
                self._exit.set()
        self.give_back_leaks()

    async def _own(
        self,
        mgr: OffloadManager,
        leave: anyio.Event,
        *,
        task_status: anyio.abc.TaskStatus[anyio.Event],
    ) -> None:
        """Enter ``mgr`` and hold it open until ``leave`` is set (by a close step or the
        end of the session); the returned event is set once its ``__aexit__`` is done."""
        left = anyio.Event()
        try:
            async with mgr:
                task_status.started(left)
                await leave.wait()
        finally:
            left.set()

    async def step(self, step: Step) -> None:
        match step:
            case Open():
                await self.open(step)
            case Store(pairs) | Load(pairs):
                self.submit("store" if isinstance(step, Store) else "load", pairs)
            case Await(index):
                await self.await_transfer(index)
            case CancelWait(index):
                await self.cancel_wait(index)
            case AwaitPinned():
                await self.await_pinned()
            case Pin(chunks):
                if not self.is_open:
                    self.counts.skipped_steps["Pin"] += 1
                    return
                self.valve.allow(self.valve.allowed + chunks)
                if not self.holders:
                    await self.wait_pins()
            case Pause():
                await self.pause()
            case Resume():
                await self.resume()
            case FailPin(ahead):
                if not self.is_open or self.fake.fail_pin_at is not None:
                    self.counts.skipped_steps["FailPin"] += 1
                    return
                # A chunk not allowed yet, so its pin call has not been made.
                self.fake.fail_pin_at = self.valve.allowed + ahead
                self.counts.faults_injected["pin"] += 1
            case FailUnpin(nth):
                if not self.is_open or self.fake.fail_unpin_at is not None:
                    self.counts.skipped_steps["FailUnpin"] += 1
                    return
                self.fake.fail_unpin_at = nth
                self.counts.faults_injected["unpin"] += 1
            case Scribble(gpu):
                self.scribble(gpu)
            case Bad(kind):
                self.bad(kind)
            case Close():
                await self.close(step)

    async def open(self, step: Open) -> None:
        mgr = self.mgr
        if mgr is not None and mgr.state is ManagerState.OPEN:
            self.bad("enter_again")
            return
        self.opened += 1
        self._old_kernel[0] = step.old_kernel
        self.fake = FakeBackend(inner=HostBackend())
        self.valve = PinValve()
        self.munmaps = []
        self.policy = step.policy
        name = None
        self.shm_path = None
        if step.backing == "shared":
            name = f"asyncpin-test-{os.getpid()}-model-{self.opened}"
            self.shm_path = SHM_DIR / name
        mgr = OffloadManager.for_kv(
            self.layout,
            HOST_BLOCKS,
            backend=self.fake,
            backing=step.backing,
            name=name,
            chunk_bytes=PAGE,
            prefault_threads=1,
            pin_threads=1,
            unpinned_policy=step.policy,
        )
        assert self._owners is not None
        self._exit = anyio.Event()
        self._left = await self._owners.start(self._own, mgr, self._exit)
        self.mgr = mgr
        self.counts.managers_opened[f"{step.policy}/{step.backing}"] += 1
        if step.old_kernel:
            self.counts.managers_opened["old_kernel"] += 1
        self.address = mgr.host_view().data_ptr()
        self.host = {c: self._host_bytes(mgr, c) for c in range(HOST_BLOCKS)}
        assert set(self.host.values()) == {bytes(HOST_BLOCK_BYTES)}, "a fresh region is zeros"
        if self.shm_path is not None:
            assert self.shm_path.exists()

    def submit(self, direction: Literal["store", "load"], pairs: Pairs) -> None:
        mgr = self.mgr
        if mgr is None:
            self.counts.skipped_steps[direction] += 1
            return
        if mgr.state is not ManagerState.OPEN:
            if direction == "store":
                self._expect_closed(lambda: mgr.store([0], [0]))
            else:
                self._expect_closed(lambda: mgr.load([0], [0]))
            return
        # Leave out pairs whose result would depend on the order of pending copies.
        dev_r, dev_w, host_r, host_w = self._pending_sets()
        if direction == "store":
            pairs = tuple((g, c) for g, c in pairs if g not in dev_w and c not in host_r | host_w)
        else:
            pairs = tuple((g, c) for g, c in pairs if c not in host_w and g not in dev_r | dev_w)
        gpus, cpus = [g for g, _ in pairs], [c for _, c in pairs]
        before = mgr.stats()
        waits = self._needs_pinning(pairs)
        transfer = mgr.store(gpus, cpus) if direction == "store" else mgr.load(cpus, gpus)
        self.counts.transfers[f"{direction}s_submitted"] += 1
        after = mgr.stats()
        assert transfer.num_blocks == len(pairs)
        assert transfer.nbytes == len(pairs) * HOST_BLOCK_BYTES
        # The path follows from which chunks are pinned: they are settled between steps.
        waited = after.transfers_waited_for_pinning - before.transfers_waited_for_pinning
        pageable = after.transfers_pageable - before.transfers_pageable
        assert waited == (waits and self.policy == "wait")
        assert pageable == (waits and self.policy == "pageable")
        assert transfer.path == ("pageable" if pageable else "pinned")
        self.pending.append(Pending(transfer, direction, pairs))

    def _pending_at(self, index: int) -> Pending | None:
        return self.pending[index % len(self.pending)] if self.pending else None

    async def await_transfer(self, index: int) -> None:
        p = self._pending_at(index)
        if p is None:
            self.counts.skipped_steps["Await"] += 1
            return
        if not p.transfer.done() and self.policy == "wait" and self._needs_pinning(p.pairs):
            if self.holders:  # its chunk cannot be pinned while paused
                self.counts.skipped_steps["Await"] += 1
                return
            last = max(c // BLOCKS_PER_CHUNK for _, c in p.pairs)
            self.valve.allow(last + 1)
            await self.wait_pins()
        with contextlib.suppress(TransferError):
            await p.transfer
        assert p.transfer.done()

    async def cancel_wait(self, index: int | None) -> None:
        mgr = self.mgr
        if mgr is None or mgr.state is not ManagerState.OPEN:
            self.counts.skipped_steps["CancelWait"] += 1
            return
        if index is None:
            awaitable: Any = mgr.pinned
            handled: tuple[type[BaseException], ...] = (PinError,)
        else:
            p = self._pending_at(index)
            if p is None:
                self.counts.skipped_steps["CancelWait"] += 1
                return
            awaitable, handled = p.transfer, (TransferError,)
        scope = anyio.CancelScope()

        async def waiter() -> None:
            with scope, contextlib.suppress(*handled):
                await awaitable

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
        if scope.cancelled_caught:
            self.counts.transfers["waits_cancelled"] += 1
        # The manager is unharmed: still open, and the transfer still tracked.
        assert mgr.state is ManagerState.OPEN

    async def await_pinned(self) -> None:
        mgr = self.mgr
        if mgr is None or mgr.state is not ManagerState.OPEN or self.holders:
            self.counts.skipped_steps["AwaitPinned"] += 1
            return
        self.valve.allow(CHUNKS)
        await self.wait_pins()
        fail_at = self.fake.fail_pin_at
        if fail_at is not None and fail_at < CHUNKS:
            try:
                await mgr.pinned
            except PinError as exc:
                assert exc.chunk_index == fail_at
            else:
                raise AssertionError("pinning succeeded past an injected pin failure")
            assert not mgr.is_pinned()
        else:
            await mgr.pinned
            assert mgr.is_pinned()
            assert mgr.stats().chunks_pinned == CHUNKS

    async def wait_pins(self) -> None:
        """Wait until every allowed chunk is pinned (or a pin failed) and the pipeline has
        booked it: pin calls end inside the pause gate, whose condition is notified then."""
        mgr, fake, target = self.mgr, self.fake, self.valve.allowed
        assert mgr is not None and not self.holders
        cond = asyncpin.gate._cond

        def settled() -> bool:
            pins = [call for call in fake.calls if call.op == "pin"]
            ok = sum(call.ok for call in pins)
            reached = len(pins) >= target or ok < len(pins)
            return reached and mgr.stats().chunks_pinned == ok

        def wait() -> bool:
            with cond:
                return cond.wait_for(settled, timeout=STEP_TIMEOUT_S)

        await wait_in_thread(wait, f"pinning did not reach {target} chunks")
        if self._pin_failed():
            # The pipeline stops at a failure; let the pin call that waits at the valve
            # end as it would have, then the failure must be reported.
            self.valve.allow(CHUNKS)
            try:
                await mgr.pinned
            except PinError as exc:
                assert exc.chunk_index == fake.fail_pin_at
            else:
                raise AssertionError("a failed pin was not reported")

    async def pause(self) -> None:
        if not self.is_open or len(self.holders) >= 2:
            self.counts.skipped_steps["Pause"] += 1
            return
        assert self.mgr is not None
        holder = Holder(self.mgr)
        self.holders.append(holder)
        holder.start()
        await wait_in_thread(lambda: holder.holding.wait(STEP_TIMEOUT_S), "pause never held")
        self.counts.transfers["pauses"] += 1

    async def resume(self) -> None:
        if not self.holders:
            self.counts.skipped_steps["Resume"] += 1
            return
        await self._release_holder(self.holders.pop())
        if self.is_open and not self.holders:
            await self.wait_pins()

    @staticmethod
    async def _release_holder(holder: Holder) -> None:
        holder.let_go()
        await anyio.to_thread.run_sync(holder.join, STEP_TIMEOUT_S)
        assert not holder.is_alive(), "a pausing thread did not exit"

    def scribble(self, gpu: int) -> None:
        dev_r, dev_w, _, _ = self._pending_sets()
        if gpu in dev_r | dev_w:
            self.counts.skipped_steps["Scribble"] += 1
            return
        self.scribbles += 1
        gen = torch.Generator().manual_seed(self.scribbles)
        for array in self.arrays:
            array[gpu] = torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8, generator=gen)
        self.device[gpu] = self._device_bytes(gpu)

    def _expect_closed(self, call: Callable[[], object]) -> None:
        try:
            call()
        except anyio.ClosedResourceError:
            self.counts.bad_inputs["use_after_close"] += 1
        else:
            raise AssertionError("a closed manager accepted a call")

    def bad(self, kind: BadKind) -> None:
        mgr = self.mgr
        if mgr is None:
            self.counts.skipped_steps["Bad"] += 1
            return
        if kind == "enter_again":
            # A manager is entered once, whatever its state; nothing changes.
            n_calls = len(self.fake.calls)
            coro = mgr.__aenter__()
            try:
                coro.send(None)
            except RuntimeError as exc:
                assert "only once" in str(exc)
            else:
                raise AssertionError("a manager was entered twice")
            finally:
                coro.close()
            assert len(self.fake.calls) == n_calls
            self.counts.bad_inputs[kind] += 1
            return
        if mgr.state is not ManagerState.OPEN:
            self._expect_closed(lambda: mgr.store([0], [0]))
            self._expect_closed(mgr.host_blocks)
            self._expect_closed(mgr.host_view)
            return
        n_host, n_dev = HOST_BLOCKS, DEVICE_BLOCKS
        bad_calls: dict[BadKind, Callable[[], Transfer]] = {
            "gpu_out_of_range": lambda: mgr.store([n_dev], [0]),
            "host_out_of_range": lambda: mgr.load([n_host], [0]),
            "negative_id": lambda: mgr.store([0], [-1]),
            "length_mismatch": lambda: mgr.store([0, 1], [0]),
            "duplicate_host_destination": lambda: mgr.store([0, 1], [2, 2]),
            "duplicate_device_destination": lambda: mgr.load([0, 1], [3, 3]),
            "float_ids": lambda: mgr.load(torch.tensor([0.0]), [0]),
            "two_dim_ids": lambda: mgr.store(torch.tensor([[0]]), [0]),
            "unknown_method": lambda: mgr.store([0], [0], method="bogus"),  # type: ignore[arg-type]
        }
        before = mgr.stats()
        n_calls = len(self.fake.calls)
        try:
            bad_calls[kind]()
        except InvalidTransferError:
            self.counts.bad_inputs[kind] += 1
        else:
            raise AssertionError(f"bad input {kind} was accepted")
        after = mgr.stats()
        # Refused before anything was counted or enqueued.
        assert (after.transfers_stored, after.transfers_loaded, after.transfers_in_flight) == (
            before.transfers_stored,
            before.transfers_loaded,
            before.transfers_in_flight,
        )
        assert len(self.fake.calls) == n_calls

    async def close(self, step: Close, *, final: bool = False) -> None:
        mgr = self.mgr
        if mgr is None:
            self.counts.skipped_steps["Close"] += 1
            return
        if mgr.state is ManagerState.CLOSED:
            calls = list(self.fake.calls)
            await mgr.aclose()
            assert self.fake.calls == calls, "a second close made backend calls"
            self.counts.closes["of_a_closed_manager"] += 1
            return
        self.counts.closes["final" if final else step.mode] += 1
        if step.race:
            self.valve.allow(CHUNKS)  # pinning runs on while the close starts
        returned: list[ManagerState] = []

        async def close_once() -> None:
            await mgr.aclose()
            returned.append(mgr.state)

        async def close_cancelled() -> None:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await mgr.aclose()  # shielded: it finishes all the same
            returned.append(mgr.state)

        callers = {"once": 1, "twice": 1, "concurrent": 3, "cancelled": 1}[step.mode]
        pins_before = len(self._pin_calls())
        async with anyio.create_task_group() as tg:
            for _ in range(callers):
                tg.start_soon(close_cancelled if step.mode == "cancelled" else close_once)
            await anyio.wait_all_tasks_blocked()
            # Close has stopped the pipeline: let the pin call held at the valve end.
            self.valve.allow(CHUNKS)
            if self.holders:
                self.counts.closes["while_paused"] += 1
                # Unpins wait for the pause to end; nothing is unpinned meanwhile.
                assert self.fake.unpinned_spans() == []
                if self.fake.pinned_spans():
                    assert mgr.state is ManagerState.CLOSING
                while self.holders:
                    await self._release_holder(self.holders.pop())
        assert returned == [ManagerState.CLOSED] * callers
        if not step.race:
            # Pinning was settled (or held by the pause): close stopped it before the
            # next chunk reached a pin call.
            assert len(self._pin_calls()) == pins_before, "a pin call started after close"
        if step.mode == "twice":
            calls = list(self.fake.calls)
            await mgr.aclose()
            assert self.fake.calls == calls
        self._exit.set()  # the owner leaves its `async with` (a no-op close now)
        await self._left.wait()
        self.settle()
        if self._pin_failed():
            self.counts.faults_triggered["pin"] += 1
        self.check_calls()
        await self.check_after_close(mgr)


# -- running examples -------------------------------------------------------------------


@contextlib.contextmanager
def patched_region(session_ref: list[Session | None], old_kernel: list[bool]) -> Iterator[None]:
    """Route prefaults and pin calls through the current session's valve, record every munmap, and
    make madvise act as on a kernel without MADV_POPULATE_WRITE when asked to."""
    real_prefault = HostRegion.prefault
    real_pin_one = PinScheduler._pin_one
    real_madvise = _sys.libc_madvise
    real_munmap = _sys.libc_munmap

    def session() -> Session:
        current = session_ref[0]
        assert current is not None
        return current

    def prefault(region: HostRegion, offset: int, nbytes: int, *args: Any) -> bool:
        session().valve.wait_turn(0, "faulting-in")
        return real_prefault(region, offset, nbytes, *args)

    def pin_one(scheduler: PinScheduler, chunk: Chunk) -> None:
        session().valve.wait_turn(chunk.index)
        real_pin_one(scheduler, chunk)

    def madvise(address: int, nbytes: int, advice: int) -> None:
        if advice == _sys.MADV_POPULATE_WRITE and old_kernel[0]:
            raise _sys.LibcError("madvise", errno.EINVAL)
        real_madvise(address, nbytes, advice)

    def munmap(address: int, nbytes: int) -> None:
        current = session_ref[0]
        calls_before = len(current.fake.calls) if current is not None else 0
        real_munmap(address, nbytes)
        if current is not None:
            current.munmaps.append((address, nbytes, calls_before))

    with (
        mock.patch.object(HostRegion, "prefault", prefault),
        mock.patch.object(PinScheduler, "_pin_one", pin_one),
        mock.patch.object(_sys, "libc_madvise", madvise),
        mock.patch.object(_sys, "libc_munmap", munmap),
    ):
        yield


def run_example(loop: str, steps: list[Step], counts: Counts) -> None:
    """One session in its own event loop and thread; a hang fails it, naming the step."""
    counts.examples += 1
    counts.event_loops[loop] += 1
    old_kernel = [False]
    ref: list[Session | None] = [None]
    errors: list[BaseException] = []

    async def main() -> None:
        session = Session(counts, old_kernel)
        ref[0] = session
        await session.run(steps)

    def target() -> None:
        try:
            anyio.run(main, backend=loop)
        except BaseException as exc:
            # The session's task group wraps a failed check: hand hypothesis the check.
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            errors.append(exc)

    with patched_region(ref, old_kernel), structlog.testing.capture_logs():
        thread = threading.Thread(target=target, name="model-example", daemon=True)
        thread.start()
        thread.join(EXAMPLE_TIMEOUT_S)
        if thread.is_alive():
            session = ref[0]
            where = session.where if session is not None else "start"
            frames = sys._current_frames()
            stacks = "\n".join(
                f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))
                for t in threading.enumerate()
                if t.ident in frames and t is not threading.current_thread()
            )
            raise AssertionError(f"the example hung at {where}\n{stacks}")
    if errors:
        raise errors[0]


B = BLOCKS_PER_CHUNK  # host block B * k is the first of chunk k

# Sessions replayed as they are on every run: hand-written ones that reach each fault and
# close mode for sure (the drawn ones reach them by chance), and ones that found a bug.
KNOWN_SESSIONS: dict[str, list[Step]] = {
    # A pin fails at chunk 2: pinning reports it, and the transfers waiting for chunks
    # past it fail having moved nothing.
    "pin-failure-fails-waiting-transfers": [
        Open("wait", "anonymous", old_kernel=False),
        Store(((0, 0), (1, 3 * B))),
        Pin(1),
        FailPin(1),
        Store(((2, 4 * B),)),
        Pin(2),
        Await(0),
        AwaitPinned(),
        Load(((5, 0),)),
        Await(0),
        Close("once", race=False),
    ],
    # One unpin fails: that chunk stays mapped and locked, the rest is released; then a
    # second manager on the same KV arrays, closed twice.
    "unpin-failure-leaks-one-chunk-then-reopen": [
        Open("wait", "shared", old_kernel=False),
        AwaitPinned(),
        Store(((0, 0), (1, 5))),
        Await(0),
        FailUnpin(2),
        Close("once", race=False),
        Open("pageable", "anonymous", old_kernel=False),
        Load(((3, 0),)),
        Await(0),
        Close("twice", race=False),
    ],
    # Close from three tasks while a thread holds the pause and transfers wait for
    # chunks: no unpin until the pause ends, and the waiting transfers fail.
    "concurrent-close-while-paused": [
        Open("wait", "anonymous", old_kernel=False),
        Pin(2),
        Pause(),
        Store(((0, 2 * B), (1, 0))),
        Pin(3),
        CancelWait(0),
        CancelWait(None),
        FailUnpin(0),
        Close("concurrent", race=False),
    ],
    # Nested pauses from two threads, pageable transfers meanwhile, then pinning
    # everything and a close from a cancelled task racing the pipeline.
    "pageable-transfers-under-nested-pauses": [
        Open("pageable", "anonymous", old_kernel=False),
        Pause(),
        Pause(),
        Store(((0, 0), (1, 5 * B))),
        Await(0),
        Resume(),
        Resume(),
        Pin(CHUNKS),
        Load(((2, 0), (3, 5 * B))),
        Await(0),
        Scribble(0),
        Store(((0, 1),)),
        Await(0),
        AwaitPinned(),
        Close("cancelled", race=True),
    ],
    # Every kind of bad input, open and closed; entering twice; closing a closed manager.
    "bad-inputs": [
        Open("wait", "anonymous", old_kernel=False),
        *(Bad(kind) for kind in BAD_KINDS),
        Open("wait", "anonymous", old_kernel=False),
        Close("once", race=False),
        Bad("float_ids"),
        Store(((0, 0),)),
        Close("once", race=False),
    ],
    # Close races a pipeline let loose, with a pin failure ahead and a transfer waiting.
    "close-races-pinning": [
        Open("wait", "anonymous", old_kernel=False),
        FailPin(3),
        Store(((0, 5 * B),)),
        Close("concurrent", race=True),
    ],
    # Bug (fixed): on a kernel without MADV_POPULATE_WRITE the prefault fell back to
    # memset(0), which erased a pageable store that reached the chunk before its prefault.
    "old-kernel-prefault-erased-a-store": [
        Open("pageable", "anonymous", old_kernel=True),
        Store(((0, 1),)),
        Await(0),
        AwaitPinned(),
    ],
    # The same fallback zeroed a shared region's data.
    "old-kernel-prefault-erased-a-shared-region": [
        Open("pageable", "shared", old_kernel=True),
        Store(((3, 0), (4, B))),
        Await(0),
        Pin(CHUNKS),
        Load(((5, 0), (6, B))),
        Await(0),
        Close("once", race=False),
    ],
}


class TestKnownSessions:
    """Hand-written sessions (each fault and close mode, and past bugs) pass on every loop."""

    @pytest.mark.parametrize("loop", BACKENDS)
    @pytest.mark.parametrize("name", sorted(KNOWN_SESSIONS))
    def test_session(self, name: str, loop: str) -> None:
        run_example(loop, KNOWN_SESSIONS[name], Counts())


class TestModel:
    """Random sessions of steps and faults keep the close order, the data and the resources."""

    def test_sessions(self) -> None:
        counts = Counts()
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
            first=OPEN,
            steps=st.lists(STEPS, max_size=MAX_STEPS),
        )
        def session(loop: str, first: Open, steps: list[Step]) -> None:
            run_example(loop, [first, *steps], counts)

        try:
            session()
        finally:
            report = os.environ.get(REPORT_ENV)
            if report:
                Path(report).write_text(json.dumps(counts.as_json(), indent=2) + "\n")
