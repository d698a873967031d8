"""A cluster's direct path: ``RedisStore(cluster=True)`` reads each value straight into the
caller's memory and writes it straight from there, one pipeline per node, keys routed by
their slots (CLUSTER SLOTS), asked again after a slot moved. Against a real three-node
cluster; the slot moves are the cluster's own (SETSLOT, MIGRATE), undone after."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio.to_thread
import pytest
import redis.crc

from asyncpin.tier import RedisStore
from asyncpin.tier.remote import _Wire, _with_host_port
from tests.redis_servers import HOST, RedisCluster, RedisServer

TIMEOUT_S = 5.0


def _slot(key: str) -> int:
    return redis.crc.key_slot(key.encode())


def _keys_on_every_node(cluster: RedisCluster, prefix: str, each: int) -> list[str]:
    """Keys of ``prefix``, at least ``each`` on every node, in the order they were made."""
    keys: list[str] = []
    counts: dict[int, int] = {node.port: 0 for node in cluster.nodes}
    i = 0
    while min(counts.values()) < each:
        key = f"{prefix}{i}"
        port = cluster.node_for_slot(_slot(key)).port
        if counts[port] < each:
            counts[port] += 1
            keys.append(key)
        i += 1
    return keys


def _move_slot(cluster: RedisCluster, slot: int, src: RedisServer, dst: RedisServer) -> None:
    """Hand ``slot`` and every key in it from ``src`` to ``dst``, as resharding does."""
    src_id, dst_id = src.command("CLUSTER", "MYID"), dst.command("CLUSTER", "MYID")
    assert isinstance(src_id, bytes) and isinstance(dst_id, bytes)
    dst.command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    keys = src.command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    assert isinstance(keys, list)
    if keys:
        src.command("MIGRATE", HOST, dst.port, "", 0, 5000, "KEYS", *keys)  # type: ignore[arg-type]
    for node in cluster.nodes:
        node.command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    cluster.wait_ok()


@pytest.fixture
def store(redis_cluster: RedisCluster) -> Iterator[RedisStore]:
    made = RedisStore(redis_cluster.url, cluster=True, timeout_s=TIMEOUT_S)
    yield made
    anyio.run(made.aclose)


def _read(
    store: RedisStore, keys: list[str], sizes: list[int]
) -> tuple[list[Any], list[int], list[bytearray]]:
    """``readinto`` of ``keys`` (head of 4 bytes): its result, the order ``into`` was
    called in, and each key's body."""
    bodies = [bytearray(max(n - 4, 0)) for n in sizes]
    order: list[int] = []

    def into(i: int, size: int, head: memoryview) -> memoryview:
        order.append(i)
        return memoryview(bodies[i])

    got = store.readinto(keys, into, head_bytes=4)
    return got, order, bodies


@pytest.mark.redis
async def test_values_go_to_and_come_from_the_node_of_their_slot(
    store: RedisStore, redis_cluster: RedisCluster, redis_keyspace: str
) -> None:
    assert store.direct_reads and store.direct_writes
    keys = _keys_on_every_node(redis_cluster, redis_keyspace, each=4)
    values = [bytes([i + 1]) * (5000 + 17 * i) for i in range(len(keys))]
    prepared: list[int] = []
    errors = await anyio.to_thread.run_sync(
        lambda: store.writefrom(
            [
                (k, (memoryview(v)[:4], memoryview(v)[4:]))
                for k, v in zip(keys, values, strict=True)
            ],
            prepare=prepared.append,
        )
    )
    assert errors == [None] * len(keys)
    assert sorted(prepared) == list(range(len(keys)))  # each header made once, before it went
    for key, value in zip(keys, values, strict=True):  # on the node its slot is served by
        assert redis_cluster.node_for_slot(_slot(key)).command("GET", key) == value
    assert set(store._node_idle) == {(HOST, node.port) for node in redis_cluster.nodes}

    missing = f"{redis_keyspace}missing"
    got, order, bodies = await anyio.to_thread.run_sync(
        lambda: _read(store, [*keys, missing], [len(v) for v in values] + [0])
    )
    assert got == [len(v) for v in values] + [None]
    assert order == list(range(len(keys)))  # the keys' order, whatever node each is on
    assert all(body == v[4:] for body, v in zip(bodies, values, strict=False))


