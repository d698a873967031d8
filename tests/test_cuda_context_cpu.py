"""asyncpin's own CUDA context (``asyncpin._cudactx``) against a recording stand-in for
libcuda, on any machine: the order of its driver calls and what it does when one fails.
The real driver runs in ``tests/cuda/test_cuda_context.py``."""

from __future__ import annotations

import os
from typing import Any

import pytest

import asyncpin._cudactx as cudactx
from asyncpin._cudactx import REGISTER_FLAGS, PinContext
from asyncpin.errors import BackendCallError
from tests.helpers import wait_child

ALREADY_REGISTERED = 712
ADDRESS, NBYTES = 0x7F0000000000, 1 << 21


class RecordingDriver:
    """The libcuda calls PinContext makes, recorded by name; ``codes[name]`` lists the
    codes that name's calls return in turn (0 once the list is used up)."""

    def __init__(self, **codes: list[int]) -> None:
        self.codes = codes
        self.calls: list[tuple[Any, ...]] = []

    def _call(self, name: str, *args: Any) -> int:
        self.calls.append((name, *args))
        queue = self.codes.get(name, [])
        return queue.pop(0) if queue else 0

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("cu"):
            raise AttributeError(name)
        return lambda *args: self._call(name, *args)

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


def make(driver: RecordingDriver) -> PinContext:
    context = PinContext(driver, 0)  # type: ignore[arg-type]
    driver.calls.clear()
    return context


class TestPinContext:
    def test_made_then_taken_off_the_thread(self) -> None:
        driver = RecordingDriver()
        PinContext(driver, 0)  # type: ignore[arg-type]
        assert driver.names() == ["cuInit", "cuDeviceGet", "cuCtxCreate_v2", "cuCtxPopCurrent_v2"]

    def test_a_register_runs_inside_the_context_and_leaves_the_thread_as_it_was(self) -> None:
        driver = RecordingDriver()
        make(driver).register(ADDRESS, NBYTES)
        names = driver.names()
        assert names == ["cuCtxPushCurrent_v2", "cuMemHostRegister_v2", "cuCtxPopCurrent_v2"]
        assert driver.calls[1][1:] == (ADDRESS, NBYTES, REGISTER_FLAGS)
        assert REGISTER_FLAGS == 0x1 | 0x2  # portable and mapped

    def test_a_failed_register_is_named_and_the_context_popped(self) -> None:
        driver = RecordingDriver(cuMemHostRegister_v2=[ALREADY_REGISTERED])
        with pytest.raises(BackendCallError) as info:
            make(driver).register(ADDRESS, NBYTES)
        assert (info.value.op, info.value.code) == ("cuMemHostRegister", ALREADY_REGISTERED)
        assert info.value.code_name == "cudaErrorHostMemoryAlreadyRegistered"
        assert driver.names()[-1] == "cuCtxPopCurrent_v2"

    def test_a_register_whose_pop_fails_is_undone_before_it_raises(self) -> None:
        # The pin contract: a pin that raises has pinned nothing.
        driver = RecordingDriver()
        context = make(driver)
        driver.codes["cuCtxPopCurrent_v2"] = [201]
        with pytest.raises(BackendCallError) as info:
            context.register(ADDRESS, NBYTES)
        assert info.value.op == "cuCtxPopCurrent"
        assert driver.names() == [
            "cuCtxPushCurrent_v2",
            "cuMemHostRegister_v2",
            "cuCtxPopCurrent_v2",
            "cuMemHostUnregister",
        ]
        assert driver.calls[-1][1:] == (ADDRESS,)

    def test_a_register_that_cannot_be_undone_counts_as_done(self) -> None:
        # Still registered: raising would leave it registered with nobody to unpin it;
        # returning lets the close unregister it like any other chunk.
        driver = RecordingDriver(cuMemHostUnregister=[1])
        context = make(driver)
        driver.codes["cuCtxPopCurrent_v2"] = [201]
        context.register(ADDRESS, NBYTES)
        assert driver.names()[-1] == "cuMemHostUnregister"

    def test_the_calls_own_error_comes_before_a_failed_pop(self) -> None:
        driver = RecordingDriver(cuMemHostRegister_v2=[ALREADY_REGISTERED])
        context = make(driver)
        driver.codes["cuCtxPopCurrent_v2"] = [201]
        with pytest.raises(BackendCallError) as info:
            context.register(ADDRESS, NBYTES)
        assert info.value.code == ALREADY_REGISTERED
        assert "cuMemHostUnregister" not in driver.names()  # nothing to undo

    def test_a_context_that_cannot_be_popped_when_made_is_destroyed(self) -> None:
        driver = RecordingDriver(cuCtxPopCurrent_v2=[201])
        with pytest.raises(BackendCallError) as info:
            PinContext(driver, 0)  # type: ignore[arg-type]
        assert info.value.op == "cuCtxPopCurrent"
        assert driver.names()[-1] == "cuCtxDestroy_v2"

    def test_a_failed_push_calls_nothing_in_the_context(self) -> None:
        driver = RecordingDriver(cuCtxPushCurrent_v2=[201])
        with pytest.raises(BackendCallError) as info:
            make(driver).unregister(ADDRESS)
        assert info.value.op == "cuCtxPushCurrent"
        assert driver.names() == ["cuCtxPushCurrent_v2"]


class TestFork:
    def test_a_forked_child_has_none_of_the_parents_contexts(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(cudactx._contexts, 0, make(RecordingDriver()))
        pid = os.fork()
        if pid == 0:  # the child: exit at once, with what it found
            os._exit(0 if not cudactx._contexts and not cudactx._lock.locked() else 1)
        assert wait_child(pid) == 0
        assert 0 in cudactx._contexts  # the parent keeps its own
