"""Triton copy kernel for KV blocks (imported only where Triton and a GPU exist)."""

import triton
import triton.language as tl


# Triton compiles a variant per alignment of each pointer and per value class of each
# integer (1, a multiple of 16, other) it is given. The id arrays' alignment and the
# segment count change from one transfer to the next: compiling a variant mid-serving
# stalls the submitting thread, and loading it breaks a CUDA graph capture under way on
# another thread. So those three are not specialised; the rest are fixed per layout.
@triton.jit(do_not_specialize=["gpu_ids", "cpu_ids", "n_segments"])
def kv_copy(
    gpu_ids,
    cpu_ids,
    array_ptrs,
    array_strides,
    host_base,
    n_segments,
    n_arrays,
    segment_words,
    TO_HOST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Segment s is block i of array a. Its device address comes from the array table
    (``array_ptrs[a] + gpu_ids[i] * array_strides[a]``, bytes); its host address is
    block-major (``host_base + (cpu_ids[i] * n_arrays + a) * segment bytes``), which is
    the pinned region through UVA, or a device staging buffer laid out the same way.
    Programs stride over segments, so the grid size bounds the SMs taken.

    It moves 8-byte words (``asyncpin.engines.cuda.plan.KERNEL_WORD``): every address
    above must be a multiple of 8, or the device faults with a sticky
    cudaErrorMisalignedAddress. The engine launches it only on layouts
    ``kernel_misalignment`` passes."""
    offsets = tl.arange(0, BLOCK)
    for s in range(tl.program_id(0), n_segments, tl.num_programs(0)):
        i = s // n_arrays
        a = s - i * n_arrays
        g = tl.load(gpu_ids + i)
        c = tl.load(cpu_ids + i)
        device_addr = tl.load(array_ptrs + a) + g * tl.load(array_strides + a)
        host_addr = host_base + (c * n_arrays + a) * segment_words * 8
        device = device_addr.to(tl.pointer_type(tl.int64))
        host = host_addr.to(tl.pointer_type(tl.int64))
        for w in range(0, segment_words, BLOCK):
            mask = w + offsets < segment_words
            if TO_HOST:
                tl.store(host + w + offsets, tl.load(device + w + offsets, mask=mask), mask=mask)
            else:
                tl.store(device + w + offsets, tl.load(host + w + offsets, mask=mask), mask=mask)
