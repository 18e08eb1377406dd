"""Tensor-core products by warp (mma.sync, f16/bf16 and tf32) and the ldmatrix loads that feed them.

The fragment layouts of ``mma.sync.aligned.m16n8k16`` (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
floating point type"): a warp computes D(16x8) = A(16x16) @ B(16x8) + C(16x8). With ``g = lane >> 2``
(groupID) and ``t = lane % 4`` (threadID_in_group), lane ``lane`` holds

    A (.b32 registers a0..a3, two f16/bf16 each, lower column in the low half):
        a0 = A[g,   2t:2t+2]   a1 = A[g+8, 2t:2t+2]   a2 = A[g, 2t+8:2t+10]   a3 = A[g+8, 2t+8:2t+10]
    B (.b32 registers b0, b1, lower row in the low half):
        b0 = B[2t:2t+2, g]     b1 = B[2t+8:2t+10, g]
    C, D (f32 registers c0..c3):
        c0, c1 = C[g, 2t], C[g, 2t+1]             c2, c3 = C[g+8, 2t], C[g+8, 2t+1]

``ldmatrix.sync.aligned.m8n8.x4.b16`` loads four 8x8 b16 matrices; lanes 8j..8j+7 give the 16-byte
row addresses of matrix j, and lane ``lane`` receives r_j = M_j[g, 2t:2t+2] (``.trans``:
r_j = M_j[2t:2t+2, g], i.e. the transpose). So an x4 load of the four 8x8 quarters of a 16x16 tile
is exactly one A fragment, and of two 8-row K tiles two B fragments (V through ``.trans``).

The twins gather the 32 lanes' registers (sim.warp_exchange), compute the product in NumPy and hand
each lane its fragment back, so a kernel's fragment indexing is checked without a GPU.
"""
import numpy as np
from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

from ._llvm import _F32, _I32, _asm, _is_16bit_array, _is_int, _is_num, _shared_address, _unpack
from .sim import _flat_bytes, warp_exchange
from .target import pick


# --------------------------------------------------------------------------------------------
# Fragment layouts as data (used by the twins and the tests; the hardware needs no table).
# --------------------------------------------------------------------------------------------
def a_fragment_coords(lane):
    """(row, col) of the 8 halves lane holds in an m16n8k16 A fragment, in register order."""
    g, t = lane >> 2, lane % 4
    return [(g + 8 * ((i >> 1) & 1), 2 * t + (i & 1) + 8 * (i >> 2)) for i in range(8)]


def b_fragment_coords(lane):
    """(row k, col n) of the 4 halves lane holds in an m16n8k16 B fragment, in register order."""
    g, t = lane >> 2, lane % 4
    return [(2 * t + (i & 1) + 8 * (i >> 1), g) for i in range(4)]


def c_fragment_coords(lane):
    """(row, col) of the 4 floats lane holds in an m16n8 C/D fragment, in register order."""
    g, t = lane >> 2, lane % 4
    return [(g + 8 * (i >> 1), 2 * t + (i & 1)) for i in range(4)]


# --------------------------------------------------------------------------------------------
# 16-bit bit patterns <-> float (host side and twins).
# --------------------------------------------------------------------------------------------
def f16_bits(x):
    """float -> f16 bits, round to nearest even (what cvt.rn.f16.f32 does)."""
    with np.errstate(over="ignore"):  # overflow to inf is the defined result
        return int(np.float32(x).astype(np.float16).view(np.uint16))


def bf16_bits(x):
    """float -> bf16 bits, round to nearest even, NaN -> canonical NaN (cvt.rn.bf16.f32)."""
    bits = int(np.float32(x).view(np.uint32))
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FFF
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def f16_value(bits):
    return float(np.uint16(bits).view(np.float16))


def bf16_value(bits):
    return float(np.uint32(bits << 16).view(np.float32))


def halves(word):
    """A packed .b32 -> (low 16 bits, high 16 bits)."""
    return word & 0xFFFF, (word >> 16) & 0xFFFF


