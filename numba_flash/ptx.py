"""Tensor-core building blocks for Numba CUDA kernels, each beside its simulator twin.

On a GPU every name below is a ``numba.cuda.extending.intrinsic`` that emits one inline-PTX
instruction (``mma.sync``, ``ldmatrix``, ``cp.async``, ``cvt``, ``ex2``). Under the CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) the same name is a Python function that computes the same thing for
one simulated thread, exchanging registers with the other 31 lanes of its warp, so a kernel's
fragment indexing is checked on a machine without a GPU. The choice is made once, at import time.

The maths: fragment layouts of ``mma.sync.aligned.m16n8k16`` (PTX ISA, "Matrix Fragments for
mma.m16n8k16 with floating point type"). A warp computes D(16x8) = A(16x16) @ B(16x8) + C(16x8).
With ``g = lane >> 2`` (groupID) and ``t = lane % 4`` (threadID_in_group), lane ``lane`` holds

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

Packed pairs: a .b32 holds two 16-bit values, the first (lower-index) element in bits 0..15. Note
``cvt.rn.f16x2.f32 d, a, b`` puts ``a`` in the HIGH half, so ``pack_f16x2(x, y)`` emits it as
``cvt d, y, x``. In the twins a packed pair is a Python int with the same bits.

Shared-memory addresses are passed as (array, element offset): the 16 bytes at that element of the
array's memory. The ``*_at`` loads take a byte address instead, ``shared_base(array) + 2·offset`` (0-based
in the simulator): a kernel that adds a compile-time offset last lets ptxas fold it into the instruction
(``[R+imm]``), where an element offset is scaled after every add. Arrays handed to ``ldmatrix_*`` / ``cp_async_*`` must be 16-byte aligned: declare
shared arrays as ``cuda.shared.array(shape, dtype, alignment=SMEM_ALIGN)`` (``SMEM_ALIGN`` is None in
the simulator, which refuses an alignment argument).
"""

import ctypes
import functools
import threading
import time

import numpy as np
from llvmlite import ir
from numba import config, cuda
from numba.cuda import types
from numba.cuda.extending import intrinsic, register_jitable

SIMULATOR = bool(config.ENABLE_CUDASIM)
SM90_ONLY = "red.global.add.v2/.v4.f32, cp.async.bulk, mbarrier expect_tx"  # what needs sm_90+ below
SMEM_ALIGN = None if SIMULATOR else 16  # ldmatrix rows and cp.async targets are 16-byte aligned
WGMMA_ALIGN = None if SIMULATOR else 1024  # wgmma's 128-byte swizzle works on 1024-byte aligned addresses
FULL_MASK = 0xFFFFFFFF


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
# Simulator plumbing: a per-warp rendezvous. Simulated threads are Python threads (BlockThread)
# that carry threadIdx/blockIdx and a per-block manager; warp collectives meet in a slot kept on
# that manager, so its state lives and dies with the block.
# --------------------------------------------------------------------------------------------
class _WarpRendezvous:
    """All ``lanes`` lanes (a warp: 32; a warpgroup: 128) deposit a value; the last to arrive runs
    ``combine`` once for the group."""

    def __init__(self, lanes=32):
        self.lanes = lanes
        self.cond = threading.Condition()
        self.values = [None] * lanes
        self.arrived = 0
        self.generation = 0
        self.result = None
        self.error = None
        self.op = None

    def exchange(self, lane, value, combine, op):
        thread = threading.current_thread()
        with self.cond:
            if self.arrived and self.op != op:
                raise RuntimeError(f"warp divergence: lane {lane} calls {op} while others call {self.op}")
            self.op = op
            generation = self.generation
            self.values[lane] = value
            self.arrived += 1
            if self.arrived == self.lanes:
                try:
                    self.result, self.error = None, None
                    self.result = combine(self.values)
                except Exception as e:  # every lane fails with it, not with a missing result
                    self.error = e
                    raise
                finally:
                    self.values, self.arrived, self.op = [None] * self.lanes, 0, None
                    self.generation += 1
                    self.cond.notify_all()
            while self.generation == generation:
                # Poll so that a crash elsewhere in the block (abort flag) does not hang us.
                self.cond.wait(timeout=0.05)
                if getattr(thread, "abort", False):
                    raise RuntimeError(f"lane {lane}: block aborted while waiting in {op}")
            if self.result is None and self.error is not None:
                raise RuntimeError(f"lane {lane}: {op} failed in another lane: {self.error}")
            return self.result[lane]


_slots_lock = threading.Lock()


def _lane_and_slot(lanes=32):
    thread = threading.current_thread()
    manager = thread._manager
    block = manager._block_dim
    nthreads = block[0] * block[1] * block[2]
    if nthreads % lanes:
        what = "warps" if lanes == 32 else f"groups of {lanes} threads"
        raise RuntimeError(f"this PTX needs whole {what}; block has {nthreads} threads")
    group, lane = divmod(thread.thread_id, lanes)
    with _slots_lock:
        slots = manager.__dict__.setdefault("_ptx_warp_slots", {})
        slot = slots.get((lanes, group))
        if slot is None:
            slot = slots[(lanes, group)] = _WarpRendezvous(lanes)
    return lane, slot


def warp_exchange(value, combine, op="exchange", lanes=32):
    """Twin helper: every lane of the warp (lanes=128: the warpgroup) passes value; returns
    combine(values_by_lane)[lane]."""
    lane, slot = _lane_and_slot(lanes)
    return slot.exchange(lane, value, combine, op)


