"""Configurations a manager refuses: sizes, pipeline knobs, backends, backing and huge
page policies. Each mistake is a typed error whose message says what is wrong, raised
before anything is mapped, and nothing is left mapped, locked, open or in /dev/shm
(``refused`` and the ``balanced_mappings`` fixture check it). Async tests run on asyncio
and on trio.
"""

from __future__ import annotations

import gc
import mmap
from typing import Any

import pytest
import torch

from asyncpin import (
    BackendUnavailableError,
    ConfigError,
    HostBackend,
    OffloadManager,
    PreflightError,
    _sys,
)
from asyncpin._config import default_chunk_bytes
from asyncpin.region import HostRegion, hugetlb_free_bytes
from asyncpin.shm import HEADER_BYTES, SHM_DIR
from asyncpin.testing import FakeBackend
from tests.helpers import open_manager, refused

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("balanced_mappings")]

PAGE = _sys.PAGE_SIZE
MIB = 1 << 20
HUGE = 1 << 50  # 1 PiB: more than any machine that runs these tests has


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

    @pytest.mark.parametrize(
        ("nbytes", "chunk"),
        [
            (MIB, 16 * MIB),
            (16 << 30, 16 * MIB),
            (17 << 30, 18 * MIB),
            (64 << 30, 64 * MIB),
            ((100 << 30) + PAGE, 64 * MIB),
            (1 << 40, 64 * MIB),
        ],
    )
    def test_default_chunk_bytes_grow_with_the_region(self, nbytes: int, chunk: int) -> None:
        # Each unpin at close waits for the device to go idle: fewer chunks for a large
        # region, and never a chunk that holds the driver's lock much longer.
        assert default_chunk_bytes(nbytes) == chunk
        assert OffloadManager(nbytes, backend=FakeBackend()).stats().chunk_bytes == chunk

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

    @pytest.mark.parametrize(
        "device", ["x", "cuda:0", -1, 1.5, True, torch.tensor(1), torch.tensor(True)], ids=repr
    )
    @pytest.mark.parametrize("backend", ["host", "auto", "instance"])
    async def test_device_that_is_no_index(self, device: object, backend: str) -> None:
        """Whatever the backend: a device is None or an index (found by a newcomer's
        trial: the host backend took any value)."""
        chosen: object = HostBackend() if backend == "instance" else backend
        with refused(ConfigError, "device must be None or a device index", repr(device)):
            await open_manager(MIB, backend=chosen, device=device)

    def test_a_numpy_device_index_is_an_index(self) -> None:
        import numpy as np

        device: Any = np.int64(0)
        assert isinstance(OffloadManager(MIB, backend="host", device=device).backend, HostBackend)

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

    @pytest.mark.parametrize(("name", "why"), [(None, "needs a name"), ("a/b", "must be")])
    def test_shared_backing_without_a_good_name_is_refused_when_made(
        self, name: Any, why: str
    ) -> None:
        # Refused by the constructor, not first by `async with` (nothing is mapped yet).
        with refused(ConfigError, why):
            OffloadManager(MIB, backend=FakeBackend(), backing="shared", name=name)

    def test_region_options_that_do_not_fit_are_refused_when_made(self, shm_name: str) -> None:
        with refused(ConfigError, "only meaningful for backing='shared'"):
            OffloadManager(MIB, backend=FakeBackend(), name=shm_name)
        with refused(ConfigError, "hugetlb", "anonymous"):
            OffloadManager(
                MIB, backend=FakeBackend(), backing="shared", name=shm_name, hugepages="hugetlb"
            )

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


class TestPreflightEdges:
    """Pre-flight at the edges: hugetlb chunks, and attaching runs the backend's pre-flight."""

    async def test_hugetlb_chunks_must_hold_whole_huge_pages(self) -> None:
        with refused(ConfigError, "multiple of 2 MiB", "hugetlb"):
            await open_manager(4 * MIB, backend="host", hugepages="hugetlb", chunk_bytes=PAGE)

    async def test_attach_runs_the_backend_preflight_before_mapping(self, shm_name: str) -> None:
        class Refusing(FakeBackend):
            def preflight(self, nbytes: int) -> None:
                raise PreflightError("memlock", nbytes, 0, "raise RLIMIT_MEMLOCK")

        async with OffloadManager(
            MIB, backend=FakeBackend(), backing="shared", name=shm_name
        ) as creator:
            # Pinned first: the fake backend reads /proc/self/maps at each pin call, an
            # fd open in its thread that the leak check below would count.
            await creator.pinned
            with refused(PreflightError, "memlock", str(MIB)):
                async with OffloadManager.attached(shm_name, backend=Refusing()):
                    pass


class TestAttached:
    """``attached(name, ...)`` fixes the backing, the name and the size: a caller's own
    choice of them is a ConfigError (it was Python's TypeError for a repeated keyword)."""

    @pytest.mark.parametrize(
        ("option", "value"), [("backing", "anonymous"), ("backing", "file"), ("nbytes", MIB)]
    )
    def test_a_fixed_option_is_refused(self, shm_name: str, option: str, value: Any) -> None:
        with refused(ConfigError, "attached() takes no", option, shm_name):
            OffloadManager.attached(shm_name, **{option: value})

    async def test_backing_shared_is_what_it_is_anyway(self, shm_name: str) -> None:
        async with (
            OffloadManager(MIB, backend=FakeBackend(), backing="shared", name=shm_name),
            OffloadManager.attached(shm_name, backing="shared", backend=FakeBackend()) as other,
        ):
            assert other.nbytes == MIB


class TestTheLeakCheck:
    """``refused`` counts what asyncpin maps and unmaps (it compared every anonymous
    mapping of the process, which the interpreter's own arenas change: a CI flake)."""

    def test_a_range_left_mapped_fails_it(self) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        leaked: list[int] = []
        with pytest.raises(AssertionError, match="left mapped"), refused(ConfigError, "bad"):
            leaked.append(_sys.libc_mmap(2 * PAGE, mmap.PROT_READ, flags))
            raise ConfigError("bad")
        _sys.libc_munmap(leaked[0], 2 * PAGE)

    async def test_earlier_garbage_collected_meanwhile_does_not_fail_it(
        self, shm_name: str
    ) -> None:
        """A shared region's view that only a reference cycle keeps holds the file's
        mapping until the collector runs, which may be inside the check (a flake of the
        full suite): earlier garbage is collected before the count."""
        async with OffloadManager(
            MIB, backend=FakeBackend(), backing="shared", name=shm_name
        ) as mgr:
            view = mgr.host_view(0, PAGE)
        cycle: list[object] = [view]
        cycle.append(cycle)
        del view, cycle
        with refused(ConfigError, "bad"):
            gc.collect()  # as the collector may run at any allocation
            raise ConfigError("bad")

    def test_a_range_unmapped_in_pieces_passes_it(self) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        with refused(ConfigError, "bad"):
            address = _sys.libc_mmap(2 * PAGE, mmap.PROT_READ, flags)
            _sys.libc_munmap(address, PAGE)
            _sys.libc_munmap(address + PAGE, PAGE)
            raise ConfigError("bad")
