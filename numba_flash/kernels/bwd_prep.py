"""The backward's small kernels around dK/dV and dQ: ``prep`` (D = rowsum(dO ∘ O) and L2 = L·log2(e) per
query row into fp32 scratch) and ``convert`` (dq = scale · the fp32 dQ planes summed in order, the last
step where the dK/dV kernel forms dQ). For every tensor-core backward: 16-bit (float16 / bfloat16 bits) and
float32 (the 3xTF32 kernels) inputs.

prep writes (B·H, NQ_PAD) rows, NQ_PAD = blocks.schedule.padded_rows(Nq), with D = 0 and L2 = +inf past
Nq, so every query tile's L2 and D arrive by cp.async and a padded query row has P = 0 without a mask.
Varlen builds (blocks.entry.varlen_entry) read packed rows and write the scratch of a dense batch padded to
the longest sequence: rows past a sequence's own length are padding as above.
"""
from __future__ import annotations

import math
from functools import lru_cache

from numba import cuda, float32, int32, types, uint16, uint32

from .. import ptx
from ..launch import launch as launch_kernel
from ..ptx import inline_device
from ..blocks.numerics import LOG2E
from ..blocks.rows import DELTA_LANES, DELTA_ROWS, row_dot_helper
from ..blocks.entry import VARLEN_ARGS, varlen_entry, varlen_key, varlen_rules
from ..blocks.schedule import plane_first_row
from ..jit_cache import compile_kernel

DTYPES = ("float16", "bfloat16", "float32")
PREP_ROWS, PREP_LANES = DELTA_ROWS, DELTA_LANES  # prep reuses the SIMT backward's row sums
CONVERT_THREADS = 256


def prep_signature(dtype: str, varlen: bool = False):
    """out, dout as float16 / uint16 (bf16 bits) / float32, lse, then the scratch rows (varlen: then
    cu_seqlens_q, cu_seqlens_k)."""
    io = types.Array({"float16": types.float16, "float32": types.float32}.get(dtype, types.uint16), 4, "A")
    rows = types.Array(types.float32, 2, "A")
    return types.void(io, io, types.Array(types.float32, 3, "A"), rows, rows, int32, int32,
                      *(VARLEN_ARGS if varlen else ()))


def _varlen(kernel, q_rows):
    """prep and convert run every block: prep writes the padding rows too."""
    return varlen_entry(kernel, globals(), *varlen_rules("rows"), seq_of=q_rows[0], slice_rows=(q_rows, ()))


def prep_source(dtype: str):
    """D = rowsum(dO ∘ O) and L2 = L·log2(e) (+inf where L = -inf) into padded (B·H, NQ_PAD) rows."""
    row_dot = row_dot_helper(dtype)  # the SIMT backward's D pass, row for row
    INF, NEG_INF = float32(math.inf), float32(-math.inf)

    def backward_prep(out, dout, lse, l2, dd, n_q, d):
        partial = cuda.shared.array((PREP_ROWS, PREP_LANES), float32)
        b, h, row, total = row_dot(out, dout, partial, n_q, d)
        bh = cuda.blockIdx.y
        if cuda.threadIdx.x % PREP_LANES == 0:
            if row < n_q:
                x = lse[b, h, row]
                dd[bh, row] = total
                l2[bh, row] = INF if x == NEG_INF else x * float32(LOG2E)
            else:  # padding: P = exp2(… − inf) = 0, and dS = 0 · (dP − 0) stays finite
                dd[bh, row] = float32(0.0)
                l2[bh, row] = INF

    return backward_prep


def convert_signature(dtype: str, varlen: bool = False):
    """dq_acc fp32 planes, dq as 16-bit words (or float32: the 3xTF32 dQ-in-dkdv), then the scalars (varlen:
    then cu_seqlens_q, cu_seqlens_k)."""
    out = types.Array(types.float32 if dtype == "float32" else types.uint16, 4, "A")
    return types.void(types.Array(types.float32, 3, "A"), out, int32, int32, float32, int32, int32, int32, int32,
                      *(VARLEN_ARGS if varlen else ()))



