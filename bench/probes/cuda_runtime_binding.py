"""Submission cost of the CUDA runtime calls the transfer engine makes per transfer: the
engine's hand-written ctypes binding against NVIDIA's typed bindings (``cuda-bindings``,
module ``cuda.bindings.runtime``), on the calling thread.

    python3 bench/probes/cuda_runtime_binding.py --out $OUT/cuda-runtime-binding.json

Calls: ``cudaMemcpyBatchAsync`` with 1, 64 and 1024 segments of 32 KiB (registered host
memory <-> device, D2H and H2D), ``cudaMemcpyAsync`` (one 32 KiB copy), ``cudaEventRecord``
and ``cudaStreamWaitEvent``. Each call is timed alone (``perf_counter_ns`` around one
call through a wrapper shaped like the engine's method, return code checked), the
variants of a call alternate in one loop (their order rotates every step), and the
streams are synchronised every few steps outside the timed region so that queues do not
fill. Figures: p50 / p90 / p99 in microseconds, and each variant's ratio to ctypes.

Variants:

- ``ctypes``: the engine's binding, copied here (same argtypes, same attribute structs,
  same version switch for the ``failIdx`` out-parameter of 12.8/12.9), so that this
  probe does not depend on engine internals that move.
- ``cb``: cuda.bindings.runtime called with what the engine holds: raw int handles
  (``stream.cuda_stream``, event handles as ints) and the engine's address arrays
  (``array('Q')`` up to 64 segments, int64 CPU tensors above). cuda-bindings takes
  Python sequences of ints, so for tensors ``cb`` includes their ``.tolist()``.
- ``cb-obj``: cuda.bindings.runtime with the handles pre-wrapped once
  (``cudaStream_t``/``cudaEvent_t``: otherwise each call builds one from the int) and,
  for the batch, the addresses already as lists of ints: its best case.
- ``convert``: the cost, alone, of turning the engine's three address arrays into lists
  (``.tolist()``): what the engine would pay on top of ``cb-obj`` for the batch.
- ``noop``: an empty wrapper call, the timing floor to subtract from every figure.

Before timing, a D2H then H2D round trip through each binding's batch call (both address
forms) must be byte-exact. Without a GPU the probe prints a "no GPU" JSON and exits 0;
without cuda-bindings it measures ctypes alone.
"""

from __future__ import annotations

import argparse
import array
import ctypes
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Union

import torch

SEGMENT = 32 << 10
BATCH_SEGMENTS = (1, 64, 1024)
SMALL_SEGMENTS = 64  # the engine's plain-Python (array('Q')) path goes up to here
MEMCPY_DEFAULT = 4
EVENT_DISABLE_TIMING = 2
WARMUP_STEPS = 20
# Copies queued between two synchronisations (batch segments, or single calls).
QUEUED_OPS = 256

Addresses = Union[torch.Tensor, "array.array[int]"]
Samples = dict[str, list[int]]


# -- the engine's ctypes binding, copied -------------------------------------------------


