"""asyncpin's own CUDA context, one per device, for registering host memory.

The one module that reaches the CUDA driver (libcuda) through ctypes. Registering and
unregistering host memory in the application's context (torch's primary context) holds
up every other thread's kernel launches for as long as the call runs, and each
unregister waits for the whole device to go idle first (measured on the H200:
``bench/probes/register_sync.py``, ``bench/probes/register_context.py``). Made from a
context of its own, a registration is the same to the application's context (portable
and mapped: pinned for every copy, readable by device code at its host address), but
launches elsewhere go on while it runs and an unregister does not wait for the
application's kernels.

The context is made on first use, in the calling (worker) thread, and kept for the
life of the process, like the primary context; it is made current only for the call
(pushed, then popped), so that no thread's own current context ever changes. Its cost:
the device memory one context takes (``bench/RESULTS.md#startup``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

from asyncpin._cudart import KNOWN_ERRORS, cuda_error_name
from asyncpin.errors import BackendCallError

__all__ = ["PinContext", "pin_context"]

# cuMemHostRegister flags: pinned for every context, mapped into the device's address
# space (device code reads it at its host address under unified addressing).
_PORTABLE = 0x1
_DEVICEMAP = 0x2
REGISTER_FLAGS = _PORTABLE | _DEVICEMAP


def _load_driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuInit.argtypes = [ctypes.c_uint]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuCtxCreate_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int]
    lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuCtxDestroy_v2.argtypes = [ctypes.c_void_p]
    return lib


class PinContext:
    """A driver context on one device; :meth:`call` runs a driver call inside it."""

    __slots__ = ("_handle", "_lib", "device")

    def __init__(self, lib: ctypes.CDLL, device: int) -> None:
        self._lib = lib
        self.device = device
        _check("cuInit", lib.cuInit(0))
        dev = ctypes.c_int()
        _check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device))
        handle = ctypes.c_void_p()
        # cuCtxCreate makes the new context current to this thread: pop it at once.
        _check("cuCtxCreate", lib.cuCtxCreate_v2(ctypes.byref(handle), 0, dev))
        popped = int(lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())))
        if popped != 0:
            lib.cuCtxDestroy_v2(handle)  # and so no longer current to this thread
            _check("cuCtxPopCurrent", popped)
        self._handle = handle

    def call(
        self, op: str, fn: Callable[..., int], *args: int, undo: Callable[[], int] | None = None
    ) -> None:
        """``fn(*args)`` with this context current to the calling thread, then the
        thread's own current context back; raises BackendCallError if either fails (the
        call's own error first). Where the call worked but the context could not be
        taken off the thread, ``undo()`` runs (still in the context) and the error is
        raised only if it returned 0: a pin that raises has pinned nothing, and one that
        could not be undone counts as done (its unpin comes at close)."""
        _check("cuCtxPushCurrent", self._lib.cuCtxPushCurrent_v2(self._handle))
        code = -1
        try:
            code = int(fn(*args))
        finally:
            popped = int(self._lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())))
            if popped != 0 and code == 0 and undo is not None and int(undo()) != 0:
                popped = 0
        _check(op, code)
        _check("cuCtxPopCurrent", popped)

    def register(self, address: int, nbytes: int) -> None:
        self.call(
            "cuMemHostRegister",
            self._lib.cuMemHostRegister_v2,
            address,
            nbytes,
            REGISTER_FLAGS,
            undo=lambda: self._lib.cuMemHostUnregister(address),
        )

    def unregister(self, address: int) -> None:
        self.call("cuMemHostUnregister", self._lib.cuMemHostUnregister, address)


def _check(op: str, code: int) -> None:
    if code != 0:
        name, text = _error_name(code)
        raise BackendCallError(op, code, name, text or f"{op} returned {code}")


def _error_name(code: int) -> tuple[str, str]:
    """The driver's codes for these calls are the runtime's (712: already registered,
    713: not registered, 2: out of memory...): named alike, by the runtime where it can
    be asked, else from the names asyncpin knows. Naming never hides the error."""
    try:
        return cuda_error_name(code)
    except Exception:
        return KNOWN_ERRORS.get(code, f"cudaError{code}"), ""


_lock = threading.Lock()
_contexts: dict[int, PinContext] = {}


def pin_context(device: int) -> PinContext:
    """The process's pin context on ``device``, made on first use (134-160 ms on the
    H200 with the device idle, up to a second with a model starting beside it: call it
    from a worker thread). Raises BackendCallError, or OSError when libcuda cannot be
    loaded, if it cannot be made; a later call tries again."""
    with _lock:
        context = _contexts.get(device)
        if context is None:
            context = _contexts[device] = PinContext(_load_driver(), device)
        return context


def _forget_in_child() -> None:
    """A forked child has none of its parent's contexts (nor CUDA); and the lock may
    have been held by a parent's thread at the fork."""
    global _lock
    _lock = threading.Lock()
    _contexts.clear()


os.register_at_fork(after_in_child=_forget_in_child)