@pytest.mark.redis
async def test_a_slot_that_moved_is_a_miss_once_then_found(
    store: RedisStore, redis_cluster: RedisCluster, redis_keyspace: str
) -> None:
    key = f"{redis_keyspace}moving"
    slot = _slot(key)
    home = redis_cluster.node_for_slot(slot)
    away = next(node for node in redis_cluster.nodes if node is not home)
    first, second = b"a" * 4096, b"b" * 4096
    assert await anyio.to_thread.run_sync(lambda: store.writefrom([(key, [first])])) == [None]
    try:
        _move_slot(redis_cluster, slot, home, away)  # the store's slots are stale now
        # A write is sent again to the slot's new node: written, no error.
        said = await anyio.to_thread.run_sync(lambda: store.writefrom([(key, [second])]))
        assert said == [None]
        assert away.command("GET", key) == second
        assert store._slots is not None and store._slots[slot] == (HOST, away.port)
        _move_slot(redis_cluster, slot, away, home)
        # A read finds the slot moved: a miss (never another key's bytes), then found.
        got, order, _ = await anyio.to_thread.run_sync(lambda: _read(store, [key], [4096]))
        assert got == [None] and order == []
        got, order, bodies = await anyio.to_thread.run_sync(lambda: _read(store, [key], [4096]))
        assert got == [4096] and order == [0] and bodies[0] == second[4:]
    finally:
        if redis_cluster.node_for_slot(slot) is not home:
            _move_slot(redis_cluster, slot, redis_cluster.node_for_slot(slot), home)


def test_a_nodes_url_keeps_the_user_the_password_and_the_query() -> None:
    url = "rediss://me:secret@seed.example:7000/0?ssl_cert_reqs=none"
    assert _with_host_port(url, "10.0.0.2", 7001) == (
        "rediss://me:secret@10.0.0.2:7001/0?ssl_cert_reqs=none"
    )
    assert _with_host_port("redis://seed:7000", "::1", 7002) == "redis://[::1]:7002"


def test_a_reply_is_parsed_within_its_bounds() -> None:
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(
            b"*2\r\n*3\r\n:0\r\n:5460\r\n*3\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nid\r\n"
            b"%1\r\n+k\r\n_\r\n"
            b"-ERR cluster support disabled\r\n"
            b"*70000\r\n"
        )
        ours.settimeout(_Wire.POLL_S)
        wire = _Wire(ours, float("inf"), lambda: None)
        assert wire.reply() == [[0, 5460, [b"127.0.0.1", 7000, b"id"]], [b"k", None]]
        with pytest.raises(ConnectionError, match="cluster support disabled"):
            wire.reply()
        with pytest.raises(ConnectionError, match="past its bounds"):
            wire.reply()
    finally:
        ours.close()
        theirs.close()


@pytest.mark.redis
async def test_a_write_sent_away_twice_is_an_error_not_written(
    store: RedisStore, redis_cluster: RedisCluster, redis_keyspace: str
) -> None:
    """A slot being migrated answers a new key with ASK, the slots asked again still name
    the same node: the write is not done, and says so (review: it was reported written)."""
    key = f"{redis_keyspace}asked"
    slot = _slot(key)
    src = redis_cluster.node_for_slot(slot)
    dst = next(node for node in redis_cluster.nodes if node is not src)
    src_id, dst_id = src.command("CLUSTER", "MYID"), dst.command("CLUSTER", "MYID")
    assert isinstance(src_id, bytes) and isinstance(dst_id, bytes)
    dst.command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    try:
        said = await anyio.to_thread.run_sync(lambda: store.writefrom([(key, [b"v" * 100])]))
        assert said[0] is not None and said[0].startswith("ASK ")
        for node in (src, dst):  # written nowhere
            assert node.command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    finally:
        for node in (src, dst):
            node.command("CLUSTER", "SETSLOT", slot, "STABLE")
        redis_cluster.wait_ok()


@pytest.mark.redis
async def test_a_node_that_fails_makes_the_slots_asked_again(
    store: RedisStore, redis_cluster: RedisCluster, redis_keyspace: str
) -> None:
    """A refused connection is no MOVED: the slots are asked again all the same, so a
    failed-over node's slots find their new node (review: the map stayed stale for good)."""
    from asyncpin.tier import RemoteError

    key = f"{redis_keyspace}down"
    node = redis_cluster.node_for_slot(_slot(key))
    assert await anyio.to_thread.run_sync(lambda: store.writefrom([(key, [b"v" * 100])])) == [None]
    assert not store._stale_slots
    node.kill()
    with pytest.raises(RemoteError):
        await anyio.to_thread.run_sync(lambda: _read(store, [key], [100]))
    assert store._stale_slots


