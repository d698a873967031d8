from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncpin import _sys

SHM = Path("/dev/shm")


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
    shm = {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()
    yield
    assert _sys.vm_locked_bytes() == locked, "locked bytes did not return to baseline"
    if SHM.is_dir():
        left = {p.name for p in SHM.iterdir()} - shm
        assert not left, f"shared region files left behind: {sorted(left)}"


@pytest.fixture
def shm_name(request: pytest.FixtureRequest) -> str:
    """A name for a shared region unique to this test and process."""
    return f"asyncpin-test-{os.getpid()}-{request.node.name[:60]}".replace("[", "-").replace(
        "]", ""
    )
