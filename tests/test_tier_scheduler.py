"""The block index apart from the transfers: an engine's scheduler keeps a BlockIndex and
hands host block ids to workers whose managers move the bytes.

- Without torch: ``asyncpin.tier.index`` (and ``import asyncpin``) import no torch, and a
  whole BlockIndex scenario runs where torch cannot be imported.
- In one process: a BlockIndex (no KVTier) drives a manager on the host engine; bytes
  round-trip by hash; a failed copy, a refused one and one the manager's close stopped
  leave nothing indexed; a cancelled wait ends no plan (the copy still owns its block).
- In three processes: the test process creates a shared region; a worker process
  attaches to it and runs the copies; a scheduler process, where torch cannot be
  imported, keeps the index and its metrics, and ends each plan on the worker's report,
  or as failed when the worker dies. The test then reads every block the scheduler says
  is resident, through its own mapping.
- README.md's wiring examples run as written, the scheduler's parts without torch
  (TestReadmeWiring).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

from asyncpin import InvalidTransferError, KVLayout, OffloadManager, Transfer, TransferError, _sys
from asyncpin.abc import EngineSetup
from asyncpin.testing import FakeBackend
from asyncpin.tier.index import BlockHash, BlockIndex, StorePlan
from tests.helpers import TIMEOUT_S, wait_thread_event
from tests.kit import CopyGate, engines_made
from tests.tier_worker_child import (
    CHUNK,
    CRASH_STATUS,
    FlakyEngine,
    hash_block,
    make_layout,
    same_bytes,
)

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "tier_worker_child.py"
SCHEDULER = REPO / "tests" / "tier_scheduler_child.py"
README = REPO / "README.md"
HOST_BLOCKS = 4

# Runs a script, or code, where torch cannot be imported (as in a scheduler process
# that has none): ``import torch`` raises ImportError.
NO_TORCH = "import sys; sys.modules['torch'] = None\n"
RUN_SCRIPT = (
    NO_TORCH
    + "import runpy; sys.argv = sys.argv[1:]\n"
    + "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_python(code: str, *, blocked: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", (NO_TORCH if blocked else "") + code],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO,
        timeout=120,
    )


# -- without torch ----------------------------------------------------------------------

INDEX_SCENARIO = """
from asyncpin.errors import InvalidTransferError
from asyncpin.tier.index import BlockIndex
from asyncpin.tier.policies import POLICY_NAMES, make_policy
from asyncpin.tier import BlockIndex as Same, KVTier, TierStats

assert Same is BlockIndex
for policy in POLICY_NAMES:
    make_policy(policy, 4)
    index = BlockIndex(2, policy=policy)
    plan = index.begin_store([1, b"h2", 3])
    assert plan.hashes == (1, b"h2") and plan.host_blocks == (0, 1) and plan.skipped == (3,)
    assert index.lookup([1, b"h2"]) == 0  # not loadable before its copy is over
    index.end_store(plan, ok=True)
    assert index.lookup([1, b"h2", 3]) == 2
    host = index.begin_load([b"h2"])
    assert host == [1]
    assert index.begin_store([3]).skipped == ()  # evicts 1: b"h2" is being loaded
    index.end_load([b"h2"], host)
    try:
        index.begin_load([1])
    except InvalidTransferError:
        pass
    else:
        raise AssertionError("1 was evicted")
    s = TierStats.from_index(index, host_block_bytes=64)
    assert (s.stored_blocks, s.evicted_blocks, s.resident_blocks) == (2, 1, 1), s
    assert s.resident_bytes == 64 and s.policy == policy
try:
    import torch
except ImportError:
    pass
else:
    raise AssertionError("torch was importable: the test blocks nothing")
