"""Backends: the platform calls that pin and unpin host memory.

The pin scheduler calls a backend from worker threads, one chunk per call. A backend
raises :class:`~asyncpin.errors.BackendCallError` for a failed call; the scheduler maps it
to a :class:`~asyncpin.errors.PinError` naming the chunk. ``cuda`` is imported lazily so
that a machine with no GPU never initialises CUDA.
"""

from __future__ import annotations

import errno
import inspect
import numbers

from asyncpin import _sys
from asyncpin._text import shown
from asyncpin.abc import PinBackend
from asyncpin.errors import BackendCallError, BackendUnavailableError, ConfigError, PreflightError

__all__ = [
    "BACKEND_NAMES",
    "HostBackend",
    "PinBackend",
    "cuda_available",
    "registers_with_cuda",
    "resolve_backend",
]

BACKEND_NAMES = ("auto", "host", "cuda")


class HostBackend:
    """Pins with ``mlock``/``munlock``: a real pin, bounded by RLIMIT_MEMLOCK unless the
    process holds CAP_IPC_LOCK. For machines with no GPU."""

    __slots__ = ()
    name = "host"
    max_pin_bytes = 1 << 62

    def preflight(self, nbytes: int) -> None:
        limit = _sys.memlock_limit_bytes()
        if limit is None or _sys.has_cap_ipc_lock():
            return
        locked = _sys.vm_locked_bytes()
        if locked + nbytes > limit:
            raise PreflightError(
                "memlock",
                nbytes,
                max(limit - locked, 0),
                f"RLIMIT_MEMLOCK is {limit} bytes with {locked} already locked; raise it "
                "(`ulimit -l unlimited`, LimitMEMLOCK=infinity in a systemd unit, "
                "`--ulimit memlock=-1` for docker, or /etc/security/limits.conf), "
                "grant CAP_IPC_LOCK, or ask for a smaller buffer",
            )

    def pin(self, address: int, nbytes: int) -> None:
        limit = _sys.memlock_limit_bytes()
        if limit is not None and _sys.has_cap_ipc_lock():
            limit = None  # no limit binds
        locked = _sys.vm_locked_bytes() if limit is not None else 0
        try:
            _sys.libc_mlock(address, nbytes)
        except _sys.LibcError as exc:
            text = str(exc)
            if exc.errno == errno.ENOMEM and limit is not None and locked + nbytes > limit:
                # The pre-flight passed; what else this process locked since took the room
                # (another manager pinning at once, say).
                text += (
                    f": RLIMIT_MEMLOCK is {limit} bytes with {locked} locked by this process "
                    "before this call; raise it (`ulimit -l unlimited`) or grant CAP_IPC_LOCK"
                )
            raise BackendCallError("mlock", exc.errno or 0, exc.code_name, text) from exc

    def unpin(self, address: int, nbytes: int) -> None:
        try:
            _sys.libc_munlock(address, nbytes)
        except _sys.LibcError as exc:
            raise BackendCallError("munlock", exc.errno or 0, exc.code_name, str(exc)) from exc

    def __repr__(self) -> str:
        return "<HostBackend mlock>"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


def registers_with_cuda(backend: object) -> bool:
    """Whether ``backend`` says that what it pins is registered with CUDA (its class sets
    ``registers_with_cuda = True``, as :class:`~asyncpin.cuda.CudaBackend` does): device
    code may then read and write the pinned chunks. False for None and for any backend
    that does not say so."""
    return getattr(backend, "registers_with_cuda", False) is True


def resolve_backend(backend: str | PinBackend, device: int | None = None) -> PinBackend:
    """Turn a name (``auto``, ``host``, ``cuda``) or a backend instance into a backend.
    ``device``: None (the current one) or a device index, whatever the backend."""
    if device is not None:
        # Any integer type (NumPy's too), never a bool or a tensor.
        if isinstance(device, bool) or not isinstance(device, numbers.Integral) or device < 0:
            raise ConfigError(
                f"device must be None or a device index (an int >= 0), got {shown(device)}"
            )
        device = int(device)
    if not isinstance(backend, str):
        if not isinstance(backend, PinBackend):
            raise ConfigError(f"backend {backend!r} does not implement PinBackend")
        validate_hooks(backend)
        return backend
    if backend == "auto":
        backend = "cuda" if cuda_available() else "host"
    if backend == "host":
        return HostBackend()
    if backend == "cuda":
        if not cuda_available():
            raise BackendUnavailableError("cuda", "torch.cuda.is_available() is False")
        from asyncpin.cuda import CudaBackend

        return CudaBackend(device)
    raise ConfigError(f"unknown backend {backend!r}: use one of {', '.join(BACKEND_NAMES)}")


#: A backend's optional hooks: ``warm_up()`` before the first pin, ``before_unpin()``
#: before a close's first unpin (``abc.PinBackend``).
HOOKS = ("warm_up", "before_unpin")


def validate_hooks(backend: PinBackend) -> None:
    """A backend's optional ``warm_up`` and ``before_unpin`` must be plain methods (they
    are called in worker threads): anything else is refused now, not skipped later."""
    for name in HOOKS:
        try:
            hook = getattr(backend, name, None)
        except Exception as exc:
            raise ConfigError(f"backend {backend!r}: reading {name} raised {exc!r}") from exc
        if hook is None:
            continue
        if (
            not callable(hook)
            or inspect.iscoroutinefunction(hook)
            or inspect.isasyncgenfunction(hook)
            or inspect.isgeneratorfunction(hook)
        ):
            raise ConfigError(
                f"backend {backend!r}: {name} must be a plain method (a def, not async, not a "
                f"generator, taking no argument), not {hook!r}"
            )
        try:
            inspect.signature(hook).bind()
        except TypeError as exc:
            raise ConfigError(f"backend {backend!r}: {name} must take no argument ({exc})") from exc
        except ValueError:  # no signature to read (a builtin): it is called as it is
            pass


def call_hook(backend: object, name: str) -> BaseException | None:
    """Call ``backend.<name>()`` if it has one (in a worker thread); returns what it
    raised, or None. It never raises itself: whatever the hook does, the pins or unpins
    that follow it must run. An awaitable returned is closed and reported as an error."""
    try:
        hook = getattr(backend, name, None)
        if hook is None:
            return None
        result = hook()
        if inspect.isawaitable(result) or inspect.isgenerator(result) or inspect.isasyncgen(result):
            if inspect.iscoroutine(result) or inspect.isgenerator(result):
                result.close()
            raise TypeError(f"{name}() returned {result!r}: it must be a plain method")
    except BaseException as exc:  # a backend's bug must not end a close nor pinning
        return exc
    return None
