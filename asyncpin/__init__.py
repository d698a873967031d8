"""asyncpin: a pinned host-memory tier for LLM KV caches, embedded in async servers."""

from asyncpin._config import DEFAULT_CHUNK_BYTES
from asyncpin.backends import HostBackend, PinBackend
from asyncpin.chunks import ChunkState
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
from asyncpin.kv import KVLayout
from asyncpin.manager import ManagerState, OffloadManager
from asyncpin.stats import ManagerStats, TierStats
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
