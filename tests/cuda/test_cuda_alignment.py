"""KV arrays at odd addresses on a real GPU: every method, both ways, byte for byte, and
the CUDA context still healthy afterwards (`pytest -m cuda`).

The copy kernel moves 8-byte words; on device arrays a few bytes into a larger buffer it
would fault with cudaErrorMisalignedAddress, a sticky error after which every CUDA call
of the process fails. Such layouts run every method as DMA (batch); aligned ones keep
the kernel. Each case also checks that no byte outside the copied blocks changed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import anyio
import pytest
import torch
from structlog.testing import capture_logs

from asyncpin import KVLayout, OffloadManager

pytestmark = pytest.mark.cuda

ARRAYS, BLOCKS, HOST_BLOCKS = 4, 256, 256
METHODS = ["auto", "batch", "pack", "kernel"]


@dataclass(frozen=True)
class Case:
    offset: int  # bytes from the buffer's start to array 0
    block: int = 112  # bytes per block
    stride: int = 0  # bytes from block to block (0: the block size)
    gap: int = 0  # bytes between one array's end and the next one's start
    dtype: torch.dtype = torch.uint8

    @property
    def step(self) -> int:
        return self.stride or self.block

    @property
    def aligned(self) -> bool:
        starts = [self.offset + a * (BLOCKS * self.step + self.gap) for a in range(ARRAYS)]
        return all(x % 8 == 0 for x in (*starts, self.step, self.block))


CASES = {
    "offset1": Case(1),
    "offset2": Case(2),
    "offset4": Case(4),
    "offset5": Case(5),
    "offset5-arrays-at-mixed-offsets": Case(5, gap=3),
    "offset2-bf16": Case(2, dtype=torch.bfloat16),
    "stride116": Case(0, stride=116),
    "block100-offset5": Case(5, block=100),
    "block113": Case(0, block=113),
    "offset8-aligned": Case(8),
}


def _views(buffer: torch.Tensor, case: Case, dtype: torch.dtype) -> list[torch.Tensor]:
    """The arrays ``[BLOCKS, block]`` over a flat uint8 ``buffer``, as ``dtype``."""
    item = dtype.itemsize
    arrays, pos = [], case.offset
    for _ in range(ARRAYS):
        raw = buffer[pos : pos + BLOCKS * case.step]
        typed = raw.view(dtype) if dtype != torch.uint8 else raw
        arrays.append(typed.as_strided((BLOCKS, case.block // item), (case.step // item, 1)))
        pos += BLOCKS * case.step + case.gap
    return arrays


def _healthy() -> None:
    """Every CUDA call still works: no sticky error poisons the context."""
    torch.cuda.synchronize()
    x = torch.arange(1024, device="cuda", dtype=torch.float32)
    assert float((x * 2).sum().item()) == 1024 * 1023
    torch.cuda.synchronize()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_every_method_both_ways_byte_exact(case: Case) -> None:
    size = case.offset + ARRAYS * (BLOCKS * case.step + case.gap) + 64
    gen = torch.Generator(device="cuda").manual_seed(case.offset * 1000 + case.block)
    buffer = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=gen)
    layout = KVLayout.from_tensors(_views(buffer, case, case.dtype))
    assert layout.block_bytes == case.block
    assert (layout.arrays[0].data_ptr() - buffer.data_ptr()) == case.offset
    ref = buffer.cpu()  # the device bytes as they must be, kept by CPU copies
    ref_arrays = _views(ref, case, torch.uint8)
    rng = random.Random(case.offset * 1000 + case.block)
    with capture_logs() as logs:
        async with OffloadManager.for_kv(layout, HOST_BLOCKS, backend="cuda") as mgr:
            await mgr.pinned
            host = mgr.host_blocks().reshape(HOST_BLOCKS, ARRAYS, -1).view(torch.uint8)
            host_ref = host.clone()
            for method in METHODS:
                for n in (100, 1):  # the large and the small (up to 64 segments) paths
                    if method == "auto":
                        # One block (a run of ids) of small blocks: the copy kernel.
                        kernel_default = "pack" if n * ARRAYS > 64 else "kernel"
                        expected = kernel_default if case.aligned else "batch"
                    else:
                        expected = method if case.aligned else "batch"
                    gpu, cpu = rng.sample(range(BLOCKS), n), rng.sample(range(HOST_BLOCKS), n)
                    with anyio.fail_after(60):
                        t = mgr.store(gpu, cpu, method=method)  # type: ignore[arg-type]
                        await t
                    assert t.method == expected, (method, n)
                    for a in range(ARRAYS):
                        host_ref[cpu, a] = ref_arrays[a][gpu]
                    assert torch.equal(host, host_ref), f"host bytes differ after {method} store"
                    dest = rng.sample(range(BLOCKS), n)
                    with anyio.fail_after(60):
                        t = mgr.load(cpu, dest, method=method)  # type: ignore[arg-type]
                        await t
                    assert t.method == expected, (method, n)
                    for a in range(ARRAYS):
                        ref_arrays[a][dest] = host_ref[cpu, a]
                    assert torch.equal(buffer.cpu(), ref), (
                        f"device bytes differ after {method} load"
                    )
            del host, host_ref
            _healthy()
    disabled = [e for e in logs if e["event"] == "transfer.kernel_disabled"]
    fallbacks = sorted(e["requested"] for e in logs if e["event"] == "transfer.method_fallback")
    if case.aligned:
        assert not disabled and not fallbacks
    else:
        assert len(disabled) == 1 and fallbacks == ["kernel", "pack"]
    _healthy()


def test_context_still_healthy_after_all_cases() -> None:
    _healthy()
    y = torch.ones(1 << 20, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(y.cpu(), torch.ones(1 << 20, dtype=torch.bfloat16))
