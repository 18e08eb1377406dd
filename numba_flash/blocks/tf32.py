"""fp32 products on tf32 tensor cores (mma.sync m16n8k8): split x = hi + lo, then 3xTF32."""
from numba import float32

from .. import ptx
from ..ptx import inline_device


# How split() rounds x to tf32 (hi) and x - hi (lo): "rn" cvt.rn.tf32.f32 (sm_90+; ptxas emits one F2FP),
# "rna" cvt.rna (sm_80+; ptxas emits four instructions: an add, an inf/NaN test, a select and a mask),
# "rn_raw" hi by cvt.rn and lo unrounded (the tensor core drops its low 13 bits: truncation, one
# instruction fewer per split, lo's rounding error twice as large).
SPLIT_ROUNDS = ("rn", "rna", "rn_raw")


def split_round_for_device(split_round=None):
    """split_round, or the device's default: "rn" on sm_90+ (and in the simulator), "rna" below it."""
    if split_round is None:
        return "rn" if ptx.current_sm90() else "rna"
    if split_round not in SPLIT_ROUNDS:
        raise ValueError(f"SPLIT_ROUND={split_round!r}: one of {SPLIT_ROUNDS}")
    return split_round


def products(PASSES_=3, SPLIT_ROUND="rn"):
    """(split, mma3): the 3xTF32 device functions every tf32 kernel uses (the backward too).

    split(x) -> (hi, lo), x = hi + lo both tf32 (PASSES_=1: lo = 0, unused), rounded as SPLIT_ROUND says
    (SPLIT_ROUNDS); mma3(c, i, a.., l.., b.., m..) adds A·B to c[i] from hi parts (a, b) and lo parts
    (l, m) as lo·hi + hi·lo + hi·hi, small terms first (PASSES_=1: hi·hi only)."""
    SPLIT = PASSES_ == 3
    if SPLIT_ROUND not in SPLIT_ROUNDS:
        raise ValueError(f"SPLIT_ROUND={SPLIT_ROUND!r}: one of {SPLIT_ROUNDS}")
    mma = ptx.mma_m16n8k8_tf32
    tf32 = ptx.tf32_round if SPLIT_ROUND == "rna" else ptx.tf32_round_rn
    LO_RAW = SPLIT_ROUND == "rn_raw"
    ZERO = float32(0.0)

    @inline_device
    def split(x):
        hi = tf32(x)
        if SPLIT:
            if LO_RAW:
                return hi, x - hi
            return hi, tf32(x - hi)
        return hi, ZERO

    @inline_device
    def mma3(c, i, a0, a1, a2, a3, l0, l1, l2, l3, b0, b1, m0, m1):
        c0, c1, c2, c3 = c[i, 0], c[i, 1], c[i, 2], c[i, 3]
        if SPLIT:
            c0, c1, c2, c3 = mma(l0, l1, l2, l3, b0, b1, c0, c1, c2, c3)
            c0, c1, c2, c3 = mma(a0, a1, a2, a3, m0, m1, c0, c1, c2, c3)
        c[i, 0], c[i, 1], c[i, 2], c[i, 3] = mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    return split, mma3


def head_dim_for(d):
    """The compiled head dim for d <= 128: the next multiple of 32 up to 64, then 128 (the swept ones)."""
    return 32 if d <= 32 else 64 if d <= 64 else 128
