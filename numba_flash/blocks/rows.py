"""Row sums over (B, H, N, d) arrays: D = Σ_c dO ∘ O per query row, the backward's preprocessing pass."""
from numba import cuda, float32, uint16, uint32, uint64

from ..ptx import bits_from_f32, f32_from_bits

U = uint64


DELTA_ROWS, DELTA_LANES = 8, 32  # the D kernel: 8 rows per block, 32 lanes summing each row


def element_io(BF16: bool):
    """Device helpers shared by all kernels: one element in as float32 (bf16 travels as uint16
    bits: Numba has no bfloat16 arrays), and one float32 out, rounded to nearest even for bf16."""
    ZERO = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def load(src, b, h, row, c, n_rows, d):
        # zero past the sequence or the head dim: padding adds nothing to any product
        if row < n_rows and c < d:
            x = src[U(b), U(h), U(row), U(c)]
            if BF16:
                return f32_from_bits(uint32(x) << 16)
            return float32(x)
        return ZERO

    @cuda.jit(device=True, inline=True)
    def store(dst, b, h, row, col, x):
        if BF16:
            bits = bits_from_f32(x)
            bits = bits + uint32(0x7FFF) + ((bits >> 16) & uint32(1))
            dst[U(b), U(h), U(row), U(col)] = uint16(bits >> 16)
        else:
            dst[U(b), U(h), U(row), U(col)] = x

    return load, store


def row_dot_helper(dtype: str):
    """row_dot(out, dout, partial) -> (b, h, row, D): D = Σ_c dO[b, h, row, c] · O[b, h, row, c] in fp32
    for this thread's row (DELTA_ROWS rows per block, DELTA_LANES lanes each; blockIdx.y = b·H + h),
    valid on lane 0; partial is the block's (DELTA_ROWS, DELTA_LANES) fp32 shared array. The
    preprocessing pass of every backward."""
    load, _ = element_io(dtype == "bfloat16")
    ROWS, LANES = DELTA_ROWS, DELTA_LANES

    @cuda.jit(device=True, inline=True)
    def row_dot(out, dout, partial, n_q, d):
        tid = cuda.threadIdx.x
        tr = tid // LANES
        lane = tid - tr * LANES
        bh = cuda.blockIdx.y
        b = bh // out.shape[1]
        h = bh - b * out.shape[1]
        row = cuda.blockIdx.x * ROWS + tr
        acc = float32(0.0)
        for c in range(lane, d, LANES):  # neighbouring lanes, neighbouring addresses
            acc = cuda.fma(load(out, b, h, row, c, n_q, d), load(dout, b, h, row, c, n_q, d), acc)
        partial[tr, lane] = acc
        cuda.syncthreads()
        total = float32(0.0)
        if lane == 0:
            for t in range(LANES):
                total += partial[tr, t]
        return b, h, row, total

    return row_dot
