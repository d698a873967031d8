"""How fast can 2 MiB values come off a local Redis: redis-py's sync client, its asyncio
client, or a socket read straight into the destination (``recv_into``)?

    python3 bench/probes/socket_reads.py [--values 64] [--repeats 5]

Starts one redis-server on loopback (tests/redis_servers.py), SETs ``--values`` values of
2 MiB, then, ``--repeats`` times in turn, reads them all in pipelines of 16 GETs three
ways into one destination buffer: redis-py's sync client and its asyncio client (each
value a ``bytes``, copied in), and RESP read off a plain socket with ``recv_into``
straight into the destination. Prints GB/s of each way, every repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.redis_servers import RedisServer

SIZE = 2 << 20
PIPELINE = 16


def main() -> int:
    import redis
    import redis.asyncio

    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--values", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    n = args.values
    keys = [f"k{i}" for i in range(n)]
    payload = bytes(range(256)) * (SIZE // 256)
    dest = bytearray(n * SIZE)
    out = memoryview(dest)

    def sync_get(client: Any) -> None:
        for lo in range(0, n, PIPELINE):
            pipe = client.pipeline(transaction=False)
            for key in keys[lo : lo + PIPELINE]:
                pipe.get(key)
            for j, value in enumerate(pipe.execute()):
                out[(lo + j) * SIZE : (lo + j + 1) * SIZE] = value

    async def async_get(client: Any) -> None:
        for lo in range(0, n, PIPELINE):
            pipe = client.pipeline(transaction=False)
            for key in keys[lo : lo + PIPELINE]:
                pipe.get(key)
            for j, value in enumerate(await pipe.execute()):
                out[(lo + j) * SIZE : (lo + j + 1) * SIZE] = value

    def socket_get(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for lo in range(0, n, PIPELINE):
                sock.sendall(
                    b"".join(
                        b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key.encode())
                        for key in keys[lo : lo + PIPELINE]
                    )
                )
                for j in range(PIPELINE):
                    line = b""
                    while not line.endswith(b"\r\n"):
                        line += sock.recv(1)
                    length = int(line[1:-2])
                    view = out[(lo + j) * SIZE : (lo + j) * SIZE + length]
                    got = 0
                    while got < length:
                        got += sock.recv_into(view[got:], length - got)
                    crlf = b""
                    while len(crlf) < 2:
                        crlf += sock.recv(2 - len(crlf))

    with tempfile.TemporaryDirectory() as root:
        server = RedisServer(Path(root) / "server")
        server.start()
        try:
            sync_client = redis.Redis.from_url(server.url)
            for key in keys:
                sync_client.set(key, payload)
            async_client = redis.asyncio.Redis.from_url(server.url)
            loop = asyncio.new_event_loop()
            ways: dict[str, Callable[[], None]] = {
                "redis-py sync": lambda: sync_get(sync_client),
                "redis-py asyncio": lambda: loop.run_until_complete(async_get(async_client)),
                "socket recv_into": lambda: socket_get(server.port),
            }
            figures: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(args.repeats):
                for name, way in ways.items():
                    dest[:] = bytes(len(dest))
                    start = time.perf_counter()
                    way()
                    figures[name].append(n * SIZE / (time.perf_counter() - start) / 1e9)
                    assert bytes(out[(n - 1) * SIZE :]) == payload, name
            loop.run_until_complete(async_client.aclose())
            loop.close()
            sync_client.close()
        finally:
            server.stop()
    for name, values in figures.items():
        print(f"{name:18} " + " ".join(f"{v:.2f}" for v in values) + " GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
