"""What the engine check runs an engine on: the host region with its first chunks pinned
(host blocks in rows of their own, or one rank's part of rows that ranks share), the
engine's tasks, and every job given to the engine with the reports of it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread

from asyncpin import _sys
from asyncpin._tasks import OwnedTasks
from asyncpin.abc import EngineFactory, EngineSetup, PinBackend, TransferEngine
from asyncpin.backends import call_hook, registers_with_cuda
from asyncpin.engines import made_off_loop
from asyncpin.kv import KVLayout
from asyncpin.region import Chunk, HostRegion, round_to_pages
from asyncpin.testing._engine_blocks import Blocks
from asyncpin.transfers import Direction, Method, Transfer, TransferJob

__all__ = ["BATCH", "EngineHarness"]

# Jobs of one direction submitted at once in the order scenario (and the blocks it needs).
BATCH = 3
_MIN_DEVICE_BLOCKS = 2 * BATCH + 3
_MIN_PINNED_BLOCKS = 2 * BATCH + 3


@dataclass(eq=False)
class _Record:
    job: TransferJob
    expected: BaseException | None
    # What the job copies, as the check made it (an engine may not change it).
    gpu_ids: list[int]
    cpu_ids: list[int]
    arrays: range | None
    done: anyio.Event = field(default_factory=anyio.Event)
    reports: list[tuple[int, BaseException | None]] = field(default_factory=list)


class _TaskLog:
    """The log of the check's task owner: a task that failed is a violation."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def error(self, event: str, **fields: Any) -> None:
        self.failures.append(f"{event} {fields.get('task')}: {fields.get('error')}")


def _split(
    hbb: int,
    num_host_blocks: int,
    pageable_blocks: int,
    chunk_bytes: int,
    host_slice: tuple[int, int],
) -> tuple[int, list[int], list[int]]:
    """Where the pinned chunks end (the last whole chunk below ``pageable_blocks`` rows
    from the end), the host blocks that lie wholly below that and the others; ValueError
    when either are too few for the check. Host block ``b`` lies at ``b * row + rank *
    hbb`` in rows of ``ranks * hbb`` bytes."""
    rank, ranks = host_slice
    row = ranks * hbb
    split = (num_host_blocks - pageable_blocks) * row
    pinned_end = split // chunk_bytes * chunk_bytes
    ends = [b * row + (rank + 1) * hbb for b in range(num_host_blocks)]
    pinned = [b for b, end in enumerate(ends) if end <= pinned_end]
    pageable = [b for b, end in enumerate(ends) if end > pinned_end]
    if len(pinned) < _MIN_PINNED_BLOCKS or len(pageable) < 2:
        shared = f" ({ranks} ranks to a row)" if ranks > 1 else ""
        raise ValueError(
            f"{num_host_blocks} host blocks of {hbb} bytes{shared} in chunks of "
            f"{chunk_bytes} leave {len(pinned)} in pinned chunks and {len(pageable)} "
            f"outside: the check needs at least {_MIN_PINNED_BLOCKS} and 2 (add host blocks "
            "or pageable_blocks)"
        )
    return pinned_end, pinned, pageable