def find_libcudart() -> ctypes.CDLL | None:
    """The libcudart torch loaded (found in /proc/self/maps), or None if it is static."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "libcudart.so" in path:
            lib = ctypes.CDLL(path)
            lib.cudaGetErrorName.restype = ctypes.c_char_p
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            return lib
    return None


def _pointer(addresses: Addresses) -> int:
    if isinstance(addresses, torch.Tensor):
        return addresses.data_ptr()
    return addresses.buffer_info()[0]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class CtypesRuntime:
    """The engine's ``_Runtime``: the same calls, argtypes and checks."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        version = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.version = version.value
        lib.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cudaEventDestroy.argtypes = [ctypes.c_void_p]
        lib.cudaStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self.batch = getattr(lib, "cudaMemcpyBatchAsync", None) if self.version >= 12080 else None
        # src order "stream" (1); prefer overlap with compute (1).
        self.attrs = _MemcpyAttributes(1, _MemLocation(0, 0), _MemLocation(0, 0), 1)
        self.attr_index = (ctypes.c_size_t * 1)(0)

    def copy_segments(
        self, dsts: Addresses, srcs: Addresses, sizes: Addresses, stream: int
    ) -> None:
        count = len(dsts)
        if count == 0:
            return
        if self.batch is not None:
            self._batch_call(dsts, srcs, sizes, self.attrs, stream)
            return
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            self.memcpy(dst, src, size, stream)

    def _batch_call(
        self,
        dsts: Addresses,
        srcs: Addresses,
        sizes: Addresses,
        attrs: _MemcpyAttributes,
        stream: int,
    ) -> None:
        args: list[Any] = [
            ctypes.c_void_p(_pointer(dsts)),
            ctypes.c_void_p(_pointer(srcs)),
            ctypes.c_void_p(_pointer(sizes)),
            ctypes.c_size_t(len(dsts)),
            ctypes.byref(attrs),
            self.attr_index,
            ctypes.c_size_t(1),
        ]
        if self.version < 13000:  # 12.8/12.9 had a failIdx out-parameter here
            fail_index = ctypes.c_size_t(0)
            args.append(ctypes.byref(fail_index))
        args.append(ctypes.c_void_p(stream))
        assert self.batch is not None
        self._check("cudaMemcpyBatchAsync", self.batch(*args))

    def memcpy(self, dst: int, src: int, size: int, stream: int) -> None:
        code = self.lib.cudaMemcpyAsync(dst, src, size, MEMCPY_DEFAULT, stream)
        self._check("cudaMemcpyAsync", code)

    def event(self) -> int:
        handle = ctypes.c_void_p()
        code = self.lib.cudaEventCreateWithFlags(ctypes.byref(handle), EVENT_DISABLE_TIMING)
        self._check("cudaEventCreateWithFlags", code)
        return int(handle.value or 0)

    def record(self, event: int, stream: int) -> None:
        self._check("cudaEventRecord", self.lib.cudaEventRecord(event, stream))

    def wait(self, stream: int, event: int) -> None:
        self._check("cudaStreamWaitEvent", self.lib.cudaStreamWaitEvent(stream, event, 0))

    def destroy(self, event: int) -> None:
        self.lib.cudaEventDestroy(event)

    def _check(self, op: str, code: int) -> None:
        if code != 0:
            self.lib.cudaGetLastError()
            name = self.lib.cudaGetErrorName(code)
            raise RuntimeError(f"{op} failed with {name.decode() if name else code} ({code})")


# -- the same calls through cuda.bindings.runtime ----------------------------------------