# --------------------------------------------------------------------------------------------
# mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32
# --------------------------------------------------------------------------------------------
def _make_mma_intrinsic(ab):
    text = (
        f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};"
    )

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if not (_is_int(a0, a1, a2, a3, b0, b1) and _is_num(c0, c1, c2, c3)):
            return None
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            regs = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6])]
            accs = [context.cast(builder, v, t, types.float32) for v, t in zip(args[6:], sig.args[6:])]
            ret = ir.LiteralStructType([_F32] * 4)
            d = _asm(builder, ret, regs + accs, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            return context.make_tuple(builder, sig.return_type, _unpack(builder, d, 4))

        return sig, codegen

    return mma


def _make_mma_twin(value_of):
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        def combine(lanes):
            A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
            for lane, (a, b, c) in enumerate(lanes):
                a_halves = [h for word in a for h in halves(int(word))]
                for (r, k), bits in zip(a_fragment_coords(lane), a_halves):
                    A[r, k] = value_of(bits)
                b_halves = [h for word in b for h in halves(int(word))]
                for (k, n), bits in zip(b_fragment_coords(lane), b_halves):
                    B[k, n] = value_of(bits)
                for (r, n), x in zip(c_fragment_coords(lane), c):
                    C[r, n] = x
            D = (A @ B + C).astype(np.float32)  # f32 accumulate; products of 16-bit floats are exact
            return [tuple(D[r, n] for r, n in c_fragment_coords(lane)) for lane in range(32)]

        value = ((a0, a1, a2, a3), (b0, b1), tuple(np.float32(x) for x in (c0, c1, c2, c3)))
        return warp_exchange(value, combine, "mma")

    return mma


mma_m16n8k16_f16 = pick(_make_mma_intrinsic("f16"), _make_mma_twin(f16_value))
mma_m16n8k16_bf16 = pick(_make_mma_intrinsic("bf16"), _make_mma_twin(bf16_value))


# --------------------------------------------------------------------------------------------
# mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 and cvt.{rna,rn}.tf32.f32 (fp32 on tensor cores)
#
# Fragments of m16n8k8 with .tf32 (one 32-bit element per register; g = lane >> 2, t = lane % 4):
#     A (16x8): a0 = A[g, t]   a1 = A[g+8, t]   a2 = A[g, t+4]   a3 = A[g+8, t+4]
#     B (8x8):  b0 = B[t, g]   b1 = B[t+4, g]
#     C, D:     as m16n8k16 (c_fragment_coords)
# A tf32 operand is an fp32 bit pattern of which the tensor core reads sign, exponent and the top
# 10 mantissa bits; tf32_round (cvt.rna: ties away from zero, sm_80+) and tf32_round_rn (cvt.rn: ties to
# even, sm_90+) round to that, so x - hi is exact in fp32 either way and the 3xTF32 split x = hi + lo
# loses only lo's last bits.
# --------------------------------------------------------------------------------------------
def tf32_a_coords(lane):
    """(row, col) of the 4 elements lane holds in an m16n8k8 tf32 A fragment, in register order."""
    g, t = lane >> 2, lane % 4
    return [(g + 8 * (i & 1), t + 4 * (i >> 1)) for i in range(4)]


def tf32_b_coords(lane):
    """(row k, col n) of the 2 elements lane holds in an m16n8k8 tf32 B fragment."""
    g, t = lane >> 2, lane % 4
    return [(t + 4 * i, g) for i in range(2)]


_TF32_MASK = 0xFFFFE000  # sign, 8 exponent bits, 10 mantissa bits


def tf32_value(x):
    """The value the tensor core reads from an fp32 operand (low 13 mantissa bits dropped)."""
    bits = int(np.float32(x).view(np.uint32)) & _TF32_MASK
    return float(np.uint32(bits).view(np.float32))


@intrinsic
def _mma_m16n8k8_tf32_intrinsic(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    if not _is_num(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return None
    sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    text = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

    def codegen(context, builder, sig, args):
        regs = [builder.bitcast(context.cast(builder, v, t, types.float32), _I32)
                for v, t in zip(args[:6], sig.args[:6])]
        accs = [context.cast(builder, v, t, types.float32) for v, t in zip(args[6:], sig.args[6:])]
        ret = ir.LiteralStructType([_F32] * 4)
        d = _asm(builder, ret, regs + accs, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
        return context.make_tuple(builder, sig.return_type, _unpack(builder, d, 4))

    return sig, codegen


def _mma_m16n8k8_tf32_twin(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    def combine(lanes):
        A, B, C = np.zeros((16, 8)), np.zeros((8, 8)), np.zeros((16, 8))
        for lane, (a, b, c) in enumerate(lanes):
            for (r, k), x in zip(tf32_a_coords(lane), a):
                A[r, k] = tf32_value(x)
            for (k, n), x in zip(tf32_b_coords(lane), b):
                B[k, n] = tf32_value(x)
            for (r, n), x in zip(c_fragment_coords(lane), c):
                C[r, n] = x
        D = (A @ B + C).astype(np.float32)  # products of tf32 values are exact in fp64
        return [tuple(D[r, n] for r, n in c_fragment_coords(lane)) for lane in range(32)]

    value = ((a0, a1, a2, a3), (b0, b1), tuple(np.float32(x) for x in (c0, c1, c2, c3)))
    return warp_exchange(value, combine, "mma.tf32")


mma_m16n8k8_tf32 = pick(_mma_m16n8k8_tf32_intrinsic, _mma_m16n8k8_tf32_twin)


def _make_tf32_round_intrinsic(mode):
    """cvt.{mode}.tf32.f32 as an intrinsic: "rna" (ties away from zero, sm_80+) or "rn" (ties to even, sm_90+).
    ptxas 13.0 emits one F2FP.TF32.F32.PACK_B for cvt.rn, four instructions for cvt.rna (an add, an inf/NaN
    test, a select, a mask)."""
    text = f"cvt.{mode}.tf32.f32 $0, $1;"

    @intrinsic
    def tf32_round(typingctx, x):
        if not _is_num(x):
            return None
        sig = types.float32(x)

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            return builder.bitcast(_asm(builder, _I32, [v], text, "=r,f"), _F32)

        return sig, codegen

    return tf32_round


def _make_tf32_round_twin(ties_even):
    """The simulator's twin: half an ulp of tf32 added to the magnitude, then the low 13 bits dropped; ties_even
    takes a bit less unless the kept last bit is odd, so a tie carries only into an odd last bit."""
    def tf32_round(x):
        bits = int(np.float32(x).view(np.uint32))
        if (bits & 0x7F800000) != 0x7F800000:  # inf and nan pass through
            bits = (bits + (0xFFF + ((bits >> 13) & 1) if ties_even else 0x1000)) & _TF32_MASK
        return np.uint32(bits).view(np.float32)

    return tf32_round


_tf32_round_twin = _make_tf32_round_twin(ties_even=False)
_tf32_round_rn_twin = _make_tf32_round_twin(ties_even=True)
tf32_round = pick(_make_tf32_round_intrinsic("rna"), _tf32_round_twin)
tf32_round_rn = pick(_make_tf32_round_intrinsic("rn"), _tf32_round_rn_twin)


# --------------------------------------------------------------------------------------------
# ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16
# --------------------------------------------------------------------------------------------
def _make_ldmatrix_intrinsic(trans, by_address=False):
    """ldmatrix(smem, offset) by element offset, or (by_address) ldmatrix_at(smem, addr) by a .shared byte
    address from shared_base: the same instruction, only the address operand is formed differently."""
    text = f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0,$1,$2,$3}}, [$4];"

    @intrinsic
    def ldmatrix(typingctx, smem, offset):
        if not (_is_16bit_array(smem) and _is_int(offset)):
            return None
        sig = types.UniTuple(types.uint32, 4)(smem, offset)

        def codegen(context, builder, sig, args):
            if by_address:
                addr = builder.trunc(context.cast(builder, args[1], sig.args[1], types.int64), _I32)
            else:
                addr = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            ret = ir.LiteralStructType([_I32] * 4)
            # side effect + memory clobber: it reads memory other threads wrote, so it must not be
            # hoisted or merged across cuda.syncthreads().
            r = _asm(builder, ret, [addr], text, "=r,=r,=r,=r,r,~{memory}", side_effect=True)
            return context.make_tuple(builder, sig.return_type, _unpack(builder, r, 4))

        return sig, codegen

    return ldmatrix


def _make_ldmatrix_twin(trans, by_address=False):
    def ldmatrix(smem, offset):
        if by_address:  # a byte offset from the array's start (shared_base's twin is 0)
            if int(offset) % 2:
                raise ValueError(f"ldmatrix: odd byte address {offset} of a 16-bit array")
            offset = int(offset) // 2
        row = _flat_bytes(smem, offset, 16, "ldmatrix").view(np.uint16).astype(np.int64)

        def combine(rows):
            out = []
            for lane in range(32):
                g, t = lane >> 2, lane % 4
                regs = []
                for j in range(4):
                    if trans:  # r_j = M_j[2t:2t+2, g]
                        lo, hi = rows[8 * j + 2 * t][g], rows[8 * j + 2 * t + 1][g]
                    else:  # r_j = M_j[g, 2t:2t+2]
                        lo, hi = rows[8 * j + g][2 * t], rows[8 * j + g][2 * t + 1]
                    regs.append(int(lo) | (int(hi) << 16))
                out.append(tuple(regs))
            return out

        return warp_exchange(row, combine, "ldmatrix.trans" if trans else "ldmatrix")

    return ldmatrix


ldmatrix_x4 = pick(_make_ldmatrix_intrinsic(trans=False), _make_ldmatrix_twin(trans=False))
ldmatrix_x4_trans = pick(_make_ldmatrix_intrinsic(trans=True), _make_ldmatrix_twin(trans=True))
ldmatrix_x4_at = pick(_make_ldmatrix_intrinsic(trans=False, by_address=True),
                      _make_ldmatrix_twin(trans=False, by_address=True))
ldmatrix_x4_trans_at = pick(_make_ldmatrix_intrinsic(trans=True, by_address=True),
                            _make_ldmatrix_twin(trans=True, by_address=True))
