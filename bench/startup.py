"""Start-up at the seed's scale: time until a server embedding the KV tier is ready to
serve, for three recipes, with a model's GPU loop and a CUDA-graph-capturing thread
running throughout.

    python3 bench/startup.py --size 16GiB --size 64GiB --size 100GiB --json-out startup.json
    python3 bench/startup.py --cold 16GiB --size 64GiB      # first on memory never touched
    python3 bench/startup.py --quick     # a few MiB; without a GPU, the host backend

Recipes (each in this process, on the event loop of an anyio program whose 1 ms heartbeat
measures the loop's lag):

- ``vllm``: ``torch.zeros(size)`` then one cudaHostRegister of it, on the event loop's
  thread (vLLM's recipe before the seed); close: one cudaHostUnregister, then the tensor
  freed, on the loop.
- ``seed``: an anonymous mapping, then one cudaHostRegister of it in a worker thread;
  close: unregister and munmap on the loop.
- ``asyncpin``: ``OffloadManager.for_kv`` over a Llama-3.1-8B layout (64 arrays of 32 KiB
  blocks, 2 MiB per host block) filling ``size``, with its defaults; ready once
  ``await mgr.pinned`` returns (pinning and the transfer engine's set-up). Then a few
  store/load round trips (their lag counts), then ``aclose()``.

Without a GPU the registrations are mlock/munlock and there is no GPU loop or capture.

Measured per run: entry (the constructor, or ``async with`` until the body runs), ready
(from the start of entry), close; the event loop's worst lag over each phase; the
longest GPU step (8 bf16 8192^3 matmuls, then a synchronize, in a thread of its own)
that began in each phase, over the step alone; graph captures made and failed (the
capturing thread captures and replays 4 small matmuls every 20 ms, in
``capture_error_mode="relaxed"``: in the stricter modes the model's loop in another
thread failed every capture; ``install_capture_gate()`` is on for every recipe, it only
holds asyncpin's calls). First, ``quiet``: two seconds of the step, the captures and
the heartbeat with nothing of the tier running, the longest step and lag the setting
gives by itself. Each phase's worst lag comes with the loop thread's stack at
that moment (sampled by a watchdog thread; ``--stacks kernel`` adds the loop thread's
kernel stack and those of the threads blocked in the kernel then, which
``bench/_kstacks.py`` reads from ``/proc/PID/task`` in a process of its own, where that
is allowed: root; ``--stacks none``: no watchdog, whose
sampling takes the GIL), each pin and unpin call is timed, and the garbage collections
that fall in a phase's worst lag are listed, to see where the time goes.

``--cold SIZE``: before anything else (after a manager of one block has loaded the copy
kernel), ``asyncpin`` then the ``vllm`` recipe at SIZE, the manager kept open until the
second is ready, so that both fault in memory this process has never touched (cold on a
machine whose memory is backed as it is first used: run it first in a fresh machine).
Warm runs fault in and free their size first.
Figures: bench/RESULTS.md#startup.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import gc
import json
import mmap
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import anyio
import anyio.to_thread
import torch

# Appended, not prepended: the asyncpin under test is the one PYTHONPATH names first.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import asyncpin.pinning
from asyncpin import KVLayout, OffloadManager, install_capture_gate
from asyncpin.backends import registers_with_cuda
from bench._common import (
    HEAD_DIM,
    HEADS,
    TOKENS,
    GiB,
    GpuStepper,
    format_bytes,
    machine,
    median,
    parse_size,
    parser,
    quiet_logs,
    write_json,
)

_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
_LIBC.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.mlock.argtypes = _LIBC.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
PIN_THREADS = 0  # --pin-threads (0: the library's default)
PREFAULT_THREADS = 0  # --prefault-threads (0: the library's default)
# --trace-calls: every pin call's and every prefault piece's span (start, end) is kept in
# the run's JSON, to set the longest steps beside them.
PREFAULTS: list[tuple[float, float]] = []
TRACE_CALLS = False
# Threads' native ids → what they are, for the kernel stacks (--stacks kernel), and the
# backend calls each made: (name, start, end) on the bench's clock.
ROLES: dict[int, str] = {}
BACKEND_CALLS: dict[int, list[tuple[str, float, float]]] = {}
# The interpreter's garbage collections: (generation, start, end) on the bench's clock.
# A collection holds the GIL, so every Python thread, the event loop's too, waits it out.
GC_SPANS: list[tuple[int, float, float]] = []
_gc_started = [0.0]
# The capturing thread's steps: (name, start, end) on the bench's clock. "enter" is
# torch.cuda.graph's entry (a device-wide synchronize, then, with --captures torch, the
# cache emptied: cudaFree of the last graph's memory), "body" the capture, "exit" its
# end (the graph instantiated), "replay" the replay and its stream's synchronize,
# "release" the graph dropped.
CAPTURE_SPANS: list[tuple[str, float, float]] = []


def _on_gc(phase: str, info: dict[str, int]) -> None:
    """Keeps every collection of generation 1 or 2, and those of 0 that took 0.5 ms or
    more (thousands a run take less). CPython runs one collection at a time."""
    if phase == "start":
        _gc_started[0] = Clock.now()
        return
    end = Clock.now()
    if info["generation"] or end - _gc_started[0] >= 0.0005:
        GC_SPANS.append((info["generation"], _gc_started[0], end))


HOST_BLOCK = 2 * 32 * TOKENS * HEADS * HEAD_DIM * 2  # 2 MiB: 64 arrays of 32 KiB
LAYERS = 32


def mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


class Clock:
    """Timestamps since the bench started."""

    t0 = time.perf_counter()

    @classmethod
    def now(cls) -> float:
        return time.perf_counter() - cls.t0


class Heartbeat:
    """A 1 ms sleep in a loop: each wake's overshoot is the loop's lag, with its time. A
    watchdog thread samples the loop thread's stack while the wake is 2 ms late or more,
    so the worst lag of a phase comes with what the loop was doing."""

    def __init__(self, stacks: str = "python") -> None:
        # "python" and "kernel": the loop's Python stack ("kernel": ``KernelStacks`` as
        # well); "none": no watchdog (it takes the GIL to sample, which a blocked loop's
        # own work then waits for).
        self.stacks_mode = stacks
        self.samples: list[tuple[float, float]] = []  # (wake time, lag)
        self.stacks: list[tuple[float, str]] = []  # (time, the loop's innermost frames)
        self._deadline = Clock.now() + 0.001
        self._tid = threading.get_ident()
        self.native_id = threading.get_native_id()
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True)

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        self._tid = threading.get_ident()
        self.native_id = threading.get_native_id()
        ROLES[self.native_id] = "loop"
        if self.stacks_mode != "none":
            self._watchdog.start()
        task_status.started()
        try:
            while True:
                self._deadline = Clock.now() + 0.001
                await anyio.sleep(0.001)
                now = Clock.now()
                self.samples.append((now, max(0.0, now - self._deadline)))
        finally:
            self._stop.set()

    def _watch(self) -> None:
        ROLES[threading.get_native_id()] = "watchdog"
        last = ""
        while not self._stop.wait(0.0005):
            now = Clock.now()
            if now - self._deadline < 0.002:
                continue
            frame = sys._current_frames().get(self._tid)
            if frame is None:
                continue
            where = " < ".join(
                f"{Path(f.filename).name}:{f.lineno} {f.name}"
                for f in reversed(traceback.extract_stack(frame)[-4:])
            )
            del frame  # a frame kept alive keeps every local of the loop's stack alive
            if where != last:
                self.stacks.append((now, where))
                last = where

    def worst(self, start: float, end: float) -> tuple[float, str, tuple[float, float]]:
        """The worst lag inside [start, end] (a wake at t late by L was blocked over
        [t - L, t]; only the part inside the window counts), the loop thread's stack
        sampled during it, and when it was."""
        lag, at = 0.0, (start, start)
        for t, late in self.samples:
            inside = min(t, end) - max(t - late, start)
            if inside > lag:
                lag, at = inside, (max(t - late, start), min(t, end))
        where = [s for t, s in self.stacks if at[0] <= t <= at[1]]
        counts = collections.Counter(where).most_common(1)
        return lag, counts[0][0] if counts else "", at


class KernelStacks:
    """``bench/_kstacks.py`` in a process of its own for the span of one run: the kernel
    stacks of this process's threads blocked in the kernel, and the event loop's. Its
    spans come back on its standard output when its standard input closes."""

    START_S = 30.0  # for the sampler's first sweep (an interpreter's start)
    STOP_S = 60.0

    def __init__(self, loop_tid: int, others: list[int]) -> None:
        self.spans: list[list[Any]] = []
        self.sweeps = 0
        self._others = set(others)  # sampled whatever their state: the step, the captures
        self._proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("_kstacks.py")),
                str(os.getpid()),
                "0.0005",
                str(loop_tid),
                *map(str, others),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self._proc.stdout is not None
        ready = select.select([self._proc.stdout], [], [], self.START_S)[0]
        if not ready or self._proc.stdout.readline() != b"sampling\n":
            self._end()
            raise RuntimeError(f"bench/_kstacks.py did not start within {self.START_S} s")

    def stop(self) -> None:
        """Ends the sampler and keeps its spans; a sampler that failed is said, not fatal
        (the run's own figures stand)."""
        try:
            out, _ = self._proc.communicate(timeout=self.STOP_S)
        except subprocess.TimeoutExpired:
            self._end()
            print("  kernel stacks: the sampler did not stop; none kept", file=sys.stderr)
            return
        if self._proc.returncode:
            print(f"  kernel stacks: the sampler failed ({self._proc.returncode})", file=sys.stderr)
            return
        doc = json.loads(out)
        self.spans, self.sweeps = doc["spans"], doc["sweeps"]

    def _end(self) -> None:
        self._proc.kill()
        self._proc.communicate()

    def during(self, start: float, end: float) -> dict[str, Any]:
        """What the threads were doing in [start, end] (the bench's clock): the loop's
        kernel stacks, and the stacks of threads in state D (named by ``role_at``), each
        with the seconds it was seen so (a span's first to last sample, at least one
        interval), most first."""
        lo, hi = start + Clock.t0, end + Clock.t0
        loop: collections.Counter[str] = collections.Counter()
        blocked: collections.Counter[str] = collections.Counter()
        others: collections.Counter[str] = collections.Counter()
        for tid, _name, first, last, state, stack in self.spans:
            seen = min(last + 0.0005, hi) - max(first, lo)
            if seen <= 0:
                continue
            role = role_at(tid, max(first, lo) - Clock.t0)
            if role == "loop":
                loop[f"{state}: {stack}"] += seen
            elif tid in self._others:
                others[f"{role} {state}: {stack}"] += seen
            if state == "D":
                blocked[f"{role}: {stack}"] += seen
        return {
            "loop": [[k, round(v, 4)] for k, v in loop.most_common(3)],
            "blocked": [[k, round(v, 4)] for k, v in blocked.most_common(6)],
            "others": [[k, round(v, 4)] for k, v in others.most_common(6)],
        }


def role_at(tid: int, when: float) -> str:
    """What a thread was at ``when`` (the bench's clock): in a pin or unpin call of the
    backend then, that call's name; else its role (``ROLES``: loop, step, capture,
    watchdog), ``worker`` for a thread that made backend calls at other times (anyio's
    worker threads also prefault), or ``thread``."""
    calls = BACKEND_CALLS.get(tid)
    for name, a, b in calls or ():
        if a <= when <= b:
            return name
    return ROLES.get(tid, "worker" if calls else "thread")


def kernel_stacks_readable() -> bool:
    """Whether this process may read its threads' kernel stacks (root, as a rule)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/stack") as f:
            return bool(f.read())
    except OSError:
        return False


class StepLog(GpuStepper):
    """A model's step in a thread, each step's (start, end) kept. It runs on a stream of
    its own and waits for that stream only: a device-wide synchronize is refused while
    another thread captures a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self.stream = torch.cuda.Stream()

    def step(self) -> float:
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            for _ in range(self.matmuls):
                torch.mm(self.a, self.b)
        self.stream.synchronize()
        return time.perf_counter() - t0

    def _run(self) -> None:
        ROLES[threading.get_native_id()] = "step"
        while not self._stop.is_set():
            start = Clock.now()
            try:
                self.step()
            except Exception as exc:  # counted: the bench goes on without this step
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            self.spans.append((start, Clock.now()))

    def within(self, start: float, end: float) -> list[tuple[float, float]]:
        """The steps that began in [start, end] (one that began before was held up by
        something else)."""
        return [(s, e) for s, e in self.spans if start <= s <= end]

    def longest(self, start: float, end: float) -> float:
        return max((e - s for s, e in self.within(start, end)), default=0.0)


class Capturer:
    """Captures and replays a graph of 4 small matmuls every 20 ms in a thread, each
    step's span kept (``CAPTURE_SPANS``).

    ``recipe``: ``torch``, ``torch.cuda.graph`` as it comes (each capture's entry
    empties torch's cache: the last graph's memory freed with cudaFree, which waits for
    the device); ``vllm``, as vLLM's graph wrapper captures (``CUDAGraphWrapper``): one
    memory pool shared by every graph, and ``gc.collect`` and ``torch.cuda.empty_cache``
    made no-ops while a graph is captured."""

    def __init__(self, recipe: str = "torch") -> None:
        self.recipe = recipe
        self.pool = torch.cuda.graph_pool_handle() if recipe == "vllm" else None
        # vllm: the last graph kept until the next is captured, so that the shared pool
        # always has a graph (torch releases a pool whose last graph is gone).
        self._kept: Any = None
        self.x = torch.randn(1024, 1024, device="cuda")
        self.stream = torch.cuda.Stream()
        self.captured = self.failed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        ROLES[threading.get_native_id()] = "capture"
        while not self._stop.wait(0.02):
            try:
                self._capture()
                self.captured += 1
            except Exception as exc:  # counted: a failed capture is the result
                self.failed += 1
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])

    def _capture(self) -> None:
        spans, now = CAPTURE_SPANS, Clock.now
        with contextlib.ExitStack() as stack:
            if self.recipe == "vllm":
                stack.enter_context(mock.patch("gc.collect", lambda *a: 0))
                stack.enter_context(mock.patch("torch.cuda.empty_cache", lambda: None))
            graph = torch.cuda.CUDAGraph()
            t0 = now()
            with torch.cuda.graph(
                graph, pool=self.pool, stream=self.stream, capture_error_mode="relaxed"
            ):
                t1 = now()
                y = self.x
                for _ in range(4):
                    y = y @ self.x
                t2 = now()
            t3 = now()
        graph.replay()
        self.stream.synchronize()
        t4 = now()
        if self.pool is not None:
            graph, self._kept = self._kept, graph  # the previous one goes
        del graph, y
        t5 = now()
        spans += [
            ("enter", t0, t1),
            ("body", t1, t2),
            ("exit", t2, t3),
            ("replay", t3, t4),
            ("release", t4, t5),
        ]


