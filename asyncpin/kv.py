"""KVLayout: the engine's per-layer KV tensors, described once, block by block.

Each tensor has a block dimension. Dimensions before it are split off (vLLM's
``[2, num_blocks, ...]`` per layer becomes a K array and a V array); what remains is an
*array* ``[num_blocks, *block_shape]`` whose blocks are each contiguous. Every array must
agree on device, dtype, number of blocks and block shape.

On the host, blocks are laid out block-major: host block ``c`` holds every array's block
back to back (``num_arrays * block_bytes`` contiguous bytes), so one host block moves as
one large DMA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from asyncpin.errors import ConfigError

__all__ = ["KVLayout"]


@dataclass(frozen=True, eq=False)
class KVLayout:
    """Per-array views ``[num_blocks, *block_shape]`` over the engine's KV tensors."""

    arrays: tuple[torch.Tensor, ...] = field(repr=False)
    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def num_arrays(self) -> int:
        return len(self.arrays)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one array."""
        numel = 1
        for dim in self.block_shape:
            numel *= dim
        return numel * self.dtype.itemsize

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one host block: every array's block, back to back."""
        return self.block_bytes * self.num_arrays

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], *, block_dim: int = 0) -> KVLayout:
        """Describe ``tensors`` (one or more per layer) whose dimension ``block_dim``
        indexes KV blocks. Raises ConfigError when they disagree or a block is not
        contiguous."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if not tensors:
            raise ConfigError("a KV layout needs at least one tensor")
        arrays: list[torch.Tensor] = []
        for n, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(f"tensor {n} is a {type(tensor).__name__}, not a torch.Tensor")
            if not 0 <= block_dim < tensor.dim():
                raise ConfigError(
                    f"block_dim={block_dim} is out of range for tensor {n} of shape "
                    f"{tuple(tensor.shape)}"
                )
            arrays.extend(_split_leading(tensor, block_dim))
        first = arrays[0]
        if first.shape[0] == 0 or first[0].numel() == 0:
            raise ConfigError("KV arrays must hold at least one non-empty block")
        for n, array in enumerate(arrays):
            for what, mine, theirs in (
                ("device", array.device, first.device),
                ("dtype", array.dtype, first.dtype),
                ("number of blocks", array.shape[0], first.shape[0]),
                ("block shape", tuple(array.shape[1:]), tuple(first.shape[1:])),
            ):
                if mine != theirs:
                    raise ConfigError(f"KV array {n} has {what} {mine}, array 0 has {theirs}")
            if not array[0].is_contiguous() or array.stride(0) < array[0].numel():
                raise ConfigError(
                    f"KV array {n} (shape {tuple(array.shape)}, strides {array.stride()}) does "
                    "not hold each block contiguously"
                )
        return cls(
            arrays=tuple(arrays),
            num_blocks=int(first.shape[0]),
            block_shape=tuple(int(d) for d in first.shape[1:]),
            dtype=first.dtype,
            device=first.device,
        )


def _split_leading(tensor: torch.Tensor, block_dim: int) -> list[torch.Tensor]:
    if block_dim == 0:
        return [tensor]
    return [part for sub in tensor.unbind(0) for part in _split_leading(sub, block_dim - 1)]