def _a_node_down(cluster: RedisCluster, keys: list[str]) -> tuple[RedisServer, list[RedisServer]]:
    """A node that does not serve ``keys[0]``, killed, and each key's node."""
    owners = [cluster.node_for_slot(_slot(key)) for key in keys]
    dead = next(node for node in cluster.nodes if node is not owners[0])
    dead.kill()
    return dead, owners


@pytest.mark.redis
async def test_a_node_down_cuts_a_read_at_its_first_key(
    store: RedisStore, redis_cluster: RedisCluster, redis_keyspace: str
) -> None:
    """The keys before the first that a node down serves are read, and the read says it
    was cut (a hostile trial: one node of three down failed every read, so a restore
    brought back nothing, not even leading blocks on the healthy nodes)."""
    from asyncpin.tier.remote import RemoteReadCut

    keys = _keys_on_every_node(redis_cluster, redis_keyspace, each=3)
    said = await anyio.to_thread.run_sync(
        lambda: store.writefrom([(k, [b"v" * 100]) for k in keys])
    )
    assert said == [None] * len(keys)
    dead, owners = _a_node_down(redis_cluster, keys)
    first = owners.index(dead)
    with pytest.raises(RemoteReadCut) as cut:
        await anyio.to_thread.run_sync(lambda: _read(store, keys, [100] * len(keys)))
    assert cut.value.sizes == [100] * first + [None] * (len(keys) - first)
    healthy = [k for k, node in zip(keys, owners, strict=True) if node is not dead]
    got, order, _ = await anyio.to_thread.run_sync(
        lambda: _read(store, healthy, [100] * len(healthy))
    )
    assert got == [100] * len(healthy) and order == list(range(len(healthy)))


@pytest.mark.redis
async def test_a_node_down_fails_the_writes_of_its_keys_alone(
    store: RedisStore, redis_cluster: RedisCluster, redis_keyspace: str
) -> None:
    """The keys of the other nodes are written and said so (a hostile trial: one node
    of three down failed the whole write, counting written values as failed)."""
    keys = _keys_on_every_node(redis_cluster, redis_keyspace, each=3)
    said = await anyio.to_thread.run_sync(lambda: store.writefrom([(k, [b"v"]) for k in keys]))
    assert said == [None] * len(keys)  # the slots are known: any node may be the one down
    dead, owners = _a_node_down(redis_cluster, keys)
    said = await anyio.to_thread.run_sync(
        lambda: store.writefrom([(k, [b"v" * 100]) for k in keys])
    )
    for key, node, error in zip(keys, owners, said, strict=True):
        if node is dead:
            assert error is not None and "failed" in error
        else:
            assert error is None and node.command("STRLEN", key) == 100


@pytest.mark.redis
@pytest.mark.parametrize("endpoint", ["unknown-endpoint", "hostname"])
async def test_a_node_that_names_no_endpoint_is_the_one_asked(
    endpoint: str, store: RedisStore, redis_cluster: RedisCluster, redis_keyspace: str
) -> None:
    """CLUSTER SLOTS gives NULL (``unknown-endpoint``) or '?' (``hostname`` with no
    hostname set) for the node asked: its own address (review: a TypeError, or a client
    of localhost:6379)."""
    keys = _keys_on_every_node(redis_cluster, redis_keyspace, each=1)
    for node in redis_cluster.nodes:
        node.command("CONFIG", "SET", "cluster-preferred-endpoint-type", endpoint)
    try:
        said = await anyio.to_thread.run_sync(
            lambda: store.writefrom([(k, [b"v" * 100]) for k in keys])
        )
        assert said == [None] * len(keys)
        got, order, _ = await anyio.to_thread.run_sync(
            lambda: _read(store, keys, [100] * len(keys))
        )
        assert got == [100] * len(keys) and order == list(range(len(keys)))
    finally:
        for node in redis_cluster.nodes:
            node.command("CONFIG", "SET", "cluster-preferred-endpoint-type", "ip")


def test_options_of_the_cluster_client_alone_keep_a_cluster_copying() -> None:
    from asyncpin import ConfigError

    url = "redis://127.0.0.1:1/0"
    store = RedisStore(url, cluster=True, require_full_coverage=True)
    assert not store.direct_reads and not store.direct_writes
    with pytest.raises(ConfigError, match="require_full_coverage= is for redis-py's cluster"):
        RedisStore(url, cluster=True, require_full_coverage=True, direct_reads=True)


