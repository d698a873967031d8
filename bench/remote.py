"""The remote tier's throughput on a local Redis server: 2 MiB host blocks written behind
and fetched back, against a plain redis-py client loop of SET and GET of the same bytes in
the same run; the process's CPU time per GB moved; the event loop's lag while it runs.

    python bench/remote.py --json-out bench/results/remote-cpu.json
    python bench/remote.py --quick                 # 8 blocks, one round: seconds
    python bench/remote.py --url redis://host:6379 # a server of yours (cluster: --cluster)

No GPU: the KV layout is Llama-3.1-8B's on CPU tensors (32 layers of K and V, blocks of
16 tokens x 8 heads x 128 bf16: 64 arrays of 32 KiB, a 2 MiB host block), moved by the
host engine. Without ``--url`` the script starts its own servers on free loopback ports (a
single node, then a three-node cluster (``--cluster-nodes`` for more), with
``tests/redis_servers.py``) and stops them:
``redis-server``, or ``valkey-server`` with ``ASYNCPIN_TEST_SERVER=valkey``.

Each round, after a warm-up round that is not counted:

- asyncpin write: ``tier.clear()``, ``tier.store(hashes, ids)`` of N blocks, then
  ``await tier.remote_written()``. Reported: the write-behind alone (from the store's copy
  done to every block written: pipelined SETs of 16 sent from the host blocks in worker
  threads, two pipelines at once, header and XXH3 checksum made there, one pipeline per
  node on a cluster; with ``--copied-writes``, each block copied out in a worker thread,
  then redis-py's pipelined SETs of the copies) and the store end to end (host copy
  included).
- asyncpin fetch: ``tier.clear()``, then ``await tier.restore(hashes, other_ids)``:
  pipelines of 16 GETs (one per node on a cluster) read straight into host blocks in
  worker threads, two at once from a node and four from a cluster, every value checked
  (header, XXH3 checksum) there (``--copied-reads``: redis-py's values, checked, then
  copied in), then loaded to the device blocks (the host engine: a
  memcpy). The public API has no fetch-only call, so "fetch" is estimated as the restore
  minus a ``tier.load`` of the same N blocks from the host (timed right after, its lag
  too).
- peer: a redis-py asyncio client (``Redis`` or ``RedisCluster``, same timeouts): SET of
  the same host blocks' bytes (``bytes`` objects made before timing) in pipelines of 16,
  then GET of them in one pipeline of N, as ``restore`` does. Values stay ``bytes``: no
  check, no copy anywhere.

CPU: ``time.process_time()`` (every thread of this process) over each phase, per GB
(1e9 bytes) of payload; the server's CPU (its ``/proc/<pid>/stat``, own servers only)
alongside. Lag: a 1 ms heartbeat task's overshoot through each phase (target: worst
<= 5 ms). Medians of ``--repeats`` rounds. Figures: bench/RESULTS.md#remote.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Appended, not prepended: the asyncpin under test is the one PYTHONPATH names first.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import anyio
import torch

from asyncpin import KVLayout, OffloadManager
from asyncpin.errors import PreflightError
from asyncpin.testing import FakeBackend
from asyncpin.tier import KVTier, RedisStore
from bench._common import (
    GB,
    Heartbeat,
    MiB,
    machine,
    median,
    own_servers,
    parser,
    quiet_logs,
    write_json,
)

LAYERS, TOKENS, HEADS, HEAD_DIM = 32, 16, 8, 128
BATCH = 16  # the tier's write batch (RemoteLink's default), the peer's SET pipeline


def make_layout(blocks: int) -> KVLayout:
    """Llama-3.1-8B's KV on CPU: per layer [2, blocks, 16, 8, 128] bf16 of random bits."""
    gen = torch.Generator().manual_seed(20240607)
    shape = (2, blocks, TOKENS, HEADS, HEAD_DIM)
    kv = [
        torch.randint(-(1 << 15), 1 << 15, shape, generator=gen, dtype=torch.int32)
        .to(torch.int16)
        .view(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    return KVLayout.from_tensors(kv, block_dim=1)


def _ticks_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Phase:
    """Wall time, this process's CPU time, the servers' CPU time and the loop's lag of one
    phase (``start`` ... ``stop``)."""

    def __init__(self, heartbeat: Heartbeat, server_pids: Sequence[int]) -> None:
        self.hb, self.pids = heartbeat, server_pids

    def start(self) -> None:
        self.hb.reset()
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.s0 = sum(_ticks_s(p) for p in self.pids)

    def stop(self, nbytes: int) -> dict[str, float | None]:
        wall = time.perf_counter() - self.t0
        cpu = time.process_time() - self.c0
        lag_max, lag_p99 = self.hb.max_s(), self.hb.p99_s()
        server = sum(_ticks_s(p) for p in self.pids) - self.s0 if self.pids else None
        return {
            "s": wall,
            "gbps": nbytes / wall / GB,
            "cpu_s": cpu,
            "cpu_s_per_gb": cpu / (nbytes / GB),
            "server_cpu_s_per_gb": None if server is None else server / (nbytes / GB),
            "lag_max_ms": lag_max * 1e3,
            "lag_p99_ms": lag_p99 * 1e3,
        }


async def measure(
    url: str,
    *,
    cluster: bool,
    blocks: int,
    repeats: int,
    timeout_s: float,
    server_pids: Sequence[int],
    backend: str,
    direct_reads: bool | None = None,
    direct_writes: bool | None = None,
    sealed: bool = False,
) -> dict[str, Any]:
    import redis.asyncio
    import redis.asyncio.cluster

    layout = make_layout(2 * blocks)
    nbytes = blocks * layout.host_block_bytes
    src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
    hashes = list(range(1_000_000, 1_000_000 + blocks))
    namespace = f"asyncpin-bench-{uuid.uuid4().hex[:12]}"
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    peer: Any = (
        redis.asyncio.cluster.RedisCluster.from_url(url, **options)
        if cluster
        else redis.asyncio.Redis.from_url(url, **options)
    )
    peer_keys = [f"{namespace}-peer:{h}" for h in hashes]
    heartbeat = Heartbeat(0.001)
    phase = Phase(heartbeat, server_pids)
    rounds: list[dict[str, Any]] = []
    used_backend = backend
    try:
        try:
            manager = OffloadManager.for_kv(
                layout, blocks, backend=FakeBackend() if backend == "fake" else backend
            )
            await manager.__aenter__()
        except PreflightError as exc:
            print(f"host backend refused ({exc}); host blocks not pinned", file=sys.stderr)
            used_backend = "fake"
            manager = OffloadManager.for_kv(layout, blocks, backend=FakeBackend())
            await manager.__aenter__()
        try:
            await manager.pinned
            store = RedisStore(
                url,
                cluster=cluster,
                timeout_s=timeout_s,
                direct_reads=direct_reads,
                direct_writes=direct_writes,
            )
            async with (
                KVTier(
                    manager,
                    remote=store,
                    model="bench-remote",
                    namespace=namespace,
                    remote_queue=max(256, blocks),
                    remote_secret=os.urandom(32) if sealed else None,
                ) as tier,
                anyio.create_task_group() as tasks,
            ):
                await tasks.start(heartbeat.run)
                # The peer's values: the host blocks' bytes, made once, before any timing.
                await tier.store(hashes, src).transfer
                await tier.remote_written()
                rows = manager.host_bytes()
                values = [bytes(rows[b].numpy().data) for b in range(blocks)]
                del rows  # a view of the host buffer would keep it mapped past the manager
                for i in range(repeats + 1):  # round 0: warm-up
                    row = await one_round(tier, peer, phase, hashes, src, dst, peer_keys, values)
                    if i == 1 or repeats == 0:
                        row["restored_bytes_equal"] = all(
                            torch.equal(raw[dst], raw[src]) for raw in layout.byte_arrays()
                        )
                    if i:
                        rounds.append(row)
                    print(
                        f"  round {i}{' (warm-up)' if not i else ''}: {_brief(row)}",
                        file=sys.stderr,
                    )
                remote = tier.stats().remote
                tasks.cancel_scope.cancel()
        finally:
            await manager.__aexit__(None, None, None)
    finally:
        await _unlink(peer, namespace)
        await peer.aclose()
    assert remote is not None
    return {
        "url": url,
        "cluster": cluster,
        "blocks": blocks,
        "host_block_bytes": layout.host_block_bytes,
        "payload_bytes": nbytes,
        "backend": used_backend,
        "timeout_s": timeout_s,
        "direct_reads": store.direct_reads,
        "direct_writes": store.direct_writes,
        "sealed": sealed,
        "rounds": rounds,
        "median": _medians(rounds),
        "remote_stats": {
            k: getattr(remote, k)
            for k in (
                "written_blocks",
                "dropped_blocks",
                "failed_writes",
                "fetched_blocks",
                "invalid_blocks",
                "errors",
                "degraded",
            )
        },
    }


async def one_round(
    tier: KVTier,
    peer: Any,
    phase: Phase,
    hashes: list[int],
    src: list[int],
    dst: list[int],
    peer_keys: list[str],
    values: list[bytes],
) -> dict[str, Any]:
    nbytes = sum(map(len, values))
    remote = tier.stats().remote
    assert remote is not None
    written0, fetched0 = remote.written_blocks, remote.fetched_blocks
    row: dict[str, Any] = {}

    # asyncpin write: the host copy, then the write-behind until every block is written.
    tier.clear()
    phase.start()
    t0 = time.perf_counter()
    await tier.store(hashes, src).transfer
    host_copy_s = time.perf_counter() - t0
    phase.start()
    await tier.remote_written()
    row["asyncpin_write"] = phase.stop(nbytes)
    row["asyncpin_write"]["store_end_to_end_s"] = host_copy_s + row["asyncpin_write"]["s"]
    row["asyncpin_write"]["host_copy_s"] = host_copy_s

    # asyncpin fetch: restore from the server into other device blocks.
    tier.clear()
    phase.start()
    restored = await tier.restore(hashes, dst)
    row["asyncpin_restore"] = phase.stop(nbytes)
    if restored != len(hashes):
        raise RuntimeError(f"restore brought back {restored} of {len(hashes)} blocks")
    phase.start()
    await tier.load(hashes, dst)
    row["asyncpin_load"] = phase.stop(nbytes)
    load_s = row["asyncpin_load"]["s"]
    fetch_s = row["asyncpin_restore"]["s"] - load_s
    row["asyncpin_fetch_est"] = {"s": fetch_s, "gbps": nbytes / fetch_s / GB, "load_s": load_s}
    remote = tier.stats().remote
    assert remote is not None
    row["written_blocks"] = remote.written_blocks - written0
    row["fetched_blocks"] = remote.fetched_blocks - fetched0

    # The peer: plain SETs in pipelines of 16, then one pipeline of GETs.
    phase.start()
    for lo in range(0, len(peer_keys), BATCH):
        pipe = peer.pipeline(transaction=False)
        for key, value in zip(peer_keys[lo : lo + BATCH], values[lo : lo + BATCH], strict=True):
            pipe.set(key, value)
        await pipe.execute()
    row["peer_set"] = phase.stop(nbytes)
    phase.start()
    pipe = peer.pipeline(transaction=False)
    for key in peer_keys:
        pipe.get(key)
    got = await pipe.execute()
    row["peer_get"] = phase.stop(nbytes)
    if [len(v) for v in got] != [len(v) for v in values]:
        raise RuntimeError("the peer's GET did not bring back every value")
    del got
    return row


def _brief(row: dict[str, Any]) -> str:
    return (
        f"write {row['asyncpin_write']['gbps']:.2f} GB/s (peer {row['peer_set']['gbps']:.2f}), "
        f"restore {row['asyncpin_restore']['gbps']:.2f} GB/s (peer GET "
        f"{row['peer_get']['gbps']:.2f}), lag {row['asyncpin_write']['lag_max_ms']:.1f} / "
        f"{row['asyncpin_restore']['lag_max_ms']:.1f} ms"
    )


def _medians(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for name, first in rounds[0].items():
        if not isinstance(first, dict):
            continue
        out[name] = {}
        for key, value in first.items():
            samples = [r[name][key] for r in rounds]
            out[name][key] = None if value is None else median(samples)
        if "lag_max_ms" in first:  # the worst of every round, not a median
            out[name]["lag_worst_ms"] = max(r[name]["lag_max_ms"] for r in rounds)
    return out


async def _unlink(peer: Any, namespace: str) -> None:
    """Delete this run's keys (asyncpin's and the peer's), one key a command."""
    keys = [key async for key in peer.scan_iter(match=f"{namespace}*", count=1000)]
    for lo in range(0, len(keys), 256):
        pipe = peer.pipeline(transaction=False)
        for key in keys[lo : lo + 256]:
            pipe.execute_command("UNLINK", key)
        await pipe.execute()


def with_servers(
    kind: str, run: Callable[[str, Sequence[int]], dict[str, Any]], nodes: int = 3
) -> dict[str, Any]:
    """Start a single node or a cluster of ``nodes`` on free loopback ports, run, stop."""
    from tests.redis_servers import RedisCluster

    with own_servers(kind, f"asyncpin-redis-{os.getpid()}-bench-", nodes) as servers:
        started = servers.nodes if isinstance(servers, RedisCluster) else [servers]
        load_before = os.getloadavg()
        doc = run(servers.url, [node.pid for node in started])
        doc["loadavg_before_after"] = [load_before, os.getloadavg()]
        info = started[0].command("INFO", "server")
        assert isinstance(info, bytes)
        doc["server"], doc["server_version"] = _server_of(info.decode())
        return doc


FIGURES = [
    ("write GB/s", "asyncpin_write", "peer_set", "gbps", True),
    ("fetch GB/s (restore, end to end)", "asyncpin_restore", "peer_get", "gbps", True),
    ("fetch GB/s (restore minus load, est.)", "asyncpin_fetch_est", "peer_get", "gbps", True),
    ("write CPU s/GB", "asyncpin_write", "peer_set", "cpu_s_per_gb", False),
    ("fetch CPU s/GB", "asyncpin_restore", "peer_get", "cpu_s_per_gb", False),
    ("write server CPU s/GB", "asyncpin_write", "peer_set", "server_cpu_s_per_gb", False),
    ("fetch server CPU s/GB", "asyncpin_restore", "peer_get", "server_cpu_s_per_gb", False),
    ("write loop lag, worst ms", "asyncpin_write", "peer_set", "lag_worst_ms", False),
    ("fetch loop lag, worst ms", "asyncpin_restore", "peer_get", "lag_worst_ms", False),
]


def print_table(doc: dict[str, Any]) -> None:
    print(
        f"{doc['blocks']} blocks of {doc['host_block_bytes'] // MiB} MiB, median of "
        f"{doc['repeats']} rounds; ratio > 1 favours asyncpin (throughput asyncpin/peer, "
        "CPU and lag peer/asyncpin)"
    )
    print("| server | figure | asyncpin | peer | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for kind, result in doc["results"].items():
        m = result["median"]
        for label, ours, theirs, key, higher in FIGURES:
            a, p = m[ours].get(key), m[theirs].get(key)
            if a is None or p is None:
                continue
            ratio = a / p if higher else (p / a if a else float("inf"))
            print(f"| {kind} | {label} | {a:.3f} | {p:.3f} | {ratio:.2f}x |")


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--url", default=None, help="a server of yours (default: start our own)")
    p.add_argument("--cluster", action="store_true", help="--url is a cluster's seed node")
    p.add_argument("--blocks", type=int, default=None, help="blocks a round (256; --quick: 8)")
    p.add_argument("--repeats", type=int, default=None, help="rounds after a warm-up (3; 1)")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=10.0,
        help="RedisStore's timeout_s, the peer's socket timeouts (10: see RESULTS.md#remote)",
    )
    p.add_argument("--backend", choices=("auto", "host", "fake"), default="auto")
    p.add_argument("--kind", action="append", choices=("node", "cluster"), help="own servers")
    p.add_argument("--cluster-nodes", type=int, default=3, help="own cluster's nodes (3)")
    p.add_argument(
        "--copied-reads",
        action="store_true",
        help="RedisStore(direct_reads=False): fetch through the client's values, copied in",
    )
    p.add_argument(
        "--copied-writes",
        action="store_true",
        help="RedisStore(direct_writes=False): copy each block out, write the copies",
    )
    p.add_argument(
        "--sealed",
        action="store_true",
        help="KVTier(remote_secret=...): values sealed with a keyed BLAKE2b, not XXH3",
    )
    args = p.parse_args()
    quiet_logs()
    try:
        import redis
    except ImportError:
        sys.exit("remote.py needs redis-py: pip install 'asyncpin[remote]'")
    blocks = args.blocks or (8 if args.quick else 256)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)

    def run(cluster: bool) -> Callable[[str, Sequence[int]], dict[str, Any]]:
        def go(url: str, pids: Sequence[int]) -> dict[str, Any]:
            return anyio.run(
                lambda: measure(
                    url,
                    cluster=cluster,
                    blocks=blocks,
                    repeats=repeats,
                    timeout_s=args.timeout_s,
                    server_pids=pids,
                    backend=args.backend,
                    direct_reads=False if args.copied_reads else None,
                    direct_writes=False if args.copied_writes else None,
                    sealed=args.sealed,
                ),
                backend="asyncio",  # redis-py's client is asyncio's
            )

        return go

    results: dict[str, Any] = {}
    if args.url is not None:
        kind = "cluster" if args.cluster else "node"
        results[kind] = run(args.cluster)(args.url, [])
        # A node's INFO (for a cluster, the one the client asks first).
        client: Any = (redis.RedisCluster if args.cluster else redis.Redis).from_url(args.url)
        try:
            info = (
                client.execute_command("INFO", "server", target_nodes="random")
                if args.cluster
                else client.execute_command("INFO", "server")
            )
        finally:
            client.close()
        text = (
            "\n".join(f"{k}:{v}" for k, v in info.items()) if isinstance(info, dict) else str(info)
        )
        results[kind]["server"], results[kind]["server_version"] = _server_of(text)
    else:
        from tests.redis_servers import available

        missing = available()  # redis-server, or valkey-server with ASYNCPIN_TEST_SERVER
        if missing is not None:
            sys.exit(f"remote.py: {missing} (or pass --url)")
        for kind in args.kind or ["node", "cluster"]:
            named = f"cluster of {args.cluster_nodes}" if kind == "cluster" else kind
            print(f"{named}:", file=sys.stderr)
            results[kind] = with_servers(kind, run(kind == "cluster"), args.cluster_nodes)
            if kind == "cluster":
                results[kind]["cluster_nodes"] = args.cluster_nodes
    doc = {
        "copied_reads": args.copied_reads,
        "copied_writes": args.copied_writes,
        "blocks": blocks,
        "host_block_bytes": 64 * TOKENS * HEADS * HEAD_DIM * 2,
        "repeats": repeats,
        "redis_py": redis.__version__,
        # redis-py parses replies with hiredis when it is installed.
        "hiredis": _hiredis_version(),
        "cpu_model": _cpu_model(),
        "results": results,
        "machine": machine(),
    }
    write_json(args.json_out, doc)
    sys.stderr.flush()
    print_table(doc)
    return 0


def _server_of(info: str) -> tuple[str, str]:
    """The server's name and version from its ``INFO server`` text. Valkey reports the
    Redis version it is compatible with, and its own."""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    name = fields.get("server_name", "redis").strip()
    return name, fields.get("valkey_version", fields.get("redis_version", "?")).strip()


def _hiredis_version() -> str | None:
    try:
        import hiredis  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(hiredis.__version__)


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    raise SystemExit(main())
