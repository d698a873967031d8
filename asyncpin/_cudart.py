"""The one module that reaches libcudart through ctypes: the library torch loaded, CUDA
error names, and the runtime calls the CUDA engine makes.

Calls go into the libcudart that torch has loaded (same runtime, same context, GIL
released for the call). A failed call raises :class:`~asyncpin.errors.BackendCallError`
with the CUDA error's code and name, and the runtime's last-error slot is cleared so the
failure cannot surface later inside an unrelated torch call as something else.
"""

from __future__ import annotations

import array
import ctypes
import threading
from pathlib import Path
from typing import Any, Union

import torch

from asyncpin.errors import BackendCallError, BackendUnavailableError

__all__ = [
    "Addresses",
    "MemLocation",
    "MemcpyAttributes",
    "Runtime",
    "batch_copy_available",
    "cuda_error_name",
    "cudart",
]

# Names for the codes asyncpin meets, used when the runtime cannot be asked.
KNOWN_ERRORS = {
    0: "cudaSuccess",
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",
    3: "cudaErrorInitializationError",
    4: "cudaErrorCudartUnloading",
    101: "cudaErrorInvalidDevice",
    201: "cudaErrorDeviceUninitialized",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered",
    801: "cudaErrorNotSupported",
    900: "cudaErrorStreamCaptureUnsupported",
    901: "cudaErrorStreamCaptureInvalidated",
    906: "cudaErrorStreamCaptureImplicit",
}

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from UVA
_EVENT_DISABLE_TIMING = 2
_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit order with the legacy stream

# Address arrays for a batched copy: int64 tensors, or array("Q") for small transfers.
Addresses = Union[torch.Tensor, "array.array[int]"]


