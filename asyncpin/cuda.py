"""The CUDA backend: page-locks host chunks with cudaHostRegister / cudaHostUnregister.

Calls go through ctypes into the libcudart that torch has loaded (same runtime, same
context, GIL released for the call). Every return code is checked; a failure is turned
into a BackendCallError carrying the CUDA error's name and text, and the runtime's
last-error slot is cleared so the failure cannot surface later inside an unrelated torch
call as something else.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from asyncpin.errors import BackendCallError, BackendUnavailableError

__all__ = ["CUDA_MAX_PIN_BYTES", "CudaBackend", "cuda_error_name"]

# One cudaHostRegister of 512 GiB or more fails on recent drivers; stay well below.
CUDA_MAX_PIN_BYTES = 256 << 30
_REGISTER_DEFAULT = 0

# Names for the codes this backend meets, used when the runtime cannot be asked.
_KNOWN_ERRORS = {
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


def _cudart() -> ctypes.CDLL | None:
    global _lib, _lib_searched
    with _lib_lock:
        if not _lib_searched:
            torch.cuda.init()
            _lib = _find_libcudart()
            _lib_searched = True
        return _lib


def cuda_error_name(code: int) -> tuple[str, str]:
    """The symbolic name and description of a CUDA runtime error code."""
    lib = _cudart()
    if lib is not None:
        name = lib.cudaGetErrorName(code)
        text = lib.cudaGetErrorString(code)
        return (name.decode() if name else f"cudaError{code}", text.decode() if text else "")
    return _KNOWN_ERRORS.get(code, f"cudaError{code}"), ""


class CudaBackend:
    """Registers chunks with the CUDA driver so that DMA can read and write them."""

    __slots__ = ("_device", "_lib")
    name = "cuda"
    max_pin_bytes = CUDA_MAX_PIN_BYTES

    def __init__(self, device: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError("cuda", "torch.cuda.is_available() is False")
        self._device = torch.cuda.current_device() if device is None else int(device)
        if not 0 <= self._device < torch.cuda.device_count():
            raise BackendUnavailableError(
                "cuda",
                f"device {self._device} does not exist ({torch.cuda.device_count()} visible)",
            )
        self._lib = _cudart()

    @property
    def device(self) -> int:
        return self._device

    def preflight(self, nbytes: int) -> None:
        # Registration is not bound by RLIMIT_MEMLOCK; available memory is checked by
        # the manager for every backend.
        return None

    def _call(self, op: str, fn_name: str, *args: int) -> None:
        # Worker threads start on device 0; the registration belongs to our device. Through
        # ctypes the GIL is released: a driver call that waits on a lock must not hold it.
        if self._lib is not None:
            self._lib.cudaSetDevice(self._device)
            fn = getattr(self._lib, fn_name)
            code = int(fn(*args))
            if code != 0:
                self._lib.cudaGetLastError()  # consume it: it must not resurface later
        else:
            torch.cuda.set_device(self._device)
            code = int(getattr(torch.cuda.cudart(), fn_name)(*args))
        if code != 0:
            name, text = cuda_error_name(code)
            raise BackendCallError(op, code, name, text or f"{fn_name} returned {code}")

    def pin(self, address: int, nbytes: int) -> None:
        self._call("cudaHostRegister", "cudaHostRegister", address, nbytes, _REGISTER_DEFAULT)

    def unpin(self, address: int, nbytes: int) -> None:
        self._call("cudaHostUnregister", "cudaHostUnregister", address)

    def __repr__(self) -> str:
        return f"<CudaBackend device={self._device}>"
