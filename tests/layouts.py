"""KV layouts engines really use, built on any device, for the round-trip tests of every
engine (the host engine here, the CUDA engine's methods in ``tests/cuda``).

Each builder takes ``(num_blocks, device)`` and returns the tensors and ``block_dim`` to
give ``KVLayout.from_tensors``, filled with random bytes."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin.transfers import Method
from tests.kit import random_bytes

Built = tuple[list[torch.Tensor], int]


def _random(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator
) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    raw = random_bytes((n * dtype.itemsize,), gen).view(dtype).view(shape)
    return raw.to(device)


def joined(num_blocks: int, device: str, gen: torch.Generator) -> Built:
    """vLLM's FlashAttention cache: per layer [2, blocks, block_size, heads, head_dim]."""
    return [_random((2, num_blocks, 4, 2, 8), torch.float16, device, gen) for _ in range(2)], 1


def flashinfer_hnd(num_blocks: int, device: str, gen: torch.Generator) -> Built:
    """FlashInfer's HND cache as vLLM allocates it: memory [blocks, 2, heads, block_size,
    head_dim], seen through a view whose logical shape is [blocks, 2, block_size, heads,
    head_dim]: the stride order puts heads before the block's tokens."""
    tensors = []
    for _ in range(2):
        physical = _random((num_blocks, 2, 2, 4, 8), torch.bfloat16, device, gen)
        tensors.append(physical.permute(0, 1, 3, 2, 4))
    return tensors, 0


def k_v_head_sizes(num_blocks: int, device: str, gen: torch.Generator) -> Built:
    """K and V of different head sizes (split per layer)."""
    tensors = []
    for _ in range(2):
        tensors.append(_random((num_blocks, 4, 2, 12), torch.bfloat16, device, gen))
        tensors.append(_random((num_blocks, 4, 2, 8), torch.bfloat16, device, gen))
    return tensors, 0


def mla_indexer(num_blocks: int, device: str, gen: torch.Generator) -> Built:
    """An MLA latent cache beside an fp8 indexer cache of another shape and dtype."""
    tensors = []
    for _ in range(2):
        tensors.append(_random((num_blocks, 4, 72), torch.bfloat16, device, gen))
        tensors.append(_random((num_blocks, 4, 34), torch.float8_e4m3fn, device, gen))
    return tensors, 0


def hybrid(num_blocks: int, device: str, gen: torch.Generator) -> Built:
    """Hybrid attention: an attention layer (K, V joined) and a state-space layer's
    state per block, float32."""
    attention = _random((2, num_blocks, 4, 2, 8), torch.float16, device, gen)
    return [attention[0], attention[1], _random((num_blocks, 3, 16), torch.float32, device, gen)], 0


def odd_bytes(num_blocks: int, device: str, gen: torch.Generator) -> Built:
    """Blocks of an odd number of bytes (the copy kernel's 8-byte words cannot run)."""
    return [
        _random((num_blocks, 3, 5), torch.uint8, device, gen),
        _random((num_blocks, 7), torch.float16, device, gen),
    ], 0


CASES: dict[str, Callable[[int, str, torch.Generator], Built]] = {
    "joined": joined,
    "flashinfer_hnd": flashinfer_hnd,
    "k_v_head_sizes": k_v_head_sizes,
    "mla_indexer": mla_indexer,
    "hybrid": hybrid,
    "odd_bytes": odd_bytes,
}


def build(name: str, num_blocks: int, device: str, seed: int = 0) -> KVLayout:
    gen = torch.Generator().manual_seed(seed)
    tensors, block_dim = CASES[name](num_blocks, device, gen)
    return KVLayout.from_tensors(tensors, block_dim=block_dim)


def block_bytes(layout: KVLayout, a: int, g: int) -> torch.Tensor:
    """The bytes of block ``g`` of array ``a``, as they lie (on the CPU)."""
    return layout.byte_arrays()[a][g].cpu()


def randomize_arrays(layout: KVLayout, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for raw in layout.byte_arrays():
        raw.copy_(random_bytes(tuple(raw.shape), gen).to(raw.device))


def _snapshot(layout: KVLayout) -> list[torch.Tensor]:
    return [raw.cpu().clone() for raw in layout.byte_arrays()]


async def round_trip(
    mgr: OffloadManager, layout: KVLayout, n: int, method: Method = "auto", seed: int = 0
) -> None:
    """Store ``n`` blocks, load them elsewhere, then move ranges of arrays one way and the
    other: every byte lands where it must and nothing else changes (AssertionError)."""
    rng = random.Random(seed)
    offsets, sizes = layout.array_offsets, layout.array_block_bytes
    arrays = range(layout.num_arrays)

    def host_part(a: int, c: int) -> torch.Tensor:
        return mgr.host_bytes()[c, offsets[a] : offsets[a] + sizes[a]]

    randomize_arrays(layout, seed + 1)
    stored = _snapshot(layout)
    gpu = rng.sample(range(layout.num_blocks), n)
    cpu = rng.sample(range(mgr.num_host_blocks), n)
    await mgr.store(gpu, cpu, method=method)
    for a, i in itertools.product(arrays, range(n)):
        assert torch.equal(host_part(a, cpu[i]), stored[a][gpu[i]]), f"store: array {a}"

    randomize_arrays(layout, seed + 2)
    before = _snapshot(layout)
    dest = rng.sample(range(layout.num_blocks), n)
    await mgr.load(cpu, dest, method=method)
    after = _snapshot(layout)
    for a in arrays:
        expected = before[a].clone()
        expected[dest] = stored[a][gpu]
        assert torch.equal(after[a], expected), f"load: array {a}"

    # A range of arrays at a time: a layer-wise load, a layer-wise store.
    for group in (layout.tensor_arrays[-1], range(1, layout.num_arrays)):
        if not group:
            continue
        randomize_arrays(layout, seed + 3)
        before = _snapshot(layout)
        await mgr.load(cpu, dest, method=method, arrays=group)
        after = _snapshot(layout)
        for a in arrays:
            expected = before[a].clone()
            if a in group:
                expected[dest] = stored[a][gpu]
            assert torch.equal(after[a], expected), f"load of arrays {group}: array {a}"
        host_before = mgr.host_bytes().clone()
        await mgr.store(dest, cpu, method=method, arrays=group)
        host_after = mgr.host_bytes()
        expected_host = host_before.clone()
        for a in group:
            for i, c in enumerate(cpu):
                expected_host[c, offsets[a] : offsets[a] + sizes[a]] = after[a][dest[i]]
        assert torch.equal(host_after, expected_host), f"store of arrays {group}"
