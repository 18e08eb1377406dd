"""Asynchronous copies from global into shared memory, so a block fetches its next tiles while it computes
on this one: cp.async (16 bytes, committed and waited for by group) and the sm_90 bulk copy with the
mbarriers that complete it.
"""
import threading
import time

import numpy as np
from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

from . import sim
from ._llvm import _I32, _asm, _element_pointer, _is_int, _make_plain_asm_intrinsic, _shared_address
from .sim import (
    _MBAR_LOCK, _POISON, _MBarrier, _async_groups, _flat_bytes, _mbarrier, _mbarrier_key, _mbarriers, _span_bytes,
)
from .target import pick


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


cp_async_16 = pick(_cp_async_16_intrinsic, _cp_async_16_twin)
cp_async_16_zfill = pick(_cp_async_16_zfill_intrinsic, _cp_async_16_zfill_twin)
cp_async_16_zero_if = pick(_cp_async_16_zero_if_intrinsic, _cp_async_16_zero_if_twin)
cp_async_commit = pick(_cp_async_commit_intrinsic, _cp_async_commit_twin)
cp_async_wait = pick(_cp_async_wait_intrinsic, _cp_async_wait_twin)


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


# Twins: a bulk copy poisons its destination at issue and lands at the first try_wait on its barrier
# (sim._MBarrier holds the barrier's state).
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
        if time.monotonic() - start > sim.MBARRIER_WAIT_LIMIT_S:
            raise RuntimeError(f"mbarrier.try_wait.parity {parity}: phase never completed "
                               f"(pending arrivals {b.pending}, tx {b.tx}, completed phases {b.phase})")
        time.sleep(0)  # let the thread that arrives run
    else:
        thread.__dict__.get("_mbar_wait_start", {}).pop(id(b), None)
    return np.uint32(done)


mbarrier_init = pick(_mbarrier_init_intrinsic, _mbarrier_init_twin)
fence_mbarrier_init = pick(_fence_mbarrier_init_intrinsic, _fence_mbarrier_init_twin)
mbarrier_arrive_expect_tx = pick(_mbarrier_arrive_expect_tx_intrinsic, _mbarrier_arrive_expect_tx_twin)
mbarrier_try_wait_parity = pick(_mbarrier_try_wait_parity_intrinsic, _mbarrier_try_wait_parity_twin)
cp_async_bulk = pick(_cp_async_bulk_intrinsic, _cp_async_bulk_twin)
