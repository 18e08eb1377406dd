"""The sm_90 tensor memory accelerator (TMA) and the synchronisation of warp-specialised kernels: tiled tensor
copies between global and shared memory described by a CUtensorMap, plain mbarrier arrivals, named barriers
and setmaxnreg.

    tma_load(rank)      cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes
    tma_store(rank)     cp.async.bulk.tensor.{rank}d.global.shared::cta.bulk_group
    bulk_commit         cp.async.bulk.commit_group
    bulk_wait_read(n)   cp.async.bulk.wait_group.read n (the sources of all but n groups are read)
    prefetch_tensormap  prefetch.tensormap (the map's 128 bytes into the constant cache)
    mbarrier_arrive     mbarrier.arrive.shared::cta.b64 (one arrival, no transaction bytes)
    named_barrier_sync(id, n) / named_barrier_arrive(id, n)   bar.sync / bar.arrive id, n (n threads)
    setmaxnreg(n, inc)  setmaxnreg.{inc,dec}.sync.aligned.u32 n (the warpgroup's registers a thread)

A tensor map is 128 opaque bytes (blocks/tensor_maps.py encodes them through the driver) kept in a global uint8
array: the copies take (array, byte offset) of the map, its generic address, which the ISA allows for a map in
.global space. Coordinates are signed element indices, innermost first; a box part outside the tensor reads
as zeros and is not written by a store. Only the 128-byte swizzle is built (the layout of wgmma's column atoms,
ptx/warpgroup.py): a box of 64 16-bit columns lands as rows of 128 B, 16-byte chunk j of row r at chunk
j ^ (r % 8), at a 1024-byte aligned shared address.

Twins: a map's bytes hold a key into a host registry (blocks.tensor_maps.simulated_map records the tensor and the
box there), a load poisons its destination and lands at the first try_wait on its barrier (as cp.async.bulk's
twin), a store reads shared memory at its wait_group.read and writes global memory then; a named barrier is a
rendezvous of n simulated threads; setmaxnreg checks its count and does nothing else.
"""
import functools
import threading

import numpy as np
from llvmlite import ir
from numba.cuda import types
from numba.cuda.extending import intrinsic

from ._llvm import _asm, _element_pointer, _is_int, _make_plain_asm_intrinsic, _shared_address
from .sim import (
    _MBAR_LOCK, _POISON, _async_groups, _flat_bytes, _mbarrier, _numpy_of, _slots_lock,
)
from .target import pick

TMA_SWIZZLE_BYTES = 128  # the only swizzle built: a box row is one 128-byte line of a column atom
TMAP_BYTES = 128  # sizeof(CUtensorMap)
TMAP_ALIGN = 64  # its alignment
RANKS = (2, 3, 4, 5)


# --------------------------------------------------------------------------------------------
# The simulator's tensor maps: the first 8 bytes are a key into this registry
# --------------------------------------------------------------------------------------------
_SIM_MAPS: dict = {}
_SIM_MAPS_LOCK = threading.Lock()
_SIM_MAGIC = 0x7A3D  # bytes 8-9 of a simulated map (a real map's bytes there are the driver's)


def sim_register(view: np.ndarray, box: tuple) -> int:
    """Key of a simulated map over ``view`` (the tensor as the kernel indexes it, dims outermost first, any byte
    strides) with ``box`` (innermost first)."""
    with _SIM_MAPS_LOCK:
        key = len(_SIM_MAPS) + 1
        _SIM_MAPS[key] = (view, tuple(int(b) for b in box))
    return key


def _sim_map(tmap, tmap_offset, what):
    raw = _numpy_of(tmap).reshape(-1).view(np.uint8)
    off = int(tmap_offset)
    if off % TMAP_ALIGN or off < 0 or off + TMAP_BYTES > raw.size:
        raise ValueError(f"{what}: tensor map at byte {off} of {raw.size}: must be {TMAP_ALIGN}-byte aligned, inside")
    key, magic = int(raw[off:off + 8].view(np.int64)[0]), int(raw[off + 8:off + 10].view(np.uint16)[0])
    with _SIM_MAPS_LOCK:
        found = _SIM_MAPS.get(key) if magic == _SIM_MAGIC else None
    if found is None:
        raise RuntimeError(f"{what}: the bytes at {off} are not a simulated tensor map (blocks.tensor_maps)")
    return found


