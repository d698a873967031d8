"""An engine made off the event loop (``made_off_loop``: the CUDA engine's way).

- The manager makes it in a worker thread while the entry waits, from a setup whose
  ``loop`` names the event loop; a factory without the attribute is made on the loop.
- What the construction raises is what the entry raises, and the region is released.
- A cancellation while it is made (anyio's, or a native ``Task.cancel()``) waits for the
  thread, and the engine it made is closed before the region is released.
- The CUDA engine is made off the loop and reaches the loop it was given.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import torch

import asyncpin.engines.cuda as ct
from asyncpin import ConfigError, KVLayout, OffloadManager
from asyncpin.abc import EngineSetup
from asyncpin.engines.cuda import CudaTransferEngine
from asyncpin.engines.cuda.completion import AsyncioHooks, TrioHooks
from asyncpin.testing import FakeBackend, FakeEngine, check_transfer_engine, is_mapped
from tests.helpers import TIMEOUT_S, MadeRegions, wait_thread_event

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _layout() -> KVLayout:
    return KVLayout.from_tensors([torch.arange(8 * 4096, dtype=torch.uint8).view(8, 4096)])


class OffLoop:
    """Makes copying FakeEngines, off the loop unless ``off=False``; records where."""

    def __init__(
        self, *, off: bool = True, fail: BaseException | None = None, background: bool = False
    ) -> None:
        if off:
            self.made_off_loop = True
        self.fail = fail
        self.background = background  # the engine prepared in the background
        self.threads: list[int] = []
        self.loops: list[Any] = []  # each setup's loop (not the setup: its host view
        # would keep the region mapped)
        self.engines: list[FakeEngine] = []
        self.entered = threading.Event()  # the construction began
        self.go_on: threading.Event | None = None  # if set, it waits for this first

    def __call__(self, setup: EngineSetup) -> FakeEngine:
        self.threads.append(threading.get_ident())
        self.loops.append(setup.loop)
        self.entered.set()
        if self.go_on is not None:
            assert self.go_on.wait(TIMEOUT_S)
        if self.fail is not None:
            raise self.fail
        engine = FakeEngine(setup, auto=True, copy=True, background=self.background)
        self.engines.append(engine)
        return engine


def _manager(
    factory: OffLoop, backend: FakeBackend, layout: KVLayout | None = None
) -> OffloadManager:
    layout = layout or _layout()
    return OffloadManager.for_kv(layout, 8, backend=backend, engine=factory, chunk_bytes=8192)


async def _entered_though_cancelled(
    factory: OffLoop, backend: FakeBackend, while_made: Callable[[], None] | None = None
) -> bool:
    """Whether the body of an entry ran, the entry cancelled (anyio) while ``factory``
    makes its engine; ``while_made()`` is called then, the cancel seen."""
    factory.go_on = threading.Event()
    entered = False

    async def enter() -> None:
        nonlocal entered
        async with _manager(factory, backend):
            entered = True

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(enter)
            await wait_thread_event(factory.entered)
            tg.cancel_scope.cancel()
            if while_made is not None:
                await anyio.lowlevel.cancel_shielded_checkpoint()
                while_made()
            factory.go_on.set()
    return entered


def _released(made_regions: MadeRegions, backend: FakeBackend) -> bool:
    unmapped = not is_mapped(*made_regions.spans[0])
    return unmapped and backend.pinned_spans() == backend.unpinned_spans()


async def test_made_in_a_worker_thread_and_serves(made_regions: MadeRegions) -> None:
    factory, backend = OffLoop(), FakeBackend()
    loop_thread, layout = threading.get_ident(), _layout()
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(factory, backend, layout) as mgr:
            await mgr.pinned
            assert factory.threads[0] != loop_thread
            # The setup names the loop the manager runs on.
            assert factory.loops == [anyio.lowlevel.current_token()]
            sent = layout.arrays[0][:2].clone()
            await mgr.store([0, 1], [5, 6])
            layout.arrays[0][:2].zero_()
            await mgr.load([5, 6], [0, 1])
            assert torch.equal(layout.arrays[0][:2], sent)
            # The fake refuses a submit off the thread it learnt as the loop's.
            assert len(factory.engines[0].submitted) == 2
    assert factory.engines[0].closed
    assert _released(made_regions, backend)


async def test_a_factory_that_does_not_say_so_is_made_on_the_loop() -> None:
    factory = OffLoop(off=False)
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(factory, FakeBackend()) as mgr:
            await mgr.pinned
    assert factory.threads == [threading.get_ident()]


@pytest.mark.parametrize("off", [True, False], ids=["off-loop", "on-loop"])
async def test_what_the_construction_raises_the_entry_raises(
    made_regions: MadeRegions, off: bool
) -> None:
    """And the region is unmapped while the error is still held: the frames of its
    traceback no longer hold the setup's view of the host blocks."""
    factory = OffLoop(off=off, fail=ConfigError("these arrays will not do"))
    backend = FakeBackend()
    with anyio.fail_after(TIMEOUT_S), pytest.raises(ConfigError, match="will not do"):
        async with _manager(factory, backend):
            pytest.fail("entered")
    assert (factory.threads[0] != threading.get_ident()) is off
    assert _released(made_regions, backend)


