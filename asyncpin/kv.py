"""KVLayout: the engine's per-layer KV tensors, described once, block by block.

Each tensor has a block dimension. Dimensions before it are split off (vLLM's
``[2, num_blocks, ...]`` per layer becomes a K array and a V array); what remains is an
*array* ``[num_blocks, *block_shape]``. Every array must agree on device and number of
blocks: block ``g`` of every array is one engine block, one id. Arrays may differ in block
shape and dtype (K and V of different head sizes, an MLA cache beside its indexer cache,
hybrid attention); ``uniform`` says whether they do not.

A block must be *dense*: its elements fill ``block_bytes`` bytes from the block's first
element, in any order of its dimensions. Contiguous blocks are dense; so are the blocks of
a view whose stride order puts heads before blocks over memory that is block-major (the
HND layout of FlashInfer's paged cache, as vLLM allocates it). The bytes of a block are
moved as they lie: a block comes back to the device exactly as it left.

On the host, blocks are laid out block-major: host block ``c`` holds every array's block
back to back (array ``a`` at ``array_offsets[a]``, ``host_block_bytes`` in all), so one
host block moves as one large DMA.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from asyncpin.errors import ConfigError

__all__ = ["KVLayout", "byte_blocks", "is_dense"]

_T = TypeVar("_T")


@dataclass(frozen=True, eq=False)
class KVLayout:
    """Per-array views ``[num_blocks, *block_shape]`` over the engine's KV tensors."""

    arrays: tuple[torch.Tensor, ...] = field(repr=False)
    num_blocks: int
    device: torch.device
    #: Each array's block shape and dtype.
    array_shapes: tuple[tuple[int, ...], ...]
    array_dtypes: tuple[torch.dtype, ...]
    #: Bytes of one block of each array, and where it lies in a host block.
    array_block_bytes: tuple[int, ...]
    array_offsets: tuple[int, ...]
    #: Bytes of one host block: every array's block, back to back.
    host_block_bytes: int
    #: The arrays each tensor given to ``from_tensors`` became, in order (for a layer's
    #: ``[2, num_blocks, ...]`` tensor, its K and V arrays): the groups of a layer-wise
    #: load.
    tensor_arrays: tuple[range, ...]

    @property
    def num_arrays(self) -> int:
        return len(self.arrays)

    @property
    def uniform(self) -> bool:
        """Whether every array has the same block shape and dtype."""
        return len(set(zip(self.array_shapes, self.array_dtypes, strict=True))) == 1

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The block shape of every array (ConfigError if they differ)."""
        return self._uniform("block shape", self.array_shapes)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of every array (ConfigError if they differ)."""
        return self._uniform("dtype", self.array_dtypes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of each array (ConfigError if they differ)."""
        return self._uniform("block size", self.array_block_bytes)

    def _uniform(self, what: str, values: tuple[_T, ...]) -> _T:
        if len(set(values)) != 1:
            raise ConfigError(
                f"the KV arrays differ in {what} ({sorted(set(map(str, values)))}): ask "
                "per array (array_shapes, array_dtypes, array_block_bytes)"
            )
        return values[0]

    def span(self, arrays: range) -> tuple[int, int]:
        """``(offset, nbytes)`` of ``arrays`` (consecutive) within a host block."""
        first, last = arrays[0], arrays[-1]
        start = self.array_offsets[first]
        return start, self.array_offsets[last] + self.array_block_bytes[last] - start

    def byte_arrays(self) -> list[torch.Tensor]:
        """Each array's blocks as raw bytes, ``[num_blocks, block_bytes]`` uint8 views."""
        return [byte_blocks(array) for array in self.arrays]

    def description(self) -> dict[str, object]:
        """What the bytes of a host block mean, recorded in a shared region's header (a
        page, whatever the number of arrays): the most telling figures, then a digest of
        every array's block shape, dtype and element order."""
        arrays = [
            (
                list(shape),
                str(dtype),
                [st if n > 1 else 0 for n, st in zip(shape, array.stride()[1:], strict=True)],
            )
            for shape, dtype, array in zip(
                self.array_shapes, self.array_dtypes, self.arrays, strict=True
            )
        ]
        digest = hashlib.sha256(json.dumps(arrays).encode()).hexdigest()[:32]
        return {
            "num_arrays": self.num_arrays,
            "host_block_bytes": self.host_block_bytes,
            "arrays": digest,
        }

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], *, block_dim: int = 0) -> KVLayout:
        """Describe ``tensors`` (one or more per layer) whose dimension ``block_dim``
        indexes KV blocks. Raises ConfigError when they disagree on device or number of
        blocks, or a block is not dense."""
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if not tensors:
            raise ConfigError("a KV layout needs at least one tensor")
        if isinstance(block_dim, bool) or not isinstance(block_dim, int):
            raise ConfigError(f"block_dim must be an int, not {type(block_dim).__name__}")
        arrays: list[torch.Tensor] = []
        groups: list[range] = []
        for n, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(f"tensor {n} is a {type(tensor).__name__}, not a torch.Tensor")
            _check_plain(tensor, n)
            if not 0 <= block_dim < tensor.dim():
                raise ConfigError(
                    f"block_dim={block_dim} is out of range for tensor {n} of shape "
                    f"{tuple(tensor.shape)}"
                )
            parts = _split_leading(tensor, block_dim)
            if not parts:
                raise ConfigError(
                    f"tensor {n} (shape {tuple(tensor.shape)}) holds no KV array: a "
                    f"dimension before block_dim={block_dim} is 0"
                )
            groups.append(range(len(arrays), len(arrays) + len(parts)))
            arrays.extend(parts)
        first = arrays[0]
        for n, array in enumerate(arrays):
            for what, mine, theirs in (
                ("device", array.device, first.device),
                ("number of blocks", array.shape[0], first.shape[0]),
            ):
                if mine != theirs:
                    raise ConfigError(f"KV array {n} has {what} {mine}, array 0 has {theirs}")
            if array.shape[0] == 0 or array[0].numel() == 0:
                raise ConfigError("KV arrays must hold at least one non-empty block")
            if not is_dense(array[0]) or (
                array.shape[0] > 1 and array.stride(0) < array[0].numel()
            ):
                raise ConfigError(
                    f"KV array {n} (shape {tuple(array.shape)}, strides {array.stride()}) does "
                    "not hold each block densely: a block's elements must fill its bytes, "
                    "apart from every other block's"
                )
        sizes = [array[0].numel() * array.dtype.itemsize for array in arrays]
        _check_apart(arrays, sizes)
        offsets = [sum(sizes[:a]) for a in range(len(sizes))]
        return cls(
            arrays=tuple(arrays),
            num_blocks=int(first.shape[0]),
            device=first.device,
            array_shapes=tuple(tuple(int(d) for d in a.shape[1:]) for a in arrays),
            array_dtypes=tuple(a.dtype for a in arrays),
            array_block_bytes=tuple(sizes),
            array_offsets=tuple(offsets),
            host_block_bytes=sum(sizes),
            tensor_arrays=tuple(groups),
        )


