"""Warpgroup products (wgmma.mma_async, sm_90a) with operands in shared memory by descriptor, and the fences,
commits and waits that order them.
"""
import functools
import threading

import numpy as np
from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

from ._llvm import _F32, _asm, _is_16bit_array, _is_f32_c_array, _is_int, _make_plain_asm_intrinsic
from .mma import a_fragment_coords, bf16_value, f16_value, halves
from .sim import _async_groups, _numpy_of, warp_exchange
from .target import pick


# --------------------------------------------------------------------------------------------
# wgmma.mma_async (sm_90a): a warpgroup (4 consecutive warps, 128 threads) computes
# D(64xN) = A(64x16) @ B(16xN) + D with B, and A unless it comes from registers, read by the tensor
# cores straight from shared memory through 64-bit matrix descriptors (no ldmatrix).
#
# Fragments (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts" of wgmma): warp w of the
# warpgroup owns rows 16w..16w+15 and, per 8 columns, exactly an m16n8 C fragment: accumulator
# register i holds D[16w + g + 8·(i%4 >= 2), 8·(i//4) + 2t + i%2]. A from registers is an m16n8k16 A
# fragment of rows 16w.. (a_fragment_coords).
#
# Shared-memory operands here use the 128-byte swizzle only. A tile of R rows and 64·c 16-bit columns
# is stored as c column atoms of R rows x 128 B (atom a holds columns 64a..64a+63), row r of an atom at
# 128·r, its 16-byte chunk j at chunk j ^ (r % 8): the hardware's swizzle XORs address bits 4-6 with
# bits 7-9, so atoms must start at multiples of 1024 B (the shared array is 1024-aligned, every atom
# a whole number of 8-row groups). Such a tile is both operand orders:
#   K-major (the reduction index along the row, as Q and K in S = Q Kᵀ): rows 8i.. of the operand at
#     start + i·SBO (SBO = 1024), k16 slice kk at + 32·(kk % 4) in atom kk // 4;
#   MN-major (the reduction index down the rows, as dO in dV = Pᵀ dO, ".trans"): k rows 8i.. at
#     start + i·SBO (SBO = 1024), n columns 64a.. at start + a·LBO (LBO = the atom's bytes).
# Descriptor bits: start address >> 4 in 0-13, LBO >> 4 in 16-29, SBO >> 4 in 32-45, 1 (128-byte
# swizzle) in 62-63 (CUTLASS's GmmaDescriptor).
#
# The accumulators are arrays (cuda.local.array, indexed by constants only: NVVM keeps them in
# registers) that the intrinsics read and write in place. wgmma is asynchronous: between an mma and
# the wgmma_wait that retires it nothing may read its accumulators; wgmma_hold(acc) after the wait
# re-defines them through an empty volatile asm, so no use can be scheduled above the wait (CUTLASS's
# warpgroup_fence_operand). The twins keep a queue per thread: a product runs when a wait retires its group,
# reading shared memory through the descriptors by the rules above, and its accumulators read NaN until
# then; fence and hold are no-ops there.
# --------------------------------------------------------------------------------------------
WGMMA_SWIZZLE_128B = 1 << 62
WGMMA_SBO = 1024  # 8 rows of 128 B: the stride between 8-row groups of a column atom


def wgmma_desc_bits(lbo_bytes: int, sbo_bytes: int = WGMMA_SBO) -> int:
    """The descriptor's fixed bits (LBO, SBO, 128-byte swizzle); add (shared byte address >> 4)."""
    if lbo_bytes % 16 or sbo_bytes % 16 or not (0 <= lbo_bytes >> 4 < 1 << 14 and 0 < sbo_bytes >> 4 < 1 << 14):
        raise ValueError(f"wgmma descriptor offsets LBO={lbo_bytes}, SBO={sbo_bytes}: multiples of 16 below 256 KiB")
    return ((lbo_bytes >> 4) << 16) | ((sbo_bytes >> 4) << 32) | WGMMA_SWIZZLE_128B


def _acc_pointers(context, builder, aryty, ary, n):
    data = context.make_array(aryty)(context, builder, value=ary).data
    return [builder.gep(data, [ir.Constant(ir.IntType(64), i)]) for i in range(n)]