def _box_slices(view, box, coords, what):
    """(box-shaped destination slices, tensor slices) of the part of the box inside the tensor."""
    if len(coords) != view.ndim or len(box) != view.ndim:
        raise ValueError(f"{what}: {len(coords)} coordinates for a rank-{view.ndim} map")
    dst, src = [], []
    for c, b, n in zip(reversed(coords), reversed(box), view.shape):  # outermost first
        lo, hi = max(int(c), 0), min(int(c) + b, n)
        if hi <= lo:
            return None
        dst.append(slice(lo - int(c), hi - int(c)))
        src.append(slice(lo, hi))
    return tuple(dst), tuple(src)


def _swizzle_rows(rows):
    """Byte index of each (row, byte) of a box of rows x 128 B in its 128-byte-swizzled shared image."""
    r = np.arange(rows)[:, None]
    byte = np.arange(TMA_SWIZZLE_BYTES)[None, :]
    return r * TMA_SWIZZLE_BYTES + (((byte >> 4) ^ (r % 8)) << 4) + (byte & 15)


def _check_box(view, box, smem_offset_bytes, what):
    if box[0] * view.itemsize != TMA_SWIZZLE_BYTES:
        raise ValueError(f"{what}: a box row of {box[0] * view.itemsize} B; the 128-byte swizzle built here takes "
                         f"exactly {TMA_SWIZZLE_BYTES} B")
    if smem_offset_bytes % 1024:
        raise ValueError(f"{what}: shared address {smem_offset_bytes} is not 1024-byte aligned (the swizzle's atom)")


