"""The CUDA engine's streams, without a GPU: made by the runtime, given back at an
engine's close, taken again by later engines on the same device, never destroyed
(torch's allocator keeps the stream of the memory allocated on it)."""

from __future__ import annotations

import itertools

import pytest
import torch

import asyncpin.engines.cuda.lanes as lanes


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
