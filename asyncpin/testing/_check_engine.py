"""A conformance check of the :class:`~asyncpin.abc.TransferEngine` contract."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch

from asyncpin import _sys
from asyncpin._tasks import OwnedTasks
from asyncpin.abc import EngineFactory, EngineSetup, PinBackend, TransferEngine
from asyncpin.kv import KVLayout
from asyncpin.region import Chunk, HostRegion, round_to_pages
from asyncpin.transfers import Direction, Method, Transfer, TransferJob, host_blocks_view

__all__ = ["check_transfer_engine"]

# Jobs of one direction submitted at once in the order scenario (and the blocks it needs).
_BATCH = 3
_MIN_DEVICE_BLOCKS = 2 * _BATCH + 3
_MIN_PINNED_BLOCKS = 2 * _BATCH + 3
# Threads of the event loop's worker pools, which outlive an engine by design.
_POOL_THREADS = ("AnyIO worker thread", "Trio thread")


async def check_transfer_engine(
    factory: EngineFactory,
    layout: KVLayout,
    *,
    num_host_blocks: int = 16,
    pageable_blocks: int = 4,
    chunk_bytes: int | None = None,
    method: Method = "auto",
    backend: PinBackend | None = None,
    seed: int = 0,
    timeout_s: float = 60.0,
) -> None:
    """Check that the engines ``factory`` makes keep the TransferEngine contract; raise
    AssertionError naming the clause broken.

    Maps a region of ``num_host_blocks`` host blocks (chunks of ``chunk_bytes``, by
    default one host block rounded up to a page), pins the chunks that hold the first
    ``num_host_blocks - pageable_blocks`` blocks with ``backend`` (None: pins nothing; a
    copy engine that reads host memory from the device needs it, e.g.
    :class:`~asyncpin.cuda.CudaBackend` for the cuda engine), makes the engine on the
    running loop from an :class:`~asyncpin.abc.EngineSetup` whose ``start_soon`` runs
    tasks owned by the check, calls ``prepare()`` in a worker thread, then checks:

    - ``submit`` sets ``transfer.method`` (one of ``methods()``) and ``transfer.path``
      before it returns, and does not report a non-empty job before it returns (the copy
      did not run on the loop); ``start_soon`` is called on the loop thread only;
    - every job is reported exactly once, on the event loop thread, with no error (or
      with the one expected), within ``timeout_s``; an empty job is reported too;
    - stores then loads round-trip byte for byte, through the block-major host layout,
      with no other host or device block touched (one store waits on a
      ``record_ready()`` marker);
    - pinned jobs of one direction submitted at once are reported in submission order,
      and the later one to the same block wins, with stores and loads in flight together;
    - pageable jobs copy through the unpinned blocks (``path`` is ``pageable``) and call
      ``job.reserve`` once, off the event loop, before copying; one whose reserve fails
      is reported with that error and copies nothing;
    - after every job was reported: the engine's tasks end when cancelled, none failed,
      ``close()`` in a worker thread returns, every thread the engine started has ended,
      no view of the host blocks outlives it (the region unmaps at release), and no job
      is reported again.

    ``layout`` holds the device arrays (CPU tensors for the host engine, CUDA tensors
    for the cuda engine); the check overwrites them. ``method`` is what pinned jobs ask
    for. The check cannot see the loop blocked by a ``submit`` that waits and reports
    later, nor require a store and a load to overlap (it is allowed, not demanded).
    """
    run = _Run(factory, layout, num_host_blocks, pageable_blocks, chunk_bytes, backend, seed,
               timeout_s)
    try:
        await run.main(method)
    finally:
        with anyio.CancelScope(shield=True):
            await run.cleanup()


@dataclass(eq=False)
class _Record:
    job: TransferJob
    expected: BaseException | None
    done: anyio.Event = field(default_factory=anyio.Event)
    reports: list[tuple[int, BaseException | None]] = field(default_factory=list)


class _TaskLog:
    """The log of the check's task owner: a task that failed is a violation."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def error(self, event: str, **fields: Any) -> None:
        self.failures.append(f"{event} {fields.get('task')}: {fields.get('error')}")