def default_host_blocks(hbb: int, pageable_blocks: int, chunk_bytes: int | None) -> int:
    """The fewest host blocks, 16 at least, that leave enough blocks in pinned chunks and
    outside them for the check, alone and with rows shared by two ranks (blocks under a
    page lie many to a chunk)."""
    chunk = chunk_bytes or round_to_pages(hbb)
    if chunk <= 0 or chunk % _sys.PAGE_SIZE:
        return 16  # the harness says what is wrong with it
    for n in range(16, 16 + 4 * (chunk // hbb + 1) + pageable_blocks):
        try:
            for host_slice in ((0, 1), (1, 2)):
                _split(hbb, n, pageable_blocks, chunk, host_slice)
        except ValueError:
            continue
        return n
    return 16


class EngineHarness:
    """One run of the check: :meth:`start` maps and pins the host blocks and makes the
    engine; :meth:`job`, :meth:`submit` and :meth:`wait` drive it, recording every report
    (a breach seen in a report or a task is a violation, raised by :meth:`verify`);
    :meth:`cleanup` undoes what a failed check left. With ``host_slice=(rank, ranks)``
    the engine's host blocks are rank ``rank``'s part of rows ``ranks`` host blocks long
    (as :func:`~asyncpin.transfers.host_bytes_view` makes them); the rest of each row must
    stay as it was."""

    def __init__(
        self,
        factory: EngineFactory,
        layout: KVLayout,
        num_host_blocks: int,
        pageable_blocks: int,
        chunk_bytes: int | None,
        backend: PinBackend | None,
        seed: int,
        timeout_s: float,
        host_slice: tuple[int, int] = (0, 1),
    ) -> None:
        self.factory, self.layout, self.backend = factory, layout, backend
        self.host_slice = host_slice
        self.timeout_s = timeout_s
        self.name = getattr(factory, "__name__", repr(factory))
        self.hbb = layout.host_block_bytes
        self.num_host = num_host_blocks
        self.chunk_bytes = chunk_bytes or round_to_pages(self.hbb)
        if self.chunk_bytes % _sys.PAGE_SIZE:
            raise ValueError(f"chunk_bytes={chunk_bytes} is not a multiple of the page size")
        if backend is not None and self.chunk_bytes > backend.max_pin_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} is above the backend's max_pin_bytes")
        self.pinned_end, self.pinned, self.pageable = _split(
            self.hbb, num_host_blocks, pageable_blocks, self.chunk_bytes, host_slice
        )
        if layout.num_blocks < _MIN_DEVICE_BLOCKS:
            raise ValueError(f"the check needs at least {_MIN_DEVICE_BLOCKS} device blocks")
        self.blocks = Blocks(layout, num_host_blocks, seed, host_slice)
        self.loop_thread = threading.get_ident()
        self.token = anyio.lowlevel.current_token()
        self.task_log = _TaskLog()
        self.tasks = OwnedTasks(self.task_log)
        self.tasks.bind()
        self.records: dict[TransferJob, _Record] = {}
        self.reported: dict[Direction, list[TransferJob]] = {"store": [], "load": []}
        self.violations: list[str] = []
        self.region: HostRegion | None = None
        self.pinned_chunks: list[Chunk] = []
        self.leaked: list[Chunk] = []
        self.threads_before: set[threading.Thread] = set()
        self.engine: TransferEngine | None = None
        self.engine_closed = False
        self.tasks_closed = False

    # -- setup -------------------------------------------------------------------------

    async def start(self, method: Method) -> TransferEngine:
        """Map the region, pin the chunks below ``pinned_end``, fill the blocks, make the
        engine (checking ``methods()`` against ``method``) and prepare it."""
        region = self.region = HostRegion.create(self.num_host * self.host_slice[1] * self.hbb)
        if self.backend is not None:
            # As a manager does: the backend's warm-up first (what it raises, the pins
            # report as they fail).
            await anyio.to_thread.run_sync(call_hook, self.backend, "warm_up")
            for chunk in region.chunks(self.chunk_bytes):
                if chunk.offset + chunk.nbytes <= self.pinned_end:
                    await anyio.to_thread.run_sync(
                        self.backend.pin, region.address + chunk.offset, chunk.nbytes
                    )
                    self.pinned_chunks.append(chunk)
        region_bytes = region.view()
        self.blocks.fill(region_bytes)

        self.threads_before = set(threading.enumerate())
        setup = EngineSetup(
            self.layout,
            self.blocks.host_view(region_bytes),
            self.chunk_bytes,
            self._start_soon,
            host_registered=registers_with_cuda(self.backend),
            loop=anyio.lowlevel.current_token(),
        )
        if made_off_loop(self.factory):  # as a manager makes it: in a worker thread
            engine = self.engine = await anyio.to_thread.run_sync(self.factory, setup)
        else:
            engine = self.engine = self.factory(setup)
        del setup, region_bytes
        if not isinstance(engine, TransferEngine):
            raise AssertionError(f"{self.name} made {engine!r}, not a TransferEngine")
        self.name = f"engine {engine.name!r}"
        if self.host_slice[1] > 1:
            self.name += f" (host rows shared by ranks: host_slice={self.host_slice})"
        methods = engine.methods()
        if (
            not isinstance(methods, tuple)
            or not methods
            or not all(isinstance(m, str) for m in methods)
        ):
            raise AssertionError(f"{self.name}: methods() must be a non-empty tuple of str")
        if method != "auto" and method not in methods:
            raise ValueError(f"method {method!r} is not one of {self.name}'s {methods}")
        if getattr(engine, "pageable_before_prepare", False):
            # It says it takes pageable jobs before its set-up: a store and a load, then,
            # each with a reserve to call.
            reserved: list[str] = []
            self.blocks.renew_device(0)
            q = self.pageable[0]
            early = [
                self.job("store", [0], [q], method, reserve=lambda: reserved.append("store")),
                self.job("load", [1], [q], method, reserve=lambda: reserved.append("load")),
            ]
            for job in early:
                self.submit(engine, job, pageable=True)
                await self.wait([job], f"a pageable {job.transfer.direction} before prepare()")
            self.compare("pageable jobs submitted before prepare()")
            if sorted(reserved) != ["load", "store"]:
                raise AssertionError(
                    f"{self.name}: pageable jobs before prepare() called job.reserve "
                    f"{reserved}, not once each"
                )
        await anyio.to_thread.run_sync(engine.prepare)
        return engine

    def _start_soon(self, fn: Callable[..., Any], *args: Any, name: object = None) -> None:
        if threading.get_ident() != self.loop_thread:
            self.violations.append("start_soon was called off the event loop thread")
            raise RuntimeError("start_soon must be called on the event loop thread")
        self.tasks.start_soon(fn, *args, name=name)

    # -- jobs and their reports --------------------------------------------------------

    def job(
        self,
        direction: Direction,
        gpu_ids: list[int],
        cpu_ids: list[int],
        method: Method,
        *,
        arrays: range | None = None,
        ready: Any = None,
        reserve: Callable[[], None] | None = None,
        expected: BaseException | None = None,
    ) -> TransferJob:
        """A job of ``direction`` (of ``arrays`` only, when set: a range of consecutive
        arrays); ``expected``: the error it must be reported with (it copies nothing)."""
        block_bytes = self.hbb if arrays is None else self.layout.span(arrays)[1]
        transfer = Transfer(direction, len(gpu_ids), len(gpu_ids) * block_bytes)
        job = TransferJob(
            transfer,
            list(gpu_ids),
            list(cpu_ids),
            method,
            arrays,
            ready=ready,
            reserve=reserve,
            on_finish=self._on_finish,
        )
        self.records[job] = _Record(job, expected, list(gpu_ids), list(cpu_ids), arrays)
        return job

    def submit(self, engine: TransferEngine, job: TransferJob, *, pageable: bool) -> None:
        transfer = job.transfer
        try:
            engine.submit(job, pageable=pageable)
        except Exception as exc:
            raise AssertionError(f"{self.name}: submit of {transfer!r} raised {exc!r}") from exc
        if transfer.method not in engine.methods():
            raise AssertionError(
                f"{self.name}: submit set transfer.method to {transfer.method!r}, not one of "
                f"methods() {engine.methods()}"
            )
        path = "pageable" if pageable else "pinned"
        if transfer.path != path:
            raise AssertionError(
                f"{self.name}: submit(pageable={pageable}) set transfer.path to "
                f"{transfer.path!r}, not {path!r}"
            )
        if transfer.num_blocks and self.records[job].reports:
            raise AssertionError(
                f"{self.name}: a {transfer.direction} of {transfer.num_blocks} blocks was "
                "reported before submit returned: its copy ran on the event loop"
            )
        record = self.records[job]
        if record.expected is None:  # a job that must fail copies nothing
            direction = transfer.direction
            self.blocks.copied(direction, record.gpu_ids, record.cpu_ids, record.arrays)

    def _on_finish(self, job: TransferJob, error: BaseException | None) -> None:
        record = self.records.get(job)
        if record is None:
            self.violations.append(f"it reported a job it was never given: {job!r}")
            return
        thread = threading.get_ident()
        record.reports.append((thread, error))
        direction = job.transfer.direction
        if len(record.reports) == 1:
            self.reported[direction].append(job)
        else:
            self.violations.append(
                f"a {direction} job was reported {len(record.reports)} times, not once"
            )
        if thread == self.loop_thread:
            self._settle(record, error)
        else:
            self.violations.append(
                f"a {direction} job was reported on thread {thread}, not on the event loop "
                f"thread {self.loop_thread}"
            )
            anyio.from_thread.run_sync(self._settle, record, error, token=self.token)

    @staticmethod
    def _settle(record: _Record, error: BaseException | None) -> None:
        if not record.done.is_set():
            record.job.transfer._finish(error)
            record.done.set()

    async def wait(self, jobs: list[TransferJob], what: str) -> None:
        with anyio.move_on_after(self.timeout_s):
            for job in jobs:
                await self.records[job].done.wait()
        pending = [job for job in jobs if not self.records[job].done.is_set()]
        self.verify()
        if pending:
            raise AssertionError(
                f"{self.name}: {len(pending)} of {len(jobs)} jobs ({what}) were not reported "
                f"within {self.timeout_s}s: {pending[0].transfer!r}"
            )
        for job in jobs:
            record = self.records[job]
            error = record.reports[0][1]
            if error is not record.expected:
                if record.expected is None:
                    raise AssertionError(f"{self.name}: {what} failed: {error!r}") from error
                raise AssertionError(
                    f"{self.name}: {what} was reported with {error!r}, not with the error "
                    f"raised: {record.expected!r}"
                )

    def verify(self) -> None:
        if self.violations:
            raise AssertionError(f"{self.name}: {'; '.join(self.violations)}")

    def compare(self, what: str) -> None:
        self.blocks.compare(f"{self.name}: after {what}")

    # -- teardown ----------------------------------------------------------------------

    async def close_tasks(self) -> None:
        if self.tasks_closed:
            return
        self.tasks_closed = True
        with anyio.move_on_after(self.timeout_s) as scope:
            await self.tasks.aclose()
        if scope.cancelled_caught:
            self.violations.append(f"its tasks did not end within {self.timeout_s}s of a cancel")

    async def release_region(self) -> bool:
        """Unpin the pinned chunks (one whose unpin raised is leaked: it stays mapped),
        drop the check's view and release the region; whether it was unmapped now."""
        assert self.backend is not None or not self.pinned_chunks
        if self.pinned_chunks:  # as a close does: it unpins whatever this raised
            await anyio.to_thread.run_sync(call_hook, self.backend, "before_unpin")
        for chunk in list(self.pinned_chunks):
            self.pinned_chunks.remove(chunk)
            assert self.region is not None and self.backend is not None
            try:
                await anyio.to_thread.run_sync(
                    self.backend.unpin, self.region.address + chunk.offset, chunk.nbytes
                )
            except Exception:
                self.leaked.append(chunk)
        self.blocks.drop_region()
        return self.region is None or self.region.release(keep=self.leaked)

    async def cleanup(self) -> None:
        """What is left after a failed check: tasks cancelled, the engine closed when no
        job is in flight (else the engine and the pinned chunks are left alone: nothing is
        freed under a copy), chunks unpinned, the region released."""
        await self.close_tasks()
        in_flight = any(not record.done.is_set() for record in self.records.values())
        if self.engine is not None and not self.engine_closed and not in_flight:
            self.engine_closed = True
            try:
                await anyio.to_thread.run_sync(self.engine.close)
            except Exception:
                in_flight = True
        if in_flight:
            self.leaked += self.pinned_chunks
            self.pinned_chunks = []
        await self.release_region()
