"""A conformance check of the :class:`~asyncpin.abc.TransferEngine` contract: the entry
point and the scenarios it runs, in order, on one :class:`EngineHarness`."""

from __future__ import annotations

import threading
from collections.abc import Callable

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch

from asyncpin.abc import EngineFactory, PinBackend, TransferEngine
from asyncpin.kv import KVLayout
from asyncpin.testing._engine_harness import BATCH, EngineHarness, default_host_blocks
from asyncpin.transfers import Method

__all__ = ["check_transfer_engine"]

# Threads of the event loop's worker pools, which outlive an engine by design.
_POOL_THREADS = ("AnyIO worker thread", "Trio thread")


async def check_transfer_engine(
    factory: EngineFactory,
    layout: KVLayout,
    *,
    num_host_blocks: int | None = None,
    pageable_blocks: int = 4,
    chunk_bytes: int | None = None,
    method: Method = "auto",
    backend: PinBackend | None = None,
    seed: int = 0,
    timeout_s: float = 60.0,
) -> None:
    """Check that the engines ``factory`` makes keep the TransferEngine contract; raise
    AssertionError naming the clause broken.

    Maps a region of ``num_host_blocks`` host blocks (by default the fewest, 16 at
    least, that leave blocks enough in pinned chunks and outside them: more where blocks
    under a page lie many to a chunk; chunks of ``chunk_bytes``, by default one host
    block rounded up to a page), pins the chunks that hold the first
    ``num_host_blocks - pageable_blocks`` blocks with ``backend`` (None: pins nothing; a
    copy engine that reads host memory from the device needs it, e.g.
    :class:`~asyncpin.cuda.CudaBackend` for the cuda engine), makes the engine on the
    running loop (in a worker thread if ``factory`` sets ``made_off_loop``, as a manager
    does) from an :class:`~asyncpin.abc.EngineSetup` whose ``start_soon`` runs
    tasks owned by the check, calls ``prepare()`` in a worker thread (an engine that sets
    ``pageable_before_prepare`` first copies a pageable store before it), then checks:

    - ``submit`` sets ``transfer.method`` (one of ``methods()``) and ``transfer.path``
      before it returns, and does not report a non-empty job before it returns (the copy
      did not run on the loop); ``start_soon`` is called on the loop thread only;
    - every job is reported exactly once, on the event loop thread, with no error (or
      with the one expected), within ``timeout_s``; an empty job is reported too;
    - stores then loads round-trip byte for byte, each array's block as it lies in
      memory (dense permuted blocks too), through the block-major host layout, with no
      other host or device block touched (one store waits on a ``record_ready()``
      marker);
    - stores and loads of a range of arrays (``job.arrays``) move those arrays' blocks
      only: the other arrays' blocks stay as they were, on the host and on the device;
    - pinned jobs of one direction submitted at once are reported in submission order,
      and the later one to the same block wins, with stores and loads in flight together;
    - pageable jobs copy through the unpinned blocks (``path`` is ``pageable``) and call
      ``job.reserve`` once, off the event loop, before copying; one whose reserve fails
      is reported with that error and copies nothing;
    - after every job was reported: the engine's tasks end when cancelled, none failed,
      ``close()`` in a worker thread returns, every thread the engine started has ended,
      no view of the host blocks outlives it (the region unmaps at release), and no job
      is reported again;
    - then, on a second engine whose host blocks are rank 1's part of rows shared by two
      ranks (``host_slice=(1, 2)``: rows ``host_blocks.stride(0)``, two host blocks,
      apart), stores, loads, ranges of arrays and pageable jobs again, with no byte of
      the other rank's part of any row touched, and its close.

    ``layout`` holds the device arrays (CPU tensors for the host engine, CUDA tensors
    for the cuda engine); the check overwrites them. ``method`` is what pinned jobs ask
    for. The check cannot see the loop blocked by a ``submit`` that waits and reports
    later, nor require a store and a load to overlap (it is allowed, not demanded).
    """
    if num_host_blocks is None:
        num_host_blocks = default_host_blocks(layout.host_block_bytes, pageable_blocks, chunk_bytes)
    args = (factory, layout, num_host_blocks, pageable_blocks, chunk_bytes, backend)
    h = EngineHarness(*args, seed, timeout_s)
    shared = EngineHarness(*args, seed + 1, timeout_s, host_slice=(1, 2))
    try:
        engine = await h.start(method)
        await _round_trip(h, engine, method)
        await _array_ranges(h, engine, method)
        await _empty_jobs(h, engine, method)
        await _order(h, engine, method)
        await _pageable(h, engine, method)
        await _close(h, engine)
    finally:
        with anyio.CancelScope(shield=True):
            await h.cleanup()
    # Host rows shared by two ranks: the engine writes its part of each row only.
    try:
        engine = await shared.start(method)
        await _round_trip(shared, engine, method)
        await _array_ranges(shared, engine, method)
        await _pageable(shared, engine, method)
        await _close(shared, engine)
    finally:
        with anyio.CancelScope(shield=True):
            await shared.cleanup()