class BindingsRuntime:
    """What a port of ``_Runtime`` onto ``cuda.bindings.runtime`` would call.

    cuda-bindings' ``cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs,
    numAttrs, stream)`` takes Python sequences: every element of ``dsts``/``srcs`` is
    wrapped in a helper object (an int, or anything with the buffer protocol: its
    address), ``sizes`` and ``attrsIdxs`` must hold ``int`` objects (an int64 tensor's
    elements are rejected), ``attrs`` is a list of ``cudaMemcpyAttributes``. It returns
    ``(err,)`` from 13.0 on, ``(err, failIdx)`` in 12.8/12.9 bindings; handles may be
    ints (a ``cudaStream_t``/``cudaEvent_t`` is built from each) or those objects."""

    def __init__(self, device: int) -> None:
        from cuda.bindings import runtime as cbr

        self.cbr = cbr
        self._check("cudaSetDevice", cbr.cudaSetDevice(device)[0])
        err, self.version = cbr.cudaRuntimeGetVersion()
        self._check("cudaRuntimeGetVersion", err)
        attrs = cbr.cudaMemcpyAttributes()
        attrs.srcAccessOrder = cbr.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        attrs.flags = cbr.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
        # srcLocHint/dstLocHint stay zero (type 0, id 0), as in the ctypes struct.
        self.attrs = [attrs]
        self.attr_index = [0]
        self.kind = cbr.cudaMemcpyKind.cudaMemcpyDefault

    def copy_segments(
        self, dsts: Addresses, srcs: Addresses, sizes: Addresses, stream: Any
    ) -> None:
        """With the engine's arrays: ``array('Q')`` iterates as ints and goes as it is;
        tensors become lists first."""
        count = len(dsts)
        if count == 0:
            return
        if isinstance(dsts, torch.Tensor):
            assert isinstance(srcs, torch.Tensor) and isinstance(sizes, torch.Tensor)
            self.copy_lists(dsts.tolist(), srcs.tolist(), sizes.tolist(), count, stream)
        else:
            self.copy_lists(dsts, srcs, sizes, count, stream)

    def copy_lists(self, dsts: Any, srcs: Any, sizes: Any, count: int, stream: Any) -> None:
        res = self.cbr.cudaMemcpyBatchAsync(
            dsts, srcs, sizes, count, self.attrs, self.attr_index, 1, stream
        )
        self._check("cudaMemcpyBatchAsync", res[0])

    def memcpy(self, dst: int, src: int, size: int, stream: Any) -> None:
        res = self.cbr.cudaMemcpyAsync(dst, src, size, self.kind, stream)
        self._check("cudaMemcpyAsync", res[0])

    def event(self) -> Any:
        err, event = self.cbr.cudaEventCreateWithFlags(self.cbr.cudaEventDisableTiming)
        self._check("cudaEventCreateWithFlags", err)
        return event

    def record(self, event: Any, stream: Any) -> None:
        self._check("cudaEventRecord", self.cbr.cudaEventRecord(event, stream)[0])

    def wait(self, stream: Any, event: Any) -> None:
        self._check("cudaStreamWaitEvent", self.cbr.cudaStreamWaitEvent(stream, event, 0)[0])

    def destroy(self, event: Any) -> None:
        self.cbr.cudaEventDestroy(event)

    def _check(self, op: str, err: Any) -> None:
        if err != 0:
            self.cbr.cudaGetLastError()
            name = self.cbr.cudaGetErrorName(err)[1]
            raise RuntimeError(f"{op} failed with {name.decode()} ({int(err)})")


# -- measurement -------------------------------------------------------------------------


def measure(
    variants: dict[str, Callable[[], None]],
    steps: int,
    sync_every: int,
    sync: Callable[[], None],
    before_step: Callable[[], None] | None = None,
) -> Samples:
    """Each step calls every variant once, timing each call alone; the order rotates
    every step. ``before_step`` and ``sync`` run outside the timed region."""
    names = list(variants)
    samples: Samples = {name: [] for name in names}
    clock = time.perf_counter_ns
    gc.collect()
    for step in range(-WARMUP_STEPS, steps):
        if before_step is not None:
            before_step()
        k = step % len(names)
        for name in names[k:] + names[:k]:
            fn = variants[name]
            t0 = clock()
            fn()
            t1 = clock()
            if step >= 0:
                samples[name].append(t1 - t0)
        if (step + 1) % sync_every == 0:
            sync()
    sync()
    return samples


def noop() -> None:
    pass


