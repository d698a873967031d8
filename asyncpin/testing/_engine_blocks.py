"""The engine check's model of the bytes: what every host and device block must hold."""

from __future__ import annotations

import torch

from asyncpin.kv import KVLayout
from asyncpin.transfers import TransferJob

__all__ = ["Blocks"]


class Blocks:
    """The host blocks (in a view of the region, block-major) and the device blocks (in
    the layout's arrays): random bytes from one seeded generator, and what each block
    must hold after the jobs submitted so far (``host`` and ``device``)."""

    def __init__(self, layout: KVLayout, num_host: int, seed: int) -> None:
        self.layout = layout
        self.hbb = layout.host_block_bytes
        self.num_host = num_host
        self.generator = torch.Generator().manual_seed(seed)
        self.region_bytes: torch.Tensor | None = None
        self.host: list[torch.Tensor] = []
        self.device: list[torch.Tensor] = []

    def fill(self, region_bytes: torch.Tensor) -> None:
        """Write random bytes to every host block of ``region_bytes``, then to every
        device block."""
        self.region_bytes = region_bytes
        self.host = [self.random_block() for _ in range(self.num_host)]
        for c, data in enumerate(self.host):
            self.host_block(c).copy_(data)
        self.device = [self.random_block() for _ in range(self.layout.num_blocks)]
        for g, data in enumerate(self.device):
            self.write_device(g, data)

    def renew_device(self, g: int) -> None:
        """Write new random bytes to device block ``g``."""
        data = self.random_block()
        self.device[g] = data
        self.write_device(g, data)

    def copied(self, job: TransferJob) -> None:
        """What the blocks must hold once ``job`` has copied."""
        pairs = zip(job.gpu_ids, job.cpu_ids, strict=True)
        if job.transfer.direction == "store":
            for g, c in pairs:
                self.host[c] = self.device[g]
        else:
            for g, c in pairs:
                self.device[g] = self.host[c]

    def compare(self, where: str) -> None:
        """Raise AssertionError (``where``, then the block) unless every block holds what
        it must."""
        for c, expected in enumerate(self.host):
            _same(f"{where}, host block {c}", self.host_block(c), expected)
        for g, expected in enumerate(self.device):
            _same(f"{where}, device block {g}", self.read_device(g), expected)

    def random_block(self) -> torch.Tensor:
        layout = self.layout
        return torch.randint(
            0,
            256,
            (layout.num_arrays, layout.block_bytes),
            dtype=torch.uint8,
            generator=self.generator,
        )

    def host_block(self, c: int) -> torch.Tensor:
        assert self.region_bytes is not None
        block = self.region_bytes[c * self.hbb : (c + 1) * self.hbb]
        return block.view(self.layout.num_arrays, self.layout.block_bytes)

    def write_device(self, g: int, data: torch.Tensor) -> None:
        for a, array in enumerate(self.layout.arrays):
            array[g].reshape(-1).view(torch.uint8).copy_(data[a].to(array.device))

    def read_device(self, g: int) -> torch.Tensor:
        return torch.stack(
            [array[g].reshape(-1).view(torch.uint8) for array in self.layout.arrays]
        ).cpu()


def _same(where: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if torch.equal(got, expected):
        return
    differ = (got != expected).nonzero()
    a, offset = (int(x) for x in differ[0])
    raise AssertionError(
        f"{where} holds wrong bytes: {len(differ)} differ, the first in array {a} at byte "
        f"{offset} ({int(got[a, offset])} instead of {int(expected[a, offset])})"
    )
