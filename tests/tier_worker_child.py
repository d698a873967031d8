"""The worker side of tests/test_tier_scheduler.py: a GPU worker's copies, on CPU tensors.

    python tests/tier_worker_child.py NAME NUM_HOST_BLOCKS READ_FD WRITE_FD

It attaches to the shared KV region ``NAME`` (the test process created it), says hello
with its block size, then runs the scheduler's messages, one JSON object a line on
``READ_FD``: ``store`` writes each hash's bytes (:func:`hash_block`, standing in for
the model's compute) into the device blocks ``gpu`` and copies them to the host blocks
``host``; ``load`` copies ``host`` into ``gpu`` and checks the bytes of ``hashes``. Each
is answered on ``WRITE_FD`` once its copy is over (``{"id", "ok", "error", "verified"}``),
never before. ``"fail": true`` makes that store's copy fail; ``"crash": true`` submits the
store and exits at once with status 3 (a worker that died mid-copy); ``exit`` closes the
manager and ends the process.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO

import anyio
import anyio.to_thread
import torch

from asyncpin import KVLayout, OffloadManager, Transfer
from asyncpin.abc import EngineSetup
from asyncpin.engines.host import HostTransferEngine
from asyncpin.transfers import TransferJob

LAYERS = 2
NUM_GPU_BLOCKS = 16
SHAPE = (2, NUM_GPU_BLOCKS, 8, 16)  # per layer: [K/V, blocks, tokens, head size]
DTYPE = torch.float16
CHUNK = 64 << 10
CRASH_STATUS = 3


def make_layout() -> KVLayout:
    """This process's "device" KV arrays (CPU tensors), zeroed."""
    return KVLayout.from_tensors(
        [torch.zeros(SHAPE, dtype=DTYPE) for _ in range(LAYERS)], block_dim=1
    )


def hash_block(h: int, layout: KVLayout) -> torch.Tensor:
    """The bytes a block hash stands for: ``[num_arrays, *block_shape]``, random, seeded
    by the hash (never all zeros)."""
    generator = torch.Generator().manual_seed(h % (1 << 63))
    nbytes = layout.host_block_bytes
    raw = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(layout.dtype).view(layout.num_arrays, *layout.block_shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class FlakyEngine(HostTransferEngine):
    """The host engine; the copy of a transfer in ``failing`` raises."""

    def __init__(self, setup: EngineSetup) -> None:
        super().__init__(setup)
        self.failing: set[Transfer] = set()

    def _copy(self, job: TransferJob) -> None:
        if job.transfer in self.failing:
            raise RuntimeError("injected copy failure")
        super()._copy(job)


async def main(name: str, num_host_blocks: int, read_fd: int, write_fd: int) -> None:
    layout = make_layout()
    engines: list[FlakyEngine] = []

    def make_engine(setup: EngineSetup) -> FlakyEngine:
        engines.append(FlakyEngine(setup))
        return engines[-1]

    reader = os.fdopen(read_fd, "r")
    writer = os.fdopen(write_fd, "w", buffering=1)

    def reply(message: dict[str, Any]) -> None:
        writer.write(json.dumps(message) + "\n")

    async with OffloadManager.attached(
        name,
        backend="host",
        chunk_bytes=CHUNK,
        kv_layout=layout,
        num_host_blocks=num_host_blocks,
        engine=make_engine,
    ) as mgr:
        with anyio.fail_after(60):
            await mgr.pinned
        (engine,) = engines
        reply({"hello": True, "host_block_bytes": layout.host_block_bytes})
        while True:
            line = await anyio.to_thread.run_sync(reader.readline)
            if not line:
                break  # the scheduler is gone
            message = json.loads(line)
            if message["op"] == "exit":
                break
            run(mgr, engine, layout, message, reply, writer)
    # Closed: the close waited for the copies in flight, and their replies went first.
    writer.close()


def run(
    mgr: OffloadManager,
    engine: FlakyEngine,
    layout: KVLayout,
    message: dict[str, Any],
    reply: Any,
    writer: TextIO,
) -> None:
    hashes: list[int] = message["hashes"]
    gpu: list[int] = message["gpu"]
    host: list[int] = message["host"]
    if message["op"] == "store":
        for h, g in zip(hashes, gpu, strict=True):
            block = hash_block(h, layout)
            for a, array in enumerate(layout.arrays):
                array[g] = block[a]
        transfer = mgr.store(gpu, host)
        if message.get("fail"):
            engine.failing.add(transfer)  # before its copy starts: that needs the loop
        if message.get("crash"):
            writer.flush()
            os._exit(CRASH_STATUS)
    else:
        transfer = mgr.load(host, gpu)

    def done(t: Transfer) -> None:
        verified = None
        if t.direction == "load" and t.error is None:
            verified = all(
                same_bytes(
                    torch.stack([array[g] for array in layout.arrays]), hash_block(h, layout)
                )
                for h, g in zip(hashes, gpu, strict=True)
            )
        error = None if t.error is None else repr(t.error)
        reply({"id": message["id"], "ok": t.error is None, "error": error, "verified": verified})

    # Reported once the copy is over, done or failed: the host blocks are the copy's
    # until then, whatever happens to a task awaiting it.
    transfer.add_done_callback(done)


if __name__ == "__main__":
    name, blocks, read_fd, write_fd = sys.argv[1:5]
    anyio.run(main, name, int(blocks), int(read_fd), int(write_fd))