def summary(ns: list[int]) -> dict[str, float]:
    xs = sorted(ns)
    n = len(xs)
    return {
        "n": n,
        "p50_us": xs[n // 2] / 1e3,
        "p90_us": xs[min(n - 1, int(n * 0.9))] / 1e3,
        "p99_us": xs[min(n - 1, int(n * 0.99))] / 1e3,
    }


def rows_of(case: dict[str, Any], samples: Samples) -> list[dict[str, Any]]:
    stats = {name: summary(ns) for name, ns in samples.items()}
    base = stats.get("ctypes")
    rows = []
    for name, st in stats.items():
        row = {**case, "variant": name, **st}
        if base is not None and name not in ("ctypes", "convert"):
            row["ratio_p50"] = st["p50_us"] / base["p50_us"]
            row["ratio_p90"] = st["p90_us"] / base["p90_us"]
        rows.append(row)
    return rows


# -- setup -------------------------------------------------------------------------------


class Buffers:
    """A device buffer, a second one for round trips, and a host buffer registered with
    cudaHostRegister (as the engine's region), each ``max(BATCH_SEGMENTS)`` segments."""

    def __init__(self, lib: ctypes.CDLL, device: torch.device) -> None:
        self.nbytes = max(BATCH_SEGMENTS) * SEGMENT
        self.lib = lib
        self.dev = torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, device=device)
        self.dev2 = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.host = torch.zeros(self.nbytes, dtype=torch.uint8)
        code = lib.cudaHostRegister(self.host.data_ptr(), self.nbytes, 0)
        self.host_kind = "cudaHostRegister"
        if code != 0:
            lib.cudaGetLastError()
            self.host = self.host.pin_memory()
            self.host_kind = f"pin_memory (cudaHostRegister failed: {code})"

    def addresses(self, n: int, *, to_host: bool, device2: bool = False) -> list[list[int]]:
        """dsts, srcs, sizes as lists: device segment i <-> host segment n-1-i (reversed,
        so that no two consecutive copies are contiguous on both sides)."""
        dev = (self.dev2 if device2 else self.dev).data_ptr()
        host = self.host.data_ptr()
        d = [dev + i * SEGMENT for i in range(n)]
        h = [host + (n - 1 - i) * SEGMENT for i in range(n)]
        sizes = [SEGMENT] * n
        return [h, d, sizes] if to_host else [d, h, sizes]

    def close(self) -> None:
        if self.host_kind == "cudaHostRegister":
            self.lib.cudaHostUnregister(self.host.data_ptr())


def engine_form(lists: list[list[int]], *, tensor: bool) -> tuple[Addresses, Addresses, Addresses]:
    """The engine's arrays: array('Q') on its small path, int64 CPU tensors otherwise."""

    def form(a: list[int]) -> Addresses:
        return torch.tensor(a, dtype=torch.int64) if tensor else array.array("Q", a)

    return form(lists[0]), form(lists[1]), form(lists[2])


def round_trip(
    name: str, rt: CtypesRuntime | BindingsRuntime, bufs: Buffers, n: int, stream: int
) -> dict[str, Any]:
    """D2H then H2D through ``rt``'s batch call, with the engine's address arrays; both
    byte-exact?"""
    tensor = n > SMALL_SEGMENTS
    size = n * SEGMENT
    bufs.host.zero_()
    bufs.dev2.zero_()
    torch.cuda.synchronize()
    rt.copy_segments(*engine_form(bufs.addresses(n, to_host=True), tensor=tensor), stream)
    torch.cuda.synchronize()
    expected = bufs.dev[:size].view(n, SEGMENT).flip(0).cpu().reshape(-1)
    host_ok = bool(torch.equal(bufs.host[:size], expected))
    back = engine_form(bufs.addresses(n, to_host=False, device2=True), tensor=tensor)
    rt.copy_segments(*back, stream)
    torch.cuda.synchronize()
    dev_ok = bool(torch.equal(bufs.dev2[:size], bufs.dev[:size]))
    return {
        "binding": name,
        "segments": n,
        "address_form": "int64 tensor" if tensor else "array('Q')",
        "d2h_exact": host_ok,
        "round_trip_exact": dev_ok,
    }