def _numpy_of(array):
    """The NumPy array behind a simulator array (shared arrays already are NumPy)."""
    while not isinstance(array, np.ndarray):
        inner = array.__dict__  # FakeWithinKernelCUDAArray wraps _item, FakeCUDAArray wraps _ary
        array = inner["_item"] if "_item" in inner else inner["_ary"]
    return array


def _flat_bytes(array, offset, nbytes, what):
    """Byte view of nbytes at element offset of array's memory, checked like the hardware would."""
    ary = _numpy_of(array)
    if not (ary.flags.c_contiguous or (ary.ndim == 1 and ary.strides[0] == ary.itemsize)):
        raise ValueError(f"{what}: array must be C-contiguous (or a unit-stride row), got strides {ary.strides}")
    start = int(offset) * ary.itemsize
    if start % 16:
        raise ValueError(f"{what}: address not 16-byte aligned (element offset {offset}, itemsize {ary.itemsize})")
    flat = ary.reshape(-1).view(np.uint8)
    if start < 0 or start + nbytes > flat.size:
        raise IndexError(f"{what}: bytes [{start}, {start + nbytes}) outside an array of {flat.size} bytes")
    return flat[start : start + nbytes]


# --------------------------------------------------------------------------------------------
# Inline-PTX plumbing for the intrinsics.
# --------------------------------------------------------------------------------------------
_I32, _F32 = ir.IntType(32), ir.FloatType()


def _asm(builder, ret, args, text, constraints, side_effect=False):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)


def _unpack(builder, struct, n):
    return [builder.extract_value(struct, i) for i in range(n)]


def _element_pointer(context, builder, aryty, ary, offty, off):
    """Generic pointer to element ``off`` of the array's memory (no strides: a flat offset)."""
    data = context.make_array(aryty)(context, builder, value=ary).data
    return builder.gep(data, [context.cast(builder, off, offty, types.intp)])


def _shared_address(context, builder, aryty, ary, offty, off):
    """32-bit .shared address of element ``off`` (the __cvta_generic_to_shared of CUDA C++).

    The offset is truncated to 32 bits before it is scaled and added, so LLVM can narrow the
    kernel's (64-bit, as Numba types it) index arithmetic to 32-bit registers.
    """
    data = context.make_array(aryty)(context, builder, value=ary).data
    base = builder.ptrtoint(builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3)), _I32)
    itemsize = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
    off32 = builder.trunc(context.cast(builder, off, offty, types.int64), _I32)
    return builder.add(base, builder.mul(off32, ir.Constant(_I32, itemsize)))


def _is_int(*tys):
    return all(isinstance(t, types.Integer) for t in tys)


def _is_num(*tys):
    return all(isinstance(t, (types.Integer, types.Float)) for t in tys)


def _is_16bit_array(ty):
    return isinstance(ty, types.Array) and ty.dtype.bitwidth == 16


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


@intrinsic
def _shared_base_intrinsic(typingctx, smem):
    if not isinstance(smem, types.Array):
        return None
    sig = types.uint32(smem)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        return builder.ptrtoint(builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3)), _I32)

    return sig, codegen


def _shared_base_twin(smem):
    return 0  # the twins of the *_at loads take byte offsets from the array's start


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


# --------------------------------------------------------------------------------------------
# cp.async.cg.shared.global (16 bytes, optional zero fill), commit_group, wait_group N
# --------------------------------------------------------------------------------------------
@intrinsic
def _cp_async_16_intrinsic(typingctx, dst, dst_offset, src, src_offset):
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and _is_int(dst_offset, src_offset)):
        return None
    sig = types.void(dst, dst_offset, src, src_offset)

    def codegen(context, builder, sig, args):
        d = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        s = _element_pointer(context, builder, sig.args[2], args[2], sig.args[3], args[3])
        _asm(builder, ir.VoidType(), [d, s], "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}", True)

    return sig, codegen


@intrinsic
def _cp_async_16_zfill_intrinsic(typingctx, dst, dst_offset, src, src_offset, src_bytes):
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)):
        return None
    if not _is_int(dst_offset, src_offset, src_bytes):
        return None
    sig = types.void(dst, dst_offset, src, src_offset, src_bytes)

    def codegen(context, builder, sig, args):
        d = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        s = _element_pointer(context, builder, sig.args[2], args[2], sig.args[3], args[3])
        n = context.cast(builder, args[4], sig.args[4], types.uint32)
        text = "cp.async.cg.shared.global [$0], [$1], 16, $2;"  # bytes past src-size are zeroed
        _asm(builder, ir.VoidType(), [d, s, n], text, "r,l,r,~{memory}", True)

    return sig, codegen


@intrinsic
def _cp_async_16_zero_if_intrinsic(typingctx, dst, dst_offset, src, src_offset, zero):
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array)):
        return None
    if not (_is_int(dst_offset, src_offset) and isinstance(zero, (types.Boolean, types.Integer))):
        return None
    sig = types.void(dst, dst_offset, src, src_offset, zero)

    def codegen(context, builder, sig, args):
        d = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        s = _element_pointer(context, builder, sig.args[2], args[2], sig.args[3], args[3])
        z = context.cast(builder, args[4], sig.args[4], types.uint32)
        # the ignore-src predicate (PTX 7.5): 16 zero bytes instead of a read; a plain LDGSTS.ZFILL, where
        # a src-size register costs ptxas an address adjustment per copy
        text = "{ .reg .pred p; setp.ne.u32 p, $2, 0; cp.async.cg.shared.global [$0], [$1], 16, p; }"
        _asm(builder, ir.VoidType(), [d, s, z], text, "r,l,r,~{memory}", True)

    return sig, codegen


