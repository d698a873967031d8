"""asyncpin: a pinned host-memory tier for LLM KV caches, embedded in async servers.

``import asyncpin`` imports no torch: the names that need it (``OffloadManager``,
``KVLayout``, ``Transfer``, ``ChunkState``, ``DEFAULT_CHUNK_BYTES``) are imported on first
use (PEP 562), so a process that runs only the block index (``asyncpin.tier.index``), such
as an engine's scheduler, never imports torch. ``from asyncpin import OffloadManager``
works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from asyncpin._lifecycle import ManagerState
from asyncpin.backends import HostBackend, PinBackend
from asyncpin.errors import (
    AsyncpinError,
    BackendCallError,
    BackendUnavailableError,
    ConfigError,
    ForkedManagerError,
    InvalidTransferError,
    LifecycleError,
    PinError,
    PreflightError,
    RegionNotFoundError,
    TransferError,
)
from asyncpin.gate import capture_gate, install_capture_gate
from asyncpin.stats import ManagerStats, TierStats

if TYPE_CHECKING:
    from asyncpin._config import DEFAULT_CHUNK_BYTES
    from asyncpin.chunks import ChunkState
    from asyncpin.kv import KVLayout
    from asyncpin.manager import OffloadManager
    from asyncpin.transfers import Transfer

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "AsyncpinError",
    "BackendCallError",
    "BackendUnavailableError",
    "ChunkState",
    "ConfigError",
    "ForkedManagerError",
    "HostBackend",
    "InvalidTransferError",
    "KVLayout",
    "LifecycleError",
    "ManagerState",
    "ManagerStats",
    "OffloadManager",
    "PinBackend",
    "PinError",
    "PreflightError",
    "RegionNotFoundError",
    "TierStats",
    "Transfer",
    "TransferError",
    "capture_gate",
    "install_capture_gate",
]

# The names that import torch, by the module that defines them.
_LAZY = {
    "DEFAULT_CHUNK_BYTES": "asyncpin._config",
    "ChunkState": "asyncpin.chunks",
    "KVLayout": "asyncpin.kv",
    "OffloadManager": "asyncpin.manager",
    "Transfer": "asyncpin.transfers",
}


if not TYPE_CHECKING:  # type checkers see the imports above; a typo stays an error

    def __getattr__(name: str) -> Any:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # once: later lookups do not come here
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
