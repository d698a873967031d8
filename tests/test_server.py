"""The example server (examples/server.py): probes, metrics and lifespan, in process
through its real lifespan, and as a uvicorn process stopped by SIGTERM; with a remote tier
on a real Redis server, readiness and metrics that show it, and no password anywhere."""

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
import structlog
import torch
from asgi_lifespan import LifespanManager
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from asyncpin import ManagerState, OffloadManager, PinError
from asyncpin.testing import FakeBackend
from asyncpin.tier import KVTier
from asyncpin.tier.remote import fingerprint
from examples.server import create_app
from tests.helpers import TIMEOUT_S, wait_thread_event
from tests.redis_servers import RedisCluster, RedisServer

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


def tier_of(app: Starlette) -> KVTier:
    tier: KVTier = app.state.tier
    return tier


def samples_of(text: str) -> dict[str, float]:
    """Prometheus text as ``{name: value}`` (the samples without labels)."""
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


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
                        "faulted_bytes": NBYTES,  # pinning begins once all is faulted in
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
                    "faulted_bytes": NBYTES,
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

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("ASYNCPIN_REDIS_CLUSTER", "maybe"),
            ("ASYNCPIN_REDIS_TIMEOUT_S", "soon"),
            ("ASYNCPIN_REDIS_TIMEOUT_S", "0"),
            ("ASYNCPIN_REDIS_TIMEOUT_S", "nan"),
        ],
    )
    def test_a_bad_remote_setting_fails_at_once(self, name: str, value: str) -> None:
        with pytest.raises(ValueError, match=name):
            create_app(environ={"ASYNCPIN_REDIS_URL": "redis://127.0.0.1:1", name: value})

    async def test_no_redis_url_no_tier(self) -> None:
        app = create_app(NBYTES, backend=FakeBackend(), chunk_bytes=CHUNK, environ={})
        with anyio.fail_after(TIMEOUT_S):
            async with serving(app) as client:
                manager = manager_of(app)
                await manager.pinned
                body = (await client.get("/healthz/ready")).json()
                text = (await client.get("/metrics")).text
        assert "remote" not in body
        assert manager.kv_layout is None and not hasattr(app.state, "tier")
        assert "asyncpin_tier" not in text


# The remote tier's tests: one test's keys under its own namespace (``redis_keyspace``).
REMOTE_TIMEOUT_S = 0.5


def remote_app(url: str, keyspace: str, *, model: str | None = None) -> Starlette:
    return create_app(
        NBYTES,
        backend=FakeBackend(),
        chunk_bytes=CHUNK,
        redis_url=url,
        redis_namespace=keyspace.rstrip(":"),
        redis_timeout_s=REMOTE_TIMEOUT_S,
        model=model,
        environ={},
    )


def fill(kv_caches: list[torch.Tensor], blocks: list[int], seed: int) -> list[torch.Tensor]:
    """Random bytes into ``blocks`` of the stand-in KV cache; returns a copy of them."""
    gen = torch.Generator().manual_seed(seed)
    for kv in kv_caches:
        kv[:, blocks] = torch.randn(kv[:, blocks].shape, generator=gen).to(kv.dtype)
    return [kv[:, blocks].clone() for kv in kv_caches]


