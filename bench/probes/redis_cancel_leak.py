"""Does redis-py's asyncio cluster client let a cancellation out of a call that nobody
cancelled? (Why RedisStore runs the client's call in a task of its own.)

    python3 bench/probes/redis_cancel_leak.py [--seconds 150] [--tasks 24]

Starts a three-node cluster on loopback (tests/redis_servers.py), runs ``--tasks`` loops
of 8-GET pipelines through one ``redis.asyncio.cluster.RedisCluster`` client (socket
timeouts 0.3 s, each call under ``anyio.fail_after(1.2)``, as RedisStore does), while the
first node is paused, resumed, killed and restarted over and over. Counts the calls that
returned, raised an exception, or raised a cancellation although no scope of the caller
was cancelled (a leak: printed with its traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.redis_servers import RedisCluster


async def calls(client: Any, i: int, stop: anyio.Event, counts: dict[str, int]) -> None:
    while not stop.is_set():
        try:
            with anyio.fail_after(1.2):
                pipe = client.pipeline(transaction=False)
                for k in range(8):
                    pipe.get(f"k{i}:{k}")
                await pipe.execute(raise_on_error=True)
            counts["returned"] += 1
        except Exception as exc:
            counts["raised"] += 1
            counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1
        except asyncio.CancelledError:
            if stop.is_set():
                raise
            counts["leaked"] += 1
            traceback.print_exc()
            await anyio.lowlevel.checkpoint()  # nothing is pending: the loop goes on


async def run(cluster: RedisCluster, seconds: float, tasks: int) -> dict[str, int]:
    import redis.asyncio.cluster

    client = redis.asyncio.cluster.RedisCluster.from_url(
        cluster.url, socket_timeout=0.3, socket_connect_timeout=0.3
    )
    counts = {"returned": 0, "raised": 0, "leaked": 0}
    stop = anyio.Event()
    victim = cluster.nodes[0]
    async with anyio.create_task_group() as tg:
        for i in range(tasks):
            tg.start_soon(calls, client, i, stop, counts)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            victim.pause()
            await anyio.sleep(1.5)  # past the node timeout (2 s) with the calls' own
            victim.resume()
            await anyio.to_thread.run_sync(cluster.wait_ok)
            await anyio.sleep(0.5)
            victim.kill()
            victim.restart()
            await anyio.to_thread.run_sync(cluster.wait_ok)
        stop.set()
    await client.aclose()
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seconds", type=float, default=150.0)
    p.add_argument("--tasks", type=int, default=24)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        cluster = RedisCluster(Path(root) / "cluster")
        cluster.start()
        try:
            counts = asyncio.run(run(cluster, args.seconds, args.tasks))
        finally:
            cluster.stop()
    print(counts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
