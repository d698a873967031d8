"""The Redis fixtures (tests/redis_servers.py) work as the remote tier's tests need, with
redis-py's asyncio client (asyncio only): set/get on the single node and across the three
nodes of the cluster; a killed server comes back empty on the same port; a paused one
answers nothing until resumed; ``noeviction`` refuses a write past ``maxmemory`` and
``allkeys-lru`` evicts; faults are undone and each test's keys deleted after it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("redis", reason="the remote tier's tests need redis-py (asyncpin[remote])")

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.redis_servers import RedisCluster, RedisServer, RedisServers, available

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

MiB = 1 << 20


@pytest.fixture
def anyio_backend() -> str:
    """redis-py's asyncio client runs on asyncio only."""
    return "asyncio"


def _client(server: RedisServer, socket_timeout: float | None = None) -> aioredis.Redis:
    """A client that fails at once when the server is down (no retries)."""
    return aioredis.Redis.from_url(
        server.url, retry=Retry(NoBackoff(), 0), socket_timeout=socket_timeout
    )


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    r = _client(redis_server)
    yield r
    await r.aclose()


@pytest.fixture
async def cluster_client(redis_cluster: RedisCluster) -> AsyncIterator[AsyncRedisCluster]:
    r = AsyncRedisCluster.from_url(redis_cluster.url)
    yield r
    await r.aclose()


async def test_single_node_set_get(
    redis_server: RedisServer, client: aioredis.Redis, redis_keyspace: str
) -> None:
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}"
    assert redis_server.alive and redis_server.pid != os.getpid()
    key = f"{redis_keyspace}block"
    assert await client.set(key, b"\x00\x01kv" * 1000)
    assert await client.get(key) == b"\x00\x01kv" * 1000
    assert await client.get(f"{redis_keyspace}missing") is None


async def test_cluster_keys_land_on_every_node(
    redis_cluster: RedisCluster, cluster_client: AsyncRedisCluster, redis_keyspace: str
) -> None:
    assert len(redis_cluster.nodes) == 3
    keys = [f"{redis_keyspace}block:{i}" for i in range(32)]
    for i, key in enumerate(keys):
        assert await cluster_client.set(key, f"value {i}")
    owners: dict[str, RedisServer] = {}
    for i, key in enumerate(keys):
        assert await cluster_client.get(key) == f"value {i}".encode()
        node = redis_cluster.node_for_slot(cluster_client.keyslot(key))
        client_node = cluster_client.get_node_from_key(key)
        assert client_node is not None and client_node.port == node.port
        # The key is really on that node: it answers a plain GET for it (no MOVED).
        assert node.command("GET", key) == f"value {i}".encode()
        owners[key] = node
    assert {node.port for node in owners.values()} == {n.port for n in redis_cluster.nodes}


async def test_kill_then_restart_brings_an_empty_server_back_on_the_same_port(
    redis_server: RedisServer, client: aioredis.Redis, redis_keyspace: str
) -> None:
    key = f"{redis_keyspace}k"
    await client.set(key, b"v")
    port, pid = redis_server.port, redis_server.pid
    redis_server.kill()
    assert not redis_server.alive
    with pytest.raises(RedisConnectionError):
        await client.get(key)
    redis_server.restart()
    assert redis_server.alive
    assert (redis_server.port, redis_server.url) == (port, f"redis://127.0.0.1:{port}")
    assert redis_server.pid != pid
    assert await client.get(key) is None  # the same client reconnects; the data is gone
    assert await client.dbsize() == 0


async def test_cluster_node_kill_then_restart_comes_back_empty(
    redis_cluster: RedisCluster, cluster_client: AsyncRedisCluster, redis_keyspace: str
) -> None:
    keys = [f"{redis_keyspace}block:{i}" for i in range(32)]
    for key in keys:
        await cluster_client.set(key, b"v")
    victim = redis_cluster.nodes[1]
    port, pid = victim.port, victim.pid
    victim.kill()
    victim.restart()
    redis_cluster.wait_ok()
    assert (victim.port, victim.alive) == (port, True) and victim.pid != pid
    for key in keys:
        on_victim = redis_cluster.node_for_slot(redis_cluster.keyslot(key)) is victim
        assert redis_cluster.node_for_slot(redis_cluster.keyslot(key)).command("EXISTS", key) == (
            0 if on_victim else 1
        )