assert sys.modules["torch"] is None
print("ok")
"""


class TestWithoutTorch:
    def test_the_index_runs_where_torch_cannot_be_imported(self) -> None:
        result = run_python(INDEX_SCENARIO)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "ok"

    def test_its_metrics_too(self) -> None:
        code = (
            "from prometheus_client import CollectorRegistry, generate_latest\n"
            "from asyncpin.metrics import TierCollector\n"
            "from asyncpin.tier.index import BlockIndex\n"
            "index = BlockIndex(4)\n"
            "registry = CollectorRegistry()\n"
            "registry.register(TierCollector(index, host_block_bytes=100))\n"
            "index.end_store(index.begin_store([1, 2]), ok=True)\n"
            "print(generate_latest(registry).decode())\n"
        )
        result = run_python(code)
        assert result.returncode == 0, result.stderr
        assert "asyncpin_tier_resident_bytes 200.0" in result.stdout

    def test_import_asyncpin_imports_no_torch_until_a_name_needs_it(self) -> None:
        code = (
            "import sys\n"
            "import asyncpin, asyncpin.errors, asyncpin.stats, asyncpin.tier\n"
            "from asyncpin import ConfigError, ManagerStats, TierStats, capture_gate\n"
            "assert 'torch' not in sys.modules, 'import asyncpin imported torch'\n"
            "assert set(asyncpin.__all__) <= set(dir(asyncpin))\n"
            "from asyncpin import OffloadManager\n"
            "assert 'torch' in sys.modules\n"
            "from asyncpin import *\n"
            "for name in asyncpin.__all__:\n"
            "    assert getattr(asyncpin, name) is not None, name\n"
            "assert OffloadManager is sys.modules['asyncpin.manager'].OffloadManager\n"
            "assert KVLayout is sys.modules['asyncpin.kv'].KVLayout\n"
            "try:\n"
            "    asyncpin.NotAName\n"
            "except AttributeError as exc:\n"
            "    assert 'NotAName' in str(exc)\n"
            "else:\n"
            "    raise AssertionError('asyncpin.NotAName')\n"
        )
        result = run_python(code, blocked=False)
        assert result.returncode == 0, result.stderr

    def test_a_name_that_needs_torch_says_so(self) -> None:
        code = (
            "import asyncpin\n"
            "try:\n"
            "    asyncpin.OffloadManager\n"
            "except ImportError as exc:\n"
            "    assert 'torch' in str(exc), exc\n"
            "else:\n"
            "    raise AssertionError('OffloadManager without torch')\n"
        )
        result = run_python(code)
        assert result.returncode == 0, result.stderr


# -- one process: a scheduler's BlockIndex, a worker's manager ---------------------------


def fill(layout: KVLayout, hashes: Sequence[BlockHash], gpu: Sequence[int]) -> None:
    """Device blocks ``gpu`` hold the bytes of ``hashes`` (the model's compute); an id
    out of range is left for the manager to refuse."""
    for h, g in zip(hashes, gpu, strict=True):
        assert isinstance(h, int)
        if not 0 <= g < layout.num_blocks:
            continue
        block = hash_block(h, layout)
        for a, array in enumerate(layout.arrays):
            array[g] = block[a]


def device_block(layout: KVLayout, g: int) -> torch.Tensor:
    return torch.stack([array[g] for array in layout.arrays])


def store(
    index: BlockIndex, mgr: OffloadManager, hashes: list[BlockHash], gpu: list[int]
) -> tuple[StorePlan, Transfer]:
    """The scheduler's plan, the worker's copy, the plan ended when the copy is over."""
    plan = index.begin_store(hashes)
    moved = [gpu[i] for i in plan.positions]
    layout = mgr.kv_layout
    assert layout is not None
    fill(layout, plan.hashes, moved)
    try:
        transfer = mgr.store(moved, list(plan.host_blocks))
    except BaseException:
        index.end_store(plan, ok=False)  # the copy never started
        raise
    transfer.add_done_callback(lambda t: index.end_store(plan, ok=t.error is None))
    return plan, transfer


async def load(
    index: BlockIndex, mgr: OffloadManager, hashes: list[BlockHash], gpu: list[int]
) -> list[int]:
    host = index.begin_load(hashes)
    transfer = mgr.load(host, gpu)
    transfer.add_done_callback(lambda t: index.end_load(hashes, host))
    await transfer
    return host


def engine_factory() -> tuple[list[FlakyEngine], Callable[[EngineSetup], FlakyEngine]]:
    return engines_made(FlakyEngine)


@pytest.mark.anyio
class TestOneProcess:
    async def test_bytes_round_trip_by_host_block_ids(self) -> None:
        layout = make_layout()
        index = BlockIndex(HOST_BLOCKS)
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
                await mgr.pinned
                prompt: list[BlockHash] = [11, 22, 33]
                _, transfer = store(index, mgr, prompt, [0, 1, 2])
                await transfer
                assert index.lookup([*prompt, 44]) == 3
                host = await load(index, mgr, prompt, [8, 9, 10])
                for h, g, b in zip(prompt, [8, 9, 10], host, strict=True):
                    assert isinstance(h, int)
                    assert same_bytes(device_block(layout, g), hash_block(h, layout))
                    assert same_bytes(mgr.host_blocks()[b], hash_block(h, layout))
                # 44 takes the free block, 55 the block of 11 (the least recently used).
                plan, transfer = store(index, mgr, [44, 55], [3, 4])
                await transfer
                assert plan.host_blocks == (3, host[0])
                assert index.lookup([11]) == 0 and index.lookup([22, 33, 44, 55]) == 4
                for h, b in zip([44, 55], plan.host_blocks, strict=True):
                    assert same_bytes(mgr.host_blocks()[b], hash_block(h, layout))
                s = index.stats()
                assert (s.stored_blocks, s.evicted_blocks, s.resident_blocks) == (5, 1, 4)

    async def test_a_failed_or_refused_copy_leaves_nothing_indexed(self) -> None:
        engines, make = engine_factory()
        index = BlockIndex(HOST_BLOCKS)
        layout = make_layout()
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(
                layout, HOST_BLOCKS, backend=FakeBackend(), engine=make
            ) as mgr:
                await mgr.pinned
                (engine,) = engines
                _, transfer = store(index, mgr, [1, 2, 3, 4], [0, 1, 2, 3])
                await transfer
                # Full: 5 evicts 1, and its copy fails.
                plan, transfer = store(index, mgr, [5], [4])
                engine.failing.add(transfer)
                with pytest.raises(TransferError, match="injected copy failure"):
                    await transfer
                assert index.lookup([5]) == 0 and index.lookup([1]) == 0 and 5 not in index
                s = index.stats()
                assert (s.failed_blocks, s.resident_blocks, s.free_blocks) == (1, 3, 1)
                # The worker refuses the ids (a device block out of range): no copy.
                with pytest.raises(InvalidTransferError, match="outside"):
                    store(index, mgr, [6], [99])
                assert 6 not in index and index.stats().free_blocks == 1
                # The freed block takes the next store.
                again, transfer = store(index, mgr, [5], [4])
                await transfer
                assert again.host_blocks == plan.host_blocks and index.lookup([5]) == 1
                assert same_bytes(mgr.host_blocks()[plan.host_blocks[0]], hash_block(5, layout))

    async def test_a_copy_the_close_stopped_leaves_nothing_indexed(self) -> None:
        """The worker's manager closes while a store waits for its chunks to be pinned:
        the copy never runs, the plan ends as failed."""
        page = _sys.PAGE_SIZE
        layout = make_layout()
        per_chunk = page // layout.host_block_bytes
        fake = FakeBackend(stall_pin_at=1)  # chunk 0 pinned, chunk 1 held, 2 never
        index = BlockIndex(3 * per_chunk)
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(
                layout, 3 * per_chunk, backend=fake, chunk_bytes=page
            ) as mgr:
                try:
                    await wait_thread_event(fake.stalled)
                    first = list(range(per_chunk))
                    _, transfer = store(index, mgr, list(first), first)
                    await transfer  # chunk 0: pinned
                    later = list(range(per_chunk, 2 * per_chunk + 1))  # chunks 1 and 2
                    plan, transfer = store(index, mgr, list(later), later)
                    assert plan.host_blocks == tuple(later)
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(mgr.aclose)
                        await anyio.wait_all_tasks_blocked()
                        fake.release()
                finally:
                    fake.release()
        assert isinstance(transfer.error, TransferError), transfer.error
        assert "will not be pinned" in str(transfer.error)
        assert index.lookup(later) == 0 and not any(h in index for h in later)
        s = index.stats()
        assert (s.resident_blocks, s.failed_blocks) == (per_chunk, len(later))
        assert s.free_blocks == 2 * per_chunk

    async def test_a_cancelled_wait_ends_no_plan(self, copy_gate: CopyGate) -> None:
        """A task awaiting the copy is cancelled (its request aborted): the copy goes on
        and owns its block until it is over; then the plan ends, here done."""
        index = BlockIndex(HOST_BLOCKS)
        layout = make_layout()
        with anyio.fail_after(TIMEOUT_S):
            async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend=FakeBackend()) as mgr:
                await mgr.pinned
                plan, transfer = store(index, mgr, [7], [0])
                try:
                    await copy_gate.wait_entered()
                    with anyio.move_on_after(0.05) as scope:
                        await transfer
                    assert scope.cancelled_caught and not transfer.done()
                    assert 7 not in index and index.lookup([7]) == 0
                    assert index.stats().free_blocks == HOST_BLOCKS - 1  # the copy's block
                finally:
                    copy_gate.release()
                await transfer
                assert index.host_block(7) == plan.host_blocks[0]
                assert same_bytes(mgr.host_blocks()[plan.host_blocks[0]], hash_block(7, layout))


# -- three processes: creator, worker, scheduler ----------------------------------------


@pytest.fixture
def pipes() -> Iterator[list[int]]:
    """Scheduler -> worker and worker -> scheduler: [read, write, read, write]."""
    fds = [*os.pipe(), *os.pipe()]
    yield fds
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def run_children(
    name: str, pipes: list[int], ending: str
) -> tuple[tuple[int, str, str], tuple[int, str]]:
    """Start the worker and the scheduler on the pipes, wait for both: the scheduler's
    status, report and errors; the worker's status and errors."""
    to_worker_r, to_worker_w, to_scheduler_r, to_scheduler_w = pipes
    common: dict[str, Any] = dict(
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO
    )
    worker = subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            name,
            str(HOST_BLOCKS),
            str(to_worker_r),
            str(to_scheduler_w),
        ],
        pass_fds=(to_worker_r, to_scheduler_w),
        **common,
    )
    scheduler = subprocess.Popen(
        [
            *(sys.executable, "-c", RUN_SCRIPT, str(SCHEDULER), str(HOST_BLOCKS)),
            *(str(to_scheduler_r), str(to_worker_w), ending),
        ],
        pass_fds=(to_scheduler_r, to_worker_w),
        **common,
    )
    for fd in pipes:  # the children hold the ends: end of file when one exits
        os.close(fd)
    pipes.clear()
    try:
        s_out, s_err = scheduler.communicate(timeout=TIMEOUT_S)
        _, w_err = worker.communicate(timeout=TIMEOUT_S)
    finally:
        for proc in (scheduler, worker):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return (scheduler.returncode, s_out, s_err), (worker.returncode, w_err)


