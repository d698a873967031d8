"""The copy kernel for KV blocks: a few dozen lines of PTX, loaded through the CUDA
runtime's library calls (``cudaLibraryLoadData``, CUDA >= 12.0) and launched with
``cudaLaunchKernel``.

Written in PTX rather than compiled by a JIT in Python, so that a process's first
manager imports no compiler and holds no GIL while the kernel is built: the driver
translates the PTX in ``cudaLibraryLoadData`` (a ctypes call, so the GIL is released),
once per process, or takes it from its cache on disk. There is one kernel for every
layout, direction and size: nothing about a transfer selects another variant, so
nothing is loaded after the engine's ``prepare()`` (which runs under the capture gate):
a load mid-serving would stall the submitting thread, and may break a graph capture
under way on another thread.
"""

from __future__ import annotations

import ctypes
import threading

from asyncpin._cudart import Runtime

__all__ = ["KV_COPY_PTX", "THREADS", "CopyKernel", "kernel_available"]

THREADS = 128  # threads of a CTA; each moves four 8-byte words a step

# Segment s (CTAs stride over them, so the grid size bounds the SMs taken) is block i =
# s / n_arrays of array a = first_array + s % n_arrays. Its device address comes from
# the array table (array_ptrs[a] + gpu_ids[i] * array_strides[a], bytes), its host
# address is block-major (host_base + cpu_ids[i] * host_stride + array_offsets[a]):
# the pinned region through UVA, or a device staging buffer laid out the same way. It
# moves array_words[a] 8-byte words, to the host where to_host is not 0, else from it.
# A CTA's threads move consecutive words (coalesced), four each per step, so that enough
# reads are in flight to fill the bus from host memory.
#
# Every address must be a multiple of 8, or the device faults with a sticky
# cudaErrorMisalignedAddress: the engine launches it only on layouts
# ``kernel_misalignment`` passes. Every parameter is 64 bits wide.
KV_COPY_PTX = r"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry kv_copy(
    .param .u64 gpu_ids,
    .param .u64 cpu_ids,
    .param .u64 array_ptrs,
    .param .u64 array_strides,
    .param .u64 array_words,
    .param .u64 array_offsets,
    .param .u64 host_base,
    .param .u64 host_stride,
    .param .u64 first_array,
    .param .u64 n_segments,
    .param .u64 n_arrays,
    .param .u64 to_host
)
{
    .reg .pred %done, %to_host, %in1, %in2, %in3;
    .reg .b32 %r;
    .reg .b64 %gpu_ids, %cpu_ids, %ptrs, %strides, %words_of, %offsets;
    .reg .b64 %host_base, %host_stride, %first, %n_segments, %n_arrays, %flag;
    .reg .b64 %s, %grid, %lane, %width, %step, %i, %a, %t, %row, %col;
    .reg .b64 %dev, %host, %words, %src, %dst, %w, %w1, %w2, %w3;
    .reg .b64 %o0, %o1, %o2, %o3, %v0, %v1, %v2, %v3;

    ld.param.u64 %gpu_ids, [gpu_ids];
    ld.param.u64 %cpu_ids, [cpu_ids];
    ld.param.u64 %ptrs, [array_ptrs];
    ld.param.u64 %strides, [array_strides];
    ld.param.u64 %words_of, [array_words];
    ld.param.u64 %offsets, [array_offsets];
    ld.param.u64 %host_base, [host_base];
    ld.param.u64 %host_stride, [host_stride];
    ld.param.u64 %first, [first_array];
    ld.param.u64 %n_segments, [n_segments];
    ld.param.u64 %n_arrays, [n_arrays];
    ld.param.u64 %flag, [to_host];
    setp.ne.u64 %to_host, %flag, 0;

    mov.u32 %r, %ctaid.x;
    cvt.u64.u32 %s, %r;
    mov.u32 %r, %nctaid.x;
    cvt.u64.u32 %grid, %r;
    mov.u32 %r, %tid.x;
    cvt.u64.u32 %lane, %r;
    mov.u32 %r, %ntid.x;
    cvt.u64.u32 %width, %r;
    shl.b64 %step, %width, 2;

SEGMENT:
    setp.ge.u64 %done, %s, %n_segments;
    @%done bra END;
    div.u64 %i, %s, %n_arrays;
    mul.lo.u64 %t, %i, %n_arrays;
    sub.u64 %t, %s, %t;
    add.u64 %a, %first, %t;
    shl.b64 %row, %i, 3;
    shl.b64 %col, %a, 3;
    add.u64 %t, %gpu_ids, %row;
    ld.global.u64 %v0, [%t];
    add.u64 %t, %cpu_ids, %row;
    ld.global.u64 %v1, [%t];
    add.u64 %t, %ptrs, %col;
    ld.global.u64 %dev, [%t];
    add.u64 %t, %strides, %col;
    ld.global.u64 %v2, [%t];
    mad.lo.u64 %dev, %v0, %v2, %dev;
    add.u64 %t, %offsets, %col;
    ld.global.u64 %v3, [%t];
    mad.lo.u64 %host, %v1, %host_stride, %host_base;
    add.u64 %host, %host, %v3;
    add.u64 %t, %words_of, %col;
    ld.global.u64 %words, [%t];
    selp.b64 %src, %dev, %host, %to_host;
    selp.b64 %dst, %host, %dev, %to_host;
    mov.u64 %w, %lane;

WORDS:
    setp.ge.u64 %done, %w, %words;
    @%done bra NEXT;
    add.u64 %w1, %w, %width;
    add.u64 %w2, %w1, %width;
    add.u64 %w3, %w2, %width;
    setp.lt.u64 %in1, %w1, %words;
    setp.lt.u64 %in2, %w2, %words;
    setp.lt.u64 %in3, %w3, %words;
    shl.b64 %o0, %w, 3;
    shl.b64 %o1, %w1, 3;
    shl.b64 %o2, %w2, 3;
    shl.b64 %o3, %w3, 3;
    add.u64 %t, %src, %o0;
    ld.global.u64 %v0, [%t];
    add.u64 %t, %src, %o1;
    @%in1 ld.global.u64 %v1, [%t];
    add.u64 %t, %src, %o2;
    @%in2 ld.global.u64 %v2, [%t];
    add.u64 %t, %src, %o3;
    @%in3 ld.global.u64 %v3, [%t];
    add.u64 %t, %dst, %o0;
    st.global.u64 [%t], %v0;
    add.u64 %t, %dst, %o1;
    @%in1 st.global.u64 [%t], %v1;
    add.u64 %t, %dst, %o2;
    @%in2 st.global.u64 [%t], %v2;
    add.u64 %t, %dst, %o3;
    @%in3 st.global.u64 [%t], %v3;
    add.u64 %w, %w, %step;
    bra WORDS;

NEXT:
    add.u64 %s, %s, %grid;
    bra SEGMENT;

END:
    ret;
}
"""

_N_PARAMS = 12
_PARAM_BYTES = 8


def kernel_available(rt: Runtime) -> bool:
    """Whether this CUDA runtime loads code at run time (``cudaLibraryLoadData``: 12.0)."""
    return hasattr(rt.lib, "cudaLibraryLoadData") and rt.version >= 12000


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


# The kernel's handle per runtime library, loaded once per process: the library is
# context-independent, and each device loads it at its first launch, which the engine's
# prepare() makes. It stays loaded for the process's life (a few KiB).
_loaded: dict[int, int] = {}
_load_lock = threading.Lock()


class CopyKernel:
    """``kv_copy``, loaded through ``rt``."""

    def __init__(self, rt: Runtime) -> None:
        lib = rt.lib
        self._rt = rt
        with _load_lock:
            kernel = _loaded.get(id(lib))
            if kernel is None:
                kernel = _loaded[id(lib)] = self._load(rt)
        self._kernel = kernel
        self._threads = _Dim3(THREADS, 1, 1)
        lib.cudaLaunchKernel.argtypes = [
            ctypes.c_void_p,
            _Dim3,
            _Dim3,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
        ]
        self._launch = lib.cudaLaunchKernel

    @staticmethod
    def _load(rt: Runtime) -> int:
        lib = rt.lib
        library, kernel = ctypes.c_void_p(), ctypes.c_void_p()
        source = ctypes.create_string_buffer(KV_COPY_PTX.encode())
        none = ctypes.c_void_p()
        code = lib.cudaLibraryLoadData(ctypes.byref(library), source, none, none, 0, none, none, 0)
        rt.check("cudaLibraryLoadData", code)
        code = lib.cudaLibraryGetKernel(ctypes.byref(kernel), library, b"kv_copy")
        rt.check("cudaLibraryGetKernel", code)
        return int(kernel.value or 0)

    def launch(self, stream: int, grid: int, args: tuple[int, ...], *, to_host: bool) -> None:
        """Queue the kernel on ``stream`` over ``grid`` CTAs; ``args`` are its parameters
        but the last (``to_host``), as integers (addresses and counts)."""
        if len(args) != _N_PARAMS - 1:  # ctypes would pad with zeros: garbage addresses
            raise ValueError(f"the copy kernel takes {_N_PARAMS - 1} arguments, got {len(args)}")
        values = (ctypes.c_uint64 * _N_PARAMS)(*args, int(to_host))
        base = ctypes.addressof(values)
        params = (ctypes.c_void_p * _N_PARAMS)(
            *range(base, base + _N_PARAMS * _PARAM_BYTES, _PARAM_BYTES)
        )
        # The runtime copies the parameters before returning: both arrays may go then.
        code = self._launch(self._kernel, _Dim3(grid, 1, 1), self._threads, params, 0, stream)
        self._rt.check("cudaLaunchKernel", code)