async def test_pause_then_resume(redis_server: RedisServer, redis_keyspace: str) -> None:
    r = _client(redis_server, socket_timeout=0.5)
    try:
        await r.set(f"{redis_keyspace}k", b"v")
        redis_server.pause()
        assert redis_server.paused and redis_server.alive
        # A stopped process never answers: any timeout shows it.
        with pytest.raises(RedisTimeoutError):
            await r.get(f"{redis_keyspace}k")
        redis_server.resume()
        assert await r.get(f"{redis_keyspace}k") == b"v"  # nothing was lost
    finally:
        await r.aclose()


async def test_noeviction_refuses_a_write_past_maxmemory(
    redis_server: RedisServer, client: aioredis.Redis, redis_keyspace: str
) -> None:
    redis_server.set_maxmemory(redis_server.used_memory() + MiB, "noeviction")
    with pytest.raises(OutOfMemoryError, match="maxmemory"):
        await client.set(f"{redis_keyspace}big", b"x" * (4 * MiB))
    assert await client.exists(f"{redis_keyspace}big") == 0
    assert await client.get(f"{redis_keyspace}big") is None  # reads still work


async def test_allkeys_lru_evicts(
    redis_server: RedisServer, client: aioredis.Redis, redis_keyspace: str
) -> None:
    redis_server.set_maxmemory(redis_server.used_memory() + 2 * MiB, "allkeys-lru")
    keys = [f"{redis_keyspace}block:{i}" for i in range(32)]
    for key in keys:
        assert await client.set(key, os.urandom(256 * 1024))  # 8 MiB in all: all accepted
    kept = await client.exists(*keys)
    assert 0 < kept < len(keys)
    assert await client.exists(keys[-1]) == 1  # the newest stays, older ones went
    info = await client.info("stats")
    assert info["evicted_keys"] > 0


async def test_reset_undoes_the_faults(
    redis_server: RedisServer, redis_servers_started: RedisServers
) -> None:
    redis_server.set_maxmemory(MiB, "allkeys-lru")
    redis_server.pause()
    redis_servers_started.reset()
    assert redis_server.alive and not redis_server.paused
    assert redis_server.command("CONFIG", "GET", "maxmemory") == [b"maxmemory", b"0"]
    redis_server.kill()
    redis_servers_started.reset()
    assert redis_server.command("PING") == "PONG"


def test_reset_waits_for_a_cluster_a_test_resumed_itself(
    redis_cluster: RedisCluster, redis_servers_started: RedisServers, redis_keyspace: str
) -> None:
    """A test that paused a node and resumed it in its own ``finally`` leaves nothing for
    reset to undo, yet the cluster may still be down: the clean-up after it must wait for
    the cluster, not fail on CLUSTERDOWN."""
    victim, witness = redis_cluster.nodes[0], redis_cluster.nodes[1]
    victim.pause()
    try:
        deadline = time.monotonic() + 30
        while b"cluster_state:fail" not in _bytes(witness.command("CLUSTER", "INFO")):
            assert time.monotonic() < deadline, "the cluster never saw the node fail"
            time.sleep(0.05)  # until the node timeout has passed on the witness
    finally:
        victim.resume()
    redis_servers_started.clean_keyspace(redis_keyspace)  # resets first: waits for ok
    key = next(
        key
        for key in (f"{redis_keyspace}{i}" for i in range(1000))
        if redis_cluster.node_for_slot(redis_cluster.keyslot(key)) is victim
    )
    assert victim.command("SET", key, b"v") == "OK"  # no CLUSTERDOWN
    assert b"cluster_state:ok" in _bytes(witness.command("CLUSTER", "INFO"))


def _bytes(reply: object) -> bytes:
    assert isinstance(reply, bytes)
    return reply


async def test_clean_keyspace_deletes_the_prefix_only(
    redis_server: RedisServer,
    redis_cluster: RedisCluster,
    cluster_client: AsyncRedisCluster,
    redis_servers_started: RedisServers,
    redis_keyspace: str,
) -> None:
    # Glob characters in a prefix are matched literally.
    prefix, other = f"{redis_keyspace}a[b]*?\\:", f"{redis_keyspace}ab*:"
    single = _client(redis_server)
    try:
        for i in range(20):
            await single.set(f"{prefix}{i}", b"v")
            await cluster_client.set(f"{prefix}{i}", b"v")
        await single.set(f"{other}0", b"v")
        await cluster_client.set(f"{other}0", b"v")
        assert redis_servers_started.clean_keyspace(prefix) == 40
        assert await single.exists(*(f"{prefix}{i}" for i in range(20))) == 0
        for i in range(20):
            assert await cluster_client.exists(f"{prefix}{i}") == 0
        assert await single.exists(f"{other}0") == 1
        assert await cluster_client.exists(f"{other}0") == 1
    finally:
        await single.aclose()


