"""The example server (examples/server.py): probes, metrics and lifespan, in process
through its real lifespan, and as a uvicorn process stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from asgi_lifespan import LifespanManager
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from asyncpin import ManagerState, OffloadManager, PinError
from asyncpin.testing import FakeBackend
from examples.server import create_app
from tests.helpers import TIMEOUT_S, wait_thread_event

REPO_ROOT = Path(__file__).resolve().parent.parent
SHM_DIR = Path("/dev/shm")
CHUNK = 64 << 10
NCHUNKS = 4
NBYTES = CHUNK * NCHUNKS


@asynccontextmanager
async def serving(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan (start-up, then shut-down on exit) and a client for it."""
    async with (
        LifespanManager(app) as lifespan,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=lifespan.app), base_url="http://asyncpin.test"
        ) as client,
    ):
        yield client


def manager_of(app: Starlette) -> OffloadManager:
    manager: OffloadManager = app.state.manager
    return manager


def assert_closed_in_order(manager: OffloadManager, fake: FakeBackend) -> None:
    """Every pinned span was unpinned once, while mapped, after the last pin."""
    ops = [call.op for call in fake.calls]
    first_unpin = ops.index("unpin") if "unpin" in ops else len(ops)
    assert "pin" not in ops[first_unpin:]
    assert sorted(fake.unpinned_spans()) == sorted(fake.pinned_spans())
    assert all(call.mapped for call in fake.calls)
    assert manager.state is ManagerState.CLOSED


class TestProbes:
    """Liveness answers at once; readiness is 503 while pinning, 200 once pinned, 500 on
    failure, with the progress in the body."""

    async def test_ready_goes_from_503_to_200(self) -> None:
        fake = FakeBackend(stall_pin_at=1)
        app = create_app(NBYTES, backend=fake, chunk_bytes=CHUNK)
        with anyio.fail_after(TIMEOUT_S):
            async with serving(app) as client:
                manager = manager_of(app)
                try:
                    live = await client.get("/healthz/live")
                    assert live.status_code == 200
                    await wait_thread_event(fake.stalled)
                    # Chunk 0 is pinned, chunk 1's pin call is held.
                    pinning = await client.get("/healthz/ready")
                    assert pinning.status_code == 503
                    assert pinning.json() == {
                        "status": "pinning",
                        "pinned_bytes": CHUNK,
                        "nbytes": NBYTES,
                        "fraction": 1 / NCHUNKS,
                    }
                finally:
                    fake.release()
                await manager.pinned
                ready = await client.get("/healthz/ready")
                assert ready.status_code == 200
                assert ready.json() == {
                    "status": "ready",
                    "pinned_bytes": NBYTES,
                    "nbytes": NBYTES,
                    "fraction": 1.0,
                }
        assert_closed_in_order(manager, fake)
        assert len(fake.pinned_spans()) == NCHUNKS

    async def test_failed_pinning_is_500_with_the_error(self) -> None:
        fake = FakeBackend(fail_pin_at=1)
        app = create_app(NBYTES, backend=fake, chunk_bytes=CHUNK)
        with anyio.fail_after(TIMEOUT_S):
            async with serving(app) as client:
                manager = manager_of(app)
                with pytest.raises(PinError):
                    await manager.pinned
                failed = await client.get("/healthz/ready")
                live = await client.get("/healthz/live")
        assert failed.status_code == 500
        body = failed.json()
        assert body["status"] == "failed"
        assert "injected failure at pin 1" in body["error"]
        assert (body["chunk"], body["code"], body["code_name"]) == (1, 9999, "EFAKE")
        assert (body["pinned_bytes"], body["nbytes"]) == (CHUNK, NBYTES)
        assert live.status_code == 200
        assert_closed_in_order(manager, fake)

    async def test_not_ready_before_start_up_and_after_shut_down(self) -> None:
        fake = FakeBackend()
        app = create_app(NBYTES, backend=fake, chunk_bytes=CHUNK)
        # httpx's ASGITransport runs no lifespan: the app has not started.
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as bare:
            starting = await bare.get("/healthz/ready")
            assert starting.status_code == 503
            assert starting.json() == {"status": "starting"}
            with anyio.fail_after(TIMEOUT_S):
                async with serving(app):
                    await manager_of(app).pinned
            closed = await bare.get("/healthz/ready")
        assert closed.status_code == 503
        assert closed.json()["status"] == "closed"
        assert_closed_in_order(manager_of(app), fake)


