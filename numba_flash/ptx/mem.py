"""Loads, stores and reductions on global and shared memory, bit casts and conversions between packed
16-bit and 32-bit values, and ex2.approx: the single instructions the kernels' epilogues, SIMT loops and
decode need where Numba's own code would take several.

16-byte shared loads and stores of float32 (``ld_shared_f32x4``, ``st_shared_f32x4``) are plain LLVM
vector accesses in address space 3 (no inline asm), so NVVM still schedules them freely; the caller
guarantees 16-byte alignment. Numba emits one 4-byte access per element, and the SIMT kernels read four
neighbouring floats per operand per step. ``f32_from_bits`` / ``bits_from_f32`` reinterpret a float32 as
uint32 and back (bfloat16 is the high half of a float32).

Packed pairs: a .b32 holds two 16-bit values, the first (lower-index) element in bits 0..15. Note
``cvt.rn.f16x2.f32 d, a, b`` puts ``a`` in the HIGH half, so ``pack_f16x2(x, y)`` emits it as
``cvt d, y, x``. In the twins a packed pair is a Python int with the same bits.
"""
import threading

import numpy as np
from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

from ._llvm import (
    _F32, _I32, _asm, _element_pointer, _is_16bit_array, _is_f32_array, _is_int, _is_num, _shared_address, _unpack,
)
from .mma import bf16_bits, f16_bits
from .sim import _flat_bytes, _numpy_of, _span_bytes
from .target import pick


# --------------------------------------------------------------------------------------------
# The .shared byte address of an array (the *_at loads add offsets to it)
# --------------------------------------------------------------------------------------------
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


shared_base = pick(_shared_base_intrinsic, _shared_base_twin)


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


pack_f16x2 = pick(_make_pack_intrinsic("f16"), _make_pack_twin(f16_bits))
pack_bf16x2 = pick(_make_pack_intrinsic("bf16"), _make_pack_twin(bf16_bits))


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


ex2_approx = pick(_ex2_approx_intrinsic, _ex2_approx_twin)


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
red_add_f32 = pick(_red_add_f32_intrinsic, _red_add_twin)
red_add_v2_f32 = pick(_red_add_v2_f32_intrinsic, _red_add_twin)
red_add_v4_f32 = pick(_red_add_v4_f32_intrinsic, _red_add_twin)
st_global_f32 = pick(_st_global_f32_intrinsic, _st_global_f32_twin)
st_global_v2_f32 = pick(_st_global_v2_f32_intrinsic, _st_global_f32_twin)


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


st_shared_b32 = pick(_st_shared_b32_intrinsic, _st_shared_b32_twin)
ld_shared_v4 = pick(_ld_shared_v4_intrinsic, _ld_shared_v4_twin)
st_global_v4 = pick(_st_global_v4_intrinsic, _st_global_v4_twin)
ld_global_nc_v4 = pick(_ld_global_nc_v4_intrinsic, _ld_global_nc_v4_twin)


# --------------------------------------------------------------------------------------------
# 16-byte shared loads and stores as LLVM vector accesses (float32 and uint32 arrays)
# --------------------------------------------------------------------------------------------
_V4 = ir.VectorType(_F32, 4)


def _shared_v4_pointer(context, builder, aryty, ary, offty, off):
    data = context.make_array(aryty)(context, builder, value=ary).data
    elem = builder.gep(data, [context.cast(builder, off, offty, types.intp)])
    return builder.addrspacecast(builder.bitcast(elem, ir.PointerType(_V4)), ir.PointerType(_V4, 3))


@intrinsic
def _ld_shared_f32x4(typingctx, smem, offset):
    if not (_is_f32_array(smem) and isinstance(offset, types.Integer)):
        return None
    sig = types.UniTuple(types.float32, 4)(smem, offset)

    def codegen(context, builder, sig, args):
        ptr = _shared_v4_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        vec = builder.load(ptr, align=16)
        items = [builder.extract_element(vec, ir.Constant(ir.IntType(32), i)) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, items)

    return sig, codegen


@intrinsic
def _st_shared_f32x4(typingctx, smem, offset, x0, x1, x2, x3):
    if not (_is_f32_array(smem) and isinstance(offset, types.Integer)
            and all(isinstance(x, (types.Float, types.Integer)) for x in (x0, x1, x2, x3))):
        return None
    sig = types.void(smem, offset, types.float32, types.float32, types.float32, types.float32)

    def codegen(context, builder, sig, args):
        ptr = _shared_v4_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        vec = ir.Constant(_V4, ir.Undefined)
        for i, x in enumerate(args[2:]):
            vec = builder.insert_element(vec, x, ir.Constant(ir.IntType(32), i))
        builder.store(vec, ptr, align=16)
        return context.get_dummy_value()

    return sig, codegen


