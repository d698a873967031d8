"""A pin backend's optional ``warm_up()`` (the CUDA backend makes its own context there):
called once per manager, in the pin thread, before anything is prefaulted or pinned and
before a KV engine's background set-up begins, so that none of them slows it down. What
it raises is logged and pinning goes on; a close that comes first skips it, and one that
comes during it waits for it. A hook that cannot work is refused when the manager is
made, and the conformance check names one that raises."""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import Any

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from asyncpin import ConfigError, HostBackend, KVLayout, OffloadManager, _sys
from asyncpin.abc import EngineSetup
from asyncpin.region import HostRegion
from asyncpin.testing import FakeBackend, FakeEngine, check_pin_backend, is_mapped
from tests.helpers import TIMEOUT_S, MadeRegions, pause_held_elsewhere, wait_thread_event

pytestmark = pytest.mark.anyio

CHUNK = 64 << 10
NCHUNKS = 8
NBYTES = CHUNK * NCHUNKS


class HeldWarmUp(FakeBackend):
    """A FakeBackend whose warm_up() sets :attr:`warming` and waits for :meth:`let_warm`."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.warming = threading.Event()
        self._go = threading.Event()

    def let_warm(self) -> None:
        self._go.set()

    def warm_up(self) -> None:
        self.warming.set()
        self._go.wait()
        super().warm_up()


def _make(backend: FakeBackend, **kw: Any) -> OffloadManager:
    kw.setdefault("pin_threads", 1)
    return OffloadManager(NBYTES, backend=backend, chunk_bytes=CHUNK, **kw)


def _events(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


def _all_released(backend: FakeBackend, made_regions: MadeRegions) -> bool:
    return sorted(backend.pinned_spans()) == sorted(backend.unpinned_spans()) and not any(
        is_mapped(*span) for span in made_regions.spans
    )


@pytest.mark.parametrize("pin_threads", [1, 3])
async def test_it_comes_once_before_the_first_pin(
    pin_threads: int, made_regions: MadeRegions
) -> None:
    backend = FakeBackend()
    with anyio.fail_after(TIMEOUT_S):
        async with _make(backend, pin_threads=pin_threads) as mgr:
            await mgr.pinned
    assert backend.warm_up_at == [0]  # once, with no pin or unpin call before it
    assert len(backend.pinned_spans()) == NCHUNKS
    assert _all_released(backend, made_regions)


async def test_one_that_raises_is_logged_and_every_chunk_pins(made_regions: MadeRegions) -> None:
    backend = FakeBackend(fail_warm_up=True)
    with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
        async with _make(backend) as mgr:
            await mgr.pinned
            assert mgr.stats().chunks_pinned == NCHUNKS
    (failed,) = _events(logs, "pin.warm_up_failed")
    assert "injected failure in warm_up" in failed["error"]
    assert failed["log_level"] == "warning"
    assert _all_released(backend, made_regions)


async def test_nothing_is_faulted_or_pinned_before_it_returns(
    made_regions: MadeRegions, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Made beside prefaulting, the CUDA backend's context took 6-10x as long.
    after_warm_up: list[bool] = []
    prefault = HostRegion.prefault
    backend = HeldWarmUp()

    def recorded(self: HostRegion, offset: int, nbytes: int, *args: Any) -> bool:
        after_warm_up.append(backend.warm_up_at == [0])
        return prefault(self, offset, nbytes, *args)

    monkeypatch.setattr(HostRegion, "prefault", recorded)
    with anyio.fail_after(TIMEOUT_S):
        async with _make(backend, prefault_threads=2) as mgr:
            await wait_thread_event(backend.warming)
            await anyio.wait_all_tasks_blocked()  # a prefault task would be in its thread
            assert backend.calls == []
            backend.let_warm()
            await mgr.pinned
    assert after_warm_up == [True] * NCHUNKS
    assert _all_released(backend, made_regions)


async def test_a_close_during_it_waits_for_it_and_pins_nothing(made_regions: MadeRegions) -> None:
    backend = HeldWarmUp()
    mgr = _make(backend)
    with anyio.fail_after(TIMEOUT_S):
        await mgr.__aenter__()
        await wait_thread_event(backend.warming)
        async with anyio.create_task_group() as tg:
            tg.start_soon(mgr.aclose)
            await anyio.wait_all_tasks_blocked()
            assert mgr.state.value == "closing"
            backend.let_warm()
        assert mgr.state.value == "closed"
        with pytest.raises(anyio.ClosedResourceError):
            await mgr.pinned
    assert backend.warm_up_at == [0] and backend.calls == []
    assert _all_released(backend, made_regions)


async def test_a_close_that_comes_first_skips_it(made_regions: MadeRegions) -> None:
    # Held at the pause (taken by another task before entry), the warm-up has not begun
    # when the close comes; the close does not wait for the pause (nothing to unpin).
    backend = FakeBackend()
    mgr = _make(backend)
    with anyio.fail_after(TIMEOUT_S):
        async with pause_held_elsewhere(mgr):
            await mgr.__aenter__()
            await mgr.aclose()
            assert mgr.state.value == "closed"
    assert backend.warm_up_at == [] and backend.calls == []
    assert _all_released(backend, made_regions)


class TestTheEnginesSetUp:
    """A KV engine prepared in the background (the CUDA engine) begins its set-up only
    once the backend's warm-up has returned: on the H200, the CUDA engine's first set-up
    beside the pin context's making held a process's first pin call 0.3-1.5 s."""

    @staticmethod
    def _factory(made: list[FakeEngine], order: list[str]) -> Callable[[EngineSetup], FakeEngine]:
        def make(setup: EngineSetup) -> FakeEngine:
            engine = FakeEngine(setup, auto=True, background=True)
            prepare = engine.prepare

            def recorded() -> None:
                order.append("set-up")
                prepare()

            engine.prepare = recorded  # type: ignore[method-assign]
            made.append(engine)
            return engine

        return make

    async def test_it_begins_after_the_warm_up(self, made_regions: MadeRegions) -> None:
        order: list[str] = []
        made: list[FakeEngine] = []

        class Recorded(HeldWarmUp):
            def warm_up(self) -> None:
                super().warm_up()
                order.append("warmed up")

        backend = Recorded()
        layout = KVLayout.from_tensors([torch.zeros(8, 4096, dtype=torch.uint8)])
        mgr = OffloadManager.for_kv(
            layout, 8, backend=backend, engine=self._factory(made, order), chunk_bytes=8192
        )
        with anyio.fail_after(TIMEOUT_S):
            async with mgr:
                await wait_thread_event(backend.warming)
                # Every task is parked (the set-up's would be in its thread by now).
                await anyio.wait_all_tasks_blocked()
                assert order == [] and not made[0].prepared
                backend.let_warm()
                await mgr.pinned
                assert made[0].prepared
        assert order == ["warmed up", "set-up"]
        assert _all_released(backend, made_regions)

    async def test_a_warm_up_that_raises_does_not_hold_it_back(
        self, made_regions: MadeRegions
    ) -> None:
        order: list[str] = []
        made: list[FakeEngine] = []
        backend = FakeBackend(fail_warm_up=True)
        layout = KVLayout.from_tensors([torch.zeros(8, 4096, dtype=torch.uint8)])
        mgr = OffloadManager.for_kv(
            layout, 8, backend=backend, engine=self._factory(made, order), chunk_bytes=8192
        )
        with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
            async with mgr:
                await mgr.pinned
                assert made[0].prepared
        assert order == ["set-up"] and backend.warm_up_at == [0]
        assert len(_events(logs, "pin.warm_up_failed")) == 1
        assert _all_released(backend, made_regions)


async def _coroutine() -> None:
    return None


class _Hooked(HostBackend):
    __slots__ = ("warm_up",)

    def __init__(self, hook: object) -> None:
        self.warm_up = hook


@pytest.mark.parametrize("hook", [5, _coroutine], ids=["not-callable", "coroutine-function"])
def test_a_hook_that_cannot_work_is_refused_when_made(hook: object) -> None:
    with pytest.raises(ConfigError, match="warm_up must be a plain method"):
        OffloadManager(NBYTES, backend=_Hooked(hook), chunk_bytes=CHUNK)


def _takes_an_argument(device: int) -> None:
    return None


def _takes_defaults(device: int = 0, *args: int, **kwargs: int) -> None:
    return None


def test_a_hook_that_needs_an_argument_is_refused_when_made() -> None:
    with pytest.raises(ConfigError, match="warm_up must take no argument"):
        OffloadManager(NBYTES, backend=_Hooked(_takes_an_argument), chunk_bytes=CHUNK)
    # One that can be called with none is taken.
    OffloadManager(NBYTES, backend=_Hooked(_takes_defaults), chunk_bytes=CHUNK)


class _RaisesAtWarmUp(HostBackend):
    __slots__ = ()

    def warm_up(self) -> None:
        raise RuntimeError("no context")


async def test_the_conformance_check_names_a_warm_up_that_raises(
    balanced_mappings: list[tuple[str, int, int]],
) -> None:
    locked = _sys.vm_locked_bytes()
    with pytest.raises(AssertionError, match=r"warm_up\(\) raised .*no context"):
        await check_pin_backend(_RaisesAtWarmUp(), locked_bytes=True)
    assert _sys.vm_locked_bytes() == locked
    assert balanced_mappings  # the region was mapped; the fixture checks it was unmapped


async def test_the_conformance_check_calls_it_before_the_pins() -> None:
    backend = FakeBackend(inner=HostBackend())
    await check_pin_backend(backend)
    assert backend.warm_up_at == [0] and len(backend.pinned_spans()) > 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_native_cancel_during_it_waits_for_it_before_the_set_up_may_start(
    anyio_backend: str,
) -> None:
    # A Task.cancel() ends a plain wait for a worker thread at once: the pipeline still
    # waits for the warm-up to return, and what beside() starts then finds it stopped.
    import asyncio

    from asyncpin.gate import PauseGate
    from asyncpin.pinning import PinScheduler

    backend = HeldWarmUp()
    region = HostRegion.create(NBYTES)
    scheduler = PinScheduler(
        region, backend, region.chunks(CHUNK), prefault_threads=1, pin_threads=1,
        pin_interval_s=0, gate=PauseGate(),
    )  # fmt: skip
    seen: list[tuple[bool, list[int]]] = []  # at beside(): stopping, warm-up calls over

    def beside() -> None:
        seen.append((scheduler.stopping, list(backend.warm_up_at)))

    try:
        with anyio.fail_after(TIMEOUT_S):
            task = asyncio.ensure_future(scheduler.run(beside))
            await wait_thread_event(backend.warming)
            task.cancel()
            await anyio.wait_all_tasks_blocked()
            assert seen == [] and not task.done()
            backend.let_warm()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert seen == [(True, [0])]
        assert scheduler.done.is_set() and backend.calls == []
    finally:
        backend.let_warm()
        region.release()


class _TakesTheGate(FakeBackend):
    """A FakeBackend whose warm_up() takes ``hold()`` (a pause or the capture gate)."""

    def __init__(self, hold: Callable[[], Any]) -> None:
        super().__init__()
        self._take = hold

    def warm_up(self) -> None:
        with self._take():
            pass


@pytest.mark.parametrize("gate", ["pinning_paused", "capture_gate"])
async def test_a_warm_up_that_takes_the_gate_it_is_held_by_is_refused(
    gate: str, made_regions: MadeRegions
) -> None:
    # It would wait for itself for ever: it gets a LifecycleError, logged, and pinning
    # goes on.
    from asyncpin import capture_gate

    mgr: OffloadManager | None = None
    backend = _TakesTheGate(
        lambda: capture_gate() if gate == "capture_gate" else mgr.pinning_paused()  # type: ignore[union-attr]
    )
    mgr = _make(backend)
    with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
        async with mgr:
            await mgr.pinned
    (failed,) = _events(logs, "pin.warm_up_failed")
    assert f"{gate}() taken inside a call that it holds back" in failed["error"]
    assert len(backend.pinned_spans()) == NCHUNKS
    assert _all_released(backend, made_regions)


def test_generator_hooks_are_refused_when_made() -> None:
    def generator() -> Any:
        yield

    async def async_generator() -> Any:
        yield

    for hook in (generator, async_generator):
        with pytest.raises(ConfigError, match="warm_up must be a plain method"):
            OffloadManager(NBYTES, backend=_Hooked(hook), chunk_bytes=CHUNK)


async def test_an_error_with_no_message_is_logged_by_its_type() -> None:
    class Silent(FakeBackend):
        def warm_up(self) -> None:
            raise KeyboardInterrupt

    with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
        async with _make(Silent()) as mgr:
            await mgr.pinned
    (failed,) = _events(logs, "pin.warm_up_failed")
    assert failed["error"] == "KeyboardInterrupt"