async def test_a_cancelled_entry_waits_and_closes_the_engine_made(
    made_regions: MadeRegions,
) -> None:
    factory, backend = OffLoop(), FakeBackend()

    def still_mapped() -> None:
        # The entry waits for the construction: nothing is released under it.
        assert is_mapped(*made_regions.spans[0])

    assert not await _entered_though_cancelled(factory, backend, still_mapped)
    assert factory.engines[0].closed
    assert _released(made_regions, backend)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_native_cancel_waits_and_closes_the_engine_made(
    made_regions: MadeRegions,
) -> None:
    factory, backend = OffLoop(), FakeBackend()
    factory.go_on = threading.Event()

    async def enter() -> None:
        async with _manager(factory, backend):
            pytest.fail("entered")

    with anyio.fail_after(TIMEOUT_S):
        task = asyncio.ensure_future(enter())
        await wait_thread_event(factory.entered)
        task.cancel()
        await asyncio.sleep(0)  # the task sees its cancel while the thread still runs
        assert not task.done()
        factory.go_on.set()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert factory.engines[0].closed
    assert _released(made_regions, backend)


async def test_the_engine_check_makes_it_as_a_manager_does() -> None:
    made: list[int] = []

    class Checked(FakeEngine):
        made_off_loop = True

        def __init__(self, setup: EngineSetup) -> None:
            made.append(threading.get_ident())
            super().__init__(setup, auto=True, copy=True)

    layout = KVLayout.from_tensors([torch.zeros(32, 4096, dtype=torch.uint8)])
    await check_transfer_engine(Checked, layout, timeout_s=TIMEOUT_S)
    assert made and threading.get_ident() not in made


async def test_the_cuda_engine_is_made_off_the_loop_and_reaches_it(
    monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    """Made in a worker thread from a setup naming the loop (its runtime stood in for:
    no GPU here), its completion hooks run calls on that loop."""
    assert CudaTransferEngine.made_off_loop is True
    monkeypatch.setattr(ct, "Runtime", lambda: object())
    monkeypatch.setattr(ct, "kernel_available", lambda rt: False)
    layout = KVLayout.from_tensors([torch.zeros(8, 4096, dtype=torch.uint8)])
    host = torch.zeros(8, layout.host_block_bytes, dtype=torch.uint8)
    ran_on: list[int] = []
    done = anyio.Event()

    def ran() -> None:
        ran_on.append(threading.get_ident())
        done.set()

    async with anyio.create_task_group() as tg:
        setup = EngineSetup(
            layout, host, 1 << 30, tg.start_soon, loop=anyio.lowlevel.current_token()
        )
        engine = await anyio.to_thread.run_sync(CudaTransferEngine, setup)
        hooks: Any = engine._completion.hooks
        assert isinstance(hooks, AsyncioHooks if anyio_backend == "asyncio" else TrioHooks)
        with anyio.fail_after(TIMEOUT_S):
            await anyio.to_thread.run_sync(hooks.call_soon, ran)
            await done.wait()
    assert ran_on == [threading.get_ident()]


class Chained(OffLoop):
    """Raises a ConfigError while handling a ValueError from a helper given the host
    view: the helper's frame, reached through ``__context__``, holds the view."""

    def __call__(self, setup: EngineSetup) -> FakeEngine:
        self.threads.append(threading.get_ident())

        def check(host_blocks: torch.Tensor) -> None:
            raise ValueError("bad host blocks")

        try:
            check(setup.host_blocks)
        except ValueError:
            raise ConfigError("this engine cannot serve them") from None
        raise AssertionError("check() returned")


@pytest.mark.parametrize("off", [True, False], ids=["off-loop", "on-loop"])
async def test_errors_chained_to_it_hold_no_view_either(
    made_regions: MadeRegions, off: bool
) -> None:
    factory, backend = Chained(off=off), FakeBackend()
    with anyio.fail_after(TIMEOUT_S), pytest.raises(ConfigError, match="cannot serve"):
        async with _manager(factory, backend):
            pytest.fail("entered")
    assert _released(made_regions, backend)


async def test_a_cancel_while_made_does_not_enter_an_engine_set_up_later(
    made_regions: MadeRegions,
) -> None:
    """An engine prepared in the background (as the CUDA engine): nothing after its
    making awaits, so the entry itself must raise the cancellation it waited through."""

    factory, backend = OffLoop(background=True), FakeBackend()
    assert not await _entered_though_cancelled(factory, backend)
    assert factory.engines[0].closed
    assert _released(made_regions, backend)


def test_the_cuda_engine_module_is_imported_in_the_thread_that_makes_it() -> None:
    """Choosing the engine for CUDA arrays (on the loop) imports nothing of it."""
    code = (
        "import sys, torch\n"
        "from types import SimpleNamespace\n"
        "from asyncpin.engines import engine_factory, made_off_loop\n"
        "factory = engine_factory('auto', SimpleNamespace(device=torch.device('cuda', 0)))\n"
        "assert made_off_loop(factory), factory\n"
        "assert 'asyncpin.engines.cuda' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