def _make_plain_asm_intrinsic(text):
    """An intrinsic of no arguments emitting ``text`` (volatile, clobbering memory: never moved across others)."""
    @intrinsic
    def plain(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], text, "~{memory}", True)

        return sig, codegen

    return plain


_cp_async_commit_intrinsic = _make_plain_asm_intrinsic("cp.async.commit_group;")


@intrinsic
def _cp_async_wait_intrinsic(typingctx, n):
    if not isinstance(n, types.IntegerLiteral):
        return None  # wait_group takes an immediate; Numba retries with the literal type
    sig = types.void(n)
    text = f"cp.async.wait_group {n.literal_value};"

    def codegen(context, builder, sig, args):
        _asm(builder, ir.VoidType(), [], text, "~{memory}", True)

    return sig, codegen


# Twins: a copy is queued at issue and lands at the wait that retires its group; meanwhile its
# destination reads as 0xFF bytes (a NaN in f16 and bf16), so a read before the wait (RAW) or an
# overwrite of a tile another thread still reads (WAR) shows up as NaNs in the simulator.
_POISON = 0xFF


class _AsyncGroups:
    """One simulated thread's queue of an asynchronous unit's operations (cp.async, wgmma), as the hardware
    keeps it: those issued since the last commit, then committed groups; retire(pending) runs each operation
    (a callable) of every group but the newest ``pending``, in issue order."""

    def __init__(self):
        self.open, self.committed = [], []

    def commit(self):
        self.committed.append(self.open)
        self.open = []

    def retire(self, pending):
        while len(self.committed) > pending:
            for land in self.committed.pop(0):
                land()


def _async_groups(unit):
    """The current simulated thread's _AsyncGroups of ``unit`` ("cp.async", "wgmma")."""
    state = threading.current_thread().__dict__
    groups = state.get(f"_ptx_{unit}")
    if groups is None:  # not setdefault: this runs for every simulated copy
        groups = state[f"_ptx_{unit}"] = _AsyncGroups()
    return groups


def _span_bytes(array, offset, nbytes, what):
    """Byte copy of nbytes at element offset from the array's data pointer, as the hardware reads it.

    Unlike _flat_bytes the array may be strided (a 4-D view of padded rows): the offset is flat
    from the first element, and the bytes must lie inside the memory the view spans.
    """
    ary = _numpy_of(array)
    if ary.flags.c_contiguous:
        return _flat_bytes(array, offset, nbytes, what)
    start = int(offset) * ary.itemsize
    if start % 16:
        raise ValueError(f"{what}: address not 16-byte aligned (element offset {offset}, itemsize {ary.itemsize})")
    low, high = np.lib.array_utils.byte_bounds(ary)
    address = ary.ctypes.data + start
    if address < low or address + nbytes > high:
        raise IndexError(f"{what}: bytes [{start}, {start + nbytes}) outside the {high - low} bytes the array spans")
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def _cp_async_16_zfill_twin(dst, dst_offset, src, src_offset, src_bytes):
    n = int(src_bytes)
    if not 0 <= n <= 16:
        raise ValueError(f"cp.async: src-size must be in [0, 16], got {n}")
    target = _flat_bytes(dst, dst_offset, 16, "cp.async dst")
    source = _span_bytes(src, src_offset, n, "cp.async src") if n else None
    target[:] = _POISON

    def land():
        target[:n] = source if n else target[:0]
        target[n:] = 0

    _async_groups("cp.async").open.append(land)


def _cp_async_16_zero_if_twin(dst, dst_offset, src, src_offset, zero):
    _cp_async_16_zfill_twin(dst, dst_offset, src, src_offset, 0 if zero else 16)


def _cp_async_16_twin(dst, dst_offset, src, src_offset):
    _cp_async_16_zfill_twin(dst, dst_offset, src, src_offset, 16)


def _cp_async_commit_twin():
    _async_groups("cp.async").commit()


def _cp_async_wait_twin(n):
    _async_groups("cp.async").retire(int(n))


# --------------------------------------------------------------------------------------------
# sm_90 bulk copies (the TMA engine's 1-D form) and the mbarriers they complete (PTX ISA 8.0):
#   mbarrier.init.shared.b64 [bar], count;                   one thread, before any use
#   fence.mbarrier_init.release.cluster; fence.proxy.async.shared::cta;   init visible to the copy engine
#   mbarrier.arrive.expect_tx.shared.b64 _, [bar], bytes;    one arrival + the bytes to expect
#   cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], size, [bar];
#   mbarrier.try_wait.parity.shared.b64 p, [bar], parity;    true once the phase of that parity is over
# A phase ends when its pending arrivals reach 0 and its transaction count (expected minus landed
# bytes) is 0; the barrier then starts the next phase (parity flips). dst and src 16-byte aligned,
# size a multiple of 16. Barrier addresses are (array, element offset) of an 8-byte aligned slot.
# --------------------------------------------------------------------------------------------
@intrinsic
def _mbarrier_init_intrinsic(typingctx, bar, bar_offset, count):
    if not (isinstance(bar, types.Array) and _is_int(bar_offset, count)):
        return None
    sig = types.void(bar, bar_offset, count)

    def codegen(context, builder, sig, args):
        a = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        n = context.cast(builder, args[2], sig.args[2], types.uint32)
        _asm(builder, ir.VoidType(), [a, n], "mbarrier.init.shared.b64 [$0], $1;", "r,r,~{memory}", True)

    return sig, codegen