def _find_libcudart() -> ctypes.CDLL | None:
    """The libcudart torch loaded (found in /proc/self/maps), or None if it is static."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "libcudart.so" in path:
            lib = ctypes.CDLL(path)
            lib.cudaGetErrorName.restype = ctypes.c_char_p
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cudaSetDevice.argtypes = [ctypes.c_int]
            return lib
    return None


_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_searched = False


def cudart() -> ctypes.CDLL | None:
    """The libcudart torch loaded (CUDA initialised first), or None if it is static."""
    global _lib, _lib_searched
    with _lib_lock:
        if not _lib_searched:
            torch.cuda.init()
            _lib = _find_libcudart()
            _lib_searched = True
        return _lib


def _error_name(lib: Any, code: int) -> tuple[str, str]:
    if lib is not None:
        name = lib.cudaGetErrorName(code)
        text = lib.cudaGetErrorString(code)
        return (name.decode() if name else f"cudaError{code}", text.decode() if text else "")
    return KNOWN_ERRORS.get(code, f"cudaError{code}"), ""


def cuda_error_name(code: int) -> tuple[str, str]:
    """The symbolic name and description of a CUDA runtime error code."""
    return _error_name(cudart(), code)


def _pointer(addresses: Addresses) -> int:
    if isinstance(addresses, torch.Tensor):
        return addresses.data_ptr()
    return addresses.buffer_info()[0]


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


class Runtime:
    """The libcudart calls the engine makes, bound once through ctypes."""

    def __init__(self) -> None:
        lib = cudart()
        if lib is None:
            raise BackendUnavailableError("cuda", "libcudart is not loaded as a shared library")
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
        # src order "stream" (1); prefer overlap with compute (1): leave the SMs alone.
        self.attrs = MemcpyAttributes(1, MemLocation(0, 0), MemLocation(0, 0), 1)
        # src order "during the API call" (2): the driver reads the source before returning.
        self.upload_attrs = MemcpyAttributes(2, MemLocation(0, 0), MemLocation(0, 0), 1)
        self.attr_index = (ctypes.c_size_t * 1)(0)

    def copy_segments(
        self, dsts: Addresses, srcs: Addresses, sizes: Addresses, stream: int
    ) -> None:
        """Enqueue ``len(dsts)`` copies (arrays of 64-bit addresses and sizes)."""
        count = len(dsts)
        if count == 0:
            return
        if self.batch is not None:
            self._batch_call(dsts, srcs, sizes, self.attrs, stream)
            return
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            code = self.lib.cudaMemcpyAsync(dst, src, size, _MEMCPY_DEFAULT, stream)
            self.check("cudaMemcpyAsync", code)

    def upload(self, dst: int, src: array.array[int], stream: int) -> None:
        """Copy ``src``, in pageable host memory, to device address ``dst`` in ``stream``'s
        order. The driver reads ``src`` before returning (its "during the API call" source
        order), so no pinned buffer is needed and ``src`` may be reused at once. Needs the
        batched call (``self.batch``)."""
        address, count = src.buffer_info()
        nbytes = count * src.itemsize
        self._batch_call(
            array.array("Q", [dst]),
            array.array("Q", [address]),
            array.array("Q", [nbytes]),
            self.upload_attrs,
            stream,
        )

    def _batch_call(
        self,
        dsts: Addresses,
        srcs: Addresses,
        sizes: Addresses,
        attrs: MemcpyAttributes,
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
        self.check("cudaMemcpyBatchAsync", self.batch(*args))

    def event(self) -> int:
        """A raw event for ordering streams (no timing, so recording it is cheap)."""
        handle = ctypes.c_void_p()
        code = self.lib.cudaEventCreateWithFlags(ctypes.byref(handle), _EVENT_DISABLE_TIMING)
        self.check("cudaEventCreateWithFlags", code)
        return int(handle.value or 0)

    def stream(self) -> int:
        """A stream of the caller's own, made on the current device and non-blocking, as
        torch's are. ``torch.cuda.Stream()`` hands out the streams of a pool of 32 per
        priority, in turn, to whoever asks: another of the process's threads may get
        the same stream for its model's work or for a graph capture, whose sequence
        would then take in the engine's copies (and fail them, and break the capture)."""
        handle = ctypes.c_void_p()
        code = self.lib.cudaStreamCreateWithFlags(ctypes.byref(handle), _STREAM_NON_BLOCKING)
        self.check("cudaStreamCreateWithFlags", code)
        return int(handle.value or 0)

    def record(self, event: int, stream: int) -> None:
        self.check("cudaEventRecord", self.lib.cudaEventRecord(event, stream))

    def wait(self, stream: int, event: int) -> None:
        """Work queued on ``stream`` from now on waits for ``event``'s latest record (the
        one made before this call: recording the event again later changes nothing)."""
        self.check("cudaStreamWaitEvent", self.lib.cudaStreamWaitEvent(stream, event, 0))

    def capturing(self, stream: int) -> bool:
        """Whether ``stream`` is capturing a CUDA graph (or its capture was invalidated and
        not yet ended). A query the runtime refuses (the legacy stream while another
        thread captures in global mode) answers False, its error cleared."""
        status = ctypes.c_int(0)
        code = self.lib.cudaStreamIsCapturing(ctypes.c_void_p(stream), ctypes.byref(status))
        if code != 0:
            self.lib.cudaGetLastError()
            return False
        return status.value != 0  # cudaStreamCaptureStatusNone is 0

    def destroy(self, event: int) -> None:
        self.lib.cudaEventDestroy(event)  # released once pending work no longer needs it

    def check(self, op: str, code: int) -> None:
        """Raise :class:`~asyncpin.errors.BackendCallError` for a failed call's ``code``."""
        if code != 0:
            self.lib.cudaGetLastError()  # consume it: it must not resurface later
            name, text = _error_name(self.lib, code)
            raise BackendCallError(op, code, name, text or f"{op} returned {code}")


def batch_copy_available() -> bool:
    """Whether the CUDA runtime has cudaMemcpyBatchAsync (12.8 and later)."""
    return Runtime().batch is not None
