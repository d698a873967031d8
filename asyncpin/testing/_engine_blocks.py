"""The engine check's model of the bytes: what every host and device block must hold, and
the bytes of the region outside the engine's host blocks, which must never change."""

from __future__ import annotations

import bisect

import torch

from asyncpin.kv import KVLayout
from asyncpin.transfers import Direction, host_bytes_view

__all__ = ["Blocks"]


class Blocks:
    """The host blocks (rows of a view of the region, block-major, ``host_slice``'s part
    of each) and the device blocks (in the layout's arrays): random bytes from one seeded
    generator, and what each block must hold after the jobs submitted so far (``host``
    and ``device``).

    A block is modelled as its ``host_block_bytes`` bytes: array ``a``'s block, as it lies
    in memory (``byte_blocks``), at ``array_offsets[a]``. Every other byte of the region
    (the other ranks' parts of each row, the tail past the last host block) keeps the
    random bytes it was given."""

    def __init__(
        self,
        layout: KVLayout,
        num_host: int,
        seed: int,
        host_slice: tuple[int, int] = (0, 1),
    ) -> None:
        self.layout = layout
        self.hbb = layout.host_block_bytes
        self.num_host = num_host
        self.host_slice = host_slice
        self.generator = torch.Generator().manual_seed(seed)
        self.raw = layout.byte_arrays()
        self.region_bytes: torch.Tensor | None = None
        self.host_rows: torch.Tensor | None = None
        # The region's bytes in no host block of the engine's view, and what they hold.
        self.outside: torch.Tensor | None = None
        self.outside_bytes: torch.Tensor | None = None
        self.host: list[torch.Tensor] = []
        self.device: list[torch.Tensor] = []

    def fill(self, region_bytes: torch.Tensor) -> None:
        """Write random bytes to the whole region (host blocks and every byte around
        them), then to every device block."""
        self.region_bytes = region_bytes
        self.host_rows = self.host_view(region_bytes)
        region_bytes.copy_(self.random(region_bytes.numel()))
        outside = torch.ones(region_bytes.numel(), dtype=torch.bool)
        host_bytes_view(outside, self.layout, self.num_host, self.host_slice).fill_(False)
        self.outside = outside
        self.outside_bytes = region_bytes[outside].clone()
        self.host = [self.host_rows[c].clone() for c in range(self.num_host)]
        self.device = [self.random(self.hbb) for _ in range(self.layout.num_blocks)]
        for g, data in enumerate(self.device):
            self.write_device(g, data)

    def host_view(self, region_bytes: torch.Tensor) -> torch.Tensor:
        """The engine's ``EngineSetup.host_blocks`` over ``region_bytes``."""
        return host_bytes_view(region_bytes, self.layout, self.num_host, self.host_slice)

    def drop_region(self) -> None:
        """Drop every view of the region (so that it can unmap)."""
        self.region_bytes = None
        self.host_rows = None

    def renew_device(self, g: int) -> None:
        """Write new random bytes to device block ``g``."""
        data = self.random(self.hbb)
        self.device[g] = data
        self.write_device(g, data)

    def copied(
        self,
        direction: Direction,
        gpu_ids: list[int],
        cpu_ids: list[int],
        arrays: range | None,
    ) -> None:
        """What the blocks must hold once a job of these ids (and ``arrays``: None for
        every array) has copied: only the bytes of ``arrays`` move."""
        start, nbytes = (0, self.hbb) if arrays is None else self.layout.span(arrays)
        part = slice(start, start + nbytes)
        for g, c in zip(gpu_ids, cpu_ids, strict=True):
            if direction == "store":
                self.host[c] = _with(self.host[c], part, self.device[g])
            else:
                self.device[g] = _with(self.device[g], part, self.host[c])

    def compare(self, where: str) -> None:
        """Raise AssertionError (``where``, then the block) unless every block holds what
        it must and no byte of the region outside the host blocks changed."""
        self._outside_untouched(where)
        layout = self.layout
        for c, expected in enumerate(self.host):
            _same(f"{where}, host block {c}", self.host_block(c), expected, layout)
        arrays = [raw.cpu() for raw in self.raw]
        for g, expected in enumerate(self.device):
            got = torch.cat([array[g] for array in arrays])
            _same(f"{where}, device block {g}", got, expected, layout)

    def _outside_untouched(self, where: str) -> None:
        assert self.region_bytes is not None and self.host_rows is not None
        assert self.outside is not None and self.outside_bytes is not None
        got = self.region_bytes[self.outside]
        if torch.equal(got, self.outside_bytes):
            return
        differ = (got != self.outside_bytes).nonzero()
        first = int(self.outside.nonzero()[int(differ[0])])
        rank, ranks = self.host_slice
        row = self.host_rows.stride(0)
        if ranks > 1:
            detail = (
                f"host_blocks rows are stride(0) = {row} bytes apart; its host block is "
                f"{self.hbb} bytes at byte {rank * self.hbb} of a row, the rest of the row "
                "is the other ranks'"
            )
        else:
            detail = f"past its {self.num_host} host blocks of {self.hbb} bytes"
        raise AssertionError(
            f"{where}, the engine wrote outside its host blocks: {len(differ)} bytes of the "
            f"region changed, the first at byte {first} ({detail})"
        )

    def random(self, nbytes: int) -> torch.Tensor:
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=self.generator)

    def host_block(self, c: int) -> torch.Tensor:
        assert self.host_rows is not None
        return self.host_rows[c]

    def write_device(self, g: int, data: torch.Tensor) -> None:
        layout = self.layout
        for raw, offset, size in zip(
            self.raw, layout.array_offsets, layout.array_block_bytes, strict=True
        ):
            raw[g].copy_(data[offset : offset + size].to(raw.device))


def _with(block: torch.Tensor, part: slice, source: torch.Tensor) -> torch.Tensor:
    """``block`` with ``part`` taken from ``source`` (a new tensor: the model's blocks are
    never changed in place, so two may share one)."""
    if part == slice(0, block.numel()):
        return source
    new = block.clone()
    new[part] = source[part]
    return new


def _same(where: str, got: torch.Tensor, expected: torch.Tensor, layout: KVLayout) -> None:
    if torch.equal(got, expected):
        return
    differ = (got != expected).nonzero()
    byte = int(differ[0])
    a = bisect.bisect_right(layout.array_offsets, byte) - 1
    offset = byte - layout.array_offsets[a]
    raise AssertionError(
        f"{where} holds wrong bytes: {len(differ)} differ, the first in array {a} at byte "
        f"{offset} ({int(got[byte])} instead of {int(expected[byte])})"
    )