def _wgmma_asm(context, builder, aryty, ary, n, text, operands, constraints):
    """The asm of an mma (or a hold) on n accumulators in place: outputs $0..$n-1, then ``operands``,
    then the accumulators' inputs tied to the outputs."""
    ptrs = _acc_pointers(context, builder, aryty, ary, n)
    accs = [builder.load(p) for p in ptrs]
    clobbers = [c for c in constraints if c.startswith("~")]
    inputs = [c for c in constraints if not c.startswith("~")]
    cons = ",".join(["=f"] * n + inputs + [str(i) for i in range(n)] + clobbers)
    ret = ir.LiteralStructType([_F32] * n)
    d = _asm(builder, ret, list(operands) + accs, text, cons, side_effect=True)
    for i, p in enumerate(ptrs):
        builder.store(builder.extract_value(d, i), p)


def _make_wgmma_intrinsic(n, ab, trans_a, trans_b, a_regs):
    """wgmma m64n{n}k16 f32 += {ab} x {ab}: (smem, acc, desc_a, desc_b, scale_d), or with a_regs
    (smem, acc, a0, a1, a2, a3, desc_b, scale_d); scale_d 0 ignores acc's old values. smem (unused on the
    GPU) is the shared array the descriptors point into: the twin reads it."""
    regs = n // 2  # accumulators per thread: 64 x n over 128 threads
    dl = ",".join(f"${i}" for i in range(regs))
    if a_regs:
        ops = f"{{${regs},${regs + 1},${regs + 2},${regs + 3}}}, ${regs + 4}, p, 1, 1, {int(trans_b)}"
        pred = regs + 5
    else:
        ops = f"${regs}, ${regs + 1}, p, 1, 1, {int(trans_a)}, {int(trans_b)}"
        pred = regs + 2
    text = (f"{{\n.reg .pred p;\nsetp.ne.b32 p, ${pred}, 0;\n"
            f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} {{{dl}}}, {ops};\n}}")

    def typing(smem, acc, rest):
        if not (_is_16bit_array(smem) and _is_f32_c_array(acc) and _is_int(*rest)):
            return None
        sig = types.void(smem, acc, *rest)

        def codegen(context, builder, sig, args):
            vals, tys = args[2:], sig.args[2:]
            if a_regs:
                operands = [context.cast(builder, v, t, types.uint32) for v, t in zip(vals[:4], tys[:4])]
                operands.append(context.cast(builder, vals[4], tys[4], types.uint64))
                cons = ["r"] * 4 + ["l", "r"]
            else:
                operands = [context.cast(builder, v, t, types.uint64) for v, t in zip(vals[:2], tys[:2])]
                cons = ["l", "l", "r"]
            operands.append(context.cast(builder, vals[-1], tys[-1], types.int32))
            cons.append("~{memory}")  # it reads shared memory: keep it below the barriers and stores before it
            _wgmma_asm(context, builder, sig.args[1], args[1], regs, text, operands, cons)

        return sig, codegen

    if a_regs:
        @intrinsic
        def wgmma(typingctx, smem, acc, a0, a1, a2, a3, desc_b, scale_d):
            return typing(smem, acc, (a0, a1, a2, a3, desc_b, scale_d))
    else:
        @intrinsic
        def wgmma(typingctx, smem, acc, desc_a, desc_b, scale_d):
            return typing(smem, acc, (desc_a, desc_b, scale_d))

    return wgmma


