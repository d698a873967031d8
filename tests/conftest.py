"""Fixtures and collection rules shared by every test module.

Async tests run on one of two plugins:

- marked ``pytest.mark.anyio`` (most modules set ``pytestmark``): anyio's plugin runs each
  test once per value of the ``anyio_backend`` fixture below, on asyncio and on trio;
- any other ``async def`` test: pytest-asyncio runs it on asyncio, as if in its auto mode.

pytest-asyncio is in strict mode (pyproject.toml) because its auto mode takes every async
test, anyio-marked ones included, and would run the trio runs on asyncio;
:func:`pytest_pycollect_makeitem` gives the asyncio mark to the unmarked ones instead.
"""

from __future__ import annotations

import gc
import inspect
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpin import _sys
from asyncpin.region import HostRegion
from tests import redis_servers
from tests.helpers import MadeRegions
from tests.kit import CopyGate

SHM = Path("/dev/shm")
_SHM_PREFIX = f"asyncpin-test-{os.getpid()}-"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    """Mark an async test that anyio does not run with ``asyncio`` (see the module doc)."""
    if not (inspect.iscoroutinefunction(obj) and name.startswith("test")):
        return
    own = [mark.name for mark in getattr(obj, "pytestmark", ())]
    if "anyio" in own or "asyncio" in own or collector.get_closest_marker("anyio"):
        return
    pytest.mark.asyncio(obj)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The event loop of an anyio-marked test: each runs once on each."""
    return str(request.param)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator: every run of a test draws the same random bytes."""
    return torch.Generator().manual_seed(20240607)


@pytest.fixture
def copy_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[CopyGate]:
    """Host-engine copies wait in their worker thread until ``copy_gate.release()``."""
    gate = CopyGate()
    gate.install(monkeypatch)
    yield gate
    gate.release()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on the GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
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


@pytest.fixture
def balanced_mappings(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int, int]]]:
    """Spy on the region's mmap/munmap: whatever a failed call mapped, it unmapped.
    Earlier tests' garbage is collected first: a region whose last view sits in a
    reference cycle (a failed check's traceback, say) is unmapped when the cycle is
    collected, which must not happen in the middle of this count."""
    gc.collect()
    calls: list[tuple[str, int, int]] = []
    real_mmap, real_munmap = _sys.libc_mmap, _sys.libc_munmap

    def spy_mmap(nbytes: int, prot: int, flags: int, fd: int = -1, addr: int = 0) -> int:
        address = real_mmap(nbytes, prot, flags, fd, addr)
        calls.append(("mmap", address, nbytes))
        return address

    def spy_munmap(address: int, nbytes: int) -> None:
        real_munmap(address, nbytes)
        calls.append(("munmap", address, nbytes))

    monkeypatch.setattr(_sys, "libc_mmap", spy_mmap)
    monkeypatch.setattr(_sys, "libc_munmap", spy_munmap)
    yield calls
    mapped = sum(n for op, _, n in calls if op == "mmap")
    unmapped = sum(n for op, _, n in calls if op == "munmap")
    assert mapped == unmapped, f"mapped {mapped} bytes but unmapped {unmapped}: {calls}"


# --- Real Redis servers for the remote tier (see tests/redis_servers.py) ---------------------
#
# Mark a test that needs one with ``pytest.mark.redis``. ``redis_server`` (a single node) and
# ``redis_cluster`` (three nodes) start on first use and run for the whole session; after
# every test they are put back as they started (resumed, restarted if killed, no memory
# limit). Each test keeps to its own keys: the prefix ``redis_keyspace``, whose keys are
# deleted after the test on every server started.


@pytest.fixture(scope="session")
def redis_servers_started() -> Iterator[redis_servers.RedisServers]:
    """The session's servers: none is started until a test asks for one; all stop at the end."""
    servers = redis_servers.RedisServers()
    try:
        yield servers
    finally:
        servers.close()


def _skip_without_redis() -> None:
    reason = redis_servers.available()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_server(
    redis_servers_started: redis_servers.RedisServers,
) -> redis_servers.RedisServer:
    """A single ``redis-server`` on loopback: ``.url``, ``.port``, ``.pid`` and the faults
    ``kill()``, ``restart()``, ``pause()``/``resume()``, ``set_maxmemory()``, ``flushall()``."""
    _skip_without_redis()
    return redis_servers_started.server()


@pytest.fixture(scope="session")
def redis_tls_server(
    redis_servers_started: redis_servers.RedisServers,
) -> redis_servers.RedisServer:
    """A single ``redis-server`` that also listens for TLS: ``.tls_url`` and the
    self-signed ``.certificate`` its clients trust (``.url``: plain, for the harness)."""
    _skip_without_redis()
    reason = redis_servers.tls_available()
    if reason is not None:
        pytest.skip(reason)
    return redis_servers_started.tls_server()


@pytest.fixture(scope="session")
def redis_cluster(
    redis_servers_started: redis_servers.RedisServers,
) -> redis_servers.RedisCluster:
    """A three-node Redis cluster on loopback: ``.url`` (a start-up node), ``.nodes`` (each a
    server as ``redis_server``), ``wait_ok()`` after a fault, ``node_for_slot()``."""
    _skip_without_redis()
    return redis_servers_started.cluster()


@pytest.fixture(autouse=True)
def _redis_reset(redis_servers_started: redis_servers.RedisServers) -> Iterator[None]:
    """After each test, undo the faults it left on the servers started so far (none: no-op)."""
    yield
    redis_servers_started.reset()


@pytest.fixture
def redis_keyspace(
    request: pytest.FixtureRequest, redis_servers_started: redis_servers.RedisServers
) -> Iterator[str]:
    """A key prefix of this test alone (``asyncpin-test:<pid>:<test>:``); its keys are deleted
    after the test (SCAN MATCH + UNLINK) on the single node and every cluster node."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:80]
    prefix = f"asyncpin-test:{os.getpid()}:{name}:"
    yield prefix
    redis_servers_started.clean_keyspace(prefix)


@pytest.fixture
def made_regions(monkeypatch: pytest.MonkeyPatch) -> MadeRegions:
    """Every region created from now on, and its span (to check it unmapped after)."""
    seen = MadeRegions()
    create = HostRegion.create.__func__  # type: ignore[attr-defined]

    def recording_create(cls: type[HostRegion], *args: Any, **kwargs: Any) -> HostRegion:
        region: HostRegion = create(cls, *args, **kwargs)
        seen.made.append(region)
        seen.spans.append((region.address, region.nbytes))
        return region

    monkeypatch.setattr(HostRegion, "create", classmethod(recording_create))
    return seen