def trace_prefaults() -> None:
    """Keep each prefault piece's span in ``PREFAULTS`` (``--trace-calls``)."""
    global TRACE_CALLS
    from asyncpin.region import HostRegion

    TRACE_CALLS = True
    inner = HostRegion.prefault

    def prefault(self: HostRegion, *args: Any, **kwargs: Any) -> Any:
        t0 = Clock.now()
        try:
            return inner(self, *args, **kwargs)
        finally:
            PREFAULTS.append((t0, Clock.now()))

    HostRegion.prefault = prefault  # type: ignore[method-assign]


class TimedBackend:
    """asyncpin's own backend, each call's duration kept, and its span (``calls``: name,
    start, end on the bench's clock). It is the inner backend to the manager in every
    other way: its optional ``warm_up`` and ``before_unpin`` are called through it, and
    it says ``registers_with_cuda`` as the inner one does (a wrapper that did not left
    the CUDA backend's context to its first pin call, skipped the close's wait for the
    device, and had the engine copy by DMA only: runs 132-133)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_pin_bytes = inner.max_pin_bytes
        self.registers_with_cuda = registers_with_cuda(inner)
        self.pins: list[float] = []
        self.unpins: list[float] = []
        self.warm_up_s: float | None = None
        self.warm_up_at: float | None = None
        self.calls: list[tuple[str, float, float]] = []

    def preflight(self, nbytes: int) -> None:
        self.inner.preflight(nbytes)

    def _timed(self, name: str, fn: Callable[..., object], *args: int) -> float:
        t0 = Clock.now()
        fn(*args)
        t1 = Clock.now()
        self.calls.append((name, t0, t1))
        BACKEND_CALLS.setdefault(threading.get_native_id(), []).append((name, t0, t1))
        return t1 - t0

    def warm_up(self) -> None:
        hook = getattr(self.inner, "warm_up", None)
        if hook is not None:
            self.warm_up_s = self._timed("warm_up", hook)
            self.warm_up_at = self.calls[-1][1]

    def before_unpin(self) -> None:
        hook = getattr(self.inner, "before_unpin", None)
        if hook is not None:
            self._timed("before_unpin", hook)

    def pin(self, address: int, nbytes: int) -> None:
        self.pins.append(self._timed("pin", self.inner.pin, address, nbytes))

    def unpin(self, address: int, nbytes: int) -> None:
        self.unpins.append(self._timed("unpin", self.inner.unpin, address, nbytes))


def timed_engine(backend: TimedBackend) -> Any:
    """The CUDA engine, its making (``engine_made``, in a worker thread while the
    manager enters) and its set-up (``set_up``, in the background) kept among the
    backend's calls, so that a step or a lag beside them names them."""
    from asyncpin.engines.cuda import CudaTransferEngine

    class TimedEngine(CudaTransferEngine):
        def __init__(self, setup: Any) -> None:
            backend._timed("engine_made", partial(CudaTransferEngine.__init__, self, setup))

        def prepare(self) -> None:
            backend._timed("set_up", partial(CudaTransferEngine.prepare, self))

    return TimedEngine