# --------------------------------------------------------------------------------------------
# cp.async.bulk.tensor loads (global -> shared, completing on an mbarrier) and stores (shared -> global)
# --------------------------------------------------------------------------------------------
def _make_tma_load_intrinsic(rank):
    coords = ", ".join(f"${3 + i}" for i in range(rank))
    text = (f"cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes "
            f"[$0], [$1, {{{coords}}}], [$2];")

    def typing(smem, smem_offset, tmap, tmap_offset, bar, bar_offset, cs):
        arrays = isinstance(smem, types.Array) and isinstance(tmap, types.Array) and isinstance(bar, types.Array)
        if not (arrays and _is_int(smem_offset, tmap_offset, bar_offset, *cs) and len(cs) == rank):
            return None
        sig = types.void(smem, smem_offset, tmap, tmap_offset, bar, bar_offset, *cs)

        def codegen(context, builder, sig, args):
            d = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            m = _element_pointer(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            b = _shared_address(context, builder, sig.args[4], args[4], sig.args[5], args[5])
            cv = [context.cast(builder, v, t, types.int32) for v, t in zip(args[6:], sig.args[6:])]
            _asm(builder, ir.VoidType(), [d, m, b, *cv], text, "r,l,r" + ",r" * rank + ",~{memory}", True)

        return sig, codegen

    if rank == 2:
        @intrinsic
        def load(typingctx, smem, smem_offset, tmap, tmap_offset, bar, bar_offset, c0, c1):
            return typing(smem, smem_offset, tmap, tmap_offset, bar, bar_offset, (c0, c1))
    elif rank == 3:
        @intrinsic
        def load(typingctx, smem, smem_offset, tmap, tmap_offset, bar, bar_offset, c0, c1, c2):
            return typing(smem, smem_offset, tmap, tmap_offset, bar, bar_offset, (c0, c1, c2))
    elif rank == 4:
        @intrinsic
        def load(typingctx, smem, smem_offset, tmap, tmap_offset, bar, bar_offset, c0, c1, c2, c3):
            return typing(smem, smem_offset, tmap, tmap_offset, bar, bar_offset, (c0, c1, c2, c3))
    else:
        @intrinsic
        def load(typingctx, smem, smem_offset, tmap, tmap_offset, bar, bar_offset, c0, c1, c2, c3, c4):
            return typing(smem, smem_offset, tmap, tmap_offset, bar, bar_offset, (c0, c1, c2, c3, c4))
    return load


def _make_tma_load_twin(rank):
    def load(smem, smem_offset, tmap, tmap_offset, bar, bar_offset, *coords):
        what = f"cp.async.bulk.tensor.{rank}d load"
        view, box = _sim_map(tmap, tmap_offset, what)
        if len(coords) != rank:
            raise ValueError(f"{what}: {len(coords)} coordinates")
        smem_np = _numpy_of(smem)
        start = int(smem_offset) * smem_np.itemsize
        _check_box(view, box, start, what)
        nbytes = int(np.prod(box)) * view.itemsize
        target = _flat_bytes(smem, smem_offset, nbytes, what + " dst")
        tile = np.zeros(tuple(reversed(box)), view.dtype)  # zeros outside the tensor
        found = _box_slices(view, box, coords, what)
        if found is not None:
            tile[found[0]] = view[found[1]]
        rows = nbytes // TMA_SWIZZLE_BYTES
        source = np.empty(nbytes, np.uint8)
        source[_swizzle_rows(rows).reshape(-1)] = np.ascontiguousarray(tile).reshape(-1).view(np.uint8)
        with _MBAR_LOCK:
            b = _mbarrier(bar, bar_offset, what)
            target[:] = _POISON
            b.copies.append((target, source))

    return load


def _make_tma_store_intrinsic(rank):
    coords = ", ".join(f"${2 + i}" for i in range(rank))
    text = f"cp.async.bulk.tensor.{rank}d.global.shared::cta.bulk_group [$0, {{{coords}}}], [$1];"

    def typing(tmap, tmap_offset, smem, smem_offset, cs):
        if not (isinstance(smem, types.Array) and isinstance(tmap, types.Array)):
            return None
        if not (_is_int(smem_offset, tmap_offset, *cs) and len(cs) == rank):
            return None
        sig = types.void(tmap, tmap_offset, smem, smem_offset, *cs)

        def codegen(context, builder, sig, args):
            m = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            s = _shared_address(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            cv = [context.cast(builder, v, t, types.int32) for v, t in zip(args[4:], sig.args[4:])]
            _asm(builder, ir.VoidType(), [m, s, *cv], text, "l,r" + ",r" * rank + ",~{memory}", True)

        return sig, codegen

    if rank == 2:
        @intrinsic
        def store(typingctx, tmap, tmap_offset, smem, smem_offset, c0, c1):
            return typing(tmap, tmap_offset, smem, smem_offset, (c0, c1))
    elif rank == 3:
        @intrinsic
        def store(typingctx, tmap, tmap_offset, smem, smem_offset, c0, c1, c2):
            return typing(tmap, tmap_offset, smem, smem_offset, (c0, c1, c2))
    elif rank == 4:
        @intrinsic
        def store(typingctx, tmap, tmap_offset, smem, smem_offset, c0, c1, c2, c3):
            return typing(tmap, tmap_offset, smem, smem_offset, (c0, c1, c2, c3))
    else:
        @intrinsic
        def store(typingctx, tmap, tmap_offset, smem, smem_offset, c0, c1, c2, c3, c4):
            return typing(tmap, tmap_offset, smem, smem_offset, (c0, c1, c2, c3, c4))
    return store


def _make_tma_store_twin(rank):
    def store(tmap, tmap_offset, smem, smem_offset, *coords):
        what = f"cp.async.bulk.tensor.{rank}d store"
        view, box = _sim_map(tmap, tmap_offset, what)
        if len(coords) != rank:
            raise ValueError(f"{what}: {len(coords)} coordinates")
        start = int(smem_offset) * _numpy_of(smem).itemsize
        _check_box(view, box, start, what)
        nbytes = int(np.prod(box)) * view.itemsize
        source = _flat_bytes(smem, smem_offset, nbytes, what + " src")
        found = _box_slices(view, box, coords, what)

        def land():  # the source is read here, at the wait that retires the group (a later overwrite races)
            image = source[_swizzle_rows(nbytes // TMA_SWIZZLE_BYTES).reshape(-1)].view(view.dtype)
            if found is not None:
                view[found[1]] = image.reshape(tuple(reversed(box)))[found[0]]

        _async_groups("bulk").open.append(land)

    return store


def _bulk_commit_twin():
    _async_groups("bulk").commit()


@functools.lru_cache(maxsize=None)
def tma_load(rank: int):
    """load(smem, smem_offset, tmap, tmap_byte_offset, bar, bar_offset, c0, .., c{rank-1}): the box at those
    coordinates (innermost first) into smem at element smem_offset (1024-byte aligned), its bytes completing
    the transaction of the mbarrier at (bar, bar_offset)."""
    if rank not in RANKS:
        raise ValueError(f"tma_load: rank {rank} not in {RANKS}")
    return pick(_make_tma_load_intrinsic(rank), _make_tma_load_twin(rank))


@functools.lru_cache(maxsize=None)
def tma_store(rank: int):
    """store(tmap, tmap_byte_offset, smem, smem_offset, c0, .., c{rank-1}): the box from smem (128-byte swizzled)
    to the tensor at those coordinates, in the thread's open bulk group (bulk_commit, bulk_wait_read)."""
    if rank not in RANKS:
        raise ValueError(f"tma_store: rank {rank} not in {RANKS}")
    return pick(_make_tma_store_intrinsic(rank), _make_tma_store_twin(rank))


@functools.lru_cache(maxsize=None)
def bulk_wait_read(pending: int):
    """cp.async.bulk.wait_group.read pending: the shared sources of all but the newest ``pending`` bulk groups are
    read (their shared memory may be written again)."""
    def twin():
        _async_groups("bulk").retire(int(pending))

    return pick(_make_plain_asm_intrinsic(f"cp.async.bulk.wait_group.read {int(pending)};"), twin)


bulk_commit = pick(_make_plain_asm_intrinsic("cp.async.bulk.commit_group;"), _bulk_commit_twin)


@intrinsic
def _prefetch_tensormap_intrinsic(typingctx, tmap, tmap_offset):
    if not (isinstance(tmap, types.Array) and _is_int(tmap_offset)):
        return None
    sig = types.void(tmap, tmap_offset)

    def codegen(context, builder, sig, args):
        m = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        _asm(builder, ir.VoidType(), [m], "prefetch.tensormap [$0];", "l,~{memory}", True)

    return sig, codegen


def _prefetch_tensormap_twin(tmap, tmap_offset):
    _sim_map(tmap, tmap_offset, "prefetch.tensormap")


prefetch_tensormap = pick(_prefetch_tensormap_intrinsic, _prefetch_tensormap_twin)


# --------------------------------------------------------------------------------------------
# mbarrier.arrive (a consumer's "slot free"): one arrival, no transaction bytes
# --------------------------------------------------------------------------------------------
@intrinsic
def _mbarrier_arrive_intrinsic(typingctx, bar, bar_offset):
    if not (isinstance(bar, types.Array) and _is_int(bar_offset)):
        return None
    sig = types.void(bar, bar_offset)

    def codegen(context, builder, sig, args):
        a = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        text = "{\n\t.reg .b64 %mbar_state;\n\tmbarrier.arrive.shared::cta.b64 %mbar_state, [$0];\n\t}"
        _asm(builder, ir.VoidType(), [a], text, "r,~{memory}", True)

    return sig, codegen


def _mbarrier_arrive_twin(bar, bar_offset):
    with _MBAR_LOCK:
        b = _mbarrier(bar, bar_offset, "mbarrier.arrive")
        if b.pending == 0:
            raise RuntimeError("mbarrier.arrive: more arrivals than the barrier's count")
        b.pending -= 1
        b._advance()


mbarrier_arrive = pick(_mbarrier_arrive_intrinsic, _mbarrier_arrive_twin)


# --------------------------------------------------------------------------------------------
# Named barriers (bar.sync / bar.arrive id, n): barrier 0 is __syncthreads'; ids 1-15 order warpgroups
# --------------------------------------------------------------------------------------------
class _NamedBarrier:
    def __init__(self):
        self.cond = threading.Condition()
        self.arrived = 0
        self.generation = 0
        self.n = None


def _named_barrier(barrier_id, n, what):
    manager = threading.current_thread()._manager
    block = manager._block_dim
    if n % 32 or n <= 0 or n > block[0] * block[1] * block[2]:
        raise ValueError(f"{what} {barrier_id}, {n}: n must be a positive multiple of 32 up to the block's threads")
    with _slots_lock:
        bars = manager.__dict__.setdefault("_ptx_named_barriers", {})
        bar = bars.get(barrier_id)
        if bar is None:
            bar = bars[barrier_id] = _NamedBarrier()
    return bar


def _named_arrive(bar, barrier_id, n, what):
    """Count one thread in; returns the generation it arrived in (the barrier completes at n threads)."""
    if bar.n not in (None, n):
        raise RuntimeError(f"{what} {barrier_id}: thread counts {bar.n} and {n} in one phase")
    bar.n = n
    generation = bar.generation
    bar.arrived += 1
    if bar.arrived == n:
        bar.arrived, bar.n = 0, None
        bar.generation += 1
        bar.cond.notify_all()
    return generation


def _make_named_barrier_twin(barrier_id, n, wait):
    what = "bar.sync" if wait else "bar.arrive"

    def twin():
        bar = _named_barrier(barrier_id, n, what)
        thread = threading.current_thread()
        with bar.cond:
            generation = _named_arrive(bar, barrier_id, n, what)
            while wait and bar.generation == generation:
                bar.cond.wait(timeout=0.05)
                if getattr(thread, "abort", False):
                    raise RuntimeError(f"{what} {barrier_id}, {n}: block aborted while waiting")

    return twin


def _check_named(barrier_id, n):
    if not (isinstance(barrier_id, int) and 1 <= barrier_id <= 15 and isinstance(n, int) and n > 0 and n % 32 == 0):
        raise ValueError(f"named barrier id={barrier_id!r}, n={n!r}: id in 1..15 (0 is __syncthreads'), n a positive "
                         "multiple of 32")


@functools.lru_cache(maxsize=None)
def named_barrier_sync(barrier_id: int, n: int):
    """bar.sync id, n: wait until n threads (whole warps) have arrived at barrier id (1..15)."""
    _check_named(barrier_id, n)
    return pick(_make_plain_asm_intrinsic(f"bar.sync {barrier_id}, {n};"), _make_named_barrier_twin(barrier_id, n, True))


@functools.lru_cache(maxsize=None)
def named_barrier_arrive(barrier_id: int, n: int):
    """bar.arrive id, n: count this thread's warp in at barrier id without waiting."""
    _check_named(barrier_id, n)
    return pick(_make_plain_asm_intrinsic(f"bar.arrive {barrier_id}, {n};"),
                _make_named_barrier_twin(barrier_id, n, False))


# --------------------------------------------------------------------------------------------
# setmaxnreg: a warpgroup gives registers back (dec) or takes them (inc); every warp of it executes it
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def setmaxnreg(count: int, inc: bool):
    """setmaxnreg.{inc,dec}.sync.aligned.u32 count (24..256, a multiple of 8); the twin only checks the count."""
    if not (isinstance(count, int) and 24 <= count <= 256 and count % 8 == 0):
        raise ValueError(f"setmaxnreg {count!r}: a multiple of 8 in 24..256")
    return pick(_make_plain_asm_intrinsic(f"setmaxnreg.{'inc' if inc else 'dec'}.sync.aligned.u32 {count};"),
                lambda: None)