async def _round_trip(h: EngineHarness, engine: TransferEngine, method: Method) -> None:
    p = h.pinned
    ready = engine.record_ready()
    store = h.job("store", [0, 1, 2], [p[2], p[0], p[1]], method, ready=ready)
    h.submit(engine, store, pageable=False)
    await h.wait([store], "a store")
    h.compare("a store")
    load = h.job("load", [3, 4, 5], [p[0], p[1], p[2]], method)
    h.submit(engine, load, pageable=False)
    await h.wait([load], "a load of the blocks stored")
    h.compare("a load of the blocks stored")


def _ranges(layout: KVLayout) -> list[range]:
    """Ranges of arrays a job may name: all but the first, the last tensor's arrays (a
    layer-wise load or store), the middle array alone; every array when there is one."""
    n = layout.num_arrays
    ranges: list[range] = []
    for arrays in (range(1, n), layout.tensor_arrays[-1], range(n // 2, n // 2 + 1)):
        if arrays and arrays not in ranges:
            ranges.append(arrays)
    return ranges


async def _array_ranges(h: EngineHarness, engine: TransferEngine, method: Method) -> None:
    """A store and a load of each range of arrays, over blocks whose bytes all differ
    (the device blocks renewed, the host blocks holding what the round trip left): only
    the range's part of each block moves."""
    p = h.pinned
    for arrays in _ranges(h.layout):
        what = f"arrays {arrays.start} to {arrays.stop - 1}"
        for g in range(h.layout.num_blocks):
            h.blocks.renew_device(g)
        store = h.job("store", [1, 2], [p[0], p[1]], method, arrays=arrays)
        h.submit(engine, store, pageable=False)
        await h.wait([store], f"a store of {what}")
        h.compare(f"a store of {what} (only those arrays move)")
        load = h.job("load", [3, 4], [p[1], p[2]], method, arrays=arrays)
        h.submit(engine, load, pageable=False)
        await h.wait([load], f"a load of {what}")
        h.compare(f"a load of {what} (only those arrays move)")


async def _empty_jobs(h: EngineHarness, engine: TransferEngine, method: Method) -> None:
    jobs = [h.job(d, [], [], method) for d in ("store", "load")]
    for job in jobs:
        h.submit(engine, job, pageable=False)
    await h.wait(jobs, "an empty job")
    h.compare("empty jobs")


async def _order(h: EngineHarness, engine: TransferEngine, method: Method) -> None:
    """Stores and loads on disjoint blocks, submitted interleaved without a pause; the
    last two of each direction target the same block."""
    for g in range(h.layout.num_blocks):
        h.blocks.renew_device(g)
    p, k = h.pinned, BATCH
    stores = [h.job("store", [i], [p[i]], method) for i in range(k)]
    stores += [h.job("store", [k + i], [p[k]], method) for i in range(2)]
    loads = [h.job("load", [k + 2 + i], [p[k + 1 + i]], method) for i in range(k)]
    loads += [h.job("load", [2 * k + 2], [p[2 * k + 1 + i]], method) for i in range(2)]
    for store, load in zip(stores, loads, strict=True):
        h.submit(engine, store, pageable=False)
        h.submit(engine, load, pageable=False)
    await h.wait(stores + loads, "stores and loads in flight together")
    for jobs in (stores, loads):
        direction = jobs[0].transfer.direction
        order = [job for job in h.reported[direction] if job in jobs]
        if order != jobs:
            got = [jobs.index(job) for job in order]
            raise AssertionError(
                f"{h.name}: {direction} jobs submitted at once were reported in the "
                f"order {got}, not in submission order"
            )
    h.compare("stores and loads in flight together (the later job to a block wins)")


async def _pageable(h: EngineHarness, engine: TransferEngine, method: Method) -> None:
    q = h.pageable
    for g in (0, 1):
        h.blocks.renew_device(g)
    calls: list[tuple[str, int, bool]] = []

    def reserve_for(what: str, blocks: list[int]) -> Callable[[], None]:
        before = [(c, h.blocks.host[c]) for c in blocks]

        def reserve() -> None:
            # Before the copy: the host blocks a store writes still hold the old bytes.
            untouched = all(torch.equal(h.blocks.host_block(c), old) for c, old in before)
            calls.append((what, threading.get_ident(), untouched))

        return reserve

    store = h.job("store", [0, 1], [q[1], q[0]], method, reserve=reserve_for("store", [q[1], q[0]]))
    h.submit(engine, store, pageable=True)
    await h.wait([store], "a pageable store")
    load = h.job("load", [2, 3], [q[0], q[1]], method, reserve=reserve_for("load", []))
    h.submit(engine, load, pageable=True)
    plain = h.job("load", [4], [q[1]], method)
    h.submit(engine, plain, pageable=True)
    await h.wait([load, plain], "pageable loads")
    h.compare("pageable stores and loads")
    for what in ("store", "load"):
        mine = [call for call in calls if call[0] == what]
        if len(mine) != 1:
            raise AssertionError(
                f"{h.name}: a pageable {what} called job.reserve {len(mine)} times, not once"
            )
        if mine[0][1] == h.loop_thread:
            raise AssertionError(
                f"{h.name}: job.reserve ran on the event loop thread (it allocates: it must "
                "run off the loop)"
            )
        if not mine[0][2]:
            raise AssertionError(f"{h.name}: job.reserve was called after the copy")

    error = OSError("reserve failed (as on a full /dev/shm)")

    def fail() -> None:
        raise error

    h.blocks.renew_device(5)
    failing = h.job("store", [5], [q[0]], method, reserve=fail, expected=error)
    h.submit(engine, failing, pageable=True)
    await h.wait([failing], "a pageable store whose reserve fails")
    h.compare("a pageable store whose reserve failed (nothing may be copied)")


async def _close(h: EngineHarness, engine: TransferEngine) -> None:
    """After every job was reported: the tasks end, none failed, close() returns, no job
    is reported again, no thread the engine started and no view of the host blocks
    outlives it."""
    await h.close_tasks()
    h.verify()
    if h.task_log.failures:
        raise AssertionError(f"{h.name}: a task failed: {h.task_log.failures[0]}")
    try:
        await anyio.to_thread.run_sync(engine.close)
    except Exception as exc:
        raise AssertionError(f"{h.name}: close() raised {exc!r}") from exc
    finally:
        h.engine_closed = True
    for _ in range(3):  # let a report already scheduled on the loop run, if any
        await anyio.lowlevel.checkpoint()
    h.verify()
    left = [
        t
        for t in threading.enumerate()
        if t not in h.threads_before
        and t.is_alive()
        and not t.name.startswith(_POOL_THREADS)
        and not isinstance(t, threading._DummyThread)
    ]
    if left:
        raise AssertionError(
            f"{h.name}: threads it started outlive close(): {[t.name for t in left]}"
        )
    if not await h.release_region():
        raise AssertionError(
            f"{h.name}: a view of the host blocks outlives close(): the region stays mapped "
            "after its release"
        )