def _ld_shared_f32x4_twin(smem, offset):
    o = int(offset)
    assert o % 4 == 0, f"ld_shared_f32x4 at element {o}: not 16-byte aligned"
    return tuple(np.float32(x) for x in smem[o:o + 4])


def _st_shared_f32x4_twin(smem, offset, x0, x1, x2, x3):
    o = int(offset)
    assert o % 4 == 0, f"st_shared_f32x4 at element {o}: not 16-byte aligned"
    smem[o:o + 4] = (x0, x1, x2, x3)


ld_shared_f32x4 = pick(_ld_shared_f32x4, _ld_shared_f32x4_twin)
st_shared_f32x4 = pick(_st_shared_f32x4, _st_shared_f32x4_twin)


@intrinsic
def _ld_shared_u32x4_intrinsic(typingctx, smem, offset):
    """Four 32-bit words of a uint32 shared array at a 16-byte aligned word offset: one LDS.128.

    (Bit-casting the lanes of ld_shared_f32x4 makes NVVM fail to compile.)
    """
    if not (isinstance(smem, types.Array) and smem.dtype == types.uint32 and isinstance(offset, types.Integer)):
        return None
    sig = types.UniTuple(types.uint32, 4)(smem, offset)

    def codegen(context, builder, sig, args):
        vec_t = ir.VectorType(ir.IntType(32), 4)
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        elem = builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.intp)])
        ptr = builder.addrspacecast(builder.bitcast(elem, ir.PointerType(vec_t)), ir.PointerType(vec_t, 3))
        vec = builder.load(ptr, align=16)
        items = [builder.extract_element(vec, ir.Constant(ir.IntType(32), i)) for i in range(4)]
        return context.make_tuple(builder, sig.return_type, items)

    return sig, codegen


def _ld_shared_u32x4_twin(smem, offset):
    o = int(offset)
    assert o % 4 == 0, f"ld_shared_u32x4 at word {o}: not 16-byte aligned"
    return tuple(np.uint32(x) for x in smem[o:o + 4])


ld_shared_u32x4 = pick(_ld_shared_u32x4_intrinsic, _ld_shared_u32x4_twin)


# --------------------------------------------------------------------------------------------
# Bit casts (no conversion instruction, just a new type for the same 32 bits) and f16 pairs to f32
# --------------------------------------------------------------------------------------------
@intrinsic
def _f32_from_bits_intrinsic(typingctx, bits):
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(word, ir.FloatType())

    return sig, codegen


@intrinsic
def _bits_from_f32_intrinsic(typingctx, x):
    if not isinstance(x, (types.Float, types.Integer)):
        return None
    sig = types.uint32(x)

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.bitcast(value, ir.IntType(32))

    return sig, codegen


@intrinsic
def _f16x2_to_f32_intrinsic(typingctx, word):
    """Two packed halves (lower index in the low 16 bits) -> (float32, float32): two cvt.f32.f16."""
    if not isinstance(word, types.Integer):
        return None
    sig = types.UniTuple(types.float32, 2)(word)

    def codegen(context, builder, sig, args):
        w = context.cast(builder, args[0], sig.args[0], types.uint32)
        pair = builder.bitcast(w, ir.VectorType(ir.HalfType(), 2))
        lo, hi = (builder.fpext(builder.extract_element(pair, ir.Constant(ir.IntType(32), i)), ir.FloatType())
                  for i in (0, 1))
        return context.make_tuple(builder, sig.return_type, [lo, hi])

    return sig, codegen


def _f32_from_bits_twin(bits):
    return np.array(int(bits) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]


def _bits_from_f32_twin(x):
    return np.array(x, dtype=np.float32).view(np.uint32)[()]


def _f16x2_to_f32_twin(word):
    lo, hi = np.array(int(word) & 0xFFFFFFFF, dtype=np.uint32).reshape(1).view(np.float16)
    return np.float32(lo), np.float32(hi)


f32_from_bits = pick(_f32_from_bits_intrinsic, _f32_from_bits_twin)
bits_from_f32 = pick(_bits_from_f32_intrinsic, _bits_from_f32_twin)
f16x2_to_f32 = pick(_f16x2_to_f32_intrinsic, _f16x2_to_f32_twin)