class TestMetricsEndpoint:
    """/metrics serves Prometheus text with the manager's figures."""

    async def test_pinned_bytes_equal_nbytes_once_pinned(self) -> None:
        fake = FakeBackend()
        app = create_app(NBYTES, backend=fake, chunk_bytes=CHUNK)
        with anyio.fail_after(TIMEOUT_S):
            async with serving(app) as client:
                await manager_of(app).pinned
                response = await client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        families = {
            family.name: family.samples for family in text_string_to_metric_families(response.text)
        }
        [pinned] = families["asyncpin_pinned_bytes"]
        [total] = families["asyncpin_region_bytes"]
        [ready] = families["asyncpin_pinned"]
        assert pinned.value == total.value == NBYTES
        assert ready.value == 1


class TestSettings:
    """create_app reads what it is not given from the environment."""

    async def test_environment_shared_region(self, shm_name: str) -> None:
        environ = {
            "ASYNCPIN_NBYTES": "256KiB",
            "ASYNCPIN_BACKEND": "host",
            "ASYNCPIN_SHARED_NAME": shm_name,
            "ASYNCPIN_CHUNK_BYTES": "64KiB",
        }
        app = create_app(environ=environ)
        with anyio.fail_after(TIMEOUT_S):
            async with serving(app) as client:
                manager = manager_of(app)
                await manager.pinned
                assert (await client.get("/healthz/ready")).status_code == 200
                stats = manager.stats()
                assert (stats.nbytes, stats.chunks_total, stats.backend) == (256 << 10, 4, "host")
                assert manager.region_name == shm_name
                assert (SHM_DIR / shm_name).exists()
        assert not (SHM_DIR / shm_name).exists()

    def test_a_bad_size_fails_at_once(self) -> None:
        with pytest.raises(ValueError, match="invalid size"):
            create_app(environ={"ASYNCPIN_NBYTES": "lots"})


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


class TestUvicornProcess:
    """Under uvicorn, the server becomes ready over HTTP and a SIGTERM shuts it down
    cleanly: exit status 0, the manager closed and its shared file unlinked."""

    def test_ready_over_http_then_sigterm(self, shm_name: str, tmp_path: Path) -> None:
        path = SHM_DIR / shm_name
        env = _child_env()
        env.update(
            ASYNCPIN_NBYTES="4MiB",
            ASYNCPIN_BACKEND="host",
            ASYNCPIN_SHARED_NAME=shm_name,
            ASYNCPIN_CHUNK_BYTES="1MiB",
        )
        log = tmp_path / "server.log"
        # The test binds the port and hands the listening socket over: no race for a port.
        with socket.socket() as sock, log.open("wb") as out:
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            port = sock.getsockname()[1]
            proc = subprocess.Popen(
                [sys.executable, "-m", "examples.server", "--fd", str(sock.fileno())],
                cwd=REPO_ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=[sock.fileno()],
            )
        try:
            deadline = time.monotonic() + 120
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                while True:
                    assert proc.poll() is None, log.read_text()
                    response = client.get("/healthz/ready")
                    if response.status_code == 200:
                        break
                    assert response.status_code == 503, response.text
                    assert time.monotonic() < deadline, f"never ready: {response.text}"
                    time.sleep(0.05)  # polling another process: nothing to wait on here
                assert response.json()["pinned_bytes"] == 4 << 20
                assert client.get("/healthz/live").status_code == 200
                metrics = client.get("/metrics").text
            [pinned] = next(
                family.samples
                for family in text_string_to_metric_families(metrics)
                if family.name == "asyncpin_pinned_bytes"
            )
            assert pinned.value == 4 << 20
            assert path.exists()
            proc.send_signal(signal.SIGTERM)
            returncode = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        output = log.read_text()
        assert returncode == 0, output
        assert not path.exists()
        assert "manager.closed" in output
        assert "Application shutdown complete" in output
