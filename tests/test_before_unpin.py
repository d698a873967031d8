"""A pin backend's optional ``before_unpin()`` (the CUDA backend's one wait for the device
before a close's unpins) never stops a close: whatever the hook or an unpin raises, every
chunk is unpinned or leaked, the region is released and the failure is logged. A hook
that cannot work (not callable, a coroutine function, a property that raises) is refused
when the manager is made; the conformance check names it and leaks nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from asyncpin import ConfigError, HostBackend, ManagerState, OffloadManager, _sys
from asyncpin.backends import call_hook
from asyncpin.testing import FakeBackend, check_pin_backend, is_mapped
from tests.helpers import TIMEOUT_S

pytestmark = pytest.mark.anyio

CHUNK = 64 << 10
NCHUNKS = 8
NBYTES = CHUNK * NCHUNKS


class Weird(BaseException):
    """Not an Exception: what a buggy backend might still raise."""


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str() of this error fails")


class Hooked(FakeBackend):
    """A FakeBackend whose before_unpin runs ``hook`` instead; from the ``raise_after``-th
    read on, reading the attribute itself raises."""

    def __init__(self, hook: Callable[[], Any], *, raise_after: int | None = None, **kw: Any):
        super().__init__(**kw)
        self._hook = hook
        self._reads = 0
        self._raise_after = raise_after

    @property
    def before_unpin(self) -> Callable[[], Any]:
        self._reads += 1
        if self._raise_after is not None and self._reads > self._raise_after:
            raise RuntimeError("reading before_unpin fails")
        return self._hook


def _raise(exc: BaseException) -> Callable[[], None]:
    def hook() -> None:
        raise exc

    return hook


async def _coroutine() -> None:
    return None


async def _open_pin_close(backend: FakeBackend) -> tuple[OffloadManager, int, list[Any]]:
    with anyio.fail_after(TIMEOUT_S), capture_logs() as logs:
        async with OffloadManager(
            NBYTES, backend=backend, chunk_bytes=CHUNK, prefault_threads=1, pin_threads=1
        ) as mgr:
            address = mgr.host_view().data_ptr()
            await mgr.pinned
    return mgr, address, logs


def _closed_cleanly(mgr: OffloadManager, backend: FakeBackend, address: int) -> None:
    assert mgr.state is ManagerState.CLOSED
    assert sorted(backend.unpinned_spans()) == sorted(backend.pinned_spans())
    assert len(backend.pinned_spans()) == NCHUNKS
    assert not is_mapped(address, NBYTES)
    assert mgr.stats().chunks_pinned == 0


class TestCloseGoesOn:
    @pytest.mark.parametrize(
        "hook",
        [
            _raise(RuntimeError("the device is gone")),
            _raise(Weird("not an Exception")),
            _raise(BadStr()),
            lambda: _coroutine(),  # a plain method that returns a coroutine
        ],
        ids=["exception", "base-exception", "bad-str", "returns-a-coroutine"],
    )
    async def test_whatever_the_hook_raises(self, hook: Callable[[], Any]) -> None:
        backend = Hooked(hook)
        mgr, address, logs = await _open_pin_close(backend)
        _closed_cleanly(mgr, backend, address)
        (failed,) = [e for e in logs if e["event"] == "unpin.wait_failed"]
        assert failed["error"]

    async def test_a_property_that_raises_at_close(self) -> None:
        # The manager read it once when it was made; the close's read raises.
        backend = Hooked(lambda: None, raise_after=1)
        mgr, address, logs = await _open_pin_close(backend)
        _closed_cleanly(mgr, backend, address)
        (failed,) = [e for e in logs if e["event"] == "unpin.wait_failed"]
        assert "reading before_unpin fails" in failed["error"]

    async def test_an_unpin_that_raises_a_base_exception_leaks_only_its_chunk(self) -> None:
        class Unpin(FakeBackend):
            def unpin(self, address: int, nbytes: int) -> None:
                if len(self.unpinned_spans()) == 2:
                    self._record("unpin", address, nbytes, False)
                    raise Weird("unpin 2")
                super().unpin(address, nbytes)

        backend = Unpin()
        mgr, address, logs = await _open_pin_close(backend)
        assert mgr.state is ManagerState.CLOSED
        assert len(backend.unpinned_spans()) == NCHUNKS  # every chunk was tried, once
        assert mgr.stats().chunks_leaked == 1
        leaked = address + 2 * CHUNK
        assert is_mapped(leaked, CHUNK)  # left mapped: never freed under the device
        assert not is_mapped(address, CHUNK) and not is_mapped(address + 3 * CHUNK, CHUNK)
        (failed,) = [e for e in logs if e["event"] == "unpin.failed"]
        assert failed["chunk"] == 2 and "unpin 2" in failed["error"]
        _sys.libc_munmap(leaked, CHUNK)


class TestRefusedWhenMade:
    @pytest.mark.parametrize(
        "hook", [5, _coroutine, "later"], ids=["not-callable", "coroutine-function", "raises"]
    )
    def test_a_hook_that_cannot_work(self, hook: Any) -> None:
        backend = Hooked(hook, raise_after=0 if hook == "later" else None)
        with pytest.raises(ConfigError, match="before_unpin"):
            OffloadManager(NBYTES, backend=backend, chunk_bytes=CHUNK)


class ReadingFails(HostBackend):
    @property
    def before_unpin(self) -> Callable[[], None]:
        raise RuntimeError("reading before_unpin fails")


class RaisesWeird(HostBackend):
    def before_unpin(self) -> None:
        raise Weird("before_unpin")


class TestCheckPinBackend:
    @pytest.mark.parametrize(
        "backend_class", [ReadingFails, RaisesWeird], ids=["raising-property", "base-exception"]
    )
    async def test_a_broken_hook_is_named_and_nothing_leaks(
        self, backend_class: type[HostBackend], balanced_mappings: list[tuple[str, int, int]]
    ) -> None:
        locked = _sys.vm_locked_bytes()
        with pytest.raises(AssertionError, match="before_unpin"):
            await check_pin_backend(backend_class(), locked_bytes=True)
        assert _sys.vm_locked_bytes() == locked
        assert balanced_mappings  # the region was mapped; the fixture checks it was unmapped


def test_call_before_unpin_returns_what_it_raised() -> None:
    class NoHook:
        pass

    assert call_hook(NoHook(), "before_unpin") is None
    error = call_hook(Hooked(_raise(Weird("x"))), "before_unpin")
    assert isinstance(error, Weird)
