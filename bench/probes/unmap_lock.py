"""How long does another thread wait to map memory while a large region is unmapped, in
one munmap call or in pieces? (Issue 17: a 200 ms GPU step at the end of closing 64
GiB on the H200, in two of three runs, where the region is unmapped.)

    python3 bench/probes/unmap_lock.py [--gib 8] [--piece-mib 0 --piece-mib 64]

For each piece size (0: one call), maps and faults in ``--gib``, then unmaps it while a
second thread maps and unmaps 64 KiB (a new thread's stack, an allocator's arena) back
to back; prints the unmap's time and that thread's longest mmap + munmap.
"""

from __future__ import annotations

import argparse
import json
import mmap
import threading
import time

from asyncpin import _sys
from asyncpin._mapping import map_anonymous_aligned


def _unmap(address: int, nbytes: int, piece: int) -> None:
    step = piece or nbytes
    for start in range(0, nbytes, step):
        _sys.libc_munmap(address + start, min(step, nbytes - start))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--gib", type=int, default=8)
    p.add_argument("--piece-mib", type=int, action="append")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    nbytes = args.gib << 30
    out = {}
    for piece_mib in args.piece_mib or [0, 64]:
        for rnd in range(args.rounds):
            address = map_anonymous_aligned(nbytes)
            _sys.libc_madvise(address, nbytes, _sys.MADV_POPULATE_WRITE)
            waits: list[float] = []
            stop = threading.Event()

            def mapper(waits: list[float] = waits, stop: threading.Event = stop) -> None:
                prot = mmap.PROT_READ | mmap.PROT_WRITE
                flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                while not stop.is_set():
                    t0 = time.perf_counter()
                    a = _sys.libc_mmap(64 << 10, prot, flags)
                    _sys.libc_munmap(a, 64 << 10)
                    waits.append(time.perf_counter() - t0)

            thread = threading.Thread(target=mapper)
            thread.start()
            time.sleep(0.05)
            n0 = len(waits)
            t0 = time.perf_counter()
            _unmap(address, nbytes, piece_mib << 20)
            unmap_s = time.perf_counter() - t0
            n1 = len(waits)
            stop.set()
            thread.join()
            out[f"piece {piece_mib} MiB round {rnd}"] = {
                "unmap_ms": round(unmap_s * 1e3, 1),
                "other_thread_max_map_ms": round(max(waits[n0 : n1 + 1], default=0.0) * 1e3, 2),
                "other_thread_maps": n1 - n0,
            }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