class TestProcesses:
    @pytest.mark.parametrize("ending", ["exit", "crash"])
    async def test_scheduler_without_torch_and_worker_over_a_shared_region(
        self, shm_name: str, pipes: list[int], ending: str
    ) -> None:
        layout = make_layout()  # this process's own, unused: the region is what we read
        with anyio.fail_after(2 * TIMEOUT_S):
            async with OffloadManager.for_kv(
                layout,
                HOST_BLOCKS,
                backend="host",
                backing="shared",
                name=shm_name,
                chunk_bytes=CHUNK,
            ) as mgr:
                await mgr.pinned
                # The children run while this process's manager keeps the region open.
                (s_rc, s_out, s_err), (w_rc, w_err) = await anyio.to_thread.run_sync(
                    run_children, shm_name, pipes, ending
                )
                assert s_rc == 0, f"scheduler:\n{s_err}\nworker:\n{w_err}"
                assert w_rc == (0 if ending == "exit" else CRASH_STATUS), w_err
                report = json.loads(s_out)
                assert report["torch"] == "None", "the scheduler imported torch"
                # Every block the scheduler's index says is resident holds its hash's
                # bytes, as this process reads the region the worker wrote.
                resident = {int(h): b for h, b in report["resident"].items()}
                big = 2**70 + 3
                assert set(resident) == ({big, 201, 202} if ending == "exit" else {201, 202})
                for h, b in resident.items():
                    assert same_bytes(mgr.host_blocks()[b], hash_block(h, layout)), h
                stats = report["stats"]
                failed = 1 if ending == "exit" else 3  # 301; and 401, 402 of the crash
                evicted = 2 if ending == "exit" else 3  # 101 and 102; and the prompt's last
                assert stats == {
                    "lookups": 4 if ending == "exit" else 6,
                    "hit_blocks": 5,
                    "looked_up_blocks": 8 if ending == "exit" else 10,
                    "stores": 3 if ending == "exit" else 4,
                    "stored_blocks": 5,
                    "skipped_blocks": 1,
                    "failed_blocks": failed,
                    "evicted_blocks": evicted,
                    "removed_blocks": 0,
                    "resident_blocks": len(resident),
                    "free_blocks": HOST_BLOCKS - len(resident),
                }
                metrics = report["metrics"]
                for name in ("stored_blocks", "failed_blocks", "evicted_blocks"):
                    assert metrics[f"asyncpin_tier_{name}_total"] == stats[name]
                assert metrics["asyncpin_tier_resident_blocks"] == len(resident)
                assert metrics["asyncpin_tier_resident_bytes"] == (
                    len(resident) * layout.host_block_bytes
                )


