from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncpin import _sys

SHM = Path("/dev/shm")
_SHM_PREFIX = f"asyncpin-test-{os.getpid()}-"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on the GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Every test must give back what it locked and every shared file it created."""
    locked = _sys.vm_locked_bytes()
    yield
    assert _sys.vm_locked_bytes() == locked, "locked bytes did not return to baseline"
    # Only this process's names (see `shm_name`): other test runs may share /dev/shm.
    left = sorted(SHM.glob(f"{_SHM_PREFIX}*")) if SHM.is_dir() else []
    assert not left, f"shared region files left behind: {left}"


@pytest.fixture
def shm_name(request: pytest.FixtureRequest) -> str:
    """A name for a shared region unique to this test and process."""
    return f"{_SHM_PREFIX}{request.node.name[:60]}".replace("[", "-").replace("]", "")
