"""Do several connections read 2 MiB values off one local server faster than one?

    python3 bench/probes/redis_get_conns.py [--server redis-server] [--io-threads 1]

Starts one server (``--server``: redis-server or valkey-server, ``--io-threads`` passed
on: Valkey's I/O threads) on loopback, SETs 256 values of 2 MiB, then reads them all
with 1, 2, 4 and 8 connections at once, each in a thread of its own, in pipelines of 16
GETs, two ways: RESP off a plain socket with ``recv_into`` straight into one
destination buffer, and ``RedisStore.readinto`` (the remote tier's direct reads: each
thread one call a pipeline, the store's idle connections shared). Prints the best GB/s
of 3 repeats, each way and count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.redis_servers import free_port

SIZE = 2 << 20
VALUES = 256
PIPELINE = 16


def main() -> int:
    from asyncpin.tier.remote import RedisStore

    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--server", default="redis-server")
    p.add_argument("--io-threads", type=int, default=1)
    p.add_argument("--json-out")
    args = p.parse_args()
    port = free_port()
    work = tempfile.mkdtemp()
    command = [args.server, "--port", str(port), "--save", "", "--appendonly", "no"]
    command += ["--dir", work]
    if args.io_threads > 1:
        command += ["--io-threads", str(args.io_threads)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    figures: dict[str, dict[int, float]] = {"socket": {}, "readinto": {}}
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                time.sleep(0.05)
        url = f"redis://127.0.0.1:{port}"
        import redis

        client = redis.Redis.from_url(url)
        payload = os.urandom(SIZE)
        for i in range(VALUES):
            client.set(f"k{i}", payload)
        dest = memoryview(bytearray(VALUES * SIZE))
        store = RedisStore(url, timeout_s=10)

        def by_socket(mine: list[int]) -> None:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                for lo in range(0, len(mine), PIPELINE):
                    part = mine[lo : lo + PIPELINE]
                    sock.sendall(
                        b"".join(
                            b"*2\r\n$3\r\nGET\r\n$%d\r\nk%d\r\n" % (len(str(k)) + 1, k)
                            for k in part
                        )
                    )
                    for k in part:
                        line = b""
                        while not line.endswith(b"\r\n"):
                            line += sock.recv(1)
                        n = int(line[1:-2])
                        view, got = dest[k * SIZE : k * SIZE + n], 0
                        while got < n:
                            got += sock.recv_into(view[got:], n - got)
                        end = b""
                        while len(end) < 2:
                            end += sock.recv(2 - len(end))

        def by_store(mine: list[int]) -> None:
            for lo in range(0, len(mine), PIPELINE):
                part = mine[lo : lo + PIPELINE]

                def into(i: int, size: int, head: memoryview, part: list[int] = part) -> memoryview:
                    return dest[part[i] * SIZE + 64 : (part[i] + 1) * SIZE]

                store.readinto([f"k{k}" for k in part], into, head_bytes=64)

        ways: dict[str, Callable[[list[int]], None]] = {"socket": by_socket, "readinto": by_store}
        for conns in (1, 2, 4, 8):
            for name, way in ways.items():
                best = 0.0
                for _ in range(3):
                    threads = [
                        threading.Thread(target=way, args=(list(range(j, VALUES, conns)),))
                        for j in range(conns)
                    ]
                    start = time.perf_counter()
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    best = max(best, VALUES * SIZE / (time.perf_counter() - start) / 1e9)
                figures[name][conns] = round(best, 3)
                print(
                    f"{args.server} io-threads {args.io_threads} {name:8} conns {conns}: "
                    f"{best:.2f} GB/s",
                    flush=True,
                )
        client.close()
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "gbps": figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
