"""What the maintained bench scripts share. Public API of asyncpin only, plus torch.

The same scripts run against any asyncpin tree put first on ``PYTHONPATH`` (``bench/gpu_pass.sh``
runs each one against the tree before a change and the one after), so nothing here may
import a private name of asyncpin.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
from anyio.abc import TaskStatus

import asyncpin

MiB, GiB = 1 << 20, 1 << 30
GB = 1e9
# A Llama-3.1-8B KV block of 16 tokens: 8 KV heads x 128 x bf16 = 32 KiB per array; 32
# layers of K and V make 64 arrays, 2 MiB per host block.
TOKENS, HEADS, HEAD_DIM = 16, 8, 128

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``16GiB``, ``512MiB``, ``64M``, ``4096``: bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (try 16GiB or 512MiB)")
    return int(match[1]) * _UNITS[match[2].upper()]


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}".replace(".00 ", " ")
    return f"{n:.0f} B"


def require_gpu() -> None:
    """Exit with a one-line message and status 1 when no CUDA GPU is visible."""
    if torch.cuda.is_available():
        return
    why = (
        f"torch {torch.__version__} is built without CUDA"
        if torch.version.cuda is None
        else "none is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    )
    sys.exit(f"{Path(sys.argv[0]).name} needs a CUDA GPU: {why}")


def quiet_logs() -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every script takes."""
    p = argparse.ArgumentParser(
        description=(doc or "").split("\n", 1)[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json-out", type=Path, default=None, help="write the full figures here")
    p.add_argument("--quick", action="store_true", help="small and short: checks the script works")
    return p


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50 and p99 (nearest rank) of ``samples``, in the samples' unit."""
    ordered = sorted(samples)
    return {
        "p50": ordered[len(ordered) // 2],
        "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
    }


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def vm_locked_bytes() -> int:
    """VmLck of this process (mlock'ed bytes; CUDA registrations do not count)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def machine() -> dict[str, Any]:
    """Where and against which asyncpin the figures were taken."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "asyncpin_path": str(Path(asyncpin.__file__).resolve().parent),
        "kernel": platform.release(),
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "gpu": gpu,
        "argv": [sys.executable, *sys.argv],
    }


def write_json(path: Path | None, doc: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"full figures: {path}", file=sys.stderr)


def kv_tensors(device: str, blocks: int, layers: int = 32) -> list[torch.Tensor]:
    """A Llama-8B-like KV cache: ``2 * layers`` arrays of ``blocks`` 32 KiB blocks of random
    bf16 (never zeros)."""
    shape = (blocks, TOKENS, HEADS, HEAD_DIM)
    return [
        torch.randn(shape, device=device, dtype=torch.float32).to(torch.bfloat16)
        for _ in range(2 * layers)
    ]


class Heartbeat:
    """Sleeps ``period_s`` in a loop and records each overshoot: the event loop's lag."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s = period_s
        self.lags: list[float] = []
        self._deadline = time.perf_counter() + period_s

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            self._deadline = time.perf_counter() + self.period_s
            await anyio.sleep(self.period_s)
            self.lags.append(max(0.0, time.perf_counter() - self._deadline))

    def reset(self) -> None:
        self.lags = []
        self._deadline = max(self._deadline, time.perf_counter())

    def max_s(self) -> float:
        """The worst lag so far, counting a sleep that is overdue but has not woken yet."""
        return max([*self.lags, time.perf_counter() - self._deadline, 0.0])

    def p99_s(self) -> float:
        return percentiles(self.lags)["p99"] if self.lags else 0.0


class GpuStepper:
    """A model's step in a thread of its own: ``matmuls`` bf16 matmuls, then synchronize.
    Records each step's wall time, to see how much pinning stretches it."""

    def __init__(self, matmuls: int = 8, n: int = 8192) -> None:
        self.a = torch.randn(n, n, device="cuda").to(torch.bfloat16)
        self.b = torch.randn(n, n, device="cuda").to(torch.bfloat16)
        self.matmuls = matmuls
        self.steps: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self.matmuls):
            torch.mm(self.a, self.b)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def alone_s(self, repeats: int = 10) -> float:
        self.step()
        return median([self.step() for _ in range(repeats)])

    def start(self) -> None:
        self.steps = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> list[float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.steps

    def _run(self) -> None:
        while not self._stop.is_set():
            self.steps.append(self.step())


class StreamSteps:
    """The start-up bench's model step (8 bf16 matmuls of 8192, then a wait for its own
    stream) in a thread, each step's (start, launched, end) kept: the launches' part and
    the wait's part apart. For the probes."""

    def __init__(self) -> None:
        self.a = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
        self.b = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
        self.stream = torch.cuda.Stream()
        self.spans: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            with torch.cuda.stream(self.stream):
                for _ in range(8):
                    torch.mm(self.a, self.b)
            t1 = time.perf_counter()
            self.stream.synchronize()
            self.spans.append((t0, t1, time.perf_counter()))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def during(self, start: float, end: float) -> list[tuple[float, float, float]]:
        """The steps that began in [start, end]."""
        return [s for s in self.spans if start <= s[0] <= end]

    def overlapping(self, start: float, end: float) -> list[tuple[float, float, float]]:
        """The steps that overlap [start, end] at all."""
        return [s for s in self.spans if s[0] <= end and s[2] >= start]


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded into this process (for calls torch does not bind)."""
    torch.cuda.init()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "libcudart.so" in path:
            return ctypes.CDLL(path)
    return ctypes.CDLL("libcudart.so")


class _PointerAttributes(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("devicePointer", ctypes.c_void_p),
        ("hostPointer", ctypes.c_void_p),
        ("reserved", ctypes.c_byte * 256),  # room for fields newer runtimes add
    ]


def still_registered(addresses: Sequence[int]) -> int:
    """How many of ``addresses`` CUDA still knows as registered host memory."""
    lib = cudart()
    count = 0
    for address in addresses:
        attrs = _PointerAttributes()
        code = lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(address))
        lib.cudaGetLastError()
        count += code == 0 and attrs.type != 0  # 0: cudaMemoryTypeUnregistered
    return count


@contextlib.contextmanager
def own_servers(kind: str, prefix: str, nodes: int = 3) -> Iterator[Any]:
    """A redis-server (``kind`` "node") or ``nodes`` as a cluster ("cluster") on free
    loopback ports (tests/redis_servers.py; ``ASYNCPIN_TEST_SERVER=valkey`` for Valkey),
    in a temporary directory named from ``prefix``: started, yielded, stopped, removed."""
    from tests.redis_servers import RedisCluster, RedisServer

    if kind == "cluster" and nodes < 3:
        raise SystemExit(f"a cluster needs 3 nodes or more, not {nodes}")
    root = Path(tempfile.mkdtemp(prefix=prefix))
    servers = (
        RedisCluster(root / "cluster", size=nodes)
        if kind == "cluster"
        else RedisServer(root / "single")
    )
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()
        shutil.rmtree(root, ignore_errors=True)
