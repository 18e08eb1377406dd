"""Shared-memory tile layouts of 16-bit rows and the cp.async copies that fill them.

Two layouts: mma.sync's (rows of HEAD_DIM words, 16-byte chunks XOR-swizzled by row % 8, so every
ldmatrix phase hits 8 distinct bank groups) and wgmma's 128-byte-swizzled column atoms (64 columns
an atom, 1024-byte aligned). A thread's copy plan is computed once per kernel; a whole tile then
costs one add per copy, and only a sequence's last tile pays for row clamps.
"""
import numpy as np
from numba import cuda, int32

from ..launch import address

from .. import ptx
from ..ptx import inline_device


@inline_device
def atom_offset(row, chunk, rows):
    """Word offset of 16-byte chunk ``chunk`` of row ``row`` in a tile of ``rows`` rows stored as column
    atoms for wgmma's 128-byte swizzle (ptx/warpgroup.py): atom chunk // 8 (64 columns) holds rows x
    128 B, chunk j of row r at chunk j ^ (r % 8) of its row."""
    return (chunk >> 3) * rows * 64 + row * 64 + (((chunk & 7) ^ (row & 7)) << 3)


def copy_threads(HEAD_DIM, THREADS):
    """Threads that issue a tile's copies, each keeping one 16-byte chunk of its rows for every copy: all of them
    where THREADS is a multiple of the row's HEAD_DIM / 8 chunks; otherwise (d = 192: 24 chunks) a power of two
    rows per pass, so that a pass divides any multiple of 16 rows (256 threads: 8 rows, 192 threads copy)."""
    chunks = HEAD_DIM // 8
    if THREADS % chunks == 0:
        return THREADS
    rows = 1 << ((THREADS // chunks).bit_length() - 1) if THREADS >= chunks else 0
    return rows * chunks


def tile_copies(HEAD_DIM, THREADS, PARTIAL_CHUNK=False, ATOM_ROWS=0):
    """(swizzle, load_tile, copy_plan, load_tile_fast): the swizzled 16-bit tile layout and the cp.async
    copies of rows into it, for any kernel of THREADS threads (the tensor-core backward uses them too); COPIES
    (a tile's copies per thread) counts over copy_threads(HEAD_DIM, THREADS) threads.

    swizzle(row, chunk): element offset of 16-byte chunk ``chunk`` of tile row ``row`` (chunks XOR
    row % 8). load_tile(smem, tile0, src, b, h, row0, n_rows, d, COPIES): rows row0.. of src[b, h]
    into the tile at word tile0, COPIES 16-byte copies per thread, each clamping its row; rows past
    n_rows and columns past d are zero-filled (the forward's FAST_LOADS=False, v3's loads). copy_plan
    and load_tile_fast are the fast path: a thread's offsets are computed once and kept across tiles
    (the forward's FAST_LOADS, the backward's every copy), a whole tile then costs one add per copy and
    only a sequence's last tile pays for row clamps. PARTIAL_CHUNK (d % 8 != 0): see kernel_source;
    load_tile always names its source bytes. ATOM_ROWS (wgmma_backward's tiles): the layout is instead
    wgmma's column atoms of a tile of ATOM_ROWS rows (atom_offset: 64 columns an atom)."""
    CHUNKS = HEAD_DIM // 8
    ROW_WORDS = 64 if ATOM_ROWS else HEAD_DIM  # words from a row to the next in the same columns
    COPY_THREADS = copy_threads(HEAD_DIM, THREADS)
    if not COPY_THREADS:
        raise ValueError(f"{THREADS} threads cannot copy rows of {CHUNKS} 16-byte chunks (fewer threads than chunks)")
    ALL_COPY = COPY_THREADS == THREADS  # else threads COPY_THREADS.. issue no copies
    ROW_STEP = COPY_THREADS // CHUNKS  # rows between a thread's successive copies (load_tile_fast)
    SWIZZLE_FIXED = ROW_STEP % 8 == 0  # then a thread's copies share row % 8: one swizzle for all
    cp_async = ptx.cp_async_16_zfill
    cp_zero_if = ptx.cp_async_16_zero_if

    if ATOM_ROWS:
        @inline_device
        def swizzle(row, chunk):
            return atom_offset(row, chunk, ATOM_ROWS)
    else:
        @inline_device
        def swizzle(row, chunk):
            return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3)

    @cuda.jit(device=True, inline=True)
    def load_tile(smem, tile0, src, b, h, row0, n_rows, d, COPIES):
        tid = cuda.threadIdx.x
        row_stride = src.strides[2] // 2
        base = b * (src.strides[0] // 2) + h * (src.strides[1] // 2)
        for i in range(COPIES if ALL_COPY or tid < COPY_THREADS else 0):
            c = tid + i * COPY_THREADS
            r = c // CHUNKS
            chunk = c - r * CHUNKS
            col = chunk * 8
            row = row0 + r
            nbytes = min(max(d - col, 0), 8) * 2 if row < n_rows else 0
            # A zero-byte copy still names an address: keep it inside the array.
            src_row = max(min(row, n_rows - 1), 0)
            src_col = col if nbytes > 0 else 0
            cp_async(smem, tile0 + swizzle(r, chunk), src, base + src_row * row_stride + src_col, nbytes)

    # cuda.jit, not inline_device: the simulator then runs it with this module's fake ``cuda`` when a kernel
    # of another module (mma_dkdv, mma_dq, ...) calls the helpers below.
    @cuda.jit(device=True, inline=True)
    def thread_x():
        """cuda.threadIdx.x for the inline_device helpers below."""
        return cuda.threadIdx.x

    @inline_device
    def copy_plan(src, b, h, d):
        """This thread's part of every tile of src[b, h]: (flat element offset of its first copy in
        row 0 of the tile, row stride in elements, source bytes per copy, shared offset of copy 0)."""
        tid = thread_x()
        r0 = tid // CHUNKS
        chunk = tid - r0 * CHUNKS
        col = chunk * 8
        col_bytes = min(max(d - col, 0), 8) * 2
        src_col = col if col_bytes > 0 else 0
        row_stride = src.strides[2] // 2
        base = b * (src.strides[0] // 2) + h * (src.strides[1] // 2) + r0 * row_stride + src_col
        return base, row_stride, col_bytes, swizzle(r0, chunk)

    @inline_device
    def copy16(smem, dst, src, src_off, nbytes):
        """One 16-byte cp.async of nbytes source bytes (0 or 16 unless PARTIAL_CHUNK), zeros after them."""
        if PARTIAL_CHUNK:  # d % 8 != 0: the chunk holding column d - 1 is part data, part zeros
            cp_async(smem, dst, src, src_off, nbytes)
        else:  # the ignore-src form: ptxas adjusted the address of every src-size copy (2 instructions)
            cp_zero_if(smem, dst, src, src_off, nbytes == 0)

    @inline_device
    def load_tile_fast(smem, tile0, src, off, row_stride, col_bytes, dst0, row0, n_rows, COPIES):
        """cp.async rows row0.. of the tile at word tile0 of smem by the plan of copy_plan, off being this
        thread's first source offset for row0 (callers step it by a constant per tile); zeros past
        n_rows / d."""
        r0 = thread_x() // CHUNKS
        if not ALL_COPY and thread_x() >= COPY_THREADS:
            return
        if int32(row0 + COPIES * ROW_STEP) <= n_rows:  # the whole tile is inside: no row checks
            for i in range(COPIES):
                dst = tile0 + (dst0 + i * ROW_STEP * ROW_WORDS if SWIZZLE_FIXED else swizzle(
                    r0 + i * ROW_STEP, thread_x() - r0 * CHUNKS))
                copy16(smem, dst, src, off + i * (ROW_STEP * row_stride), col_bytes)
        else:
            for i in range(COPIES):
                dst = tile0 + (dst0 + i * ROW_STEP * ROW_WORDS if SWIZZLE_FIXED else swizzle(
                    r0 + i * ROW_STEP, thread_x() - r0 * CHUNKS))
                row = row0 + r0 + i * ROW_STEP
                # A copy of zeros still names an address: the last row, inside the array.
                src_off = off + (min(row, n_rows - 1) - row0 - r0) * row_stride
                copy16(smem, dst, src, src_off, col_bytes if row < n_rows else 0)

    return swizzle, load_tile, copy_plan, load_tile_fast


_F16, _WORD, _F32 = np.dtype(np.float16), np.dtype(np.uint16), np.dtype(np.float32)


def check_layout(q, k, v, out, lse, d, HEAD_DIM):
    """The layout the 16-bit forward kernels' cp.async copies need (mma_forward, wgmma_forward), on the host."""
    if d > HEAD_DIM:
        raise ValueError(f"head dim {d} > HEAD_DIM={HEAD_DIM}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"H={q.shape[1]} is not a multiple of Hkv={k.shape[1]}")
    if len({x.dtype for x in (q, k, v, out)}) != 1 or q.dtype not in (_F16, _WORD):
        raise ValueError(f"q, k, v, out must share dtype float16 or uint16 (bf16 bits); got {[x.dtype for x in (q, k, v, out)]}")
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if x.strides[-1] != 2:
            raise ValueError(f"{name}: last dim must have unit stride, strides are {x.strides}")
        if name != "out" and any(s % 16 for s in x.strides[:-1]):
            raise ValueError(f"{name}: strides {x.strides} (bytes) must be multiples of 16 for cp.async; pad the rows")
        if name != "out" and address(x) % 16:
            raise ValueError(f"{name}: data pointer is not 16-byte aligned")
    if lse.dtype != _F32:
        raise ValueError(f"lse must be float32, got {lse.dtype}")
