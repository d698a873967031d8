"""The CUDA engine's pack staging, allocated on the first pack job of a layout whose
default is batch: when it cannot be made, the job runs as batch (on the CPU, with a
stand-in runtime and kernel)."""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

import asyncpin.engines.cuda as ct
from asyncpin.errors import BackendCallError
from asyncpin.transfers import Transfer, TransferJob
from tests.cuda_engine_cpu import cpu_engine, offset_layout


class _Lane:
    """A lane whose staging cannot be made, failing as ``failure`` says."""

    staging = None

    def __init__(self, failure: BaseException) -> None:
        self.failure = failure

    def allocate_staging(self, rt: Any, host_block_bytes: int) -> None:
        raise self.failure


@pytest.mark.parametrize(
    "failure",
    [
        # torch.empty on a full device
        RuntimeError("CUDA out of memory"),
        # the runtime refusing to record the staging's events (cudaEventRecord)
        BackendCallError("cudaEventRecord", 719, "cudaErrorLaunchFailure", "launch failure"),
    ],
    ids=["no-memory", "runtime-error"],
)
def test_a_staging_that_cannot_be_made_falls_back_to_batch(
    monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    async def main() -> None:
        layout = ct_layout()
        with cpu_engine(monkeypatch, layout, kernel=object(), host_blocks=2) as engine:
            monkeypatch.setattr(ct, "on_device", lambda index: contextlib.nullcontext())
            engine._lanes = {"store": _Lane(failure), "load": _Lane(failure)}  # type: ignore[dict-item]
            ids = list(range(100))
            job = TransferJob(Transfer("store", 100, 100 << 23), ids, ids, "pack")
            with capture_logs() as logs:
                method = engine._choose(job, pageable=False)
            assert method == "batch"
            assert [entry["event"] for entry in logs] == ["transfer.staging_failed"]

    anyio.run(main)


def ct_layout() -> Any:
    """Blocks of 2 MiB: batch by default, so pack staging is made on first use."""
    return offset_layout(0, 2 << 20, blocks=2, arrays=4)