def _register(address: int, nbytes: int) -> None:
    if torch.cuda.is_available():
        code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
        if code:
            raise RuntimeError(f"cudaHostRegister failed: {code}")
    elif _LIBC.mlock(address, nbytes):
        raise OSError(ctypes.get_errno(), "mlock failed")


def _unregister(address: int, nbytes: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(address)
    else:
        _LIBC.munlock(address, nbytes)


def _prime(nbytes: int) -> None:
    """Fault ``nbytes`` in and free them: the next run finds memory the machine backs. A
    memset through ctypes, which releases the GIL (a torch fill of many GiB holds it for
    seconds, and the model's loop thread with it)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    ctypes.memset(buf.data_ptr(), 0, nbytes)
    del buf


class Run:
    """One recipe's phases: marks (name → time) and a record of what happened."""

    def __init__(self, recipe: str, nbytes: int) -> None:
        self.recipe, self.nbytes = recipe, nbytes
        self.marks: dict[str, float] = {}
        self.extra: dict[str, Any] = {}
        self.calls: list[tuple[str, float, float]] = []  # the backend's, if timed

    def mark(self, name: str) -> None:
        self.marks[name] = Clock.now()


async def vllm_open(run: Run) -> Callable[[], None]:
    run.mark("start")
    tensor = torch.zeros(run.nbytes, dtype=torch.uint8)
    _register(tensor.data_ptr(), run.nbytes)
    run.mark("entered")
    run.mark("ready")

    def close() -> None:
        _unregister(tensor.data_ptr(), run.nbytes)

    return close  # the tensor is freed with the closure


async def seed_open(run: Run) -> Callable[[], None]:
    run.mark("start")
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    address = _LIBC.mmap(None, run.nbytes, prot, flags, -1, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    run.mark("entered")
    await anyio.to_thread.run_sync(_register, address, run.nbytes)
    run.mark("ready")

    def close() -> None:
        _unregister(address, run.nbytes)
        _LIBC.munmap(address, run.nbytes)

    return close


def kv_layout(blocks: int) -> tuple[KVLayout, list[torch.Tensor]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (blocks, TOKENS, HEADS, HEAD_DIM)
    arrays = [torch.ones(shape, device=device, dtype=torch.bfloat16) for _ in range(2 * LAYERS)]
    return KVLayout.from_tensors(arrays), arrays


async def asyncpin_run(
    run: Run,
    layout: KVLayout,
    trips: int,
    chunk_bytes: int | None = None,
    inside: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """The tier's start-up, ``trips`` round trips, ``inside()`` if given, then close."""
    from asyncpin.backends import resolve_backend

    backend = TimedBackend(resolve_backend("auto", None))
    num_host_blocks = run.nbytes // HOST_BLOCK
    kwargs: dict[str, Any] = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    if layout.device.type == "cuda":
        kwargs["engine"] = timed_engine(backend)
    if PIN_THREADS:
        kwargs["pin_threads"] = PIN_THREADS
    if PREFAULT_THREADS:
        kwargs["prefault_threads"] = PREFAULT_THREADS
    run.mark("start")
    mgr = OffloadManager.for_kv(layout, num_host_blocks, backend=backend, **kwargs)
    async with mgr:
        run.mark("entered")
        await mgr.pinned
        run.mark("ready")
        if inside is not None:
            await inside()
        blocks = min(64, layout.num_blocks)
        for i in range(trips):
            ids = [(i * blocks + j) % num_host_blocks for j in range(blocks)]
            await mgr.store(range(blocks), ids)
            await mgr.load(ids, range(blocks))
        run.mark("served")
        stats = mgr.stats()
        run.extra["chunks"] = stats.chunks_total
        run.extra["chunk_bytes"] = stats.chunk_bytes
        run.mark("close")
    run.mark("closed")
    run.calls = backend.calls
    run.extra["warm_up_s"] = backend.warm_up_s
    if backend.warm_up_at is not None:
        run.extra["warm_up_at_s"] = backend.warm_up_at - run.marks["start"]
    for name in ("engine_made", "set_up"):  # the CUDA engine's (timed_engine)
        spans = [(a - run.marks["start"], b - a) for what, a, b in backend.calls if what == name]
        if spans:
            run.extra[f"{name}_at_s"], run.extra[f"{name}_s"] = spans[0]
    if TRACE_CALLS:
        t0 = run.marks["start"]
        run.extra["pin_spans"] = [
            [round(a - t0, 5), round(b - a, 5)] for what, a, b in backend.calls if what == "pin"
        ]
        run.extra["prefault_spans"] = [[round(a - t0, 5), round(b - a, 5)] for a, b in PREFAULTS]
        PREFAULTS.clear()
    for name, calls in (("pin", backend.pins), ("unpin", backend.unpins)):
        if calls:
            ordered = sorted(calls)
            run.extra[f"{name}_call_p50_ms"] = ordered[len(ordered) // 2] * 1e3
            run.extra[f"{name}_call_max_ms"] = ordered[-1] * 1e3
            run.extra[f"{name}_calls_s"] = sum(calls)


async def peer_run(run: Run, opener: Callable[[Run], Any]) -> None:
    close = await opener(run)
    await anyio.sleep(0.005)  # the heartbeat wakes: a blocked loop's lag is recorded
    run.mark("served")
    run.mark("close")
    close()
    del close
    run.mark("closed")
    await anyio.sleep(0.005)


def _during(
    spans: list[tuple[Any, float, float]], lo: float, hi: float, start: float
) -> list[list[Any]]:
    """The spans (what, start, end) under way in [lo, hi], as (what, start from
    ``start``, duration)."""
    return [
        [what, round(a - start, 4), round(b - a, 4)] for what, a, b in spans if a <= hi and b >= lo
    ]


def phases(
    run: Run,
    hb: Heartbeat,
    steps: StepLog | None,
    step_alone: float,
    kstacks: KernelStacks | None = None,
) -> dict[str, Any]:
    m = run.marks
    windows = {
        "opening": (m["start"], m["ready"]),
        # Opening's two parts: the body of `async with` entered, then pinned.
        "entering": (m["start"], m["entered"]),
        "pinning": (m["entered"], m["ready"]),
        "serving": (m["ready"], m["served"]),
        "closing": (m["close"], m["closed"]),
    }
    out: dict[str, Any] = {
        "recipe": run.recipe,
        "nbytes": run.nbytes,
        "enter_s": m["entered"] - m["start"],
        "ready_s": m["ready"] - m["start"],
        "close_s": m["closed"] - m["close"],
        **run.extra,
    }
    for phase, (start, end) in windows.items():
        lag, where, (lo, hi) = hb.worst(start, end)
        out[f"lag_{phase}_s"] = lag
        out[f"lag_{phase}_at"] = where
        if kstacks is not None:
            out[f"lag_{phase}_kernel"] = kstacks.during(lo, hi)
        # When the worst lag was (from the phase's start), and the backend's calls under
        # way then: (name, start from the phase's start, duration).
        out[f"lag_{phase}_window"] = [round(lo - start, 4), round(hi - start, 4)]
        out[f"lag_{phase}_calls"] = _during(run.calls, lo, hi, start)
        # The capturing thread's steps then, and the garbage collections (by generation).
        out[f"lag_{phase}_capture"] = _during(CAPTURE_SPANS, lo, hi, start)
        out[f"lag_{phase}_gc"] = _during(GC_SPANS, lo, hi, start)
        if steps is not None and phase in ("opening", "pinning", "closing"):
            out[f"stretch_{phase}"] = steps.longest(start, end) / step_alone
            out[f"steps_{phase}"] = [
                [round(s - start, 4), round(e - s, 4)] for s, e in steps.within(start, end)
            ][:2000]
            # The longest step's span, and what else went on then: the capturing thread's
            # steps and the backend's calls (name, start from the phase's start, duration).
            longest = max(steps.within(start, end), key=lambda se: se[1] - se[0], default=None)
            if longest is not None:
                a0, b0 = longest
                out[f"longest_step_{phase}"] = {
                    "at": [round(a0 - start, 4), round(b0 - a0, 4)],
                    "capture": _during(CAPTURE_SPANS, a0, b0, start),
                    "calls": _during(run.calls, a0, b0, start)[:20],
                }
    return out


async def one(
    recipe: str, nbytes: int, hb: Heartbeat, steps: StepLog | None, step_alone: float, args: Any
) -> dict[str, Any]:
    run = Run(recipe, nbytes)
    watched = [tid for tid, role in ROLES.items() if role in ("step", "capture")]
    kstacks = KernelStacks(hb.native_id, watched) if args.stacks == "kernel" else None
    try:
        if recipe == "asyncpin":
            layout, arrays = kv_layout(256 if torch.cuda.is_available() else 4)
            await asyncpin_run(run, layout, args.trips, args.chunk_bytes)
            del arrays
        else:
            await peer_run(run, vllm_open if recipe == "vllm" else seed_open)
        await anyio.sleep(0.01)
    finally:
        if kstacks is not None:
            kstacks.stop()
    result = phases(run, hb, steps, step_alone, kstacks)
    if kstacks is not None:
        result["kernel_sweeps"] = kstacks.sweeps
    stretch = result.get("stretch_opening")
    print(
        f"  {format_bytes(nbytes)} {recipe}: enter {result['enter_s'] * 1e3:.1f} ms, ready "
        f"{result['ready_s']:.2f} s, close {result['close_s']:.2f} s, lag enter/pin/serve/close "
        f"{result['lag_entering_s'] * 1e3:.1f}/{result['lag_pinning_s'] * 1e3:.1f}/"
        f"{result['lag_serving_s'] * 1e3:.1f}/{result['lag_closing_s'] * 1e3:.1f} ms"
        + (
            f", step x{stretch:.2f} open (x{result['stretch_pinning']:.2f} pinning) / "
            f"x{result['stretch_closing']:.2f} close"
            if stretch is not None
            else ""
        )
        + "".join(
            f", {name} {result[f'{name}_s'] * 1e3:.1f} ms at {result[f'{name}_at_s']:.3f} s"
            for name in ("warm_up", "engine_made", "set_up")
            if result.get(f"{name}_at_s") is not None
        ),
        file=sys.stderr,
        flush=True,
    )
    for phase in ("entering", "pinning", "serving", "closing"):
        lo, hi = result[f"lag_{phase}_window"]
        long_calls = [c for c in result[f"lag_{phase}_calls"] if c[2] >= 0.05]
        print(
            f"    worst {phase} lag at {lo:.3f}-{hi:.3f} s; backend calls under way then: "
            f"{len(result[f'lag_{phase}_calls'])}, of 50 ms or more: {long_calls}; "
            f"garbage collections then: {result[f'lag_{phase}_gc']}; "
            f"capture steps then: {result[f'lag_{phase}_capture'][:6]}",
            file=sys.stderr,
            flush=True,
        )
        longest = result.get(f"longest_step_{phase}")
        if longest is not None:
            (at, took), calls = longest["at"], longest["calls"]
            print(
                f"    longest {phase} step at {at:.3f} s, {took * 1e3:.1f} ms; capture steps "
                f"then: {longest['capture'][:6]}; backend calls then: {len(calls)}, the "
                f"longest {max((c[2] for c in calls), default=0):.4f} s",
                file=sys.stderr,
                flush=True,
            )
        kernel = result.get(f"lag_{phase}_kernel")
        if kernel is not None:
            print(
                f"    kernel stacks then (thread: stack, seconds seen): loop "
                f"{kernel['loop'][:2]}; blocked {kernel['blocked'][:4]}; step and "
                f"captures {kernel['others'][:4]}",
                file=sys.stderr,
                flush=True,
            )
    return result


async def cold_pair(nbytes: int, hb: Heartbeat, steps: StepLog | None, alone: float) -> Any:
    """``asyncpin`` then ``vllm``, each on memory this process never touched: the
    manager stays open (pinned) while the second recipe runs. asyncpin goes first: on a
    machine whose memory grows as it is used, its check of available memory sees only
    what the machine has grown to so far."""
    before = mem_total_bytes()
    layout, arrays = kv_layout(256 if torch.cuda.is_available() else 4)
    ours, peer = Run("asyncpin", nbytes), Run("vllm", nbytes)

    async def then_peer() -> None:
        close = await vllm_open(peer)
        await anyio.sleep(0.005)
        peer.mark("served")
        peer.mark("close")
        close()
        del close
        peer.mark("closed")

    await asyncpin_run(ours, layout, trips=1, inside=then_peer)
    del arrays
    await anyio.sleep(0.01)
    return {
        "mem_total_before": before,
        "mem_total_after": mem_total_bytes(),
        "runs": [phases(ours, hb, steps, alone), phases(peer, hb, steps, alone)],
    }


async def quiet(
    hb: Heartbeat, steps: StepLog | None, alone: float, seconds: float
) -> dict[str, Any]:
    """``seconds`` (2, 0.2 with --quick) of the heartbeat, and on a GPU the step and the
    captures, with nothing of the tier running: the longest step and lag the setting
    itself gives."""
    start = Clock.now()
    await anyio.sleep(seconds)
    end = Clock.now()
    out: dict[str, Any] = {"seconds": end - start, "lag_s": hb.worst(start, end)[0]}
    if steps is not None:
        out["stretch"] = steps.longest(start, end) / alone
        within = steps.within(start, end)
        out["steps"] = len(within)
        out["over_1_5x"] = sum(e - s > 1.5 * alone for s, e in within) / max(1, len(within))
    return out


async def bench(args: Any) -> dict[str, Any]:
    gpu = torch.cuda.is_available()
    steps = StepLog() if gpu else None
    alone = steps.alone_s() if steps is not None else 0.0
    capturer = Capturer(args.captures) if gpu else None
    gate = install_capture_gate()
    hb = Heartbeat(args.stacks)
    doc: dict[str, Any] = {
        "machine": machine(),
        "step_alone_s": alone,
        "stacks": args.stacks,
        "chunk_bytes_asked": args.chunk_bytes,
        "prefault_threads_asked": args.prefault_threads,
        "pin_beside_faulting": args.pin_beside_faulting,
        "captures_recipe": args.captures,
        "gc_freeze": args.gc_freeze,
        "sizes": {},
    }
    async with anyio.create_task_group() as tg:
        await tg.start(hb.run)
        if steps is not None:
            steps.start()
        if args.gc_freeze:  # before the captures: --captures vllm patches gc.collect out
            gc.collect()
            gc.freeze()
            doc["gc_frozen_objects"] = gc.get_freeze_count()
        if capturer is not None:
            capturer.start()
        try:
            doc["quiet"] = await quiet(hb, steps, alone, 0.2 if args.quick else 2.0)
            if args.cold:
                # The copy kernel's load (once per process) out of the cold figures.
                await asyncpin_run(Run("asyncpin", HOST_BLOCK), *kv_layout(4)[:1], trips=0)
                doc["cold"] = await cold_pair(args.cold, hb, steps, alone)
            for nbytes in args.size:
                runs: list[dict[str, Any]] = []
                order = list(args.recipe)
                for rep in range(args.repeats):
                    rotated = order[rep % len(order) :] + order[: rep % len(order)]
                    for recipe in rotated:
                        if recipe == "seed" and rep >= args.seed_repeats:
                            continue
                        await anyio.to_thread.run_sync(_prime, nbytes)
                        runs.append(await one(recipe, nbytes, hb, steps, alone, args))
                doc["sizes"][format_bytes(nbytes).replace(" ", "")] = summarise(runs)
        finally:
            if capturer is not None:
                capturer.stop()
                doc["captures"] = {
                    "made": capturer.captured,
                    "failed": capturer.failed,
                    "errors": capturer.errors[:5],
                }
            if steps is not None:
                steps.stop()
                doc["step_errors"] = {"count": len(steps.errors), "first": steps.errors[:3]}
            gate.uninstall()
            tg.cancel_scope.cancel()
    return doc


KEYS = (
    "enter_s",
    "ready_s",
    "close_s",
    "lag_opening_s",
    "lag_serving_s",
    "lag_closing_s",
    "stretch_opening",
    "stretch_closing",
)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": runs}
    for recipe in dict.fromkeys(r["recipe"] for r in runs):
        mine = [r for r in runs if r["recipe"] == recipe]
        out[recipe] = {
            key: {
                "median": median([r[key] for r in mine]),
                "min": min(r[key] for r in mine),
                "max": max(r[key] for r in mine),
            }
            for key in KEYS
            if all(key in r for r in mine)
        }
        out[recipe]["n"] = len(mine)
    return out


def _t(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def print_table(doc: dict[str, Any]) -> None:
    where = doc["machine"]["gpu"] or "host backend (no GPU)"
    print(f"\nStart-up on {where}; step alone {doc['step_alone_s'] * 1e3:.1f} ms; medians")
    q = doc.get("quiet")
    if q is not None:
        print(
            f"quiet (captures and heartbeat, no tier), {q['seconds']:.1f} s: lag {_t(q['lag_s'])}"
            + (f", step x{q['stretch']:.2f}" if "stretch" in q else "")
        )
    head = (
        f"{'size':>7} {'recipe':<9} {'n':>2} {'enter':>9} {'ready':>8} {'close':>8} "
        f"{'lag open':>9} {'serve':>8} {'close':>8} {'step open':>9} {'close':>6}"
    )
    print(head)
    print("-" * len(head))
    rows = [(size, s) for size, s in doc["sizes"].items()]
    if "cold" in doc:
        rows.insert(0, ("cold", summarise(doc["cold"]["runs"])))
    for size, summary in rows:
        for recipe in ("vllm", "seed", "asyncpin"):
            s = summary.get(recipe)
            if s is None:
                continue

            def get(key: str, s: dict[str, Any] = s) -> float | None:
                return s[key]["median"] if key in s else None

            stretch = get("stretch_opening")
            print(
                f"{size:>7} {recipe:<9} {s['n']:>2} {_t(s['enter_s']['median']):>9} "
                f"{_t(s['ready_s']['median']):>8} {_t(s['close_s']['median']):>8} "
                f"{_t(s['lag_opening_s']['median']):>9} {_t(s['lag_serving_s']['median']):>8} "
                f"{_t(s['lag_closing_s']['median']):>8} "
                + (
                    f"{stretch:>8.2f}x {get('stretch_closing'):>5.2f}x"
                    if stretch is not None
                    else f"{'-':>9} {'-':>6}"
                )
            )
        if "vllm" in summary and "asyncpin" in summary:
            v, a = summary["vllm"], summary["asyncpin"]
            print(
                f"{'':>7} vllm / asyncpin: ready "
                f"{v['ready_s']['median'] / a['ready_s']['median']:.2f}x, close "
                f"{v['close_s']['median'] / a['close_s']['median']:.2f}x"
            )
    if "captures" in doc:
        c = doc["captures"]
        print(f"graph captures: {c['made']} made, {c['failed']} failed {c['errors'][:1]}")
    if doc.get("step_errors", {}).get("count"):
        print(f"GPU steps that failed: {doc['step_errors']}")


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--size", type=parse_size, action="append", help="repeatable (default 16GiB)")
    p.add_argument("--cold", type=parse_size, default=None, help="a cold pair at this size first")
    p.add_argument("--recipe", action="append", choices=("vllm", "seed", "asyncpin"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed-repeats", type=int, default=1, help="the seed recipe is slow")
    p.add_argument("--chunk-bytes", type=parse_size, default=None, help="default: the library's")
    p.add_argument("--pin-threads", type=int, default=0, help="0: the library's default")
    p.add_argument(
        "--pin-beside-faulting",
        action="store_true",
        help="asyncpin pins each chunk as soon as it is faulted in, beside the faulting "
        "of the rest, as before runs 148-149 (asyncpin.pinning.PIN_BESIDE_FAULTING); by "
        "default it pins once the whole region is faulted in",
    )
    p.add_argument("--prefault-threads", type=int, default=0, help="0: the library's default")
    p.add_argument("--trips", type=int, default=20, help="store/load round trips when ready")
    p.add_argument(
        "--trace-calls",
        action="store_true",
        help="keep every pin call's and prefault piece's span in the JSON (pin_spans, "
        "prefault_spans: start from the run's start, seconds)",
    )
    p.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.collect() then gc.freeze() once the model's loop runs, before any recipe "
        "(a server's long-lived heap kept out of the collector's full collections)",
    )
    p.add_argument(
        "--captures",
        choices=("torch", "vllm"),
        default="torch",
        help="how the capturing thread captures: torch.cuda.graph as it comes (torch), or "
        "as vLLM's graph wrapper does, one shared pool and no cache emptying (vllm)",
    )
    p.add_argument(
        "--stacks",
        choices=("python", "kernel", "none"),
        default="python",
        help="what the watchdog samples while the loop is late (kernel: needs root)",
    )
    args = p.parse_args()
    if args.quick:
        args.size, args.repeats, args.trips = [8 << 20], 1, 2
        args.cold = args.cold and 8 << 20
    args.size = args.size if args.size is not None else [16 * GiB]
    args.recipe = args.recipe or ["vllm", "seed", "asyncpin"]
    global PIN_THREADS, PREFAULT_THREADS
    PIN_THREADS, PREFAULT_THREADS = args.pin_threads, args.prefault_threads
    if args.pin_beside_faulting:
        asyncpin.pinning.PIN_BESIDE_FAULTING = True
    if args.trace_calls:
        trace_prefaults()
    if args.stacks == "kernel" and not kernel_stacks_readable():
        print(
            "--stacks kernel: threads' kernel stacks cannot be read here (root only); "
            "--stacks python instead",
            file=sys.stderr,
        )
        args.stacks = "python"
    quiet_logs()
    gc.callbacks.append(_on_gc)
    doc = anyio.run(bench, args)
    write_json(args.json_out, doc)
    print_table(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