# fence.mbarrier_init orders the inits before later cluster-scope uses; fence.proxy.async makes them visible
# to the async proxy (the copy engine) that completes transactions.
_fence_mbarrier_init_intrinsic = _make_plain_asm_intrinsic(
    "fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;")


@intrinsic
def _mbarrier_arrive_expect_tx_intrinsic(typingctx, bar, bar_offset, nbytes):
    if not (isinstance(bar, types.Array) and _is_int(bar_offset, nbytes)):
        return None
    sig = types.void(bar, bar_offset, nbytes)

    def codegen(context, builder, sig, args):
        a = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        n = context.cast(builder, args[2], sig.args[2], types.uint32)
        text = "{\n\t.reg .b64 %mbar_state;\n\tmbarrier.arrive.expect_tx.shared.b64 %mbar_state, [$0], $1;\n\t}"
        _asm(builder, ir.VoidType(), [a, n], text, "r,r,~{memory}", True)

    return sig, codegen


@intrinsic
def _mbarrier_try_wait_parity_intrinsic(typingctx, bar, bar_offset, parity):
    if not (isinstance(bar, types.Array) and _is_int(bar_offset, parity)):
        return None
    sig = types.uint32(bar, bar_offset, parity)

    def codegen(context, builder, sig, args):
        a = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        par = context.cast(builder, args[2], sig.args[2], types.uint32)
        text = ("{\n\t.reg .pred %mbar_done;\n\tmbarrier.try_wait.parity.shared.b64 %mbar_done, [$1], $2;\n\t"
                "selp.u32 $0, 1, 0, %mbar_done;\n\t}")
        return _asm(builder, _I32, [a, par], text, "=r,r,r,~{memory}", True)

    return sig, codegen


@intrinsic
def _cp_async_bulk_intrinsic(typingctx, dst, dst_offset, src, src_offset, nbytes, bar, bar_offset):
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and isinstance(bar, types.Array)):
        return None
    if not _is_int(dst_offset, src_offset, nbytes, bar_offset):
        return None
    sig = types.void(dst, dst_offset, src, src_offset, nbytes, bar, bar_offset)

    def codegen(context, builder, sig, args):
        d = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        s = _element_pointer(context, builder, sig.args[2], args[2], sig.args[3], args[3])
        n = context.cast(builder, args[4], sig.args[4], types.uint32)
        b = _shared_address(context, builder, sig.args[5], args[5], sig.args[6], args[6])
        # A .shared::cta address is a valid .shared::cluster address of the issuing CTA; a generic
        # pointer into global memory is its global address (CUDA's identity mapping).
        text = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];"
        _asm(builder, ir.VoidType(), [d, s, n, b], text, "r,l,r,r,~{memory}", True)

    return sig, codegen


# Twins: one _MBarrier per (block, address). A bulk copy poisons its destination at issue (0xFF
# bytes, NaN in f16/bf16/f32) and lands at the first try_wait on its barrier, so a read before the
# wait, or a refill of a tile another thread still reads, shows up as NaNs. A wait that never
# completes (wrong parity, a missing arrive) raises instead of hanging the simulator.
_MBAR_LOCK = threading.Lock()
MBARRIER_WAIT_LIMIT_S = 20.0