_written: dict[str, str] = {}


async def test_keyspace_written(
    redis_server: RedisServer, cluster_client: AsyncRedisCluster, redis_keyspace: str
) -> None:
    """Leaves keys behind for the fixture to delete (checked by the next test)."""
    client = _client(redis_server)
    try:
        for i in range(10):
            await client.set(f"{redis_keyspace}{i}", b"v")
            await cluster_client.set(f"{redis_keyspace}{i}", b"v")
    finally:
        await client.aclose()
    _written["prefix"] = redis_keyspace


async def test_keyspace_deleted_after_the_test(
    redis_server: RedisServer, redis_cluster: RedisCluster, redis_keyspace: str
) -> None:
    if "prefix" not in _written:
        pytest.skip("runs after test_keyspace_written")
    assert redis_keyspace != _written["prefix"]
    for node in [redis_server, *redis_cluster.nodes]:
        assert node.keys(_written["prefix"]) == []


def test_a_taken_port_is_exchanged_at_first_start(tmp_path: Path) -> None:
    """Another process took the port between the choice and the start: another is taken."""
    if (reason := available()) is not None:
        pytest.skip(reason)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = RedisServer(tmp_path / "server", port=taken)
        try:
            server.start()
            assert server.port != taken and server.command("PING") == "PONG"
        finally:
            server.stop()
    assert not server.alive


def test_a_port_another_server_answers_on_is_exchanged_at_first_start(tmp_path: Path) -> None:
    """The port's holder is another redis-server, which answers PING: the start must not
    take that answer for its own process's (three nodes of a cluster once shared two ports
    that way and the cluster never formed)."""
    if (reason := available()) is not None:
        pytest.skip(reason)
    holder = RedisServer(tmp_path / "holder")
    holder.start()
    server = RedisServer(tmp_path / "server", port=holder.port)
    try:
        server.start()
        assert server.port != holder.port
        assert server.alive
        info = server.command("INFO", "server")
        assert isinstance(info, bytes) and f"process_id:{server.pid}\r\n".encode() in info
    finally:
        server.stop()
        holder.stop()
    assert not server.alive and not holder.alive


def test_servers_die_with_the_test_process(tmp_path: Path) -> None:
    """A test process killed outright (no teardown) leaves no server behind."""
    if (reason := available()) is not None:
        pytest.skip(reason)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from tests.redis_servers import "
            "RedisServer; s = RedisServer(Path(sys.argv[1])); s.start(); "
            "print(s.pid, flush=True); time.sleep(600)",
            str(tmp_path / "server"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    pid = int(child.stdout.readline())
    assert _running(pid)
    child.kill()
    child.wait()
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the kernel has delivered the death signal
    assert not _running(pid)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie that nobody reaped yet is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("required", [None, "1"])
def test_a_missing_server_skips_unless_required(
    monkeypatch: pytest.MonkeyPatch, required: str | None
) -> None:
    """.ci/run's Valkey pass sets ASYNCPIN_TEST_SERVER_REQUIRED=1: a server missing there
    fails the tests, where elsewhere it skips them (a pass that skipped everything would
    pass)."""
    import tests.redis_servers as servers

    monkeypatch.setattr(servers, "SERVER_BIN", "asyncpin-no-such-server")
    monkeypatch.setattr(servers, "CLI_BIN", "asyncpin-no-such-cli")
    if required is None:
        monkeypatch.delenv("ASYNCPIN_TEST_SERVER_REQUIRED", raising=False)
        reason = servers.available()
        assert reason is not None and "asyncpin-no-such-server" in reason
    else:
        monkeypatch.setenv("ASYNCPIN_TEST_SERVER_REQUIRED", required)
        with pytest.raises(RuntimeError, match="asyncpin-no-such-server"):
            servers.available()