# -- README.md: wiring the tier --------------------------------------------------------------------

_FENCE = re.compile(r"^```python\n(.*?)^```\n", re.S | re.M)
WORKER_SIDE = "# -- worker side"


def wiring_blocks() -> list[str]:
    """README.md's wiring example (the block with the worker side) and the block of a
    bare index's metrics."""
    found = _FENCE.findall(README.read_text())
    return [
        next(b for b in found if WORKER_SIDE in b),
        next(b for b in found if "TierCollector(index" in b),
    ]


class TestReadmeWiring:
    """README.md's wiring blocks ("Wiring the tier into an engine", "Tier metrics"): 1,
    the scheduler and a simulated worker; 2, the tier metrics of a bare index, where torch
    cannot be imported."""

    def test_there_are_the_two_blocks(self) -> None:
        blocks = wiring_blocks()
        assert len(blocks) == 2, blocks
        assert WORKER_SIDE in blocks[0]

    @pytest.mark.parametrize("n", [0, 1], ids=["wiring-1", "wiring-metrics-2"])
    def test_block_runs(self, n: int) -> None:
        code = wiring_blocks()[n]
        # The metrics block is the scheduler's: it runs where torch cannot be imported.
        result = run_python(code, blocked=n == 1)
        assert result.returncode == 0, f"README.md wiring block {n + 1}:\n{result.stderr}"
        assert "Traceback" not in result.stderr, result.stderr
        if n == 0:
            assert "request 2: 3 of 4 blocks loaded from the host" in result.stdout
            assert "failed_blocks=1" in result.stdout
        else:
            assert "asyncpin_tier_resident_bytes 786432.0" in result.stdout

    def test_the_scheduler_side_of_block_1_needs_no_torch(self) -> None:
        scheduler_side = wiring_blocks()[0].split(WORKER_SIDE)[0]
        drive = (
            "s = Scheduler(num_host_blocks=2)\n"
            "store = s.offload([1, 2, 3], [7, 8, 9])\n"
            "assert store is not None and store['host'] == [0, 1] and store['gpu'] == [7, 8]\n"
            "assert s.fetch([1], [0]) == (0, None)\n"
            "s.reported({'id': store['id'], 'ok': True})\n"
            "hit, load = s.fetch([1, 2, 3], [4, 5, 6])\n"
            "assert hit == 2 and load is not None and load['host'] == [0, 1], load\n"
            "s.reported({'id': load['id'], 'ok': True})\n"
            "assert s.offload([1, 2], [0, 1]) is None  # present: nothing to copy\n"
            "assert s.index.stats().resident_blocks == 2 and not s.waiting\n"
            "assert sys.modules['torch'] is None\n"
        )
        result = run_python(scheduler_side + drive)
        assert result.returncode == 0, result.stderr