def convert_source(dtype: str, vec: bool = False):
    """dQ = scale · Σ_p dq_acc[plane p], planes summed in order 0, 1, ... (one plane unless the
    deterministic splits wrote several), rounded to 16 bits: the last step of the dQ-in-dkdv paths.
    A thread converts a pair of columns, or with ``vec`` 8 (two 16-byte loads per plane, one 16-byte
    store: d % 8 == 0, dq rows 16-byte aligned); the sums are the same either way. dtype "float32"
    (the 3xTF32 backward): dq stays fp32, two 16-byte stores per 8 columns."""
    F32 = dtype == "float32"
    pack = ptx.pack_f16x2 if dtype == "float16" else ptx.pack_bf16x2
    ld = ptx.ld_global_nc_v4
    st = ptx.st_global_v4
    VEC = bool(vec)
    from ..ptx import bits_from_f32, f32_from_bits

    def backward_dq_convert(dq_acc, dq, n_q, d, scale, n_k, block_n, block_m, causal):
        bh = cuda.blockIdx.y
        n_heads = dq.shape[1]
        n_bh = dq.shape[0] * n_heads
        b = bh // n_heads
        h = bh - b * n_heads
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        per_row = d // 8 if VEC else (d + 1) // 2  # threads per row
        row = i // per_row
        col = (8 if VEC else 2) * (i - row * per_row)
        if row < n_q and VEC:
            plane = n_bh * dq_acc.shape[1] * dq_acc.shape[2]  # elements per plane
            src = (bh * dq_acc.shape[1] + row) * dq_acc.shape[2] + col
            acc = cuda.local.array(8, float32)
            for j in range(8):
                acc[j] = float32(0.0)
            for p in range(dq_acc.shape[0] // n_bh):  # planes 0, 1, ... in a fixed order
                if row >= plane_first_row(p, n_q, n_k, block_n, block_m, causal):
                    w = ld(dq_acc, src + p * plane)
                    u = ld(dq_acc, src + p * plane + 4)
                    for j in range(4):
                        acc[j] += f32_from_bits(w[j])
                        acc[4 + j] += f32_from_bits(u[j])
            if F32:
                dst = b * (dq.strides[0] // 4) + h * (dq.strides[1] // 4) + row * (dq.strides[2] // 4) + col
                st(dq, dst, bits_from_f32(acc[0] * scale), bits_from_f32(acc[1] * scale),
                   bits_from_f32(acc[2] * scale), bits_from_f32(acc[3] * scale))
                st(dq, dst + 4, bits_from_f32(acc[4] * scale), bits_from_f32(acc[5] * scale),
                   bits_from_f32(acc[6] * scale), bits_from_f32(acc[7] * scale))
            else:
                st(dq, b * (dq.strides[0] // 2) + h * (dq.strides[1] // 2) + row * (dq.strides[2] // 2) + col,
                   pack(acc[0] * scale, acc[1] * scale), pack(acc[2] * scale, acc[3] * scale),
                   pack(acc[4] * scale, acc[5] * scale), pack(acc[6] * scale, acc[7] * scale))
        elif row < n_q:
            x = float32(0.0)
            y = float32(0.0)
            for p in range(dq_acc.shape[0] // n_bh):  # planes 0, 1, ... in a fixed order
                if row >= plane_first_row(p, n_q, n_k, block_n, block_m, causal):
                    x += dq_acc[p * n_bh + bh, row, col]
                    y += dq_acc[p * n_bh + bh, row, col + 1]
            if F32:
                dq[b, h, row, col] = x * scale
                if col + 1 < d:
                    dq[b, h, row, col + 1] = y * scale
            else:
                bits = pack(x * scale, y * scale)
                dq[b, h, row, col] = uint16(bits & 0xFFFF)
                if col + 1 < d:
                    dq[b, h, row, col + 1] = uint16(bits >> 16)

    return backward_dq_convert


# The vector forms of prep and convert (d % 8 == 0 and 16-byte aligned rows: every shipped layout): 16-byte
# loads and stores instead of one element per thread. The scalar forms (one element per load, 2-byte stores)
# took 162 and 148 us at fp16 B4 H16 N4096 d128 (profile-backward-autograd-2026-12-01-after.txt), 3-4 times
# what their bytes need.
VEC_THREADS = 256


def prep_vec_source(dtype: str, head_dim: int):
    """``prep`` reading 16-byte chunks: HEAD_DIM / PER lanes per row (PER = 8 16-bit or 4 fp32 elements a
    chunk), each one chunk of O and of dO (d % PER == 0, so a chunk is all data or past d and skipped), the
    row's sum by shuffles. VEC_THREADS / LANES rows per block."""
    F32 = dtype == "float32"
    PER = 4 if F32 else 8  # elements per 16-byte chunk ...
    ITEM = 4 if F32 else 2  # ... of this many bytes
    LANES = head_dim // PER
    ROWS = VEC_THREADS // LANES
    BF16 = dtype == "bfloat16"
    ld = ptx.ld_global_nc_v4
    shfl = ptx.shfl_xor_sync
    FULL = ptx.FULL_MASK
    INF, NEG_INF, ZERO = float32(math.inf), float32(-math.inf), float32(0.0)
    HI = uint32(0xFFFF0000)
    from ..ptx import f16x2_to_f32, f32_from_bits

    @inline_device
    def pair(word):
        if BF16:
            return f32_from_bits(word << 16), f32_from_bits(word & HI)
        return f16x2_to_f32(word)

    def backward_prep(out, dout, lse, l2, dd, n_q, d):
        tid = cuda.threadIdx.x
        r = tid // LANES
        c = tid - r * LANES
        bh = cuda.blockIdx.y
        b = bh // out.shape[1]
        h = bh - b * out.shape[1]
        row = cuda.blockIdx.x * ROWS + r
        acc = ZERO
        if row < n_q and c * PER < d:
            o = ld(out, b * (out.strides[0] // ITEM) + h * (out.strides[1] // ITEM) + row * (out.strides[2] // ITEM)
                   + c * PER)
            g = ld(dout, b * (dout.strides[0] // ITEM) + h * (dout.strides[1] // ITEM)
                   + row * (dout.strides[2] // ITEM) + c * PER)
            for i in range(4):
                if F32:
                    acc = cuda.fma(f32_from_bits(o[i]), f32_from_bits(g[i]), acc)
                else:
                    o0, o1 = pair(o[i])
                    g0, g1 = pair(g[i])
                    acc = cuda.fma(o1, g1, cuda.fma(o0, g0, acc))
        m = 1
        while m < LANES:  # the row's lanes are neighbours in one warp
            acc += shfl(FULL, acc, m)
            m *= 2
        if c == 0:
            if row < n_q:
                x = lse[b, h, row]
                dd[bh, row] = acc
                l2[bh, row] = INF if x == NEG_INF else x * float32(LOG2E)
            else:  # padding: P = exp2(… − inf) = 0, and dS = 0 · (dP − 0) stays finite
                dd[bh, row] = ZERO
                l2[bh, row] = INF

    return backward_prep, ROWS



# --------------------------------------------------------------------------------------------
# Builds and launches
# --------------------------------------------------------------------------------------------
def _check_dtype(dtype):
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {DTYPES}")


@lru_cache(maxsize=None)
def build_prep(dtype: str, varlen: bool = False):
    """The scalar prep (one element per load)."""
    _check_dtype(dtype)
    kernel = prep_source(dtype)
    return compile_kernel(("bwd_prep.prep", dtype) + varlen_key(varlen), prep_signature(dtype, varlen),
                          _varlen(kernel, ("out", "dout", "lse")) if varlen else kernel)


@lru_cache(maxsize=None)
def build_prep_vec(dtype: str, head_dim: int, varlen: bool = False):
    """(kernel, rows per block) of the vector prep."""
    if dtype not in DTYPES or head_dim not in ((32, 64, 128) if dtype == "float32" else (64, 128, 256)):
        raise ValueError(f"vector prep: dtype {dtype!r} not in {DTYPES} or head dim {head_dim} not "
                         "64 / 128 / 256 (32 too for float32; 192 takes 256's)")
    source, rows = prep_vec_source(dtype, head_dim)
    if varlen:
        source = _varlen(source, ("out", "dout", "lse"))
    return compile_kernel(("bwd_prep.prep_vec", dtype, head_dim) + varlen_key(varlen),
                          prep_signature(dtype, varlen), source), rows


@lru_cache(maxsize=None)
def build_convert(dtype: str, vec: bool = False, varlen: bool = False):
    """The convert kernel (float32: the 3xTF32 backward's dq stays fp32)."""
    _check_dtype(dtype)
    kernel = convert_source(dtype, vec)
    return compile_kernel(("bwd_prep.convert", dtype, bool(vec)) + varlen_key(varlen),
                          convert_signature(dtype, varlen), _varlen(kernel, ("dq",)) if varlen else kernel)


def launch_prep(dtype, head_dim, vec, out, dout, lse, l2, dd, n_q, d, n_bh, stream, varlen=None):
    """D and L2 into the scratch rows l2, dd: by 16-byte loads where vec (d a multiple of a chunk's elements,
    out and dout rows 16-byte aligned), else one element per load. varlen: (cu_seqlens_q, cu_seqlens_k) with
    packed out, dout, lse viewed as batches (arrays.packed_as_batch)."""
    tail, extra = ((varlen[0], varlen[1]), {"varlen": True}) if varlen is not None else ((), {})
    if vec:  # (d = 192: 256's build, a warp per row; its lanes past d load nothing)
        kernel, rows = build_prep_vec(dtype, 256 if head_dim == 192 else head_dim, **extra)
        launch_kernel(kernel, (l2.shape[1] // rows, n_bh), VEC_THREADS, stream, 0, out, dout, lse, l2, dd, n_q, d,
                      *tail)
    else:
        launch_kernel(build_prep(dtype, **extra), (l2.shape[1] // PREP_ROWS, n_bh), PREP_ROWS * PREP_LANES, stream,
                      0, out, dout, lse, l2, dd, n_q, d, *tail)


def launch_convert(dtype, vec, dq_acc, dq, n_q, d, softmax_scale, n_k, bn, bm, causal, n_bh, stream, varlen=None):
    """dq = scale · the planes of dq_acc summed in order (convert_source; vec: 8 columns a thread). varlen: as
    launch_prep's (n_q: the longest sequence's rows; the planes are zeroed, so every plane's rows are read)."""
    threads = CONVERT_THREADS
    per_row = d // 8 if vec else (d + 1) // 2  # threads per row: 8 columns, or a pair, each
    tail, extra = ((varlen[0], varlen[1]), {"varlen": True}) if varlen is not None else ((), {})
    if vec:
        extra["vec"] = True
    launch_kernel(build_convert(dtype, **extra),
                  ((n_q * per_row + threads - 1) // threads, n_bh), threads, stream, 0,
                  dq_acc, dq, n_q, d, float32(softmax_scale), n_k, bn, bm, int(bool(causal)), *tail)

