"""Transfer engines, and the one place an engine is chosen.

- ``host`` (:class:`~asyncpin.engines.host.HostTransferEngine`): KV arrays that are CPU
  tensors; copies in worker threads.
- ``cuda`` (:class:`~asyncpin.engines.cuda.CudaTransferEngine`): KV arrays on a GPU;
  copies on CUDA streams, completion reported by waiter threads.

A manager takes ``engine="auto"`` (by the KV arrays' device), one of the names, or any
callable that makes a :class:`~asyncpin.abc.TransferEngine` from an
:class:`~asyncpin.abc.EngineSetup` (an engine class is one).
"""

from __future__ import annotations

from asyncpin._text import shown
from asyncpin.abc import EngineFactory, EngineSetup, TransferEngine
from asyncpin.errors import ConfigError

__all__ = ["ENGINE_NAMES", "check_engine_choice", "make_engine"]

ENGINE_NAMES = ("auto", "host", "cuda")


def check_engine_choice(engine: str | EngineFactory) -> str | EngineFactory:
    """``engine`` if a manager can take it (a name, or a callable); ConfigError if not."""
    if isinstance(engine, str):
        if engine not in ENGINE_NAMES:
            raise ConfigError(
                f"unknown engine {engine!r}: use one of {', '.join(ENGINE_NAMES)}, or a "
                "callable that makes a TransferEngine from an EngineSetup"
            )
        return engine
    if not callable(engine):
        raise ConfigError(f"engine must be a name or a callable, got {shown(engine)}")
    return engine


def make_engine(engine: str | EngineFactory, setup: EngineSetup) -> TransferEngine:
    """The engine for ``setup``: by name (``auto``: by the KV arrays' device) or made by
    the given factory. Raises ConfigError when it cannot serve these arrays."""
    device = setup.layout.device.type
    if engine == "auto":
        engine = {"cuda": "cuda", "cpu": "host"}.get(device, "")
        if not engine:
            raise ConfigError(f"KV arrays on {setup.layout.device} are not supported")
    if engine == "host":
        from asyncpin.engines.host import HostTransferEngine

        return HostTransferEngine(setup)
    if engine == "cuda":
        if device != "cuda":
            raise ConfigError(
                f"the cuda engine needs KV arrays on a GPU; these are on {setup.layout.device}"
            )
        from asyncpin.engines.cuda import CudaTransferEngine

        return CudaTransferEngine(setup)
    assert not isinstance(engine, str)
    made = engine(setup)
    if not isinstance(made, TransferEngine):
        raise ConfigError(f"engine factory {engine!r} returned {made!r}, not a TransferEngine")
    return made