def _make_wgmma_hold_intrinsic(n):
    """An empty volatile asm that reads and re-defines the n / 2 accumulators of an m64n{n} product
    (CUTLASS's warpgroup_fence_operand)."""
    @intrinsic
    def hold(typingctx, acc):
        if not _is_f32_c_array(acc):
            return None
        sig = types.void(acc)

        def codegen(context, builder, sig, args):
            _wgmma_asm(context, builder, sig.args[0], args[0], n // 2, "", [], [])

        return sig, codegen

    return hold


def _wgmma_operand(sbytes, desc, rows, cols, k_major):
    """The (rows x cols) matrix a descriptor describes (K-major: rows = M or N, cols = 16; MN-major:
    rows = 16 k, cols = M or N), read from the shared bytes by the 128-byte swizzle rules above."""
    desc = int(desc)
    start, lbo, sbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
    if desc >> 62 != 1:
        raise ValueError(f"wgmma twin: descriptor {desc:#x} is not a 128-byte swizzle (bits 62-63 = {desc >> 62})")
    if (start >> 7) & 7 or (desc >> 49) & 7:  # the hardware would then need (and read) the base-offset field
        raise ValueError(f"wgmma twin: descriptor {desc:#x} starts at byte {start}, not at a whole 8-row group of "
                         "a 1024-aligned atom (plus chunk offsets), or sets the base-offset bits 49-51")
    out = np.empty((rows, cols), np.int64)
    for r in range(rows):
        for c in range(0, cols, 8):  # 16-byte chunks of 8 elements along the contiguous index
            if k_major:  # element (r = m or n, c = k)
                addr = start + (r // 8) * sbo + (r % 8) * 128 + (c // 8) * 16
            else:  # element (r = k, c = m or n)
                addr = start + (c // 64) * lbo + ((c % 64) // 8) * 16 + (r // 8) * sbo + (r % 8) * 128
            addr ^= ((addr >> 7) & 7) << 4
            if addr < 0 or addr + 16 > sbytes.size:
                raise IndexError(f"wgmma twin: descriptor {desc:#x} reads bytes [{addr}, {addr + 16}) outside "
                                 f"{sbytes.size} bytes of shared memory")
            out[r, c:c + 8] = sbytes[addr:addr + 16].view(np.uint16)
    return out


def _make_wgmma_twin(n, value_of, trans_a, trans_b, a_regs):
    """Issue: the product is queued (operands by value where they are registers, by descriptor where they are
    shared memory) and its accumulators turn NaN. It runs when a wgmma_wait retires its group, reading shared
    memory then, as the hardware may: a kernel that reads the accumulators before the wait that retires the
    product, or that overwrites an operand tile meanwhile (lane 0 of the warpgroup keeps the operands' bits
    as they were at the issue, and a difference at the retirement is refused as a race), fails in the
    simulator too. For each accumulator array with products in flight the thread keeps its running value."""
    regs = n // 2
    vec = np.vectorize(value_of, otypes=[np.float64])

    def operands(smem, a, desc_b):
        """The shared operands' bits (A None where it comes from registers)."""
        sbytes = _numpy_of(smem).reshape(-1).view(np.uint8)
        b = _wgmma_operand(sbytes, desc_b, 16, n, False) if trans_b else _wgmma_operand(sbytes, desc_b, n, 16, True)
        if a_regs:
            return None, b
        return (_wgmma_operand(sbytes, a, 16, 64, False) if trans_a else _wgmma_operand(sbytes, a, 64, 16, True)), b

    def combine(lanes):  # lanes: (running value, a, desc_b, scale_d, smem, snap), one per lane of the warpgroup
        if len({(None if a_regs else v[1], v[2], v[3]) for v in lanes}) != 1:
            raise ValueError(f"wgmma m64n{n} twin: the lanes of a warpgroup passed different descriptors or scale_d")
        a_bits, b_bits = operands(lanes[0][4], lanes[0][1], lanes[0][2])
        if any(x is not None and not np.array_equal(x, y) for x, y in zip((a_bits, b_bits), lanes[0][5])):
            raise RuntimeError(f"wgmma m64n{n} twin: shared memory under an operand changed between the product's "
                               "issue and the wait that retired it (a race on the GPU)")
        if a_regs:
            A = np.zeros((64, 16))
            for lane, value in enumerate(lanes):
                w, l32 = divmod(lane, 32)
                bits = [h for word in value[1] for h in halves(word)]
                for (r, k), b in zip(a_fragment_coords(l32), bits):
                    A[16 * w + r, k] = value_of(b)
        else:
            A = vec(a_bits).T if trans_a else vec(a_bits)
        B = vec(b_bits) if trans_b else vec(b_bits).T
        D = A @ B  # products of 16-bit floats are exact; one rounding to fp32 below
        out = []
        for lane, value in enumerate(lanes):
            w, l32 = divmod(lane, 32)
            g, t = l32 >> 2, l32 & 3
            i = np.arange(regs)
            r = 16 * w + g + 8 * ((i % 4) >= 2)
            c = 8 * (i // 4) + 2 * t + (i % 2)
            old = value[0].astype(np.float64) if value[3] else 0.0
            out.append((D[r, c] + old).astype(np.float32))
        return out

    def wgmma(smem, acc, *rest):
        arr = _numpy_of(acc)
        flat = arr.reshape(-1)
        if flat.size < regs:
            raise ValueError(f"wgmma m64n{n}: the accumulator array has {flat.size} elements, needs {regs}")
        thread = threading.current_thread()
        running = thread.__dict__.setdefault("_ptx_wgmma_running", {})
        if id(arr) not in running:  # [array, running value, products in flight on it]
            running[id(arr)] = [arr, flat[:regs].astype(np.float32), 0]
            flat[:regs] = np.nan
        state = running[id(arr)]
        state[2] += 1
        a, desc_b, scale_d = tuple(int(x) for x in rest[:4]) if a_regs else int(rest[0]), int(rest[-2]), bool(rest[-1])
        snap = operands(smem, a, desc_b) if thread.thread_id % 128 == 0 else None

        def land():
            state[1] = warp_exchange((state[1], a, desc_b, scale_d, smem, snap), combine, f"wgmma.m64n{n}", lanes=128)
            state[2] -= 1
            if state[2] == 0:  # its last product in flight: the accumulators hold the value again
                flat[:regs] = state[1]
                del running[id(arr)]

        _async_groups("wgmma").open.append(land)

    return wgmma


def _wgmma_commit_twin():
    _async_groups("wgmma").commit()


def _make_wgmma_wait_twin(pending):
    def wait():
        _async_groups("wgmma").retire(pending)

    return wait


def _noop_twin(*args):  # fence, hold: nothing to do where products run at their retirement
    return None


@functools.lru_cache(maxsize=None)
def wgmma(n: int, dtype: str, trans_a: bool = False, trans_b: bool = False, a_regs: bool = False):
    """wgmma.mma_async m64n{n}k16, f32 accumulators, A and B of ``dtype`` ("float16" / "bfloat16"), from
    shared memory by descriptor (trans: MN-major) or A from registers (a_regs); the twin in the simulator.
    Call as f(smem, acc, desc_a, desc_b, scale_d) or, with a_regs, f(smem, acc, a0, a1, a2, a3, desc_b,
    scale_d)."""
    if n % 8 or not 8 <= n <= 256 or dtype not in ("float16", "bfloat16") or (a_regs and trans_a):
        raise ValueError(f"wgmma m64n{n}k16 {dtype} trans_a={trans_a} a_regs={a_regs}: n a multiple of 8 in "
                         "8..256, float16 or bfloat16, A from registers is never transposed")
    f16 = dtype == "float16"
    return pick(_make_wgmma_intrinsic(n, "f16" if f16 else "bf16", trans_a, trans_b, a_regs),
                _make_wgmma_twin(n, f16_value if f16 else bf16_value, trans_a, trans_b, a_regs))


@functools.lru_cache(maxsize=None)
def wgmma_hold(n: int):
    """hold(acc): the n / 2 accumulators of an m64n{n} product re-defined after a wgmma_wait (no-op twin)."""
    return pick(_make_wgmma_hold_intrinsic(n), _noop_twin)


@functools.lru_cache(maxsize=None)
def wgmma_wait(pending: int):
    """wgmma.wait_group.sync.aligned pending: until at most ``pending`` committed groups are in flight."""
    return pick(_make_plain_asm_intrinsic(f"wgmma.wait_group.sync.aligned {int(pending)};"),
                _make_wgmma_wait_twin(int(pending)))


def _make_u32_hold_intrinsic(n):
    """An empty volatile asm that reads and re-defines the first n words of a uint32 array (the A fragments of
    products from registers), so their definitions stay above the wgmma.fence that follows it."""
    @intrinsic
    def hold(typingctx, regs):
        if not (isinstance(regs, types.Array) and regs.dtype == types.uint32 and regs.layout == "C"):
            return None
        sig = types.void(regs)

        def codegen(context, builder, sig, args):
            ptrs = _acc_pointers(context, builder, sig.args[0], args[0], n)
            vals = [builder.load(p) for p in ptrs]
            ret = ir.LiteralStructType([ir.IntType(32)] * n)
            cons = ",".join(["=r"] * n + [str(i) for i in range(n)])
            d = _asm(builder, ret, vals, "", cons, side_effect=True)
            for i, p in enumerate(ptrs):
                builder.store(builder.extract_value(d, i), p)

        return sig, codegen

    return hold


@functools.lru_cache(maxsize=None)
def wgmma_hold_a(n: int):
    """hold(a): the n uint32 A-fragment words of an array (4 per k-step) pinned where they were packed, before
    the wgmma.fence of the products that read them (ptxas serializes products whose register inputs are defined
    after the fence: C7513); a no-op twin."""
    return pick(_make_u32_hold_intrinsic(int(n)), _noop_twin)


# wgmma.fence: registers written before it are seen by the products after it
wgmma_fence = pick(_make_plain_asm_intrinsic("wgmma.fence.sync.aligned;"), _noop_twin)
wgmma_commit = pick(_make_plain_asm_intrinsic("wgmma.commit_group.sync.aligned;"), _wgmma_commit_twin)
# generic-proxy writes (st.shared, cp.async) made visible to the async proxy that wgmma reads through
fence_proxy_async = pick(_make_plain_asm_intrinsic("fence.proxy.async.shared::cta;"), _noop_twin)
