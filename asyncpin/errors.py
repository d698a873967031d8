"""The exception family of asyncpin.

Every error subclasses :class:`AsyncpinError` and the closest builtin, and carries
the fields a caller needs to act on it. Use after close raises anyio's
``ClosedResourceError`` instead (it is not an asyncpin error: the caller closed it).
"""

from __future__ import annotations

__all__ = [
    "AsyncpinError",
    "BackendCallError",
    "BackendUnavailableError",
    "ConfigError",
    "ForkedManagerError",
    "InvalidTransferError",
    "LifecycleError",
    "PinError",
    "PreflightError",
    "RegionNotFoundError",
    "TransferError",
]


class AsyncpinError(Exception):
    """Base of every error asyncpin raises."""


class ConfigError(AsyncpinError, ValueError):
    """An argument is out of range or of the wrong kind; nothing was mapped or pinned."""


class PreflightError(AsyncpinError, OSError):
    """A check before mapping found the machine cannot serve the request.

    ``check`` names the check (``memlock``, ``memory``, ``shm``...), ``needed`` and
    ``available`` are in bytes, and the message says what to change.
    """

    def __init__(self, check: str, needed: int, available: int, fix: str) -> None:
        self.check = check
        self.needed = needed
        self.available = available
        self.fix = fix
        super().__init__(
            f"pre-flight check {check!r} failed: {needed} bytes needed, "
            f"{available} bytes available; {fix}"
        )


class RegionNotFoundError(AsyncpinError, FileNotFoundError):
    """Attaching to a shared region by a name that no process has created."""

    def __init__(self, name: str, path: str) -> None:
        self.name = name
        self.path = path
        super().__init__(f"no shared region named {name!r} ({path} does not exist)")


class BackendUnavailableError(AsyncpinError, RuntimeError):
    """The backend asked for cannot run on this machine (no GPU, no CUDA runtime...)."""

    def __init__(self, backend: str, reason: str) -> None:
        self.backend = backend
        self.reason = reason
        super().__init__(f"backend {backend!r} is unavailable: {reason}")


class BackendCallError(AsyncpinError, OSError):
    """One call into the platform (mlock, cudaHostRegister...) returned an error.

    ``code`` is the errno or CUDA error number, ``code_name`` its symbolic name.
    """

    def __init__(self, op: str, code: int, code_name: str, detail: str) -> None:
        self.op = op
        self.code = code
        self.code_name = code_name
        self.detail = detail
        super().__init__(f"{op} failed with {code_name} ({code}): {detail}")


class PinError(AsyncpinError, RuntimeError):
    """Pinning a chunk of the host region failed; the cause is chained.

    ``chunk_index``, ``offset`` and ``nbytes`` locate the chunk inside the region;
    ``code`` and ``code_name`` come from the failing platform call when there was one.
    """

    def __init__(
        self,
        chunk_index: int,
        offset: int,
        nbytes: int,
        code: int | None,
        code_name: str | None,
        reason: str,
    ) -> None:
        self.chunk_index = chunk_index
        self.offset = offset
        self.nbytes = nbytes
        self.code = code
        self.code_name = code_name
        self.reason = reason
        code_part = f" [{code_name} ({code})]" if code_name is not None else ""
        super().__init__(
            f"pinning chunk {chunk_index} (offset {offset}, {nbytes} bytes) failed"
            f"{code_part}: {reason}"
        )


class TransferError(AsyncpinError, RuntimeError):
    """A KV block transfer failed on the device, or its host blocks could not be pinned.

    ``direction`` (``store`` or ``load``) and ``method`` (``batch``, ``pack``...) say
    which transfer; ``code`` and ``code_name`` carry the failing platform call's error
    (a CUDA error number and name) when there was one. The original error is chained.
    """

    def __init__(
        self,
        message: str,
        *,
        direction: str | None = None,
        method: str | None = None,
        code: int | None = None,
        code_name: str | None = None,
    ) -> None:
        self.direction = direction
        self.method = method
        self.code = code
        self.code_name = code_name
        super().__init__(message)


class InvalidTransferError(TransferError, ValueError):
    """A transfer was refused before anything was enqueued: ids out of range, lengths that
    differ, duplicate destinations, ids on a device or of a non-integer dtype."""


class LifecycleError(AsyncpinError, RuntimeError):
    """A call refused because it cannot work where it was made: closing inside a hold
    that the close itself would wait for (``pinning_paused()``, ``capture_gate()``), or
    from an event loop other than the one that opened the manager; a store or load while
    the caller's current stream captures a CUDA graph. Nothing changed: the manager can
    be closed once the hold is released, or from its own loop; the transfer called
    before or after the capture."""


class ForkedManagerError(LifecycleError):
    """A manager used in a process forked from the one that opened it. Its region is the
    parent's (not mapped in the child: ``MADV_DONTFORK``), and so are its pins; the child
    must open its own manager."""


def describe_error(exc: BaseException) -> str:
    """``str(exc)`` for a log line; the type's name where that is empty or raises
    (whatever it raises): describing a backend's error must never be what fails."""
    try:
        text = str(exc)
    except BaseException:
        return f"<{type(exc).__name__}; str() raised>"
    return text or type(exc).__name__
