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
from asyncpin.kv import KVLayout

__all__ = [
    "ENGINE_NAMES",
    "check_engine_choice",
    "engine_factory",
    "made_off_loop",
    "make_engine",
]

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


def engine_factory(engine: str | EngineFactory, layout: KVLayout) -> EngineFactory:
    """What makes the engine for ``layout``: the class a name stands for (``auto``: by
    the KV arrays' device; imported here) or the given factory. Raises ConfigError when
    a named engine cannot serve these arrays."""
    device = layout.device.type
    if engine == "auto":
        engine = {"cuda": "cuda", "cpu": "host"}.get(device, "")
        if not engine:
            raise ConfigError(f"KV arrays on {layout.device} are not supported")
    if engine == "host":
        if device != "cpu":
            raise ConfigError(
                "the host engine copies between CPU tensors; these KV arrays are on "
                f"{layout.device}"
            )
        from asyncpin.engines.host import HostTransferEngine

        return HostTransferEngine
    if engine == "cuda":
        if device != "cuda":
            raise ConfigError(
                f"the cuda engine needs KV arrays on a GPU; these are on {layout.device}"
            )
        return _CudaEngine()
    assert not isinstance(engine, str)
    return engine


class _CudaEngine:
    """The ``cuda`` engine's factory: made off the loop, as the engine class says, and
    its module imported there too (the import took about 18 ms with torch loaded)."""

    made_off_loop = True

    def __call__(self, setup: EngineSetup) -> TransferEngine:
        from asyncpin.engines.cuda import CudaTransferEngine

        return CudaTransferEngine(setup)


def made_off_loop(factory: EngineFactory) -> bool:
    """Whether ``factory`` makes its engine in a worker thread (``made_off_loop``)."""
    return getattr(factory, "made_off_loop", False) is True


def make_engine(factory: EngineFactory, setup: EngineSetup) -> TransferEngine:
    """The engine ``factory`` makes from ``setup``; ConfigError if it is not one."""
    made = factory(setup)
    if not isinstance(made, TransferEngine):
        raise ConfigError(f"engine factory {factory!r} returned {made!r}, not a TransferEngine")
    return made
