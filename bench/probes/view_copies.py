"""Which torch copies between GPU tensors and views of a pinned region the CUDA driver
takes: within one pinned chunk, and across two (each chunk is its own registration).

    python3 bench/probes/view_copies.py [--json-out F]

For each registration mode (asyncpin's own context, the default, and torch's context:
``CudaBackend(own_context=False)``), each direction, and ``non_blocking`` off and on,
copies one chunk's bytes at a chunk's start, and then the same bytes straddling a chunk
boundary, and reports "ok" (bytes checked) or the error's first line; each by a torch
``copy_`` and by ``mgr.host_copy`` (cut where the chunks meet).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))

from asyncpin import OffloadManager
from asyncpin.cuda import CudaBackend

CHUNK = 4 << 20


def _try(copy: Any) -> str:
    try:
        ok = copy()
        torch.cuda.synchronize()
        return "ok" if ok() else "wrong bytes"
    except Exception as exc:  # the probe reports whatever the driver says
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


async def _mode(own_context: bool) -> dict[str, str]:
    results: dict[str, str] = {}
    backend = CudaBackend(0, own_context=own_context)
    async with OffloadManager(4 * CHUNK, backend=backend, chunk_bytes=CHUNK) as mgr:
        await mgr.pinned
        for where, start in (("within", CHUNK), ("across", CHUNK + CHUNK // 2)):
            view = mgr.host_view(start, CHUNK)
            for blocking in (False, True):
                gpu = torch.randint(0, 255, (CHUNK,), dtype=torch.uint8, device="cuda")

                def store(
                    v: torch.Tensor = view, g: torch.Tensor = gpu, nb: bool = blocking
                ) -> Any:
                    v.copy_(g, non_blocking=nb)
                    return lambda: torch.equal(v, g.cpu())

                def load(v: torch.Tensor = view, nb: bool = blocking) -> Any:
                    v.fill_(7)
                    out = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
                    out.copy_(v, non_blocking=nb)
                    return lambda: bool((out == 7).all())

                def host_store(
                    v: torch.Tensor = view, g: torch.Tensor = gpu, nb: bool = blocking
                ) -> Any:
                    mgr.host_copy(v, g, non_blocking=nb)
                    return lambda: torch.equal(v, g.cpu())

                def host_load(v: torch.Tensor = view, nb: bool = blocking) -> Any:
                    v.fill_(9)
                    out = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
                    mgr.host_copy(out, v, non_blocking=nb)
                    return lambda: bool((out == 9).all())

                key = f"{where} non_blocking={blocking}"
                results[f"D2H {key}"] = _try(store)
                results[f"H2D {key}"] = _try(load)
                results[f"D2H host_copy {key}"] = _try(host_store)
                results[f"H2D host_copy {key}"] = _try(host_load)
            del view
        # A strided view (as host_array() gives) whose rows each span a boundary.
        rows = mgr.host_view(CHUNK // 4, 3 * CHUNK).view(3, CHUNK)[:, CHUNK // 2 :]
        gpu = torch.randint(0, 255, tuple(rows.shape), dtype=torch.uint8, device="cuda")

        def strided_store(v: torch.Tensor = rows, g: torch.Tensor = gpu) -> Any:
            v.copy_(g)
            return lambda: torch.equal(v, g.cpu())

        def strided_load(v: torch.Tensor = rows) -> Any:
            v.fill_(5)
            out = torch.empty(tuple(v.shape), dtype=torch.uint8, device="cuda")
            out.copy_(v)
            return lambda: bool((out == 5).all())

        results["D2H strided rows across"] = _try(strided_store)
        results["H2D strided rows across"] = _try(strided_load)
        # Dense with permuted dimensions (FlashInfer's HND blocks), across two chunks; the
        # GPU tensor laid out alike (as empty_like or .to("cuda") give it).
        hnd = mgr.host_view(CHUNK // 2, CHUNK).view(64, 16, CHUNK // 1024).permute(1, 0, 2)
        gpu = torch.randint(0, 255, tuple(hnd.shape), dtype=torch.uint8).to("cuda")
        gpu = torch.empty_like(hnd, device="cuda").copy_(gpu)

        def hnd_store(v: torch.Tensor = hnd, g: torch.Tensor = gpu) -> Any:
            v.copy_(g)
            return lambda: torch.equal(v, g.cpu())

        def hnd_host_copy(v: torch.Tensor = hnd, g: torch.Tensor = gpu) -> Any:
            mgr.host_copy(v, g)
            return lambda: torch.equal(v, g.cpu())

        results["D2H permuted dense across"] = _try(hnd_store)
        results["D2H host_copy permuted dense across"] = _try(hnd_host_copy)
        del rows, hnd
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json-out")
    args = parser.parse_args()
    out: dict[str, Any] = {}
    for own in (True, False):
        out["own context" if own else "torch's context"] = anyio.run(_mode, own)
    for mode, results in out.items():
        for key, value in results.items():
            print(f"{mode:16} {key:42} {value}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
