"""16-byte shared-memory loads/stores and float bit casts for the SIMT kernels, with simulator twins.

Numba emits one 4-byte ``ld.shared.f32`` per element. The SIMT kernels read four neighbouring
floats per operand per step, so one ``ld.shared.v4.f32`` does the work of four: the
shared-memory pipe, not the FMA units, was the limit of the scalar version. These are plain
LLVM vector loads/stores in address space 3 (no inline asm), so NVVM still schedules them
freely; the caller guarantees 16-byte alignment (element offset a multiple of 4 in a float32
array whose base is 16-byte aligned, as dynamic shared memory is).

``f32_from_bits`` / ``bits_from_f32`` reinterpret a float32 as uint32 and back (bfloat16 is the
high half of a float32).

Under ``NUMBA_ENABLE_CUDASIM=1`` each name is a Python function computing the same values.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import config
from numba.cuda import types
from numba.cuda.extending import intrinsic

SIMULATOR = bool(config.ENABLE_CUDASIM)

_F32 = ir.FloatType()
_V4 = ir.VectorType(_F32, 4)


def _shared_v4_pointer(context, builder, aryty, ary, offty, off):
    data = context.make_array(aryty)(context, builder, value=ary).data
    elem = builder.gep(data, [context.cast(builder, off, offty, types.intp)])
    return builder.addrspacecast(builder.bitcast(elem, ir.PointerType(_V4)), ir.PointerType(_V4, 3))


def _is_f32_array(ty):
    return isinstance(ty, types.Array) and ty.dtype == types.float32


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


@intrinsic
def _f32_from_bits(typingctx, bits):
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(types.uint32)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _F32)

    return sig, codegen


@intrinsic
def _bits_from_f32(typingctx, x):
    if not isinstance(x, types.Float):
        return None
    sig = types.uint32(types.float32)

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


def _ld_shared_f32x4_twin(smem, offset):
    o = int(offset)
    assert o % 4 == 0, f"ld_shared_f32x4 at element {o}: not 16-byte aligned"
    return tuple(np.float32(x) for x in smem[o:o + 4])


def _st_shared_f32x4_twin(smem, offset, x0, x1, x2, x3):
    o = int(offset)
    assert o % 4 == 0, f"st_shared_f32x4 at element {o}: not 16-byte aligned"
    smem[o:o + 4] = (x0, x1, x2, x3)


def _f32_from_bits_twin(bits):
    return np.array(int(bits) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]


def _bits_from_f32_twin(x):
    return np.uint32(np.array(x, dtype=np.float32).view(np.uint32)[()])


if SIMULATOR:
    ld_shared_f32x4 = _ld_shared_f32x4_twin
    st_shared_f32x4 = _st_shared_f32x4_twin
    f32_from_bits = _f32_from_bits_twin
    bits_from_f32 = _bits_from_f32_twin
else:
    ld_shared_f32x4 = _ld_shared_f32x4
    st_shared_f32x4 = _st_shared_f32x4
    f32_from_bits = _f32_from_bits
    bits_from_f32 = _bits_from_f32

__all__ = ["SIMULATOR", "ld_shared_f32x4", "st_shared_f32x4", "f32_from_bits", "bits_from_f32"]