def libcudart_mappings() -> list[str]:
    paths = {
        line.split()[-1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "cudart" in line or "cuda/bindings" in line
    }
    return sorted(p for p in paths if p.startswith("/"))


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(repeats: int) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    lib = find_libcudart()
    if lib is None:
        return {"status": "skipped", "reason": "libcudart is not loaded as a shared library"}
    ct = CtypesRuntime(lib)
    meta: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "cpu": cpu_model(),
        "ctypes_runtime_version": ct.version,
        "ctypes_batch": ct.batch is not None,
        "segment_bytes": SEGMENT,
        "repeats": repeats,
        "warmup_steps": WARMUP_STEPS,
    }
    cb: BindingsRuntime | None = None
    try:
        import cuda.bindings

        meta["cuda_bindings"] = getattr(cuda.bindings, "__version__", "?")
        cb = BindingsRuntime(device.index)
        meta["cb_runtime_version"] = cb.version
        meta["cb_driver_version"] = cb.cbr.cudaDriverGetVersion()[1]
    except Exception as exc:
        meta["cuda_bindings_error"] = f"{type(exc).__name__}: {exc}"
    if ct.batch is None:
        return {"status": "skipped", "reason": "no cudaMemcpyBatchAsync (CUDA < 12.8)", **meta}

    bufs = Buffers(lib, device)
    meta["host_memory"] = bufs.host_kind
    stream = torch.cuda.Stream(device)
    other = torch.cuda.Stream(device)
    s, s2 = stream.cuda_stream, other.cuda_stream

    def sync() -> None:
        stream.synchronize()
        other.synchronize()

    # Correctness, once per binding and address form (array('Q'), then int64 tensors). A
    # binding that fails is left out of the timings (ctypes failing fails the run).
    checks: list[dict[str, Any]] = []
    for n in (SMALL_SEGMENTS, max(BATCH_SEGMENTS)):
        checks.append(round_trip("ctypes", ct, bufs, n, s))
        if cb is not None:
            try:
                checks.append(round_trip("cb", cb, bufs, n, s))
            except Exception as exc:
                meta["cuda_bindings_error"] = f"{type(exc).__name__}: {exc}"
                cb = None
    meta["mappings"] = libcudart_mappings()

    def exact(binding: str) -> bool:
        return all(
            c["d2h_exact"] and c["round_trip_exact"] for c in checks if c["binding"] == binding
        )

    if not exact("ctypes"):
        bufs.close()
        return {
            "status": "failed",
            "reason": "ctypes round trip not byte-exact",
            **meta,
            "checks": checks,
        }
    if cb is not None and not exact("cb"):
        meta["cuda_bindings_error"] = "round trip not byte-exact: cuda-bindings left out"
        cb = None

    rows: list[dict[str, Any]] = []
    rows += rows_of({"call": "noop"}, measure({"noop": noop}, repeats, repeats, sync))

    b = cb  # settled: closures below see it as it is now
    s_obj = b.cbr.cudaStream_t(s) if b is not None else None
    s2_obj = b.cbr.cudaStream_t(s2) if b is not None else None

    # cudaMemcpyAsync: one 32 KiB copy each way.
    for direction in ("D2H", "H2D"):
        dst, src, _ = (a[0] for a in bufs.addresses(1, to_host=direction == "D2H"))
        variants: dict[str, Callable[[], None]] = {
            "ctypes": partial(ct.memcpy, dst, src, SEGMENT, s)
        }
        if b is not None:
            variants["cb"] = partial(b.memcpy, dst, src, SEGMENT, s)
            variants["cb-obj"] = partial(b.memcpy, dst, src, SEGMENT, s_obj)
        every = max(1, QUEUED_OPS // len(variants))
        case = {"call": "cudaMemcpyAsync", "segments": 1, "direction": direction}
        rows += rows_of(case, measure(variants, repeats, every, sync))

    # cudaEventRecord, then cudaStreamWaitEvent on another stream (the engine's _join).
    ct_event = ct.event()
    cb_event = b.event() if b is not None else None
    cb_event_int = int(cb_event) if cb_event is not None else 0
    variants = {"ctypes": partial(ct.record, ct_event, s)}
    if b is not None:
        variants["cb"] = partial(b.record, cb_event_int, s)
        variants["cb-obj"] = partial(b.record, cb_event, s_obj)
    every = max(1, QUEUED_OPS // len(variants))
    rows += rows_of({"call": "cudaEventRecord"}, measure(variants, repeats, every, sync))

    def record_all() -> None:
        ct.record(ct_event, s)
        if b is not None:
            b.record(cb_event, s_obj)

    variants = {"ctypes": partial(ct.wait, s2, ct_event)}
    if b is not None:
        variants["cb"] = partial(b.wait, s2, cb_event_int)
        variants["cb-obj"] = partial(b.wait, s2_obj, cb_event)
    rows += rows_of(
        {"call": "cudaStreamWaitEvent"},
        measure(variants, repeats, every, sync, before_step=record_all),
    )

    # cudaMemcpyBatchAsync.
    for n in BATCH_SEGMENTS:
        tensor = n > SMALL_SEGMENTS
        steps = repeats if n <= SMALL_SEGMENTS else max(50, repeats // 4)
        for direction in ("D2H", "H2D"):
            lists = bufs.addresses(n, to_host=direction == "D2H")
            eng = engine_form(lists, tensor=tensor)
            variants = {"ctypes": partial(ct.copy_segments, eng[0], eng[1], eng[2], s)}
            if b is not None:
                variants["cb"] = partial(b.copy_segments, eng[0], eng[1], eng[2], s)
                variants["cb-obj"] = partial(b.copy_lists, lists[0], lists[1], lists[2], n, s_obj)

                def convert(eng: tuple[Addresses, ...] = eng) -> None:
                    for a in eng:
                        a.tolist()

                variants["convert"] = convert
            calls = sum(1 for name in variants if name != "convert")
            every = max(1, QUEUED_OPS // (calls * n))
            case = {
                "call": "cudaMemcpyBatchAsync",
                "segments": n,
                "direction": direction,
                "address_form": "int64 tensor" if tensor else "array('Q')",
                "convert_needed": tensor,
            }
            rows += rows_of(case, measure(variants, steps, every, sync))

    sync()
    ct.destroy(ct_event)
    if b is not None:
        b.destroy(cb_event)
    bufs.close()
    return {"status": "ok", **meta, "checks": checks, "results": rows}


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'call':<22}{'segs':>5} {'dir':<4}{'variant':<9}{'p50 us':>9}{'p90 us':>9}"
    lines = [head + f"{'x p50':>7}{'x p90':>7}"]
    for r in rows:
        ratio = f"{r['ratio_p50']:>7.2f}{r['ratio_p90']:>7.2f}" if "ratio_p50" in r else " " * 14
        lines.append(
            f"{r['call']:<22}{r.get('segments', ''):>5} {r.get('direction', ''):<4}"
            f"{r['variant']:<9}{r['p50_us']:>9.2f}{r['p90_us']:>9.2f}{ratio}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=2000, help="timed calls per variant")
    parser.add_argument(
        "--out",
        help="JSON output (default: $OUT/cuda-runtime-binding.json where OUT is set, "
        "else nothing is written)",
    )
    parser.add_argument("--quick", action="store_true", help="200 repeats: a smoke run")
    args = parser.parse_args()
    repeats = 200 if args.quick else args.repeats
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = str(Path(os.environ["OUT"]) / "cuda-runtime-binding.json")

    t0 = time.perf_counter()
    if not torch.cuda.is_available():
        why = (
            f"torch {torch.__version__} is built without CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible"
        )
        result: dict[str, Any] = {"status": "skipped", "reason": f"no GPU: {why}"}
    else:
        result = run(repeats)
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    text = json.dumps(result, indent=1)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    if result["status"] != "ok":
        print(text)
        sys.exit(0 if result["status"] == "skipped" else 1)
    print(json.dumps({k: v for k, v in result.items() if k != "results"}, indent=1))
    print(table(result["results"]))


if __name__ == "__main__":
    main()
