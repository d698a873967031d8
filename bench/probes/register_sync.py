"""Do cudaHostRegister / cudaHostUnregister wait for the GPU, or hold up other threads'
launches? (Issue 17: the GPU step stretches while pinning and more while closing.)

    python3 bench/probes/register_sync.py [--chunk-mib 16] [--chunks 64]

Prints, for chunks of ``--chunk-mib``: each call's time with the GPU idle; with a 200 ms
kernel queued on another stream (a call that waits for the device takes ~200 ms); and the
longest kernel launch of a thread that launches small kernels back to back while this
thread registers then unregisters ``--chunks`` chunks (the launch blocked by the call).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--chunk-mib", type=int, action="append")
    p.add_argument("--chunks", type=int, default=64)
    args = p.parse_args()
    rt = torch.cuda.cudart()
    torch.cuda.init()
    x = torch.ones(1 << 20, device="cuda")
    out = {}
    for mib in args.chunk_mib or [16]:
        size = mib << 20
        buf = torch.ones(size * args.chunks, dtype=torch.uint8)
        base = buf.data_ptr()
        addrs = [base + i * size for i in range(args.chunks)]

        def reg(a: int, size: int = size) -> float:
            t0 = time.perf_counter()
            assert int(rt.cudaHostRegister(a, size, 0)) == 0
            return time.perf_counter() - t0

        def unreg(a: int) -> float:
            t0 = time.perf_counter()
            assert int(rt.cudaHostUnregister(a)) == 0
            return time.perf_counter() - t0

        idle_reg = [reg(a) for a in addrs[:8]]
        idle_unreg = [unreg(a) for a in addrs[:8]]
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(1.98e9 * 0.2))  # ~200 ms at 1.98 GHz
        busy_reg = reg(addrs[0])
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(1.98e9 * 0.2))
        busy_unreg = unreg(addrs[0])
        torch.cuda.synchronize()

        launches: list[float] = []
        stop = threading.Event()

        def launcher(launches: list[float] = launches, stop: threading.Event = stop) -> None:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                while not stop.is_set():
                    t0 = time.perf_counter()
                    x.add_(1)
                    launches.append(time.perf_counter() - t0)
                    if len(launches) % 64 == 0:
                        s.synchronize()

        th = threading.Thread(target=launcher)
        th.start()
        time.sleep(0.2)
        baseline = max(launches) if launches else 0.0
        n0 = len(launches)
        t0 = time.perf_counter()
        regs = [reg(a) for a in addrs]
        t1 = time.perf_counter()
        during_reg = max(launches[n0:], default=0.0)
        n1 = len(launches)
        unregs = [unreg(a) for a in addrs]
        t2 = time.perf_counter()
        during_unreg = max(launches[n1:], default=0.0)
        stop.set()
        th.join()
        out[f"{mib}MiB"] = {
            "idle_reg_ms": [round(v * 1e3, 3) for v in idle_reg],
            "idle_unreg_ms": [round(v * 1e3, 3) for v in idle_unreg],
            "reg_with_200ms_kernel_queued_ms": busy_reg * 1e3,
            "unreg_with_200ms_kernel_queued_ms": busy_unreg * 1e3,
            "launch_max_ms_alone": baseline * 1e3,
            "launch_max_ms_during_reg": during_reg * 1e3,
            "launch_max_ms_during_unreg": during_unreg * 1e3,
            "reg_total_ms": (t1 - t0) * 1e3,
            "unreg_total_ms": (t2 - t1) * 1e3,
            "reg_max_ms": max(regs) * 1e3,
            "unreg_max_ms": max(unregs) * 1e3,
            "launches_during_reg": n1 - n0,
            "launches_during_unreg": len(launches) - n1,
        }
        del buf
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
