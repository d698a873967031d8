"""Bad input: each mistake is a typed error with a message that says what is wrong, and
nothing is left mapped, locked, open or in /dev/shm afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from asyncpin import (
    AsyncpinError,
    BackendUnavailableError,
    ConfigError,
    HostBackend,
    OffloadManager,
    PreflightError,
    RegionNotFoundError,
    _sys,
)
from asyncpin.region import HostRegion, hugetlb_free_bytes
from asyncpin.shm import HEADER_BYTES, SHM_DIR
from asyncpin.testing import FakeBackend

PAGE = _sys.PAGE_SIZE
MIB = 1 << 20
HUGE = 1 << 50  # 1 PiB: more than any machine that runs these tests has

E = TypeVar("E", bound=BaseException)


def footprint() -> tuple[int, frozenset[str]]:
    """Mappings and open file descriptors of this process, to compare before/after."""
    maps = len(Path("/proc/self/maps").read_text().splitlines())
    return maps, frozenset(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def balanced_mappings(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int, int]]]:
    """Spy on the region's mmap/munmap: whatever a failed call mapped, it unmapped."""
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


@contextmanager
def refused(error: type[E], *words: str) -> Iterator[pytest.ExceptionInfo[E]]:
    """Expect ``error`` whose message holds every one of ``words``, leaving no mapping and
    no file descriptor behind (VmLck and /dev/shm are checked by the autouse fixture)."""
    before = footprint()
    with pytest.raises(error) as info:
        yield info
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert isinstance(info.value, AsyncpinError)
    assert footprint() == before, "a mapping or file descriptor was left behind"


async def open_manager(nbytes: Any, **kwargs: Any) -> None:
    """Construct and enter a manager; the bad input may be caught at either step."""
    async with OffloadManager(nbytes, **kwargs):
        pass
    pytest.fail(f"OffloadManager({nbytes!r}, **{kwargs!r}) opened")


class TestSize:
    """nbytes must be a positive int that the machine can hold."""

    @pytest.mark.parametrize("nbytes", [0, -1, -PAGE])
    async def test_not_positive(self, nbytes: int) -> None:
        with refused(ConfigError, "nbytes", "positive", str(nbytes)) as info:
            await open_manager(nbytes, backend="host")
        assert isinstance(info.value, ValueError)

    @pytest.mark.parametrize(
        ("nbytes", "type_name"),
        [(4096.0, "float"), (True, "bool"), (False, "bool"), ("4096", "str"), (None, "NoneType")],
    )
    async def test_not_an_int(self, nbytes: Any, type_name: str) -> None:
        with refused(ConfigError, "nbytes must be an int", type_name):
            await open_manager(nbytes, backend="host")

    @pytest.mark.parametrize("nbytes", [0, -PAGE, 1.5, True])
    def test_region_refuses_bad_size(self, nbytes: Any) -> None:
        with refused(ConfigError, "nbytes"):
            HostRegion.create(nbytes)

    async def test_more_than_available_memory(self) -> None:
        with refused(PreflightError, "memory", str(HUGE), "smaller buffer") as info:
            await open_manager(HUGE, backend="host")
        assert info.value.check == "memory"
        assert info.value.needed == HUGE
        assert 0 < info.value.available < HUGE
        assert isinstance(info.value, OSError)

    async def test_more_than_available_memory_shared(self, shm_name: str) -> None:
        with refused(PreflightError, "memory") as info:
            await open_manager(HUGE, backend="host", backing="shared", name=shm_name)
        assert info.value.check == "memory"
        assert not (SHM_DIR / shm_name).exists()

    def test_more_than_shm_space(self, shm_name: str) -> None:
        with refused(PreflightError, "shm", "--shm-size") as info:
            HostRegion.create(HUGE, backing="shared", name=shm_name)
        assert info.value.check == "shm"
        assert info.value.needed == HUGE + HEADER_BYTES  # the data and its header page
        assert not (SHM_DIR / shm_name).exists()