@pytest.mark.redis
async def test_a_cluster_node_taken_for_a_server_says_so(
    redis_cluster: RedisCluster, redis_keyspace: str
) -> None:
    """A store made without ``cluster=True`` on a cluster's node: the keys that node does
    not serve are refused with words that say what to do, on a write and on a read.
    (Before: a read of such a key was a silent miss; a write failed with the server's
    MOVED reply alone; then, a newcomer's trial found EXISTS and the copying paths
    still said MovedError alone.)"""
    from asyncpin.tier import RemoteError

    keys = _keys_on_every_node(redis_cluster, redis_keyspace, each=2)
    seed = redis_cluster.nodes[0]
    mine = [k for k in keys if redis_cluster.node_for_slot(_slot(k)) is seed]
    other = next(k for k in keys if k not in mine)
    store = RedisStore(seed.url, timeout_s=5.0)
    try:
        value = memoryview(b"v" * 5000)
        errors = await anyio.to_thread.run_sync(
            lambda: store.writefrom([(k, (value,)) for k in keys])
        )
        for key, error in zip(keys, errors, strict=True):
            if key in mine:
                assert error is None
            else:
                assert error is not None and "cluster=True" in error
                assert redis_cluster.node_for_slot(_slot(key)).command("GET", key) is None
        got, _, _ = await anyio.to_thread.run_sync(lambda: _read(store, mine, [5000] * 2))
        assert got == [5000, 5000]
        with pytest.raises(RemoteError, match=r"a node of a cluster.*cluster=True"):
            await anyio.to_thread.run_sync(lambda: _read(store, [other], [5000]))
        # Through redis-py's client too (EXISTS for lookup_remote; the copying paths).
        for call in (store.exists, store.get):
            with pytest.raises(RemoteError, match=r"a node of a cluster.*cluster=True"):
                await call([other])
    finally:
        await store.aclose()


# -- a hostile process's trial (each failed before its fix) ----------------------------------


def test_a_slot_map_is_checked_before_any_work_it_asks_for() -> None:
    """CLUSTER SLOTS from a server that is no cluster's node: an integer where a host
    goes (before: ``bytes(n)`` made n zero bytes, 1 GB for 44 bytes of reply, the event
    loop's thread held meanwhile), ranges naming more slots than a cluster has (before:
    65,536 ranges of every slot, a billion assignments), a port that is no port: each a
    ConnectionError, at once. A real reply, with a NULL endpoint, maps."""
    from asyncpin.tier.remote import _slot_map

    host = [b"127.0.0.1", 7000, b"id"]
    for reply, words in [
        ([[0, 16383, [10**12, 7000]]], "no name"),
        ([[0, 16383, [b"h" * 300, 7000]]], "no name"),
        ([[0, 16383, host]] * 2, "more slots"),
        ([[0, 16383, [b"127.0.0.1", 70000]]], "no port"),
        ([[0, 16383, [b"127.0.0.1", b"7000"]]], "no port"),
        ([[b"0", 16383, host]], "another shape"),
        ([[0, 16384, host]], "slots 0-16384"),
        (b"OK", "no list"),
    ]:
        with pytest.raises(ConnectionError, match=words):
            _slot_map(reply, "10.0.0.1")
    slots = _slot_map([[0, 99, host], [100, 16383, [None, 7001]]], "10.0.0.1")
    assert slots[0] == ("127.0.0.1", 7000) and slots[16383] == ("10.0.0.1", 7001)


def test_a_reply_is_bounded_in_its_bytes_in_all() -> None:
    """Many strings, each under the 1 MiB a string may have, past 8 MiB in all: an error
    once the bound is crossed (before: 16,000 strings of 1 MiB would all be read and kept)."""
    ours, theirs = socket.socketpair()
    piece = b"$1048576\r\n" + b"x" * (1 << 20) + b"\r\n"

    def send() -> None:
        with contextlib.suppress(OSError):  # the reader gave up and closed its end
            theirs.sendall(b"*16000\r\n" + piece * 12)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        ours.settimeout(_Wire.POLL_S)
        wire = _Wire(ours, time.monotonic() + 30, lambda: None)  # (before: this, hit)
        with pytest.raises(ConnectionError, match="a reply longer than"):
            wire.reply()
    finally:
        ours.close()
        sender.join()
        theirs.close()
