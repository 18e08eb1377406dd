"""The online-softmax step (section 3.6.4), written once for every forward family.

Per query row and K/V tile, with raw scores s and c = softmax_scale·log2(e), in base 2:

    M_new = max(M, c·rowmax(s))       running maximum, kept scaled (rounded once)
    alpha = 2^(M - M_new)             moves what was accumulated under the old maximum
    p     = 2^(c·s - M_new)           one FFMA and one ex2 per score
    l_i   = alpha·l_i + rowsum(p)
    acc   = alpha·acc + p·V_j

and at the end O = acc / l_i, L = (M + log2 l_i)·ln 2 (``row_lse``; -inf for a row that saw no key). A row with nothing visible yet keeps
M = -inf: the exponent then subtracts 0 (``m_or_zero``), so 2^(-inf) gives 0, not nan.

Lazy rescaling (FA4's conditional rescaling, ``fragment_softmax``'s step_lazy): M moves only when a tile's
maximum exceeds it by more than RESCALE_LOG2, so p <= 2^RESCALE_LOG2 and acc, l_i keep their scale on almost
every tile; the result is the same softmax, as O and L use one M throughout.

``fragment_softmax`` works on mma.sync accumulator fragments (rows g and g + 8 of each 16-row m-tile, a row's
columns spread over the 4 lanes of a quad): mma_forward takes its lazy step and tf32_forward its quad sums.
tf32_forward (eager, alpha folded into P·V's FFMA) and simt_forward still spell their steps out: through
these helpers their PTX changed (tf32x1 d64: P·V's FFMAs scheduled elsewhere; simt: every build).
"""
import math

from numba import cuda, float32

from .. import ptx
from ..ptx import inline_device
from .numerics import LN2

# M moves only when a tile's maximum exceeds it by more than this (log2 units), so every p <= 2^8 = 256
# (FA4's threshold: far from overflow in fp32 acc / l_i and in f16 / bf16 P).
RESCALE_LOG2 = 8.0
NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
ONE = float32(1.0)


# cuda.jit, not inline_device: the simulator then runs it with its fake ``cuda`` when a kernel of another
# module calls the helpers below (as blocks/copies.py's thread_x).
@cuda.jit(device=True, inline=True)
def fma(a, b, c):
    return cuda.fma(a, b, c)


@inline_device
def m_or_zero(m):
    """The maximum an exponent subtracts: 0 while the row has seen nothing (M = -inf)."""
    return ZERO if m == NEG_INF else m


@inline_device
def row_lse(m, l_row):
    """L = (M + log2 l)·ln 2, natural log, of a row that saw a key (l != 0: a NaN l, from a NaN or +inf score,
    gives NaN; the caller stores -inf where l = 0, two stores under the branch, as the kernels were measured)."""
    return (m + math.log2(l_row)) * float32(LN2)


