"""The host engine: KV arrays that are CPU tensors, copied in worker threads. It runs
every test of the API on a machine with no GPU, and serves CPU-only engines."""

from __future__ import annotations

from collections import deque

import anyio
import torch

from asyncpin.abc import EngineSetup
from asyncpin.errors import ConfigError
from asyncpin.transfers import Direction, TransferJob, copy_in_thread, interrupted

__all__ = ["HostTransferEngine"]


class HostTransferEngine:
    """Copies between CPU tensors standing in for device KV and the host region, in a
    worker thread (torch's copy kernels release the GIL).

    Each direction has one FIFO, drained by one task at a time that copies its jobs one
    after the other: jobs of one direction run in submission order (a later store to the
    same host block wins, as on the CUDA engine's streams), while a store and a load run
    at once. The draining task is started when a direction's FIFO gets a job and none is
    running, and ends when the FIFO is empty, so nothing outlives the transfers."""

    name = "host"

    def __init__(self, setup: EngineSetup) -> None:
        if setup.layout.device.type != "cpu":
            raise ConfigError(
                f"the host engine copies between CPU tensors; these KV arrays are on "
                f"{setup.layout.device}"
            )
        self._layout = setup.layout
        self._host: torch.Tensor | None = setup.host_blocks
        self._bytes = setup.layout.byte_arrays()
        self._start_soon = setup.start_soon
        # One worker thread per direction, apart from the application's default pool.
        self._limiter = anyio.CapacityLimiter(2)
        self._queues: dict[Direction, deque[TransferJob]] = {"store": deque(), "load": deque()}
        self._draining: dict[Direction, bool] = {"store": False, "load": False}

    def methods(self) -> tuple[str, ...]:
        return ("host",)

    def prepare(self) -> None:
        """Nothing to prepare: copies are torch CPU ops."""

    def record_ready(self) -> None:
        return None

    def submit(self, job: TransferJob, *, pageable: bool) -> None:
        job.transfer.method = "host"
        job.transfer.path = "pageable" if pageable else "pinned"
        direction = job.transfer.direction
        if not self._draining[direction]:
            # If this raises, nothing was queued: the caller fails the transfer.
            self._start_soon(self._drain, direction)
            self._draining[direction] = True
        self._queues[direction].append(job)

    async def _drain(self, direction: Direction) -> None:
        """Copy the direction's jobs one at a time, oldest first, until none is left.

        A failed copy fails its own transfer only. Cancelled (the manager is closing): the
        job being copied is settled by ``copy_in_thread`` once its copy is over, and the
        jobs still queued, which never started, are settled as interrupted."""
        queue = self._queues[direction]
        try:
            while queue:
                job = queue.popleft()
                await copy_in_thread(job, self._copy, limiter=self._limiter)
        except BaseException as exc:
            while queue:
                queue.popleft().finish(interrupted(exc))
            raise
        finally:
            self._draining[direction] = False

    def _copy(self, job: TransferJob) -> None:
        host = self._host
        assert host is not None, "a copy after close"
        layout = self._layout
        gpu_ids = torch.tensor(job.gpu_ids, dtype=torch.int64)
        cpu_ids = torch.tensor(job.cpu_ids, dtype=torch.int64)
        # Bytes as they lie: a block comes back exactly as it left, whatever its layout.
        for a in job.arrays or range(layout.num_arrays):
            offset = layout.array_offsets[a]
            part = host[:, offset : offset + layout.array_block_bytes[a]]
            if job.transfer.direction == "store":
                part[cpu_ids] = self._bytes[a][gpu_ids]
            else:
                self._bytes[a][gpu_ids] = part[cpu_ids]

    def close(self) -> None:
        """Drop the view of the host blocks: only the application's views may keep the
        region mapped past close."""
        self._host = None