class TestKnobs:
    """chunk_bytes, thread counts and pacing are range-checked before anything is mapped."""

    @pytest.mark.parametrize("chunk_bytes", [0, -PAGE, PAGE + 1, PAGE // 2, 4096.0, True])
    async def test_chunk_bytes(self, chunk_bytes: Any) -> None:
        with refused(ConfigError, "chunk_bytes", "multiple of the page size", str(PAGE)):
            await open_manager(MIB, backend="host", chunk_bytes=chunk_bytes)

    @pytest.mark.parametrize("knob", ["prefault_threads", "pin_threads"])
    @pytest.mark.parametrize("value", [0, -1, 1.5, True])
    async def test_thread_counts(self, knob: str, value: Any) -> None:
        with refused(ConfigError, knob, ">= 1", repr(value)):
            await open_manager(MIB, backend="host", **{knob: value})

    async def test_negative_pin_interval(self) -> None:
        with refused(ConfigError, "pin_interval_s", ">= 0"):
            await open_manager(MIB, backend="host", pin_interval_s=-0.5)

    @pytest.mark.parametrize("value", ["1", float("nan"), float("inf"), True])
    async def test_pin_interval_not_a_finite_number(self, value: object) -> None:
        with refused(ConfigError, "pin_interval_s", "finite number"):
            await open_manager(MIB, backend="host", pin_interval_s=value)


class TestBackend:
    """Unknown or unavailable backends are named in the error, before any mapping."""

    @pytest.mark.parametrize("backend", ["gpu9", "", "HOST", "mlock"])
    async def test_unknown_backend_name(self, backend: str) -> None:
        with refused(ConfigError, "unknown backend", repr(backend), "auto, host, cuda") as info:
            await open_manager(MIB, backend=backend)
        assert isinstance(info.value, ValueError)

    async def test_object_that_is_not_a_backend(self) -> None:
        with refused(ConfigError, "does not implement PinBackend"):
            await open_manager(MIB, backend=object())

    async def test_cuda_without_gpu(self) -> None:
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
        with refused(BackendUnavailableError, "'cuda'", "unavailable") as info:
            await open_manager(MIB, backend="cuda")
        assert info.value.backend == "cuda"
        assert "is_available" in info.value.reason
        assert isinstance(info.value, RuntimeError)

    def test_auto_without_gpu_is_the_host_backend(self) -> None:
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
        assert isinstance(OffloadManager(MIB, backend="auto").backend, HostBackend)


class TestBackingAndHugePages:
    """Unknown backing or huge page policies, and policies that do not fit, are ConfigErrors."""

    @pytest.mark.parametrize("backing", ["file", "tmpfs", "", "SHARED"])
    async def test_unknown_backing(self, backing: str) -> None:
        with refused(ConfigError, "unknown backing", repr(backing), "'anonymous' or 'shared'"):
            await open_manager(MIB, backend="host", backing=backing)

    @pytest.mark.parametrize("backing", ["file", ""])
    def test_region_refuses_unknown_backing(self, backing: Any) -> None:
        with refused(ConfigError, "unknown backing"):
            HostRegion.create(MIB, backing=backing)

    @pytest.mark.parametrize("hugepages", ["always", "madvise", "", "THP", True])
    async def test_unknown_hugepages_policy(self, hugepages: Any) -> None:
        with refused(ConfigError, "unknown hugepages policy", repr(hugepages)):
            await open_manager(MIB, backend="host", hugepages=hugepages)

    @pytest.mark.parametrize("hugepages", ["always", ""])
    def test_region_refuses_unknown_hugepages_policy(self, hugepages: Any) -> None:
        with refused(ConfigError, "unknown hugepages policy"):
            HostRegion.create(MIB, hugepages=hugepages)

    async def test_hugetlb_with_shared_backing(self, shm_name: str) -> None:
        with refused(ConfigError, "hugetlb", "anonymous"):
            await open_manager(
                MIB, backend="host", backing="shared", name=shm_name, hugepages="hugetlb"
            )
        assert not (SHM_DIR / shm_name).exists()

    async def test_hugetlb_beyond_the_pool(self) -> None:
        nbytes = hugetlb_free_bytes() + 4 * MIB
        if nbytes > _sys.mem_available_bytes() // 2:
            pytest.skip("the hugetlb pool here is too large to overrun safely")
        with refused(PreflightError, "hugetlb", "nr_hugepages") as info:
            await open_manager(nbytes, backend="host", hugepages="hugetlb")
        assert info.value.check == "hugetlb"
        assert info.value.needed >= nbytes


class TestSharedNames:
    """Shared regions need a safe name; attaching to a missing one is RegionNotFoundError."""

    async def test_shared_without_name(self) -> None:
        with refused(ConfigError, "backing='shared'", "name"):
            await open_manager(MIB, backend="host", backing="shared")

    async def test_name_without_shared_backing(self, shm_name: str) -> None:
        with refused(ConfigError, "name", "backing='shared'"):
            await open_manager(MIB, backend="host", name=shm_name)
        assert not (SHM_DIR / shm_name).exists()

    @pytest.mark.parametrize(
        "name", ["../x", "", ".", "..", "a/b", "/abs", "sp ace", "nul\x00", "é", "x" * 201]
    )
    async def test_bad_name_on_create(self, name: str) -> None:
        escaped = (SHM_DIR / "../x").resolve()
        assert not escaped.exists()
        with refused(ConfigError, "shared region name", repr(name)) as info:
            await open_manager(MIB, backend="host", backing="shared", name=name)
        assert "letters, digits" in str(info.value)
        assert not escaped.exists()

    @pytest.mark.parametrize("name", ["../x", "", "..", "a/b"])
    async def test_bad_name_on_attach(self, name: str) -> None:
        with refused(ConfigError, "shared region name"):
            async with OffloadManager.attached(name, backend="host"):
                pass
        with refused(ConfigError, "shared region name"):
            HostRegion.attach(name)

    async def test_attach_to_missing_name(self, shm_name: str) -> None:
        with refused(RegionNotFoundError, "no shared region named", shm_name) as info:
            async with OffloadManager.attached(shm_name, backend="host"):
                pass
        assert isinstance(info.value, FileNotFoundError)
        assert info.value.name == shm_name
        assert info.value.path == str(SHM_DIR / shm_name)
        with refused(RegionNotFoundError, shm_name):
            HostRegion.attach(shm_name)


class TestAttachToForeignFile:
    """Attaching refuses a /dev/shm file that asyncpin did not make, and closes what it opened."""

    @pytest.mark.parametrize("size", [0, 100, PAGE + 1])
    def test_size_not_a_region(self, shm_name: str, size: int) -> None:
        path = SHM_DIR / shm_name
        path.write_bytes(b"\x01" * size)
        try:
            with refused(ConfigError, f"size {size}", "not a region made by asyncpin"):
                HostRegion.attach(shm_name)
            assert path.read_bytes() == b"\x01" * size
        finally:
            path.unlink()

    def test_not_a_regular_file(self, shm_name: str) -> None:
        path = SHM_DIR / shm_name
        os.mkfifo(path, 0o600)
        try:
            with refused(ConfigError, "not a regular file", "refusing to attach"):
                HostRegion.attach(shm_name)
        finally:
            path.unlink()

    def test_directory(self, shm_name: str) -> None:
        path = SHM_DIR / shm_name
        path.mkdir()
        try:
            with refused(ConfigError, "is a directory"):
                HostRegion.attach(shm_name)
        finally:
            path.rmdir()

    def test_owned_by_another_user(self, shm_name: str) -> None:
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file away")
        path = SHM_DIR / shm_name
        path.write_bytes(b"\x01" * PAGE)
        try:
            os.chown(path, 65534, 65534)
            with refused(ConfigError, "owned by uid", "refusing to attach"):
                HostRegion.attach(shm_name)
            assert path.exists()
        finally:
            path.unlink()


class TestReviewedEdges:
    """Pre-flight and probes at the edges: hugetlb chunks, attach pre-flight, probe after close."""

    async def test_hugetlb_chunks_must_hold_whole_huge_pages(self) -> None:
        with refused(ConfigError, "multiple of 2 MiB", "hugetlb"):
            await open_manager(4 * MIB, backend="host", hugepages="hugetlb", chunk_bytes=PAGE)

    async def test_attach_runs_the_backend_preflight_before_mapping(self, shm_name: str) -> None:
        class Refusing(FakeBackend):
            def preflight(self, nbytes: int) -> None:
                raise PreflightError("memlock", nbytes, 0, "raise RLIMIT_MEMLOCK")

        async with OffloadManager(MIB, backend=FakeBackend(), backing="shared", name=shm_name):
            with refused(PreflightError, "memlock", str(MIB)):
                async with OffloadManager.attached(shm_name, backend=Refusing()):
                    pass

    async def test_is_pinned_is_false_after_close(self) -> None:
        async with OffloadManager(MIB, backend=FakeBackend(), chunk_bytes=256 << 10) as mgr:
            await mgr.pinned
            assert mgr.is_pinned()
        assert not mgr.is_pinned()
