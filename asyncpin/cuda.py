"""The CUDA backend: page-locks host chunks with cudaHostRegister / cudaHostUnregister.

Calls go through ctypes (``asyncpin._cudart``) into the libcudart that torch has loaded
(same runtime, same context, GIL released for the call). Every return code is checked; a
failure is turned into a BackendCallError carrying the CUDA error's name and text, and
the runtime's last-error slot is cleared so the failure cannot surface later inside an
unrelated torch call as something else.
"""

from __future__ import annotations

import torch

from asyncpin._cudart import cuda_error_name, cudart
from asyncpin.errors import BackendCallError, BackendUnavailableError

__all__ = ["CUDA_MAX_PIN_BYTES", "CudaBackend"]

# One cudaHostRegister of 512 GiB or more fails on recent drivers; stay well below.
CUDA_MAX_PIN_BYTES = 256 << 30
_REGISTER_DEFAULT = 0


class CudaBackend:
    """Registers chunks with the CUDA driver so that DMA can read and write them."""

    __slots__ = ("_device", "_lib")
    name = "cuda"
    max_pin_bytes = CUDA_MAX_PIN_BYTES
    # What it pins, device code may read and write through unified addressing
    # (``EngineSetup.host_registered``).
    registers_with_cuda = True

    def __init__(self, device: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError("cuda", "torch.cuda.is_available() is False")
        self._device = torch.cuda.current_device() if device is None else int(device)
        if not 0 <= self._device < torch.cuda.device_count():
            raise BackendUnavailableError(
                "cuda",
                f"device {self._device} does not exist ({torch.cuda.device_count()} visible)",
            )
        self._lib = cudart()

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
