"""How fast one thread can SET 2 MiB values to a local redis-server, by way of sending:
the whole value in one blocking ``sendall``, a ``send`` loop under a 50 ms socket timeout
(whole views, or 256 KiB pieces: what ``RedisStore.writefrom`` does), and ``sendmsg`` of
the command's parts; against redis-py's asyncio pipeline of ready ``bytes`` (the peer of
bench/remote.py). Pipelines of 16 values, every reply read; rounds alternate.

    python3 bench/probes/redis_send.py --port 6390 [--blocks 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time

import redis.asyncio

SZ, BATCH = 2 << 20, 16


def command_head(key: bytes, size: int) -> bytes:
    return b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size)


def replies(sock: socket.socket, n: int, buf: bytearray) -> None:
    while buf.count(b"\r\n") < n:
        buf += sock.recv(4096)
    del buf[:]


def run_socket(port: int, data: memoryview, blocks: int, how: str) -> float:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if how != "sendall":
        sock.settimeout(0.05)
    piece = 256 << 10 if how == "pieces" else None
    buf = bytearray()
    t0 = time.perf_counter()
    for lo in range(0, blocks, BATCH):
        for i in range(lo, min(blocks, lo + BATCH)):
            value = data[i * SZ : (i + 1) * SZ]
            head, tail = command_head(b"p:%d" % i, SZ), b"\r\n"
            if how == "sendall":
                sock.sendall(head)
                sock.sendall(value)
                sock.sendall(tail)
            elif how == "sendmsg":
                parts = [memoryview(head), value, memoryview(tail)]
                while parts:
                    try:
                        n = sock.sendmsg(parts)
                    except TimeoutError:
                        continue
                    while parts and n >= len(parts[0]):
                        n -= len(parts[0])
                        parts.pop(0)
                    if parts and n:
                        parts[0] = parts[0][n:]
            else:
                for part in (memoryview(head), value, memoryview(tail)):
                    while part:
                        try:
                            n = sock.send(part[:piece] if piece else part)
                        except TimeoutError:
                            continue
                        part = part[n:]
        replies(sock, min(blocks, lo + BATCH) - lo, buf)
    dt = time.perf_counter() - t0
    sock.close()
    return blocks * SZ / dt / 1e9


async def run_peer(port: int, values: list[bytes]) -> float:
    client = redis.asyncio.Redis(port=port)
    t0 = time.perf_counter()
    for lo in range(0, len(values), BATCH):
        pipe = client.pipeline(transaction=False)
        for i in range(lo, min(len(values), lo + BATCH)):
            pipe.set(f"q:{i}", values[i])
        await pipe.execute()
    dt = time.perf_counter() - t0
    await client.aclose()
    return len(values) * SZ / dt / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json-out")
    args = p.parse_args()
    raw = bytearray(os.urandom(args.blocks * SZ))
    data = memoryview(raw)
    values = [bytes(data[i * SZ : (i + 1) * SZ]) for i in range(args.blocks)]
    out: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for how in ("sendall", "send", "pieces", "sendmsg"):
            out.setdefault(how, []).append(run_socket(args.port, data, args.blocks, how))
        out.setdefault("peer", []).append(asyncio.run(run_peer(args.port, values)))
    for how, figures in out.items():
        print(f"{how:8s} " + " ".join(f"{f:.2f}" for f in figures) + " GB/s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
