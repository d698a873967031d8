"""How long does prefaulting take next to a thread busy in Python, with the prefault
pieces allowed to grow to CAP MiB? (The pieces grow while the GIL is slow to come back;
issue 17 capped them at 8 MiB.)

    python3 bench/probes/prefault_busy_gil.py CAP_MIB [--gib 2]

Faults in ``--gib`` of fresh memory in 64 MiB chunks, one thread, through
``HostRegion.prefault``, while another thread counts in a Python loop; prints the time.
Run each cap in its own process, alternating: the first run on memory the machine has
not backed yet is slower whatever the cap.
"""

from __future__ import annotations

import argparse
import threading
import time

import asyncpin.region
from asyncpin.region import HostRegion

CHUNK = 64 << 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("cap_mib", type=int)
    p.add_argument("--gib", type=int, default=2)
    args = p.parse_args()
    asyncpin.region.PREFAULT_MAX_PIECE_BYTES = args.cap_mib << 20
    stop = threading.Event()

    def busy() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=busy)
    thread.start()
    region = HostRegion.create(args.gib << 30)
    try:
        t0 = time.perf_counter()
        for offset in range(0, region.nbytes, CHUNK):
            region.prefault(offset, CHUNK)
        print(f"cap {args.cap_mib} MiB: {time.perf_counter() - t0:.2f} s")
    finally:
        stop.set()
        thread.join()
        region.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
