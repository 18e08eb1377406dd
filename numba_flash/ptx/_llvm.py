"""The llvmlite side of the intrinsics: inline-asm calls, pointers and .shared addresses, argument type tests."""
from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

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


def _is_f32_array(ty):
    return isinstance(ty, types.Array) and ty.dtype == types.float32


def _is_f32_c_array(ty):
    return isinstance(ty, types.Array) and ty.dtype == types.float32 and ty.layout == "C"


def _make_plain_asm_intrinsic(text):
    """An intrinsic of no arguments emitting ``text`` (volatile, clobbering memory: never moved across others)."""
    @intrinsic
    def plain(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], text, "~{memory}", True)

        return sig, codegen

    return plain
