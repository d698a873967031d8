"""The CUDA backend: registers host chunks with the CUDA driver (page-locked, mapped).

By default it registers from a CUDA context of asyncpin's own on the device
(``asyncpin._cudactx``: ``cuMemHostRegister`` portable and mapped, made current for the
call only), so that a running model's launches are not held up while a chunk is
registered and a close does not wait for the model's kernels once per chunk. What it
pins is pinned for every context: torch's copies and device code see it as they would
memory registered in their own. ``CudaBackend(own_context=False)`` registers in the
calling thread's runtime context instead (``cudaHostRegister``, torch's primary
context), as before; so does the default where the driver refuses a second context.

Calls go through ctypes, the GIL released for the call. Every return code is checked; a
failure is turned into a BackendCallError carrying the CUDA error's name and text, and
the runtime's last-error slot is cleared so the failure cannot surface later inside an
unrelated torch call as something else.
"""

from __future__ import annotations

import threading
import time

import structlog
import torch

from asyncpin._cudactx import PinContext, pin_context
from asyncpin._cudart import cuda_error_name, cudart
from asyncpin.errors import BackendCallError, BackendUnavailableError, describe_error

__all__ = ["CUDA_MAX_PIN_BYTES", "CudaBackend"]

# One cudaHostRegister of 512 GiB or more fails on recent drivers; stay well below.
CUDA_MAX_PIN_BYTES = 256 << 30
_REGISTER_DEFAULT = 0


class CudaBackend:
    """Registers chunks with the CUDA driver so that DMA can read and write them."""

    __slots__ = ("_context", "_context_lock", "_device", "_lib", "_own_context")
    name = "cuda"
    max_pin_bytes = CUDA_MAX_PIN_BYTES
    # What it pins, device code may read and write through unified addressing
    # (``EngineSetup.host_registered``).
    registers_with_cuda = True

    def __init__(self, device: int | None = None, *, own_context: bool = True) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError("cuda", "torch.cuda.is_available() is False")
        self._device = torch.cuda.current_device() if device is None else int(device)
        if not 0 <= self._device < torch.cuda.device_count():
            raise BackendUnavailableError(
                "cuda",
                f"device {self._device} does not exist ({torch.cuda.device_count()} visible)",
            )
        self._lib = cudart()
        self._own_context = bool(own_context)
        self._context: PinContext | None = None
        self._context_lock = threading.Lock()

    @property
    def device(self) -> int:
        return self._device

    @property
    def own_context(self) -> bool:
        """Whether chunks are registered from asyncpin's own context (False where it was
        not asked for, or the driver refused to make it)."""
        return self._own_context

    def _pin_context(self) -> PinContext | None:
        if not self._own_context:
            return None
        with self._context_lock:
            if self._context is None and self._own_context:
                t0 = time.perf_counter()
                try:
                    self._context = pin_context(self._device)
                    structlog.get_logger("asyncpin").debug(
                        "pin.own_context", device=self._device, seconds=time.perf_counter() - t0
                    )
                except Exception as exc:  # no libcuda, a driver without these calls...
                    # Registering in the runtime's context still works, with its costs.
                    self._own_context = False
                    structlog.get_logger("asyncpin").warning(
                        "pin.own_context_unavailable",
                        device=self._device,
                        error=describe_error(exc),
                    )
            return self._context

    def warm_up(self) -> None:
        """Make the pin context now: a manager calls this before it faults or pins
        anything, and before its CUDA engine's first set-up begins (on the H200 the
        context took 0.11-0.14 s made so, against 0.8-1.5 s beside either). It never
        raises: a context the driver refuses leaves the runtime's (``own_context``
        False)."""
        self._pin_context()

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
        context = self._pin_context()
        if context is not None:
            context.register(address, nbytes)
        else:
            self._call("cudaHostRegister", "cudaHostRegister", address, nbytes, _REGISTER_DEFAULT)

    def unpin(self, address: int, nbytes: int) -> None:
        # A chunk is unregistered where it was registered: the context is made before the
        # first pin, and the fallback happens only then.
        context = self._context
        if context is not None:
            context.unregister(address)
        else:
            self._call("cudaHostUnregister", "cudaHostUnregister", address)

    def before_unpin(self) -> None:
        """Wait for the device work queued so far, once before a close's unpins: an
        unregister in the runtime's context waits for it each time, and one from asyncpin's
        own context does not, so a copy that code outside the manager queued on a view
        (close waits for the manager's own transfers) must be over before its pages are
        released."""
        if self._context is None:
            return
        if self._lib is not None:
            self._call("cudaDeviceSynchronize", "cudaDeviceSynchronize")
        else:
            torch.cuda.synchronize(self._device)

    def __repr__(self) -> str:
        where = "own context" if self._context is not None else "runtime context"
        return f"<CudaBackend device={self._device} {where}>"
