"""Child process for tests/cuda/test_cuda.py: captures CUDA graphs while an 8 GiB manager
pins.

    python tests/cuda/cuda_capture_child.py {gated,hook,ungated}

Prints one JSON line: captures made, those made while pinning was under way, capture
errors, and the pin error's CUDA code. A collision corrupts CUDA state for the rest of
the process (torch's graph RNG, the capture stream), which is why it runs on its own.
"""

from __future__ import annotations

import json
import sys

import anyio
import anyio.lowlevel
import torch

from asyncpin import OffloadManager, install_capture_gate

GiB, MiB = 1 << 30, 1 << 20


LAYERS = 200


def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Many kernels, as an engine's capture has: the capture spans several GIL switch
    # intervals, so registrations can start in the middle of it as they do in a server.
    for _ in range(LAYERS):
        x = torch.tanh(x @ w)
    return x


def capture_once(x: torch.Tensor, w: torch.Tensor) -> None:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = forward(x, w)
    graph.replay()
    torch.cuda.synchronize()
    if not torch.allclose(y, forward(x, w), atol=1e-4):
        raise AssertionError("the captured graph computed something else")


async def main(mode: str) -> dict[str, object]:
    sys.setswitchinterval(0.0005)
    x = torch.randn(256, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda") / 16
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: lazy cuBLAS set-up must not happen in capture
        for _ in range(3):
            forward(x, w)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    capture_once(x, w)  # one capture before any pinning: the recipe itself works

    handle = install_capture_gate() if mode == "hook" else None
    captures = during = 0
    errors: list[str] = []
    try:
        async with OffloadManager(8 * GiB, backend="cuda", chunk_bytes=32 * MiB) as mgr:
            while captures < 100 or not mgr.pinned.is_set():
                under_way = 0 < mgr.stats().pinned_bytes < mgr.nbytes
                try:
                    if mode == "gated":
                        with mgr.pinning_paused():
                            capture_once(x, w)
                    else:
                        capture_once(x, w)
                except RuntimeError as exc:
                    errors.append(str(exc).splitlines()[0])
                    break  # the capture state of the process is now unreliable
                captures += 1
                during += under_way
                await anyio.lowlevel.checkpoint()
            pin_error = mgr.pin_error
            stats = mgr.stats()
    finally:
        if handle is not None:
            handle.uninstall()
    return {
        "mode": mode,
        "captures": captures,
        "during_pinning": during,
        "errors": errors,
        "pin_error_code": pin_error.code if pin_error else None,
        "pin_error_name": pin_error.code_name if pin_error else None,
        "chunks_pinned_at_end": stats.chunks_pinned,
        "chunks_total": stats.chunks_total,
    }


if __name__ == "__main__":
    print(json.dumps(anyio.run(main, sys.argv[1])))