def _check_plain(tensor: torch.Tensor, n: int) -> None:
    """A strided tensor whose bytes are its values: not sparse, nested, quantized (the
    scales are not in the blocks) or a lazy conjugate or negative view."""
    why = None
    if tensor.is_nested:
        why = "a nested tensor"
    elif tensor.layout != torch.strided:
        why = f"a {tensor.layout} tensor"
    elif tensor.is_quantized:
        why = "a quantized tensor (its scales are not in its blocks): pass its int_repr()"
    elif tensor.is_conj() or tensor.is_neg():
        why = "a lazy conjugate or negative view: resolve it first"
    if why is not None:
        raise ConfigError(f"tensor {n} is {why}; KV arrays are strided tensors of plain values")


def _check_apart(arrays: list[torch.Tensor], sizes: list[int]) -> None:
    """No block of one array overlaps a block of another unless the two arrays are the
    same memory (a cache shared between layers): a load into one would otherwise write
    another array's blocks. Arrays are compared by their blocks' byte ranges, block ``g``
    at ``ptr + g * stride``: apart when their extents are, or, with one stride, when their
    blocks sit at offsets that never meet modulo the stride. Whatever their storages: two
    storages may hold the same memory (``torch.from_numpy`` of two views of one array,
    DLPack, ``frombuffer``)."""
    spans = []
    for array, size in zip(arrays, sizes, strict=True):
        ptr = array.data_ptr()
        stride = array.stride(0) * array.dtype.itemsize
        end = ptr + (array.shape[0] - 1) * stride + size
        spans.append((ptr, stride, size, end))
    for i, (a, sa, za, ea) in enumerate(spans):
        for j in range(i):
            b, sb, zb, eb = spans[j]
            if ea <= b or eb <= a or (a, sa, za) == (b, sb, zb):
                continue
            if sa == sb and sa >= za and sa >= zb and len(arrays[i]) > 1:
                d = (b - a) % sa
                if d >= za and d + zb <= sa:
                    continue
            raise ConfigError(
                f"KV arrays {j} and {i} overlap in memory: a block of one holds bytes of a "
                "block of the other"
            )


def is_dense(block: torch.Tensor) -> bool:
    """Whether ``block``'s elements fill ``numel * itemsize`` bytes from its first element,
    in some order of its dimensions (any permutation of a contiguous tensor)."""
    expected = 1
    for size, stride in sorted(
        ((s, st) for s, st in zip(block.shape, block.stride(), strict=True) if s != 1),
        key=lambda d: d[1],
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def byte_blocks(array: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_bytes]`` uint8 view of the bytes of ``array``'s dense blocks."""
    size = array.dtype.itemsize
    raw = torch.empty(0, dtype=torch.uint8, device=array.device)
    raw.set_(
        array.untyped_storage(),
        array.storage_offset() * size,
        (array.shape[0], array[0].numel() * size),
        (array.stride(0) * size, 1),
    )
    return raw


def _split_leading(tensor: torch.Tensor, block_dim: int) -> list[torch.Tensor]:
    if block_dim == 0:
        return [tensor]
    return [part for sub in tensor.unbind(0) for part in _split_leading(sub, block_dim - 1)]
