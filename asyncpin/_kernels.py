"""Triton copy kernel for KV blocks (imported only where Triton and a GPU exist)."""

import triton
import triton.language as tl


# Triton compiles a variant per alignment of each pointer and per value class of each
# integer (1, a multiple of 16, other; 32 or 64 bits) it is given. The id arrays'
# alignment, the segment count, the host base and stride (a staging slot's depend on the
# arrays a job moves) and the range of arrays change from one transfer to the next:
# compiling a variant mid-serving stalls the submitting thread, and loading it breaks a
# CUDA graph capture under way on another thread. So those are not specialised, and the
# integers are 64-bit whatever their value; the tables are fixed per layout. One variant
# per direction, then, which the engine launches directly once compiled
# (``asyncpin.engines.cuda.methods``).
@triton.jit(
    do_not_specialize=[
        "gpu_ids",
        "cpu_ids",
        "host_base",
        "host_stride",
        "first_array",
        "n_segments",
        "n_arrays",
    ]
)
def kv_copy(
    gpu_ids,
    cpu_ids,
    array_ptrs,
    array_strides,
    array_words,
    array_offsets,
    host_base: tl.int64,
    host_stride: tl.int64,
    first_array: tl.int64,
    n_segments: tl.int64,
    n_arrays: tl.int64,
    TO_HOST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Segment s is block i of array a (arrays ``first_array .. first_array + n_arrays -
    1``). Its device address comes from the array table (``array_ptrs[a] + gpu_ids[i] *
    array_strides[a]``, bytes); its host address is block-major (``host_base + cpu_ids[i]
    * host_stride + array_offsets[a]``), which is the pinned region through UVA, or a
    device staging buffer laid out the same way. It moves ``array_words[a]`` words.
    Programs stride over segments, so the grid size bounds the SMs taken.

    It moves 8-byte words (``asyncpin.engines.cuda.plan.KERNEL_WORD``): every address
    above must be a multiple of 8, or the device faults with a sticky
    cudaErrorMisalignedAddress. The engine launches it only on layouts
    ``kernel_misalignment`` passes."""
    offsets = tl.arange(0, BLOCK)
    for s in range(tl.program_id(0), n_segments, tl.num_programs(0)):
        i = s // n_arrays
        a = first_array + s - i * n_arrays
        g = tl.load(gpu_ids + i)
        c = tl.load(cpu_ids + i)
        device_addr = tl.load(array_ptrs + a) + g * tl.load(array_strides + a)
        host_addr = host_base + c * host_stride + tl.load(array_offsets + a)
        words = tl.load(array_words + a)
        device = device_addr.to(tl.pointer_type(tl.int64))
        host = host_addr.to(tl.pointer_type(tl.int64))
        for w in range(0, words, BLOCK):
            mask = w + offsets < words
            if TO_HOST:
                tl.store(host + w + offsets, tl.load(device + w + offsets, mask=mask), mask=mask)
            else:
                tl.store(device + w + offsets, tl.load(host + w + offsets, mask=mask), mask=mask)
