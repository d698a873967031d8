"""The copy kernel's addressing, checked on the CPU with Triton's interpreter (no GPU).

Runs ``asyncpin._kernels.kv_copy`` under ``TRITON_INTERPRET=1`` over CPU tensors for the
layouts of ``tests/layouts.py`` (the ones whose blocks are whole 8-byte words), random
ranges of arrays and both directions, as the engine launches it: over the host region
(the ``kernel`` method: host block ``c`` at ``c * host_block_bytes``, or one rank's part
of blocks that several ranks share) and over a staging buffer (``pack``: slot ``j`` of
the range's span). Every byte is compared with the layout's
definition. A check of the arithmetic only: the GPU run is what proves the kernel.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python bench/probes/kernel_on_cpu.py

Triton 3.6's interpreter under NumPy >= 2.3 fails on ``range(tl.program_id(0), ...)``
("only 0-dimensional arrays can be converted to Python scalars"): in
``triton/runtime/interpreter.py``, make the tensor's ``__index__`` read
``int(self.handle.data.reshape(-1)[0])``.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from asyncpin._kernels import kv_copy
from asyncpin.engines.cuda.plan import KERNEL_WORD, AddressPlan
from tests.layouts import CASES, build


def check(case: str, seed: int) -> None:
    rng = random.Random(seed)
    layout = build(case, 24, "cpu", seed)
    raw = layout.byte_arrays()
    plan = AddressPlan(
        array_ptrs=[a.data_ptr() for a in layout.arrays],
        array_strides=[a.stride(0) * a.dtype.itemsize for a in layout.arrays],
        array_bytes=layout.array_block_bytes,
        host_base=0,
        chunk_bytes=1 << 30,
    )
    tables = [plan.ptrs_cpu, plan.strides_cpu, plan.bytes_cpu // KERNEL_WORD, plan.offsets_cpu]
    lo = rng.randrange(layout.num_arrays)
    arrays = range(lo, rng.randint(lo + 1, layout.num_arrays))
    offset, span = plan.span(arrays)
    n = rng.randint(1, 9)
    gpu = rng.sample(range(24), n)
    for staging in (False, True):
        slots = rng.sample(range(16), n) if not staging else list(range(n))
        # The region: rank ``rank`` of ``ranks`` sharing each host block (host_slice).
        ranks = 1 if staging else rng.choice([1, 2, 3])
        rank = rng.randrange(ranks)
        stride = span if staging else layout.host_block_bytes * ranks
        host = torch.zeros(16, stride, dtype=torch.uint8)
        first = -offset if staging else rank * layout.host_block_bytes
        base = host.data_ptr() + first
        ids = [torch.tensor(gpu), torch.tensor(slots)]
        before = [r.clone() for r in raw]
        kv_copy[(3,)](
            *ids,
            *tables,
            base,
            stride,
            arrays.start,
            n * len(arrays),
            len(arrays),
            TO_HOST=True,
            BLOCK=512,
        )
        for a in arrays:
            start = layout.array_offsets[a] + first
            for g, c in zip(gpu, slots, strict=True):
                part = host[c, start : start + layout.array_block_bytes[a]]
                assert torch.equal(part, raw[a][g]), (case, seed, staging, "store", a)
        outside = host.clone()
        for a in arrays:
            start = layout.array_offsets[a] + first
            outside[slots, start : start + layout.array_block_bytes[a]] = 0
        assert not outside.any(), (case, seed, staging, "store wrote outside its bytes")
        for r in raw:
            r.zero_()
        dest = rng.sample(range(24), n)
        kv_copy[(3,)](
            torch.tensor(dest),
            ids[1],
            *tables,
            base,
            stride,
            arrays.start,
            n * len(arrays),
            len(arrays),
            TO_HOST=False,
            BLOCK=512,
        )
        for a, r in enumerate(raw):
            expected = torch.zeros_like(r)
            if a in arrays:
                expected[dest] = before[a][gpu]
            assert torch.equal(r, expected), (case, seed, staging, "load", a)
        for r, b in zip(raw, before, strict=True):
            r.copy_(b)


def main() -> int:
    cases = [c for c in sorted(CASES) if c != "odd_bytes"]
    for case in cases:
        for seed in range(4):
            check(case, seed)
    print(
        f"copy kernel (interpreted): {len(cases)} layouts x 4 seeds x region/staging x "
        "store/load: every byte where the layout puts it"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
