"""Shared regions' names and attaching: a shared region needs a safe name; attaching to a
missing name is RegionNotFoundError; a /dev/shm file that asyncpin did not make is
refused, left as it was, and everything opened to look at it is closed. Async tests run
on asyncio and on trio.
"""

from __future__ import annotations

import os
import socket

import pytest

from asyncpin import (
    ConfigError,
    OffloadManager,
    RegionNotFoundError,
    _sys,
)
from asyncpin.region import HostRegion
from asyncpin.shm import SHM_DIR, is_stale, unlink_stale
from tests.helpers import open_manager, refused

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("balanced_mappings")]

PAGE = _sys.PAGE_SIZE
MIB = 1 << 20
HUGE = 1 << 50  # 1 PiB: more than any machine that runs these tests has


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

    async def test_a_socket(self, shm_name: str) -> None:
        """A hostile trial: a Unix socket another user bound at the name made create,
        attach, is_stale and unlink_stale raise a bare OSError (ENXIO)."""
        path = SHM_DIR / shm_name
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.bind(str(path))
            with refused(ConfigError, "not a region made by asyncpin"):
                HostRegion.attach(shm_name)
            with refused(ConfigError, "not a region made by asyncpin"):
                is_stale(shm_name)
            assert not unlink_stale(shm_name)
            with refused(ConfigError, shm_name):
                async with OffloadManager(PAGE, backend="host", backing="shared", name=shm_name):
                    pass
            assert path.exists()
        finally:
            sock.close()
            path.unlink(missing_ok=True)

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