def fragment_softmax(S_TILES: int, O_TILES: int, M_TILES: int = 1):
    """Device functions of the online softmax on a warp's mma.sync fragments: s[mt·S_TILES + nt] (S, then P in
    place), acc[mt·O_TILES + dt] (O), m_i and l_i of rows mr = 2 mt + half (row g + 8·half of m-tile mt; l_i is
    this lane's partial sum, quad_row_sum adds the quad's). Returns (tile_row_max, exp_row, quad_row_sum,
    step_lazy): step_lazy rescales acc itself, and only when some row's M moved."""
    ROWS_L = 2 * M_TILES
    ex2 = ptx.ex2_approx
    shfl_xor = ptx.shfl_xor_sync
    FULL = ptx.FULL_MASK
    RESCALE = float32(RESCALE_LOG2)  # a Python float would make the comparison fp64 (cvt + add.f64 per row)

    @inline_device
    def tile_row_max(s, mr):
        """Row mr's maximum of this tile's raw scores, over the quad."""
        half = mr & 1
        s0 = (mr >> 1) * S_TILES
        m_tile = NEG_INF
        for nt in range(S_TILES):
            m_tile = max(m_tile, max(s[s0 + nt, 2 * half], s[s0 + nt, 2 * half + 1]))
        m_tile = max(m_tile, shfl_xor(FULL, m_tile, 1))
        return max(m_tile, shfl_xor(FULL, m_tile, 2))

    @inline_device
    def exp_row(s, mr, m_sub, scale_log2):
        """p = 2^(s·c − m_sub) in place of row mr's scores (one FFMA and one ex2 each); this lane's sum of them."""
        half = mr & 1
        s0 = (mr >> 1) * S_TILES
        row_sum = ZERO
        for nt in range(S_TILES):
            for c in range(2):
                p = ex2(fma(s[s0 + nt, 2 * half + c], scale_log2, -m_sub))
                s[s0 + nt, 2 * half + c] = p
                row_sum += p
        return row_sum

    @inline_device
    def quad_row_sum(l_i, mr):
        """Row mr's l over the quad (each lane summed its own columns of the row)."""
        l_row = l_i[mr]
        l_row += shfl_xor(FULL, l_row, 1)
        return l_row + shfl_xor(FULL, l_row, 2)

    @inline_device
    def step_lazy(s, acc, m_i, l_i, m_nw, scale_log2):
        """The lazy step: a row's M moves only past M + RESCALE_LOG2; the rescale of acc (O_TILES/2 FMUL per
        row, on the path into P·V's mma) then costs one branch per lane on almost every tile. m_nw: the
        caller's local array of ROWS_L rows (the simulator allocates only in the kernel's module)."""
        rescale = False
        for mr in range(ROWS_L):
            m_c = tile_row_max(s, mr) * scale_log2
            # -inf + RESCALE_LOG2 is -inf: a row's first visible key always sets M.
            m_nw[mr] = m_c if m_c > m_i[mr] + RESCALE else m_i[mr]
            rescale |= m_nw[mr] != m_i[mr]
        if rescale:
            for mr in range(ROWS_L):
                half = mr & 1
                a0_ = (mr >> 1) * O_TILES
                # exactly 1 where M held; 0 where the row saw nothing before (acc, l_i are 0 there)
                alpha = ONE if m_nw[mr] == m_i[mr] else ex2(m_i[mr] - m_nw[mr])
                l_i[mr] *= alpha
                m_i[mr] = m_nw[mr]
                for dt in range(O_TILES):
                    acc[a0_ + dt, 2 * half] *= alpha
                    acc[a0_ + dt, 2 * half + 1] *= alpha
        for mr in range(ROWS_L):
            l_i[mr] += exp_row(s, mr, m_or_zero(m_i[mr]), scale_log2)

    return tile_row_max, exp_row, quad_row_sum, step_lazy



def fragment_softmax_deferred(S_TILES: int, O_TILES: int, M_TILES: int = 1):
    """fragment_softmax's lazy step split in two, for kernels whose P·V of the previous tile is still in flight on
    acc when this tile's scores are ready (the accumulators may not be touched until that product retires).
    Returns (step, rescale): step(s, m_i, l_i, alpha, scale_log2) -> bool moves M and l and turns s into P as
    step_lazy does, leaving each row's factor in alpha (exactly 1 where M held), and says whether some row's M
    moved; rescale(acc, alpha) then applies the factors to acc once that product retired."""
    ROWS_L = 2 * M_TILES
    tile_row_max, exp_row, _, _ = fragment_softmax(S_TILES, O_TILES, M_TILES)
    ex2 = ptx.ex2_approx
    RESCALE = float32(RESCALE_LOG2)  # a Python float would make the comparison fp64

    @inline_device
    def step(s, m_i, l_i, alpha, scale_log2):
        moved = False
        for mr in range(ROWS_L):
            m_c = tile_row_max(s, mr) * scale_log2
            # -inf + RESCALE_LOG2 is -inf: a row's first visible key always sets M
            m_nw = m_c if m_c > m_i[mr] + RESCALE else m_i[mr]
            # 0 where the row saw nothing before (acc, l_i are 0 there)
            alpha[mr] = ONE if m_nw == m_i[mr] else ex2(m_i[mr] - m_nw)
            moved |= m_nw != m_i[mr]
            l_i[mr] *= alpha[mr]
            m_i[mr] = m_nw
        for mr in range(ROWS_L):
            l_i[mr] += exp_row(s, mr, m_or_zero(m_i[mr]), scale_log2)
        return moved

    @inline_device
    def rescale(acc, alpha):
        for mr in range(ROWS_L):
            half = mr & 1
            a0_ = (mr >> 1) * O_TILES
            for dt in range(O_TILES):
                acc[a0_ + dt, 2 * half] *= alpha[mr]
                acc[a0_ + dt, 2 * half + 1] *= alpha[mr]

    return step, rescale
