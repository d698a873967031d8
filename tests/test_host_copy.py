"""``OffloadManager.host_copy``: a copy between a view of the region and another tensor,
cut where the region's chunks meet. Each chunk is a pinned registration of its own, and
the CUDA driver refuses a copy that spans two (``bench/probes/view_copies.py``: a torch
``copy_`` of such a view fails with cudaErrorInvalidValue); the ``cuda`` case runs with
``pytest -m cuda`` on the GPU machine."""

from __future__ import annotations

import anyio
import pytest
import torch

import asyncpin.manager
from asyncpin import ConfigError, OffloadManager
from asyncpin.region import chunk_pieces
from asyncpin.testing import FakeBackend
from tests.helpers import TIMEOUT_S

pytestmark = pytest.mark.anyio

CHUNK = 1 << 20


def test_pieces_meet_chunk_boundaries() -> None:
    assert chunk_pieces(0, 3 * CHUNK, CHUNK) == [
        (0, CHUNK),
        (CHUNK, 2 * CHUNK),
        (2 * CHUNK, 3 * CHUNK),
    ]
    assert chunk_pieces(CHUNK - 8, 16, CHUNK) == [(0, 8), (8, 16)]
    assert chunk_pieces(5, 10, CHUNK) == [(0, 10)]
    assert chunk_pieces(CHUNK, CHUNK, CHUNK) == [(0, CHUNK)]
    assert chunk_pieces(7, 0, CHUNK) == []


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


def _manager(device: torch.device) -> OffloadManager:
    backend = {"backend": FakeBackend()} if device.type == "cpu" else {"backend": "cuda"}
    return OffloadManager(4 * CHUNK, chunk_bytes=CHUNK, **backend)


@pytest.mark.parametrize("non_blocking", [False, True])
async def test_a_view_across_chunks_copies_both_ways(
    device: torch.device, non_blocking: bool
) -> None:
    gen = torch.Generator().manual_seed(1)
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(device) as mgr:
            await mgr.pinned
            # 2.5 chunks of fp16 from half-way into chunk 0: three chunks, two boundaries.
            view = mgr.host_view(CHUNK // 2, 5 * CHUNK // 2).view(torch.float16)
            data = torch.randn(view.shape, generator=gen).half().to(device)
            mgr.host_copy(view, data, non_blocking=non_blocking)
            back = torch.zeros_like(data)
            if device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            mgr.host_copy(back, view, non_blocking=non_blocking)
            if device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            assert torch.equal(view, data.cpu()) and torch.equal(back, data)
            # Dense with its dimensions permuted (HND blocks), against a contiguous tensor.
            hnd = view.view(40, 16, CHUNK // 512).permute(1, 0, 2)
            data = torch.randn(hnd.shape, generator=gen).half().to(device)
            mgr.host_copy(hnd, data, non_blocking=non_blocking)
            back = torch.zeros_like(data)
            mgr.host_copy(back, hnd, non_blocking=non_blocking)
            if device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            assert torch.equal(hnd, data.cpu()) and torch.equal(back, data)
            rows = mgr.host_view().view(4, CHUNK)[1:3]  # a slice of rows: contiguous
            mgr.host_copy(rows, torch.ones(2, CHUNK, dtype=torch.uint8, device=device))
            if device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            assert bool((mgr.host_view(CHUNK, 2 * CHUNK) == 1).all())
            del view, hnd, rows


async def test_what_it_cannot_copy_is_refused() -> None:
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(torch.device("cpu")) as mgr:
            await mgr.pinned
            view = mgr.host_view(0, 2 * CHUNK)
            before = view.clone()
            for dst, src, words in (
                (view, torch.zeros(CHUNK, dtype=torch.uint8), "one shape and dtype"),
                (view, torch.zeros(2 * CHUNK, dtype=torch.int8), "one shape and dtype"),
                (
                    view.view(torch.complex64),
                    torch.zeros(2 * CHUNK // 8, dtype=torch.complex64).conj(),
                    "conjugate",
                ),
                (torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8), "view of"),
                (view, [0] * 4, "not list"),
                (mgr.host_view(512, CHUNK), mgr.host_view(0, CHUNK), "overlapping"),
            ):
                with pytest.raises(ConfigError, match=words):
                    mgr.host_copy(dst, src)  # type: ignore[arg-type]
            assert torch.equal(view, before)  # nothing copied
            mgr.host_copy(mgr.host_view(3 * CHUNK, 64), mgr.host_view(0, 64))  # apart: fine
            assert torch.equal(mgr.host_view(3 * CHUNK, 64), mgr.host_view(0, 64))
            del view
        with pytest.raises(anyio.ClosedResourceError):
            mgr.host_copy(torch.zeros(1), torch.zeros(1))


async def test_every_piece_lies_in_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies host_copy makes, recorded: a contiguous view, a dense view whose
    dimensions are permuted (FlashInfer's HND blocks), each against a contiguous tensor,
    both ways; every piece within one chunk, the bytes right. A strided view (not dense)
    goes to torch whole, and an empty one copies nothing."""
    pieces: list[tuple[int, int]] = []
    real = asyncpin.manager._copy_piece

    def record(to: torch.Tensor, frm: torch.Tensor, non_blocking: bool) -> None:
        host = to if base <= to.data_ptr() < base + 4 * CHUNK else frm
        pieces.append((host.data_ptr() - base, host.numel()))
        real(to, frm, non_blocking)

    monkeypatch.setattr(asyncpin.manager, "_copy_piece", record)
    gen = torch.Generator().manual_seed(2)
    with anyio.fail_after(TIMEOUT_S):
        async with _manager(torch.device("cpu")) as mgr:
            await mgr.pinned
            base = mgr.host_view().data_ptr()
            raw = mgr.host_view(CHUNK // 2 + 6, 2 * CHUNK)  # an odd offset
            contiguous = raw.view(torch.int16)
            permuted = raw.view(torch.int16).view(64, 16, CHUNK // 1024).permute(1, 0, 2)
            for view in (contiguous, permuted):
                data = torch.randint(-(2**15), 2**15, view.shape, generator=gen, dtype=torch.int16)
                pieces.clear()
                mgr.host_copy(view, data)
                assert torch.equal(view, data)
                back = torch.empty(view.shape, dtype=torch.int16)
                mgr.host_copy(back, view)
                assert torch.equal(back, data)
                assert len(pieces) == 6  # three chunks touched, each way
                for start, nbytes in pieces:
                    assert start // CHUNK == (start + nbytes - 1) // CHUNK, (start, nbytes)
            pieces.clear()
            rows = mgr.host_view().view(4, CHUNK)[:, CHUNK // 2 :]  # not dense
            mgr.host_copy(rows, torch.full(rows.shape, 3, dtype=torch.uint8))
            assert bool((rows == 3).all()) and pieces == []
            mgr.host_copy(mgr.host_view(0, 8)[:0], torch.empty(0, dtype=torch.uint8))
            del raw, contiguous, permuted, view, rows