@pytest.mark.redis
class TestRemoteTier:
    """``ASYNCPIN_REDIS_URL`` runs a KV tier whose remote tier is that server: readiness
    reports it (still ready, but degraded, while the server fails), /metrics exports it,
    and a password in the URL shows nowhere."""

    async def test_readiness_and_metrics_show_the_remote_tier(
        self, redis_server: RedisServer, redis_keyspace: str
    ) -> None:
        app = remote_app(redis_server.url, redis_keyspace, model="m")
        with anyio.fail_after(TIMEOUT_S):
            async with serving(app) as client:
                await manager_of(app).pinned
                ready = await client.get("/healthz/ready")
                assert ready.status_code == 200
                assert ready.json()["remote"] == {
                    "store": f"<RedisStore {redis_server.url}>",
                    "degraded": False,
                    "errors": 0,
                    "written_blocks": 0,
                    "failed_writes": 0,
                    "dropped_blocks": 0,
                    "queued_blocks": 0,
                }
                tier = tier_of(app)
                kv_caches: list[torch.Tensor] = app.state.kv_caches
                kept = fill(kv_caches, [0, 1, 2], seed=1)
                await tier.store([11, 12, 13], [0, 1, 2]).transfer
                await tier.remote_written()
                assert len(redis_server.keys(redis_keyspace)) == 3
                # The host forgets them; the remote tier brings them back.
                tier.clear()
                assert await tier.restore([11, 12, 13, 14], [5, 6, 7, 8]) == 3
                assert all(
                    torch.equal(kv[:, [5, 6, 7]], k) for kv, k in zip(kv_caches, kept, strict=True)
                )
                ready = await client.get("/healthz/ready")
                metrics = await client.get("/metrics")
        body = ready.json()
        assert ready.status_code == 200 and body["status"] == "ready"
        assert body["remote"]["written_blocks"] == 3 and not body["remote"]["degraded"]
        samples = samples_of(metrics.text)
        assert samples["asyncpin_tier_host_blocks"] == NBYTES // (16 << 10)
        assert samples["asyncpin_tier_stored_blocks_total"] == 3 + 3  # stored, then fetched
        assert samples["asyncpin_tier_remote_written_blocks_total"] == 3
        assert samples["asyncpin_tier_remote_fetched_blocks_total"] == 3
        assert samples["asyncpin_tier_remote_hit_blocks_total"] == 3
        assert samples["asyncpin_tier_remote_missed_blocks_total"] == 1
        assert samples["asyncpin_tier_remote_degraded"] == 0
        assert samples["asyncpin_pinned_bytes"] == NBYTES

    async def test_a_killed_server_is_degraded_and_still_ready(
        self, redis_server: RedisServer, redis_keyspace: str
    ) -> None:
        app = remote_app(redis_server.url, redis_keyspace)
        with anyio.fail_after(TIMEOUT_S):
            async with serving(app) as client:
                await manager_of(app).pinned
                tier = tier_of(app)
                redis_server.kill()
                # Nothing has failed yet: not degraded until an operation does.
                assert not (await client.get("/healthz/ready")).json()["remote"]["degraded"]
                assert await tier.lookup_remote([1, 2]) == 0
                ready = await client.get("/healthz/ready")
                degraded = samples_of((await client.get("/metrics")).text)
                # The host serves on.
                await tier.store([5], [5]).transfer
                assert await tier.restore([5], [6]) == 1
                # Its write to the server failed before the server is back (a failure
                # counted once a lookup began would keep the tier degraded past it).
                await tier.remote_written()
                redis_server.restart()  # back, empty: the next operation that works
                assert await tier.lookup_remote([1]) == 0
                recovered = await client.get("/healthz/ready")
                metrics = samples_of((await client.get("/metrics")).text)
        assert ready.status_code == 200
        body = ready.json()
        assert body["status"] == "ready"
        assert body["remote"]["degraded"] is True and body["remote"]["errors"] >= 1
        assert degraded["asyncpin_tier_remote_degraded"] == 1
        assert degraded["asyncpin_tier_remote_errors_total"] >= 1
        assert recovered.status_code == 200
        assert recovered.json()["remote"]["degraded"] is False
        assert metrics["asyncpin_tier_remote_degraded"] == 0

    async def test_a_password_shows_nowhere(
        self, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Through the environment, a URL with credentials the server refuses: readiness,
        metrics and logs name the server, never the user's password."""
        secret = "s3cret-word"
        url = f"redis://admin:{secret}@127.0.0.1:{redis_server.port}/0"
        environ = {
            "ASYNCPIN_NBYTES": str(NBYTES),
            "ASYNCPIN_BACKEND": "host",
            "ASYNCPIN_CHUNK_BYTES": str(CHUNK),
            "ASYNCPIN_REDIS_URL": url,
            "ASYNCPIN_REDIS_TIMEOUT_S": str(REMOTE_TIMEOUT_S),
        }
        app = create_app(environ=environ)
        caplog.set_level("DEBUG")
        with structlog.testing.capture_logs() as events, anyio.fail_after(TIMEOUT_S):
            async with serving(app) as client:
                await manager_of(app).pinned
                tier = tier_of(app)
                await tier.store([1], [0]).transfer
                await tier.remote_written()  # refused: WRONGPASS
                assert await tier.lookup_remote([1, 2]) == 1  # the host's; then refused
                ready = await client.get("/healthz/ready")
                metrics = await client.get("/metrics")
        remote = ready.json()["remote"]
        assert remote["store"] == f"<RedisStore redis://127.0.0.1:{redis_server.port}/0>"
        assert remote["degraded"] is True and remote["failed_writes"] == 1
        assert any(e["event"] == "tier.remote_degraded" for e in events)
        for what, text in (
            ("readiness", ready.text),
            ("metrics", metrics.text),
            ("logs", repr(events)),
            ("stdlib logs", caplog.text),
            ("the tier", repr(tier) + repr(tier.stats())),
        ):
            assert secret not in text, what

    async def test_settings_from_the_environment_a_cluster(
        self, redis_cluster: RedisCluster, redis_keyspace: str
    ) -> None:
        environ = {
            "ASYNCPIN_NBYTES": str(NBYTES),
            "ASYNCPIN_BACKEND": "host",
            "ASYNCPIN_CHUNK_BYTES": str(CHUNK),
            "ASYNCPIN_REDIS_URL": redis_cluster.url,
            "ASYNCPIN_REDIS_CLUSTER": "1",
            "ASYNCPIN_REDIS_TIMEOUT_S": "2.5",
            "ASYNCPIN_REDIS_NAMESPACE": redis_keyspace.rstrip(":"),
            "ASYNCPIN_MODEL": "llama-test",
        }
        app = create_app(environ=environ)
        with anyio.fail_after(TIMEOUT_S):
            async with serving(app) as client:
                manager = manager_of(app)
                await manager.pinned
                tier = tier_of(app)
                layout = manager.kv_layout
                assert layout is not None and tier.remote is not None
                assert tier.remote.print_ == fingerprint(
                    "llama-test", layout.description(), manager.host_slice
                )
                assert tier.remote.key_of(7).startswith(redis_keyspace)
                await tier.store([7, 8], [0, 1]).transfer
                await tier.remote_written()
                tier.clear()
                assert await tier.restore([7, 8], [2, 3]) == 2
                ready = await client.get("/healthz/ready")
        remote = ready.json()["remote"]
        assert remote["store"] == f"<RedisStore {redis_cluster.url} cluster>"
        assert (remote["degraded"], remote["written_blocks"]) == (False, 2)


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