class _Run:
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
    ) -> None:
        self.factory, self.layout, self.backend = factory, layout, backend
        self.timeout_s = timeout_s
        self.name = getattr(factory, "__name__", repr(factory))
        self.hbb = layout.host_block_bytes
        self.num_host = num_host_blocks
        self.chunk_bytes = chunk_bytes or round_to_pages(self.hbb)
        if self.chunk_bytes % _sys.PAGE_SIZE:
            raise ValueError(f"chunk_bytes={chunk_bytes} is not a multiple of the page size")
        if backend is not None and self.chunk_bytes > backend.max_pin_bytes:
            raise ValueError(f"chunk_bytes={chunk_bytes} is above the backend's max_pin_bytes")
        split = (num_host_blocks - pageable_blocks) * self.hbb
        pinned_end = split // self.chunk_bytes * self.chunk_bytes
        self.pinned = [b for b in range(num_host_blocks) if (b + 1) * self.hbb <= pinned_end]
        self.pageable = [b for b in range(num_host_blocks) if (b + 1) * self.hbb > pinned_end]
        if len(self.pinned) < _MIN_PINNED_BLOCKS or len(self.pageable) < 2:
            raise ValueError(
                f"{num_host_blocks} host blocks of {self.hbb} bytes in chunks of "
                f"{self.chunk_bytes} leave {len(self.pinned)} in pinned chunks and "
                f"{len(self.pageable)} outside: the check needs at least "
                f"{_MIN_PINNED_BLOCKS} and 2 (add host blocks or pageable_blocks)"
            )
        if layout.num_blocks < _MIN_DEVICE_BLOCKS:
            raise ValueError(f"the check needs at least {_MIN_DEVICE_BLOCKS} device blocks")
        self.pinned_end = pinned_end
        self.generator = torch.Generator().manual_seed(seed)
        self.loop_thread = threading.get_ident()
        self.token = anyio.lowlevel.current_token()
        self.task_log = _TaskLog()
        self.tasks = OwnedTasks(self.task_log)
        self.tasks.bind()
        self.records: dict[TransferJob, _Record] = {}
        self.reported: dict[Direction, list[TransferJob]] = {"store": [], "load": []}
        self.violations: list[str] = []
        self.region: HostRegion | None = None
        self.region_bytes: torch.Tensor | None = None
        self.pinned_chunks: list[Chunk] = []
        self.leaked: list[Chunk] = []
        self.engine: TransferEngine | None = None
        self.engine_closed = False
        self.tasks_closed = False
        self.host_model: list[torch.Tensor] = []
        self.device_model: list[torch.Tensor] = []

    # -- the run ------------------------------------------------------------------------

    async def main(self, method: Method) -> None:
        layout = self.layout
        region = self.region = HostRegion.create(self.num_host * self.hbb)
        if self.backend is not None:
            for chunk in region.chunks(self.chunk_bytes):
                if chunk.offset + chunk.nbytes <= self.pinned_end:
                    await anyio.to_thread.run_sync(
                        self.backend.pin, region.address + chunk.offset, chunk.nbytes
                    )
                    self.pinned_chunks.append(chunk)
        self.region_bytes = region.view()
        self.host_model = [self._random_block() for _ in range(self.num_host)]
        for c, data in enumerate(self.host_model):
            self._host_block(c).copy_(data)
        self.device_model = [self._random_block() for _ in range(layout.num_blocks)]
        for g, data in enumerate(self.device_model):
            self._write_device(g, data)

        threads_before = set(threading.enumerate())
        setup = EngineSetup(
            layout,
            host_blocks_view(self.region_bytes, layout, self.num_host),
            self.chunk_bytes,
            self._start_soon,
        )
        engine = self.engine = self.factory(setup)
        del setup
        if not isinstance(engine, TransferEngine):
            raise AssertionError(f"{self.name} made {engine!r}, not a TransferEngine")
        self.name = f"engine {engine.name!r}"
        methods = engine.methods()
        if not isinstance(methods, tuple) or not methods or not all(
            isinstance(m, str) for m in methods
        ):
            raise AssertionError(f"{self.name}: methods() must be a non-empty tuple of str")
        if method != "auto" and method not in methods:
            raise ValueError(f"method {method!r} is not one of {self.name}'s {methods}")
        await anyio.to_thread.run_sync(engine.prepare)

        await self._round_trip(engine, method)
        await self._empty_jobs(engine, method)
        await self._order(engine, method)
        await self._pageable(engine, method)
        await self._close(engine, threads_before)

    async def _round_trip(self, engine: TransferEngine, method: Method) -> None:
        p = self.pinned
        ready = engine.record_ready()
        store = self._job("store", [0, 1, 2], [p[2], p[0], p[1]], method, ready=ready)
        self._submit(engine, store, pageable=False)
        await self._wait([store], "a store")
        self._compare("a store")
        load = self._job("load", [3, 4, 5], [p[0], p[1], p[2]], method)
        self._submit(engine, load, pageable=False)
        await self._wait([load], "a load of the blocks stored")
        self._compare("a load of the blocks stored")

    async def _empty_jobs(self, engine: TransferEngine, method: Method) -> None:
        jobs = [self._job(d, [], [], method) for d in ("store", "load")]
        for job in jobs:
            self._submit(engine, job, pageable=False)
        await self._wait(jobs, "an empty job")
        self._compare("empty jobs")

    async def _order(self, engine: TransferEngine, method: Method) -> None:
        """Stores and loads on disjoint blocks, submitted interleaved without a pause; the
        last two of each direction target the same block."""
        for g in range(self.layout.num_blocks):
            data = self._random_block()
            self.device_model[g] = data
            self._write_device(g, data)
        p, k = self.pinned, _BATCH
        stores = [self._job("store", [i], [p[i]], method) for i in range(k)]
        stores += [self._job("store", [k + i], [p[k]], method) for i in range(2)]
        loads = [self._job("load", [k + 2 + i], [p[k + 1 + i]], method) for i in range(k)]
        loads += [self._job("load", [2 * k + 2], [p[2 * k + 1 + i]], method) for i in range(2)]
        for store, load in zip(stores, loads, strict=True):
            self._submit(engine, store, pageable=False)
            self._submit(engine, load, pageable=False)
        await self._wait(stores + loads, "stores and loads in flight together")
        for jobs in (stores, loads):
            direction = jobs[0].transfer.direction
            order = [job for job in self.reported[direction] if job in jobs]
            if order != jobs:
                got = [jobs.index(job) for job in order]
                raise AssertionError(
                    f"{self.name}: {direction} jobs submitted at once were reported in the "
                    f"order {got}, not in submission order"
                )
        self._compare("stores and loads in flight together (the later job to a block wins)")

    async def _pageable(self, engine: TransferEngine, method: Method) -> None:
        q = self.pageable
        for g in (0, 1):
            self.device_model[g] = self._random_block()
            self._write_device(g, self.device_model[g])
        calls: list[tuple[str, int, bool]] = []

        def reserve_for(what: str, blocks: list[int]) -> Callable[[], None]:
            before = [(c, self.host_model[c]) for c in blocks]

            def reserve() -> None:
                # Before the copy: the host blocks a store writes still hold the old bytes.
                untouched = all(torch.equal(self._host_block(c), old) for c, old in before)
                calls.append((what, threading.get_ident(), untouched))
            return reserve

        store = self._job("store", [0, 1], [q[1], q[0]], method,
                          reserve=reserve_for("store", [q[1], q[0]]))
        self._submit(engine, store, pageable=True)
        await self._wait([store], "a pageable store")
        load = self._job("load", [2, 3], [q[0], q[1]], method,
                         reserve=reserve_for("load", []))
        self._submit(engine, load, pageable=True)
        plain = self._job("load", [4], [q[1]], method)
        self._submit(engine, plain, pageable=True)
        await self._wait([load, plain], "pageable loads")
        self._compare("pageable stores and loads")
        for what in ("store", "load"):
            mine = [call for call in calls if call[0] == what]
            if len(mine) != 1:
                raise AssertionError(
                    f"{self.name}: a pageable {what} called job.reserve {len(mine)} times, "
                    "not once"
                )
            if mine[0][1] == self.loop_thread:
                raise AssertionError(
                    f"{self.name}: job.reserve ran on the event loop thread (it allocates: "
                    "it must run off the loop)"
                )
            if not mine[0][2]:
                raise AssertionError(f"{self.name}: job.reserve was called after the copy")

        error = OSError("reserve failed (as on a full /dev/shm)")

        def fail() -> None:
            raise error

        self.device_model[5] = self._random_block()
        self._write_device(5, self.device_model[5])
        failing = self._job("store", [5], [q[0]], method, reserve=fail, expected=error)
        self._submit(engine, failing, pageable=True)
        await self._wait([failing], "a pageable store whose reserve fails")
        self._compare("a pageable store whose reserve failed (nothing may be copied)")

    async def _close(self, engine: TransferEngine, threads_before: set[threading.Thread]) -> None:
        await self._close_tasks()
        self._verify()
        if self.task_log.failures:
            raise AssertionError(f"{self.name}: a task failed: {self.task_log.failures[0]}")
        try:
            await anyio.to_thread.run_sync(engine.close)
        except Exception as exc:
            raise AssertionError(f"{self.name}: close() raised {exc!r}") from exc
        finally:
            self.engine_closed = True
        for _ in range(3):  # let a report already scheduled on the loop run, if any
            await anyio.lowlevel.checkpoint()
        self._verify()
        left = [
            t for t in threading.enumerate()
            if t not in threads_before and t.is_alive()
            and not t.name.startswith(_POOL_THREADS)
            and not isinstance(t, threading._DummyThread)
        ]
        if left:
            raise AssertionError(
                f"{self.name}: threads it started outlive close(): {[t.name for t in left]}"
            )
        await self._unpin()
        self.region_bytes = None
        assert self.region is not None
        if not self.region.release(keep=self.leaked):
            raise AssertionError(
                f"{self.name}: a view of the host blocks outlives close(): the region "
                "stays mapped after its release"
            )

    async def cleanup(self) -> None:
        """What is left after a failed check: tasks cancelled, the engine closed when no
        job is in flight (else the engine and the pinned chunks are left alone: nothing is
        freed under a copy), chunks unpinned, the region released."""
        await self._close_tasks()
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
        await self._unpin()
        self.region_bytes = None
        if self.region is not None:
            self.region.release(keep=self.leaked)

    # -- helpers -----------------------------------------------------------------------

    async def _close_tasks(self) -> None:
        if self.tasks_closed:
            return
        self.tasks_closed = True
        with anyio.move_on_after(self.timeout_s) as scope:
            await self.tasks.aclose()
        if scope.cancelled_caught:
            self.violations.append(f"its tasks did not end within {self.timeout_s}s of a cancel")

    async def _unpin(self) -> None:
        assert self.backend is not None or not self.pinned_chunks
        for chunk in list(self.pinned_chunks):
            self.pinned_chunks.remove(chunk)
            assert self.region is not None and self.backend is not None
            try:
                await anyio.to_thread.run_sync(
                    self.backend.unpin, self.region.address + chunk.offset, chunk.nbytes
                )
            except Exception:
                self.leaked.append(chunk)

    def _start_soon(self, fn: Callable[..., Any], *args: Any, name: object = None) -> None:
        if threading.get_ident() != self.loop_thread:
            self.violations.append("start_soon was called off the event loop thread")
            raise RuntimeError("start_soon must be called on the event loop thread")
        self.tasks.start_soon(fn, *args, name=name)

    def _job(
        self,
        direction: Direction,
        gpu_ids: list[int],
        cpu_ids: list[int],
        method: Method,
        *,
        ready: Any = None,
        reserve: Callable[[], None] | None = None,
        expected: BaseException | None = None,
    ) -> TransferJob:
        transfer = Transfer(direction, len(gpu_ids), len(gpu_ids) * self.hbb)
        job = TransferJob(transfer, gpu_ids, cpu_ids, method, ready=ready, reserve=reserve,
                          on_finish=self._on_finish)
        self.records[job] = _Record(job, expected)
        return job

    def _submit(self, engine: TransferEngine, job: TransferJob, *, pageable: bool) -> None:
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
        if self.records[job].expected is not None:
            return  # a job that must fail copies nothing
        if transfer.direction == "store":
            for g, c in zip(job.gpu_ids, job.cpu_ids, strict=True):
                self.host_model[c] = self.device_model[g]
        else:
            for g, c in zip(job.gpu_ids, job.cpu_ids, strict=True):
                self.device_model[g] = self.host_model[c]

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

    async def _wait(self, jobs: list[TransferJob], what: str) -> None:
        with anyio.move_on_after(self.timeout_s):
            for job in jobs:
                await self.records[job].done.wait()
        pending = [job for job in jobs if not self.records[job].done.is_set()]
        self._verify()
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
                    raise AssertionError(
                        f"{self.name}: {what} failed: {error!r}"
                    ) from error
                raise AssertionError(
                    f"{self.name}: {what} was reported with {error!r}, not with the error "
                    f"raised: {record.expected!r}"
                )

    def _verify(self) -> None:
        if self.violations:
            raise AssertionError(f"{self.name}: {'; '.join(self.violations)}")

    # -- bytes -------------------------------------------------------------------------

    def _random_block(self) -> torch.Tensor:
        layout = self.layout
        return torch.randint(
            0, 256, (layout.num_arrays, layout.block_bytes), dtype=torch.uint8,
            generator=self.generator,
        )

    def _host_block(self, c: int) -> torch.Tensor:
        assert self.region_bytes is not None
        block = self.region_bytes[c * self.hbb : (c + 1) * self.hbb]
        return block.view(self.layout.num_arrays, self.layout.block_bytes)

    def _write_device(self, g: int, data: torch.Tensor) -> None:
        for a, array in enumerate(self.layout.arrays):
            array[g].reshape(-1).view(torch.uint8).copy_(data[a].to(array.device))

    def _read_device(self, g: int) -> torch.Tensor:
        return torch.stack(
            [array[g].reshape(-1).view(torch.uint8) for array in self.layout.arrays]
        ).cpu()

    def _compare(self, what: str) -> None:
        for c, expected in enumerate(self.host_model):
            _same(f"{self.name}: after {what}, host block {c}", self._host_block(c), expected)
        for g, expected in enumerate(self.device_model):
            _same(f"{self.name}: after {what}, device block {g}", self._read_device(g), expected)


def _same(where: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if torch.equal(got, expected):
        return
    differ = (got != expected).nonzero()
    a, offset = (int(x) for x in differ[0])
    raise AssertionError(
        f"{where} holds wrong bytes: {len(differ)} differ, the first in array {a} at byte "
        f"{offset} ({int(got[a, offset])} instead of {int(expected[a, offset])})"
    )
