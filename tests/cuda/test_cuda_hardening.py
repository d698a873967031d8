"""Region hardening on a real GPU: views that outlive close after real cudaHostRegister
calls, and shared KV regions whose header carries the layout (run with `pytest -m cuda`)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import anyio
import pytest
import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin.errors import ConfigError
from asyncpin.testing import FakeBackend

pytestmark = pytest.mark.cuda

NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered
BLOCKS = 64


def _cuda_fake() -> FakeBackend:
    from asyncpin.cuda import CudaBackend

    return FakeBackend(inner=CudaBackend())


def _registered(address: int) -> bool:
    from asyncpin._cudart import cudart

    lib = cudart()
    assert lib is not None
    flags = ctypes.c_uint(0)
    code = lib.cudaHostGetFlags(ctypes.byref(flags), ctypes.c_void_p(address))
    lib.cudaGetLastError()  # clear the error a lookup of unregistered memory leaves
    return bool(code == 0)


def _mapped(address: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
        if lo <= address < hi:
            return True
    return False


def _layout(dtype: torch.dtype = torch.bfloat16) -> KVLayout:
    gen = torch.Generator(device="cuda").manual_seed(3)
    arrays = [
        torch.randint(-100, 100, (BLOCKS, 16, 8, 64), generator=gen, device="cuda").to(dtype)
        for _ in range(4)
    ]
    return KVLayout.from_tensors(arrays)


class TestViewsOutliveCloseOnCuda:
    """After close every chunk is unregistered, a live view still reads its bytes, and the
    range is unmapped once the view is gone."""

    async def test_host_blocks_after_close(self) -> None:
        layout = _layout()
        fake = _cuda_fake()
        mgr = OffloadManager.for_kv(layout, BLOCKS, backend=fake, chunk_bytes=1 << 20)
        with anyio.fail_after(120):
            async with mgr:
                await mgr.pinned
                await mgr.store(list(range(BLOCKS)), list(range(BLOCKS)))
                blocks = mgr.host_blocks()
                address = blocks.data_ptr()
                assert _registered(address)
        assert all(not _registered(a) for a, _ in fake.pinned_spans())
        assert sorted(fake.unpinned_spans()) == sorted(fake.pinned_spans())
        assert mgr.stats().mapped_by_views_bytes == mgr.nbytes
        for a, array in enumerate(layout.arrays):
            assert torch.equal(blocks[:, a], array.cpu())  # the stored bytes, still readable
        del blocks
        assert mgr.stats().mapped_by_views_bytes == 0
        assert not _mapped(address)


class TestSharedKvHeaderOnCuda:
    """A shared KV region records its layout; an attacher with another layout is refused
    before anything is mapped or pinned."""

    async def test_other_dtype_is_refused(self, shm_name: str) -> None:
        with anyio.fail_after(120):
            async with OffloadManager.for_kv(
                _layout(torch.bfloat16), BLOCKS, backing="shared", name=shm_name
            ) as creator:
                await creator.pinned
                fake = _cuda_fake()
                other = OffloadManager.attached(
                    shm_name,
                    backend=fake,
                    kv_layout=_layout(torch.float16),
                    num_host_blocks=BLOCKS,
                )
                with pytest.raises(ConfigError, match="dtype"):
                    async with other:
                        pass
                assert fake.calls == []
