"""The CUDA engine's streams, without a GPU: made by the runtime, given back at an
engine's close, taken again by later engines on the same device, never destroyed
(torch's allocator keeps the stream of the memory allocated on it)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

import asyncpin.engines.cuda.lanes as lanes
from tests.helpers import wait_child


class _Stream:
    """What the lanes read of a ``torch.cuda.ExternalStream``."""

    def __init__(self, handle: int, device: torch.device) -> None:
        self.cuda_stream = handle
        self.device = device


class _Runtime:
    def __init__(self) -> None:
        self.made: list[int] = []
        self._handles = itertools.count(0x1000, 0x10)

    def stream(self) -> int:
        self.made.append(next(self._handles))
        return self.made[-1]


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> _Runtime:
    monkeypatch.setattr(torch.cuda, "ExternalStream", _Stream)
    monkeypatch.setattr(lanes, "_idle", {})
    return _Runtime()


def test_streams_given_back_are_taken_again_on_their_device(rt: _Runtime) -> None:
    first: list[torch.cuda.Stream] = []
    a = lanes.own_stream(rt, torch.device("cuda", 0), first)  # type: ignore[arg-type]
    b = lanes.own_stream(rt, torch.device("cuda", 1), first)  # type: ignore[arg-type]
    assert first == [a, b] and rt.made == [a.cuda_stream, b.cuda_stream]
    lanes.give_back(first)
    again: list[torch.cuda.Stream] = []
    c = lanes.own_stream(rt, torch.device("cuda", 0), again)  # type: ignore[arg-type]
    d = lanes.own_stream(rt, torch.device("cuda", 0), again)  # type: ignore[arg-type]
    e = lanes.own_stream(rt, torch.device("cuda", 1), again)  # type: ignore[arg-type]
    assert c.cuda_stream == a.cuda_stream  # taken again, on its own device
    assert d.cuda_stream not in (a.cuda_stream, b.cuda_stream)  # none idle: a new one
    assert e.cuda_stream == b.cuda_stream
    assert len(rt.made) == 3 and again == [c, d, e]


def test_a_stream_that_cannot_be_wrapped_is_not_lost(
    rt: _Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(handle: int, device: torch.device) -> _Stream:
        raise RuntimeError("no stream")

    monkeypatch.setattr(torch.cuda, "ExternalStream", refuse)
    made: list[torch.cuda.Stream] = []
    with pytest.raises(RuntimeError, match="no stream"):
        lanes.own_stream(rt, torch.device("cuda", 0), made)  # type: ignore[arg-type]
    assert made == [] and lanes._idle == {0: rt.made}


def test_a_forked_child_has_none_of_the_parents_streams(rt: _Runtime) -> None:
    lanes.give_back([_Stream(0x2000, torch.device("cuda", 0))])  # type: ignore[list-item]
    with lanes._idle_lock:  # as another thread might hold it at the fork
        pid = os.fork()
        if pid == 0:  # the child: exit at once, with what it found
            os._exit(0 if not lanes._idle and not lanes._idle_lock.locked() else 1)
    assert wait_child(pid) == 0
    assert lanes._idle == {0: [0x2000]}  # the parent keeps its own