class _MBarrier:
    def __init__(self, count):
        self.count = self.pending = int(count)
        self.tx = 0
        self.phase = 0  # completed phases
        self.copies = []

    def _advance(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count


def _mbarrier_key(bar, bar_offset):
    ary = _numpy_of(bar)
    start = int(bar_offset) * ary.itemsize
    if start % 8:
        raise ValueError(f"mbarrier: address not 8-byte aligned (element offset {bar_offset}, itemsize {ary.itemsize})")
    return ary.ctypes.data + start


def _mbarriers():
    manager = threading.current_thread()._manager
    with _slots_lock:
        return manager.__dict__.setdefault("_ptx_mbarriers", {})


def _mbarrier(bar, bar_offset, what):
    found = _mbarriers().get(_mbarrier_key(bar, bar_offset))
    if found is None:
        raise RuntimeError(f"{what}: mbarrier at element offset {bar_offset} used before mbarrier.init")
    return found


def _mbarrier_init_twin(bar, bar_offset, count):
    if not 1 <= int(count) < 2**20:
        raise ValueError(f"mbarrier.init: count must be in [1, 2^20), got {count}")
    with _MBAR_LOCK:
        _mbarriers()[_mbarrier_key(bar, bar_offset)] = _MBarrier(count)


def _fence_mbarrier_init_twin():
    pass  # the twins share one address space: nothing to order


def _mbarrier_arrive_expect_tx_twin(bar, bar_offset, nbytes):
    with _MBAR_LOCK:
        b = _mbarrier(bar, bar_offset, "mbarrier.arrive.expect_tx")
        if b.pending == 0:
            raise RuntimeError("mbarrier.arrive.expect_tx: more arrivals than the barrier's count")
        b.tx += int(nbytes)
        b.pending -= 1
        b._advance()


def _cp_async_bulk_twin(dst, dst_offset, src, src_offset, nbytes, bar, bar_offset):
    n = int(nbytes)
    if n <= 0 or n % 16:
        raise ValueError(f"cp.async.bulk: size must be a positive multiple of 16, got {n}")
    target = _flat_bytes(dst, dst_offset, n, "cp.async.bulk dst")
    source = _span_bytes(src, src_offset, n, "cp.async.bulk src")
    with _MBAR_LOCK:
        b = _mbarrier(bar, bar_offset, "cp.async.bulk")
        target[:] = _POISON
        b.copies.append((target, source))


def _mbarrier_try_wait_parity_twin(bar, bar_offset, parity):
    thread = threading.current_thread()
    with _MBAR_LOCK:
        b = _mbarrier(bar, bar_offset, "mbarrier.try_wait.parity")
        for target, source in b.copies:  # the copies land: complete_tx of their bytes
            target[:] = source
            b.tx -= target.size
        b.copies = []
        b._advance()
        # The phase of parity `parity` is over once the completed-phase count has moved past it.
        done = b.phase % 2 != int(parity) % 2
    if not done:
        start = thread.__dict__.setdefault("_mbar_wait_start", {}).setdefault(id(b), time.monotonic())
        if getattr(thread, "abort", False):
            raise RuntimeError("mbarrier.try_wait: block aborted while waiting")
        if time.monotonic() - start > MBARRIER_WAIT_LIMIT_S:
            raise RuntimeError(f"mbarrier.try_wait.parity {parity}: phase never completed "
                               f"(pending arrivals {b.pending}, tx {b.tx}, completed phases {b.phase})")
        time.sleep(0)  # let the thread that arrives run
    else:
        thread.__dict__.get("_mbar_wait_start", {}).pop(id(b), None)
    return np.uint32(done)


# --------------------------------------------------------------------------------------------
# cvt.rn.{f16,bf16}x2.f32 packing, ex2.approx.ftz.f32
# --------------------------------------------------------------------------------------------
def _make_pack_intrinsic(kind):
    text = f"cvt.rn.{kind}x2.f32 $0, $2, $1;"  # cvt puts its first source in the high half

    @intrinsic
    def pack(typingctx, x, y):
        if not _is_num(x, y):
            return None
        sig = types.uint32(x, y)

        def codegen(context, builder, sig, args):
            xs = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
            return _asm(builder, _I32, xs, text, "=r,f,f")

        return sig, codegen

    return pack


def _make_pack_twin(bits_of):
    def pack(x, y):
        return bits_of(x) | (bits_of(y) << 16)

    return pack


@intrinsic
def _ex2_approx_intrinsic(typingctx, x):
    if not _is_num(x):
        return None
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return _asm(builder, _F32, [v], "ex2.approx.ftz.f32 $0, $1;", "=f,f")

    return sig, codegen


def _ex2_approx_twin(x):
    with np.errstate(over="ignore"):
        y = np.exp2(np.float32(x), dtype=np.float32)
    return np.float32(0.0) if abs(y) < np.finfo(np.float32).tiny else y  # .ftz flushes subnormals


# --------------------------------------------------------------------------------------------
# red.global.add.f32: an atomic add whose result is not needed (the atomic dQ of the backward)
# --------------------------------------------------------------------------------------------
def _red_add(n, op="red.global.add"):
    """(typing, codegen) of red.global.add.f32 on n consecutive elements: n = 1 scalar, n = 2 or 4
    the sm_90 vector forms (8- or 16-byte aligned), whose warp-wide adds of a fragment's column pairs
    fill whole 32-byte sectors in half (a quarter of) the instructions. op="st.global": plain stores of
    the same operands (n = 1 or 2; the deterministic splits' first adds into uninitialised planes)."""
    regs = "$1" if n == 1 else "{" + ", ".join(f"${i + 1}" for i in range(n)) + "}"
    text = f"{op}{'' if n == 1 else f'.v{n}'}.f32 [$0], {regs};"
    constraints = "l," + ",".join("f" * n) + ",~{memory}"

    def typing(array, offset, values):
        if isinstance(array, types.Array) and array.dtype == types.float32 and _is_int(offset) and _is_num(*values):
            return types.void(array, offset, *values)
        return None

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        xs = [context.cast(builder, a, t, types.float32) for a, t in zip(args[2:], sig.args[2:])]
        # A generic pointer into global memory is its global address (CUDA's identity mapping).
        _asm(builder, ir.VoidType(), [ptr, *xs], text, constraints, True)

    return typing, codegen


_RED_1, _RED_2, _RED_4 = _red_add(1), _red_add(2), _red_add(4)
_ST_1, _ST_2 = _red_add(1, "st.global"), _red_add(2, "st.global")


@intrinsic
def _st_global_f32_intrinsic(typingctx, array, offset, value):
    sig = _ST_1[0](array, offset, (value,))
    return sig and (sig, _ST_1[1])


@intrinsic
def _st_global_v2_f32_intrinsic(typingctx, array, offset, x, y):
    sig = _ST_2[0](array, offset, (x, y))
    return sig and (sig, _ST_2[1])


@intrinsic
def _red_add_f32_intrinsic(typingctx, array, offset, value):
    sig = _RED_1[0](array, offset, (value,))
    return sig and (sig, _RED_1[1])


@intrinsic
def _red_add_v2_f32_intrinsic(typingctx, array, offset, x, y):
    sig = _RED_2[0](array, offset, (x, y))
    return sig and (sig, _RED_2[1])


@intrinsic
def _red_add_v4_f32_intrinsic(typingctx, array, offset, x, y, z, w):
    sig = _RED_4[0](array, offset, (x, y, z, w))
    return sig and (sig, _RED_4[1])


_RED_LOCK = threading.Lock()


def _make_flat_f32_twin(name, add):
    """Twin of red.global.add (add) or st.global (not add) on consecutive fp32 elements from a flat offset;
    a vector (2 or 4 values) must be aligned to its size."""
    def twin(array, offset, *values):
        off = int(offset)
        if len(values) > 1 and off % len(values):  # the GPU faults on a misaligned vector address: so does the twin
            raise ValueError(f"{name}_v{len(values)}_f32: element offset {off} is not {4 * len(values)}-byte aligned")
        flat = _numpy_of(array).reshape(-1)  # contiguous arrays only, like the flat offset on the GPU
        with _RED_LOCK:
            for i, x in enumerate(values):
                flat[off + i] = flat[off + i] + np.float32(x) if add else np.float32(x)
    return twin


_red_add_twin = _make_flat_f32_twin("red_add", add=True)
_st_global_f32_twin = _make_flat_f32_twin("st_global", add=False)


# --------------------------------------------------------------------------------------------
# Plain shared / global accesses the epilogue through shared memory needs: a 32-bit shared store
# into a 16-bit tile, a 16-byte shared load and a 16-byte global store (flat element offsets)
# --------------------------------------------------------------------------------------------
@intrinsic
def _st_shared_b32_intrinsic(typingctx, smem, offset, word):
    if not (_is_16bit_array(smem) and _is_int(offset, word)):
        return None
    sig = types.void(smem, offset, word)

    def codegen(context, builder, sig, args):
        addr = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        w = context.cast(builder, args[2], sig.args[2], types.uint32)
        _asm(builder, ir.VoidType(), [addr, w], "st.shared.b32 [$0], $1;", "r,r,~{memory}", True)

    return sig, codegen


@intrinsic
def _ld_shared_v4_intrinsic(typingctx, smem, offset):
    if not (_is_16bit_array(smem) and _is_int(offset)):
        return None
    sig = types.UniTuple(types.uint32, 4)(smem, offset)

    def codegen(context, builder, sig, args):
        addr = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        ret = ir.LiteralStructType([_I32] * 4)
        r = _asm(builder, ret, [addr], "ld.shared.v4.b32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}", True)
        return context.make_tuple(builder, sig.return_type, _unpack(builder, r, 4))

    return sig, codegen


@intrinsic
def _st_global_v4_intrinsic(typingctx, array, offset, w0, w1, w2, w3):
    if not (isinstance(array, types.Array) and _is_int(offset, w0, w1, w2, w3)):
        return None
    sig = types.void(array, offset, w0, w1, w2, w3)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        words = [context.cast(builder, a, t, types.uint32) for a, t in zip(args[2:], sig.args[2:])]
        # A generic pointer into global memory is its global address (CUDA's identity mapping).
        _asm(builder, ir.VoidType(), [ptr, *words], "st.global.v4.b32 [$0], {$1,$2,$3,$4};",
             "l,r,r,r,r,~{memory}", True)

    return sig, codegen


@intrinsic
def _ld_global_nc_v4_intrinsic(typingctx, array, offset):
    """Four 32-bit words at element ``offset`` (flat, from the data pointer) of a global array, 16-byte
    aligned: one read-only LDG.128 (the array is not written while the kernel runs)."""
    if not (isinstance(array, types.Array) and _is_int(offset)):
        return None
    sig = types.UniTuple(types.uint32, 4)(array, offset)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        ret = ir.LiteralStructType([_I32] * 4)
        r = _asm(builder, ret, [ptr], "ld.global.nc.v4.b32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l", False)
        return context.make_tuple(builder, sig.return_type, _unpack(builder, r, 4))

    return sig, codegen


def _ld_global_nc_v4_twin(array, offset):
    w = np.array(_span_bytes(array, offset, 16, "ld.global.nc.v4")).view(np.uint32)
    return int(w[0]), int(w[1]), int(w[2]), int(w[3])


def _st_shared_b32_twin(smem, offset, word):
    flat = _numpy_of(smem).reshape(-1)
    off = int(offset)
    if off % 2:
        raise ValueError(f"st.shared.b32: element offset {off} is not 4-byte aligned")
    flat[off] = int(word) & 0xFFFF
    flat[off + 1] = (int(word) >> 16) & 0xFFFF


def _ld_shared_v4_twin(smem, offset):
    w = _flat_bytes(smem, offset, 16, "ld.shared.v4").view(np.uint32)
    return int(w[0]), int(w[1]), int(w[2]), int(w[3])


def _st_global_v4_twin(array, offset, w0, w1, w2, w3):
    target = _span_bytes(array, offset, 16, "st.global.v4")
    target[:] = np.array([int(w0), int(w1), int(w2), int(w3)], np.uint32).view(np.uint8)


# --------------------------------------------------------------------------------------------
# Warp shuffle (the simulator has none): the quad reductions of the softmax use it.
# --------------------------------------------------------------------------------------------
def _shfl_xor_sync_twin(mask, value, lane_mask):
    if int(mask) != FULL_MASK:
        raise NotImplementedError("the shfl_xor_sync twin supports only the full-warp mask")
    return warp_exchange(value, lambda vals: [vals[lane ^ int(lane_mask)] for lane in range(32)], "shfl_xor")


def _syncwarp_twin(mask=FULL_MASK):
    """__syncwarp(): the 32 lanes meet (the simulator has no syncwarp)."""
    if int(mask) != FULL_MASK:
        raise NotImplementedError("the syncwarp twin supports only the full-warp mask")
    warp_exchange(0, lambda vals: vals, "syncwarp")


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


def _is_f32_array(ty):
    return isinstance(ty, types.Array) and ty.dtype == types.float32 and ty.layout == "C"


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
        if not (_is_16bit_array(smem) and _is_f32_array(acc) and _is_int(*rest)):
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
        if not _is_f32_array(acc):
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


# --------------------------------------------------------------------------------------------
# Which GPU the intrinsics are for: vector red and the bulk copy exist from sm_90 on (ptxas rejects
# them for sm_80-89), so kernels that use them pick a fallback below it.
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _compute_capability_of(device_id: int) -> tuple:  # one driver query per device, not per call
    return tuple(cuda.gpus[device_id].compute_capability)


def compute_capability(device_id: int | None = None) -> tuple:
    """(major, minor) of a device (default: the current one)."""
    return _compute_capability_of(cuda.get_current_device().id if device_id is None else device_id)


def current_wgmma() -> bool:
    """True when the current device has wgmma (sm_90a: compute capability 9.x; not sm_80-89, and not sm_100+,
    where wgmma is gone). The simulator: True (its twins have it)."""
    return SIMULATOR or compute_capability()[0] == 9


def current_sm90() -> bool:
    """True when the current device is sm_90 or newer (the simulator: True, its twins have all)."""
    return SIMULATOR or compute_capability() >= (9, 0)


# --------------------------------------------------------------------------------------------
# Device helpers for kernels, callable from a kernel like any function: compiled as device
# functions and inlined by NVVM (so fragment arrays passed to them still become registers).
# Unlike a plain cuda.jit(device=True) function, register_jitable is also an ordinary Python
# function in the simulator.
# --------------------------------------------------------------------------------------------
def inline_device(fn):
    return register_jitable(inline="never")(fn)


# --------------------------------------------------------------------------------------------
# The public names: intrinsics on a GPU, twins in the simulator.
# --------------------------------------------------------------------------------------------
if SIMULATOR:
    mma_m16n8k16_f16 = _make_mma_twin(f16_value)
    mma_m16n8k16_bf16 = _make_mma_twin(bf16_value)
    mma_m16n8k8_tf32 = _mma_m16n8k8_tf32_twin
    tf32_round = _make_tf32_round_twin(ties_even=False)
    tf32_round_rn = _make_tf32_round_twin(ties_even=True)
    ldmatrix_x4 = _make_ldmatrix_twin(trans=False)
    ldmatrix_x4_trans = _make_ldmatrix_twin(trans=True)
    ldmatrix_x4_at = _make_ldmatrix_twin(trans=False, by_address=True)
    ldmatrix_x4_trans_at = _make_ldmatrix_twin(trans=True, by_address=True)
    shared_base = _shared_base_twin
    cp_async_16 = _cp_async_16_twin
    cp_async_16_zfill = _cp_async_16_zfill_twin
    cp_async_16_zero_if = _cp_async_16_zero_if_twin
    cp_async_commit = _cp_async_commit_twin
    cp_async_wait = _cp_async_wait_twin
    pack_f16x2 = _make_pack_twin(f16_bits)
    pack_bf16x2 = _make_pack_twin(bf16_bits)
    ex2_approx = _ex2_approx_twin
    shfl_xor_sync = _shfl_xor_sync_twin
    syncwarp = _syncwarp_twin
    red_add_f32 = red_add_v2_f32 = red_add_v4_f32 = _red_add_twin
    st_global_f32 = st_global_v2_f32 = _st_global_f32_twin
    st_shared_b32 = _st_shared_b32_twin
    ld_shared_v4 = _ld_shared_v4_twin
    st_global_v4 = _st_global_v4_twin
    ld_global_nc_v4 = _ld_global_nc_v4_twin
    mbarrier_init = _mbarrier_init_twin
    fence_mbarrier_init = _fence_mbarrier_init_twin
    mbarrier_arrive_expect_tx = _mbarrier_arrive_expect_tx_twin
    mbarrier_try_wait_parity = _mbarrier_try_wait_parity_twin
    cp_async_bulk = _cp_async_bulk_twin
else:
    mma_m16n8k16_f16 = _make_mma_intrinsic("f16")
    mma_m16n8k16_bf16 = _make_mma_intrinsic("bf16")
    mma_m16n8k8_tf32 = _mma_m16n8k8_tf32_intrinsic
    tf32_round = _make_tf32_round_intrinsic("rna")
    tf32_round_rn = _make_tf32_round_intrinsic("rn")
    ldmatrix_x4 = _make_ldmatrix_intrinsic(trans=False)
    ldmatrix_x4_trans = _make_ldmatrix_intrinsic(trans=True)
    ldmatrix_x4_at = _make_ldmatrix_intrinsic(trans=False, by_address=True)
    ldmatrix_x4_trans_at = _make_ldmatrix_intrinsic(trans=True, by_address=True)
    shared_base = _shared_base_intrinsic
    cp_async_16 = _cp_async_16_intrinsic
    cp_async_16_zfill = _cp_async_16_zfill_intrinsic
    cp_async_16_zero_if = _cp_async_16_zero_if_intrinsic
    cp_async_commit = _cp_async_commit_intrinsic
    cp_async_wait = _cp_async_wait_intrinsic
    pack_f16x2 = _make_pack_intrinsic("f16")
    pack_bf16x2 = _make_pack_intrinsic("bf16")
    ex2_approx = _ex2_approx_intrinsic
    shfl_xor_sync = cuda.shfl_xor_sync
    red_add_f32 = _red_add_f32_intrinsic
    red_add_v2_f32 = _red_add_v2_f32_intrinsic
    red_add_v4_f32 = _red_add_v4_f32_intrinsic
    st_global_f32 = _st_global_f32_intrinsic
    st_global_v2_f32 = _st_global_v2_f32_intrinsic
    st_shared_b32 = _st_shared_b32_intrinsic
    ld_shared_v4 = _ld_shared_v4_intrinsic
    st_global_v4 = _st_global_v4_intrinsic
    ld_global_nc_v4 = _ld_global_nc_v4_intrinsic
    mbarrier_init = _mbarrier_init_intrinsic
    fence_mbarrier_init = _fence_mbarrier_init_intrinsic
    mbarrier_arrive_expect_tx = _mbarrier_arrive_expect_tx_intrinsic
    mbarrier_try_wait_parity = _mbarrier_try_wait_parity_intrinsic
    cp_async_bulk = _cp_async_bulk_intrinsic

    @inline_device
    def syncwarp():  # cuda.syncwarp is a typing stub, callable only as an attribute of cuda
        cuda.syncwarp()

@functools.lru_cache(maxsize=None)
def wgmma(n: int, dtype: str, trans_a: bool = False, trans_b: bool = False, a_regs: bool = False):
    """wgmma.mma_async m64n{n}k16, f32 accumulators, A and B of ``dtype`` ("float16" / "bfloat16"), from
    shared memory by descriptor (trans: MN-major) or A from registers (a_regs); the twin in the simulator.
    Call as f(smem, acc, desc_a, desc_b, scale_d) or, with a_regs, f(smem, acc, a0, a1, a2, a3, desc_b,
    scale_d)."""
    if n % 8 or not 8 <= n <= 256 or dtype not in ("float16", "bfloat16") or (a_regs and trans_a):
        raise ValueError(f"wgmma m64n{n}k16 {dtype} trans_a={trans_a} a_regs={a_regs}: n a multiple of 8 in "
                         "8..256, float16 or bfloat16, A from registers is never transposed")
    if SIMULATOR:
        return _make_wgmma_twin(n, f16_value if dtype == "float16" else bf16_value, trans_a, trans_b, a_regs)
    return _make_wgmma_intrinsic(n, "f16" if dtype == "float16" else "bf16", trans_a, trans_b, a_regs)


@functools.lru_cache(maxsize=None)
def wgmma_hold(n: int):
    """hold(acc): the n / 2 accumulators of an m64n{n} product re-defined after a wgmma_wait (no-op twin)."""
    return _noop_twin if SIMULATOR else _make_wgmma_hold_intrinsic(n)


@functools.lru_cache(maxsize=None)
def wgmma_wait(pending: int):
    """wgmma.wait_group.sync.aligned pending: until at most ``pending`` committed groups are in flight."""
    if SIMULATOR:
        return _make_wgmma_wait_twin(int(pending))
    return _make_plain_asm_intrinsic(f"wgmma.wait_group.sync.aligned {int(pending)};")


if SIMULATOR:
    wgmma_fence = fence_proxy_async = _noop_twin
    wgmma_commit = _wgmma_commit_twin
else:
    wgmma_fence = _make_plain_asm_intrinsic("wgmma.fence.sync.aligned;")  # registers written before it are seen
    wgmma_commit = _make_plain_asm_intrinsic("wgmma.commit_group.sync.aligned;")
    # generic-proxy writes (st.shared, cp.async) made visible to the async proxy that wgmma reads through
    fence_proxy_async = _make_plain_asm_intrinsic("fence.proxy.async.shared::cta;")

__all__ = [
    "SIMULATOR", "SMEM_ALIGN", "WGMMA_ALIGN", "FULL_MASK",
    "mma_m16n8k16_f16", "mma_m16n8k16_bf16", "mma_m16n8k8_tf32", "tf32_round", "tf32_round_rn",
    "ldmatrix_x4", "ldmatrix_x4_trans",
    "ldmatrix_x4_at", "ldmatrix_x4_trans_at", "shared_base",
    "cp_async_16", "cp_async_16_zfill", "cp_async_16_zero_if", "cp_async_commit", "cp_async_wait",
    "mbarrier_init", "fence_mbarrier_init", "mbarrier_arrive_expect_tx", "mbarrier_try_wait_parity", "cp_async_bulk",
    "pack_f16x2", "pack_bf16x2", "ex2_approx", "shfl_xor_sync", "syncwarp", "red_add_f32", "red_add_v2_f32",
    "red_add_v4_f32", "st_global_f32", "st_global_v2_f32",
    "wgmma", "wgmma_hold", "wgmma_wait", "wgmma_fence", "wgmma_commit", "fence_proxy_async", "wgmma_desc_bits",
    "WGMMA_SBO", "inline_device", "st_shared_b32", "ld_shared_v4", "st_global_v4", "ld_global_nc_v4", "current_sm90",
    "current_wgmma",
    "compute_capability",
    "a_fragment_coords", "b_fragment_coords", "c_fragment_coords", "tf32_a_coords", "tf32_b_coords", "tf32_value",
    "f16_bits", "bf16_bits", "f16_value", "bf16_value", "halves",
]
