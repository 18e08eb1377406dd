"""Entry points of the forward and of the backward's dK/dV kernels, and the host side of the dQ-in-dkdv launches.

Every forward family with mods (mma.sync, SIMT) writes one ``forward_body(q, k, v, out, lse, n_q, n_k, d, group,
scale_log2, left, right, cap_a, cap_b, slopes, inv_scale)`` and gets its kernel from ``forward_entry``.

Every dK/dV family (mma.sync, wgmma, 3xTF32) writes one ``dkdv_body(q, k, v, dout, l2, dd, dk, dv, dq_acc,
n_q, n_k, d, group, scale_log2, scale, kb[, first])`` for key block ``kb`` and gets its kernels from
``dkdv_entry``: the plain build (no dQ), the atomic grid's (every block adds into one plane) and the
deterministic splits' (key block kb0 + blockIdx.x into plane blockIdx.x). ``kernel_signature`` types them,
``launch_dq_in_dkdv`` launches the last two.

``varlen_entry`` turns any of those entries into its varlen (packed sequences) form: the kernel takes
cu_seqlens_q and cu_seqlens_k too, finds its block's sequence, and runs the dense entry with that sequence's
lengths and first rows (``with_row_bases``), so the bodies (their masks, mods and schedules) are the dense ones.
"""
from __future__ import annotations

import inspect
import types as pytypes

from numba import cuda, float32, int32, types

from ..launch import address
from ..ptx import inline_device
from ..launch import launch as launch_kernel


MOD_ARGS = (int32, int32, float32, float32, types.Array(types.float32, 2, "A"), float32)  # blocks/mods.py's
VARLEN_ARGS = (types.Array(types.int32, 1, "A"), types.Array(types.int32, 1, "A"))  # cu_seqlens_q, cu_seqlens_k


def kernel_signature(kernel: str, atomic_dq: bool = False, dq_splits: bool = False, io=types.uint16,
                     mods: bool = False, varlen: bool = False, aux: tuple = ()):
    """dkdv(q, k, v, do, l2, dd, dk, dv[, dq_acc], ...[, kb0, plane_rows]) / dq(q, k, v, do, l2, dd, dq, ...):
    io elements (16-bit words, or float32 for the 3xTF32 kernels); dq_acc (planes·B·H, NQ_PAD, HEAD_DIM) fp32
    when dkdv also adds up dQ (atomic_dq). mods: a build with a window, softcap or ALiBi also takes MOD_ARGS
    (left, right, cap_a, cap_b, slopes, 1 / scale) after scale (before a splits build's kb0, plane_rows);
    varlen: cu_seqlens_q and cu_seqlens_k last (varlen_entry); aux: the user mods' aux arrays' Numba types
    (blocks.mods.user_aux_types), last (user_entry)."""
    io = types.Array(io, 4, "A")
    rows = types.Array(types.float32, 2, "A")
    grads = (io, io) if kernel == "dkdv" else (io,)
    if atomic_dq:
        grads += (types.Array(types.float32, 3, "A"),)
    tail = (int32, int32) if dq_splits else ()  # kb0, plane_rows (the deterministic splits' launches)
    if mods:
        tail = MOD_ARGS + tail
    if varlen:
        tail += VARLEN_ARGS
    tail += tuple(aux)
    return types.void(io, io, io, io, rows, rows, *grads, int32, int32, int32, int32, float32, float32, *tail)


def forward_signature(mods: bool = False, varlen: bool = False, aux: tuple = ()):
    """The 16-bit forward kernels' signature (mma_forward, wgmma_forward): q, k, v, out as 16-bit words (any
    strides, last dim unit), lse float32, n_q, n_k, d, group, scale_log2; with mods MOD_ARGS, then the user mods'
    aux arrays (``aux``: their Numba types, blocks.mods.user_aux_types); varlen VARLEN_ARGS."""
    io = types.Array(types.uint16, 4, "A")
    lse = types.Array(types.float32, 3, "A")
    tail = (MOD_ARGS if mods else ()) + tuple(aux) + (VARLEN_ARGS if varlen else ())
    return types.void(io, io, io, io, lse, int32, int32, int32, int32, float32, *tail)


def forward_grid(tile, n_bh: int, q_tiles: int):
    """(grid, tile) of a forward launch: (B·H, Q tiles) with grid_bh_x, else (Q tiles, B·H). grid_bh_x is dropped
    (the other grid runs the same maths) where the Q tiles pass the y axis's 65535 and B·H does not; ValueError
    where neither fits."""
    grid_bh_x = tile.has("grid_bh_x")
    if grid_bh_x and q_tiles > 65535 >= n_bh:
        grid_bh_x = False
        tile = tile.with_(flags=tile.flags - {"grid_bh_x"})
    if (q_tiles if grid_bh_x else n_bh) > 65535:
        raise ValueError(f"{'Q tiles' if grid_bh_x else 'B*H'} = {q_tiles if grid_bh_x else n_bh} exceeds the "
                         "grid's y limit of 65535")
    return ((n_bh, q_tiles) if grid_bh_x else (q_tiles, n_bh)), tile


def _at_home(fn, home: dict, name: str):
    """fn with the kernel module's globals: the simulator swaps ``cuda`` in the globals of the kernel it runs,
    and the body it calls reads ``cuda`` from its own module's."""
    out = pytypes.FunctionType(fn.__code__, home, name, fn.__defaults__, fn.__closure__)
    out.__qualname__ = name
    return out


def forward_entry(body, home: dict, name: str, mods: bool, slopes_stand_in: str = "lse", varlen: bool = False,
                  block_q: int = 0, grid_bh_x: bool = False, user_aux: int = -1):
    """The forward kernel (before cuda.jit) that runs ``body``, named ``name`` (``name + "_mods"`` with mods) in
    module ``home``. mods: it takes MOD_ARGS after scale_log2 and passes them on. Without: the body gets constants
    for them, which its pruned branches never read; slopes_stand_in says what array stands in for the slopes:
    "lse" itself, or "lse[0]" (its first plane: the SIMT body's slope indexing is typed on a 2-D array).
    varlen: the packed-sequences form (varlen_entry; body takes q_base, k_base last), its Q tiles of block_q rows
    in the grid order grid_bh_x says. user_aux >= 0: a build with user mods (blocks/mods.py), named
    ``name + "_user"``: MOD_ARGS, then that many aux arrays, which the body gets as one tuple, its last parameter ``aux``
    (after q_base, k_base = 0, 0)."""
    if user_aux >= 0:
        if varlen:
            raise ValueError("forward_entry: user mods have no varlen build")
        aux = [f"aux{i}" for i in range(user_aux)]
        src = (f"def make(body):\n"
               f"    def kernel(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, left, right, cap_a, cap_b, slopes, "
               f"inv_scale{''.join(', ' + a for a in aux)}):\n"
               f"        body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, left, right, cap_a, cap_b, slopes, "
               f"inv_scale, 0, 0, ({''.join(a + ', ' for a in aux)}))\n"
               f"    return kernel\n")
        scope: dict = {}
        exec(compile(src, f"<forward_entry {name}_user>", "exec"), scope)  # one parameter per aux array
        return _at_home(scope["make"](body), home, name + "_user")
    if varlen:
        kernel = forward_entry(with_row_bases(body, home), home, name, mods, slopes_stand_in)
        return varlen_entry(kernel, home, *varlen_rules("q_tiles", block_q, grid_bh_x))
    zero = float32(0.0)
    if mods:
        def kernel(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, left, right, cap_a, cap_b, slopes, inv_scale):
            body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, left, right, cap_a, cap_b, slopes, inv_scale)
        return _at_home(kernel, home, name + "_mods")
    if slopes_stand_in == "lse":
        def kernel(q, k, v, out, lse, n_q, n_k, d, group, scale_log2):
            body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, 0, 0, zero, zero, lse, zero)
    elif slopes_stand_in == "lse[0]":
        def kernel(q, k, v, out, lse, n_q, n_k, d, group, scale_log2):
            body(q, k, v, out, lse, n_q, n_k, d, group, scale_log2, 0, 0, zero, zero, lse[0], zero)
    else:
        raise ValueError(f"forward_entry: slopes_stand_in {slopes_stand_in!r}; accepted 'lse' or 'lse[0]'")
    return _at_home(kernel, home, name)


def maps_entry(body, home: dict, name: str, mods: bool, user_aux: int = -1, varlen: bool = False, block_q: int = 0,
               grid_bh_x: bool = False):
    """The kernel (before cuda.jit) of a forward that reads q, k and v through TMA maps (kernels/wgmma_ws_forward.py),
    named ``name`` (``name + "_mods"`` with mods, ``name + "_user"`` with user mods) in module ``home``:
    (maps, out, lse, n_heads, n_q, n_k, d, group, scale_log2), then MOD_ARGS with mods, then user_aux aux arrays
    (user_aux >= 0), which ``body`` gets as one tuple, its parameter ``aux``. Without mods the body gets constants
    for MOD_ARGS (lse stands in for the slopes), which its pruned branches never read.

    varlen: the packed-sequences form (``name + "_varlen"``), VARLEN_ARGS last. The block finds its sequence b
    from blockIdx as varlen_rules("q_tiles", block_q, grid_bh_x) says (heads = out.shape[1]), returns at once
    where its Q tile lies past the sequence, and runs the body with the sequence's lengths for n_q and n_k and
    its first rows as the body's q_base, k_base (parameters after aux)."""
    lead = "maps, out, lse, n_heads, n_q, n_k, d, group, scale_log2"
    if varlen:
        if user_aux >= 0:
            raise ValueError("maps_entry: user mods have no varlen build")
        sequence, outside = varlen_rules("q_tiles", block_q, grid_bh_x)
        mod_params = ", left, right, cap_a, cap_b, slopes, inv_scale" if mods else ""
        mod_call = mod_params if mods else ", 0, 0, zero, zero, lse, zero"
        src = (f"def make(body, zero, sequence, outside, int32):\n"
               f"    def kernel({lead}{mod_params}, cu_q, cu_k):\n"
               f"        b = sequence(out)\n"
               f"        q_base = cu_q[b]\n"
               f"        k_base = cu_k[b]\n"
               f"        n_q_b = int32(cu_q[b + 1] - q_base)\n"
               f"        n_k_b = int32(cu_k[b + 1] - k_base)\n"
               f"        if outside(n_q_b, n_k_b, 0):\n"
               f"            return\n"
               f"        body(maps, out, lse, n_heads, n_q_b, n_k_b, d, group, scale_log2{mod_call}, (), q_base, k_base)\n"
               f"    return kernel\n")
        scope: dict = {}
        exec(compile(src, f"<maps_entry {name}_varlen>", "exec"), scope)
        suffix = ("_mods" if mods else "") + "_varlen"
        return _at_home(scope["make"](body, float32(0.0), sequence, outside, int32), home, name + suffix)
    if user_aux >= 0:
        aux = [f"aux{i}" for i in range(user_aux)]
        params = lead + ", left, right, cap_a, cap_b, slopes, inv_scale" + "".join(", " + a for a in aux)
        call = lead + ", left, right, cap_a, cap_b, slopes, inv_scale, (" + "".join(a + ", " for a in aux) + ")"
        suffix = "_user"
    elif mods:
        params = call = lead + ", left, right, cap_a, cap_b, slopes, inv_scale"
        suffix = "_mods"
    else:
        params, call, suffix = lead, lead + ", 0, 0, zero, zero, lse, zero", ""
    src = f"def make(body, zero):\n    def kernel({params}):\n        body({call})\n    return kernel\n"
    scope: dict = {}
    exec(compile(src, f"<maps_entry {name}{suffix}>", "exec"), scope)  # one parameter per aux array
    return _at_home(scope["make"](body, float32(0.0)), home, name + suffix)


def dkdv_entry(body, home: dict, name: str, atomic_dq: bool, dq_splits: int = 0, first: bool = True,
               stand_in: str = "l2", mods: bool = False, varlen_block_n: int = 0):
    """The kernel (before cuda.jit) that runs ``body`` for its block, named ``name`` in module ``home``
    (the caller's globals()). atomic_dq False: dq_acc is never touched and ``stand_in`` ("l2" or "dk") takes
    its place. atomic_dq with dq_splits 0: every block adds into one plane (the order of the adds, hence the
    last bits, vary). dq_splits 1 / 2: the deterministic splits' builds taking kb0 and plane_rows after scale:
    key block kb0 + blockIdx.x, dQ into plane blockIdx.x (plane_rows = B·H rows of dq_acc each); 2 is the first
    launch's build, which stores (nobody zeroes the planes; as a runtime branch the choice cost 24 instructions
    per step). A launch's blocks own one plane each and the launches follow each other on one stream, so each dQ
    element of a plane gets its adds from one lane, launch after launch: the same sums every run. The plane is
    a view (its own base address): as a row offset it cost 40 B of spills. first: whether body takes the
    store-or-add flag as its last argument. mods: the kernel also takes blocks/mods.py's launch arguments
    (MOD_ARGS) and passes them on after the flag; its splits build only adds (dq_splits 1: a window's key
    blocks do not cover their plane's rows from its first on, so the planes are zeroed and no launch stores).
    varlen_block_n > 0: the packed-sequences form (varlen_entry; body takes q_base, k_base last), key blocks of
    that many keys."""
    if varlen_block_n:
        kernel = dkdv_entry(with_row_bases(body, home), home, name, atomic_dq, dq_splits, first, stand_in, mods)
        return varlen_entry(kernel, home, *varlen_rules("key_blocks", varlen_block_n), seq_of="k")
    FIRST_STORES = dq_splits == 2  # a compile-time constant: the other build's stores are pruned
    if mods and (dq_splits == 2 or not first):
        raise ValueError("dkdv_entry: a build with mods adds into zeroed planes (no storing build) and takes a body "
                         "with the store-or-add flag")
    if mods and atomic_dq and dq_splits:
        def kernel(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, left, right, cap_a,
                   cap_b, slopes, inv_scale, kb0, plane_rows):
            body(q, k, v, dout, l2, dd, dk, dv, dq_acc[cuda.blockIdx.x * plane_rows:], n_q, n_k, d, group,
                 scale_log2, scale, kb0 + cuda.blockIdx.x, False, left, right, cap_a, cap_b, slopes, inv_scale)
    elif mods and atomic_dq:
        def kernel(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, left, right, cap_a,
                   cap_b, slopes, inv_scale):
            body(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, cuda.blockIdx.x,
                 False, left, right, cap_a, cap_b, slopes, inv_scale)
    elif mods:
        def kernel(q, k, v, dout, l2, dd, dk, dv, n_q, n_k, d, group, scale_log2, scale, left, right, cap_a, cap_b,
                   slopes, inv_scale):
            body(q, k, v, dout, l2, dd, dk, dv, l2, n_q, n_k, d, group, scale_log2, scale, cuda.blockIdx.x, False,
                 left, right, cap_a, cap_b, slopes, inv_scale)
    elif atomic_dq and dq_splits and first:
        def kernel(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, kb0, plane_rows):
            body(q, k, v, dout, l2, dd, dk, dv, dq_acc[cuda.blockIdx.x * plane_rows:], n_q, n_k, d, group,
                 scale_log2, scale, kb0 + cuda.blockIdx.x, FIRST_STORES)
    elif atomic_dq and dq_splits:
        def kernel(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, kb0, plane_rows):
            body(q, k, v, dout, l2, dd, dk, dv, dq_acc[cuda.blockIdx.x * plane_rows:], n_q, n_k, d, group,
                 scale_log2, scale, kb0 + cuda.blockIdx.x)
    elif atomic_dq and first:
        def kernel(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale):
            body(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, cuda.blockIdx.x,
                 False)
    elif atomic_dq:
        def kernel(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale):
            body(q, k, v, dout, l2, dd, dk, dv, dq_acc, n_q, n_k, d, group, scale_log2, scale, cuda.blockIdx.x)
    elif first and stand_in == "l2":
        def kernel(q, k, v, dout, l2, dd, dk, dv, n_q, n_k, d, group, scale_log2, scale):
            body(q, k, v, dout, l2, dd, dk, dv, l2, n_q, n_k, d, group, scale_log2, scale, cuda.blockIdx.x, False)
    elif stand_in == "dk" and not first:
        def kernel(q, k, v, dout, l2, dd, dk, dv, n_q, n_k, d, group, scale_log2, scale):
            body(q, k, v, dout, l2, dd, dk, dv, dk, n_q, n_k, d, group, scale_log2, scale, cuda.blockIdx.x)
    else:
        raise ValueError(f"no plain dkdv entry with first={first}, stand_in={stand_in!r}")
    return _at_home(kernel, home, name)


def user_entry(body, home: dict, name: str, params: str, call: str, n_aux: int):
    """The kernel (before cuda.jit) of a backward build with user mods (blocks/mods.py), named ``name + "_user"``:
    ``params`` (its parameters before the aux arrays, as source text), then n_aux aux arrays, running
    ``body(call, (aux0, ...))``: the body takes the aux arrays as one tuple, its last parameter ``aux``."""
    aux = [f"aux{i}" for i in range(n_aux)]
    src = (f"def make(body):\n"
           f"    def kernel({params}{''.join(', ' + a for a in aux)}):\n"
           f"        body({call}, ({''.join(a + ', ' for a in aux)}))\n"
           f"    return kernel\n")
    scope: dict = {}
    exec(compile(src, f"<user_entry {name}>", "exec"), scope)  # one parameter per aux array
    return _at_home(scope["make"](body), home, name + "_user")


def dkdv_user_entry(body, home: dict, name: str, atomic_dq: bool, dq_splits: int, n_aux: int):
    """dkdv_entry's mods builds (the plain, the atomic grid's, the splits' adding one) with user mods: the same
    parameters, then the aux arrays (user_entry; the splits' kb0, plane_rows before them)."""
    if dq_splits == 2:
        raise ValueError("dkdv_user_entry: a build with mods adds into zeroed planes (no storing build)")
    mods = "left, right, cap_a, cap_b, slopes, inv_scale"
    params = (f"q, k, v, dout, l2, dd, dk, dv{', dq_acc' if atomic_dq else ''}, n_q, n_k, d, group, scale_log2, "
              f"scale, {mods}{', kb0, plane_rows' if dq_splits else ''}")
    acc = ("dq_acc[cuda.blockIdx.x * plane_rows:]" if dq_splits else "dq_acc") if atomic_dq else "l2"
    kb = "kb0 + cuda.blockIdx.x" if dq_splits else "cuda.blockIdx.x"
    call = (f"q, k, v, dout, l2, dd, dk, dv, {acc}, n_q, n_k, d, group, scale_log2, scale, {kb}, False, {mods}, "
            "0, 0")
    return user_entry(body, home, name, params, call, n_aux)


def varlen_key(varlen: bool) -> tuple:
    """What a varlen build adds to its cache key (nothing for the dense builds: their keys stay as they were)."""
    return ("varlen",) if varlen else ()


def varlen_rules(tiles: str, block: int = 0, grid_bh_x: bool = False):
    """(sequence, outside) for varlen_entry. sequence(x): b from blockIdx.y = b·heads + h (blockIdx.x with
    grid_bh_x), heads = x.shape[1]. outside(n_q, n_k, kb0) by what blockIdx.x (.y with grid_bh_x) counts:
    "q_tiles" (of ``block`` rows, the heaviest first: the forward's and the dq kernel's order) past n_q,
    "key_blocks" (kb0 + blockIdx.x, of ``block`` keys) past n_k, or "rows" (never: prep and convert write
    every padded row)."""
    if tiles not in ("q_tiles", "key_blocks", "rows"):
        raise ValueError(f"varlen_rules: tiles {tiles!r}; accepted 'q_tiles', 'key_blocks', 'rows'")
    Q_TILES, KEY_BLOCKS, BH_X = tiles == "q_tiles", tiles == "key_blocks", bool(grid_bh_x)

    @cuda.jit(device=True, inline=True)  # cuda.jit: the simulator runs it with this module's fake cuda
    def sequence(x):
        return (cuda.blockIdx.x if BH_X else cuda.blockIdx.y) // x.shape[1]

    @cuda.jit(device=True, inline=True)
    def outside(n_q, n_k, kb0):
        if Q_TILES:
            q_tile = cuda.gridDim.y - 1 - cuda.blockIdx.y if BH_X else cuda.gridDim.x - 1 - cuda.blockIdx.x
            return q_tile * block >= n_q
        if KEY_BLOCKS:
            return (kb0 + cuda.blockIdx.x) * block >= n_k
        return False

    return sequence, outside


def with_row_bases(body, home: dict):
    """body (which takes q_base, k_base last, with defaults 0) as a body whose n_q and n_k arrive as pairs
    (length, first row) from varlen_entry through an unchanged dense entry, which only forwards them."""
    params = [p for p in inspect.signature(body).parameters.values() if p.name != "aux"]  # user mods: not varlen
    names = [p.name for p in params[:-2]]
    if "n_q" not in names or "n_k" not in names or [p.name for p in params[-2:]] != ["q_base", "k_base"]:
        raise ValueError(f"with_row_bases: {body.__name__} needs n_q, n_k and q_base, k_base last; it has {names}")
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    head = ", ".join(f"{n}=d_{n}" if n in defaults else n for n in names)
    call = ", ".join({"n_q": "n_q[0]", "n_k": "n_k[0]"}.get(n, n) for n in names)
    src = (f"def make(body, {', '.join('d_' + n for n in defaults) or '_'}):\n"
           f"    def {body.__name__}_rows({head}):\n"
           f"        body({call}, n_q[1], n_k[1])\n"
           f"    return {body.__name__}_rows\n")
    scope: dict = {}
    exec(compile(src, f"<with_row_bases {body.__name__}>", "exec"), scope)  # the parameter list is the body's
    made = scope["make"](body, *(defaults.values() or (None,)))
    return inline_device(_at_home(made, home, made.__name__))


def varlen_entry(kernel, home: dict, sequence, outside, seq_of: str | None = None, slice_rows: tuple | None = None):
    """The varlen form of a dense entry ``kernel`` (before cuda.jit): the same parameters, then cu_seqlens_q and
    cu_seqlens_k (int32, B + 1).

    The host passes packed arrays as (B, H, total, d) views whose batch stride is 0, and scratch rows as for a
    dense batch of B sequences of the longest length (the grids too). The block finds its sequence
    b = ``sequence(x)``, x the parameter named seq_of (default the first), from blockIdx as the body does (the
    body's own b then indexes only per-sequence things: the scratch rows and the ALiBi slopes), reads its rows
    cu_q[b] .. cu_q[b + 1] - 1 and keys cu_k[b] .. cu_k[b + 1] - 1, and returns at once where
    ``outside(n_q, n_k, kb0)`` (its tile lies past the sequence: kb0 is the splits' first key block, else 0).
    Else it runs ``kernel`` with the sequence's lengths for n_q and n_k, causal, windows and mods then
    aligning per sequence, and its first rows one of two ways:

    * slice_rows None: n_q and n_k go in as pairs (length, first row), for an entry whose body is
      ``with_row_bases``' (the body adds the first rows to its own offsets and stores, addressing the
      kernel's own arrays as the dense build does);
    * slice_rows (q_rows, k_rows): the parameters named there are viewed from the sequence's first query
      (key) row on (prep and convert: short kernels with registers to spare)."""
    code = kernel.__code__
    params = code.co_varnames[:code.co_argcount]
    seq_of = seq_of or params[0]
    q_rows, k_rows = slice_rows or ((), ())
    missing = [n for n in (*q_rows, *k_rows, "n_q", seq_of) if n not in params]
    if missing:
        raise ValueError(f"varlen_entry: {kernel.__name__} has no parameters {missing} (it has {params})")
    lengths = {"n_q": "n_q_b", "n_k": "n_k_b"} if slice_rows else {"n_q": "(n_q_b, q_base)", "n_k": "(n_k_b, k_base)"}

    def arg(n):
        if n in q_rows:
            return f"{n}[:, :, q_base:]"
        if n in k_rows:
            return f"{n}[:, :, k_base:]"
        return lengths.get(n, n)

    # the lengths as int32, as the dense kernels take them (int32 - int32 is int64 in Numba; ptxas -v, the d128
    # causal forward: 44 B spilled instead of 48)
    src = (f"def make(inner, sequence, outside, int32):\n"
           f"    def {kernel.__name__}_varlen({', '.join(params)}, cu_q, cu_k):\n"
           f"        b = sequence({seq_of})\n"
           f"        q_base = cu_q[b]\n"
           f"        k_base = cu_k[b]\n"
           f"        n_q_b = int32(cu_q[b + 1] - q_base)\n"
           f"        n_k_b = int32(cu_k[b + 1] - k_base)\n"
           f"        if outside(n_q_b, n_k_b, {'kb0' if 'kb0' in params else '0'}):\n"
           f"            return\n"
           f"        inner({', '.join(arg(n) for n in params)})\n"
           f"    return {kernel.__name__}_varlen\n")
    scope: dict = {}
    exec(compile(src, f"<varlen_entry {kernel.__name__}>", "exec"), scope)  # the parameter list is the kernel's
    inner = inline_device(_at_home(kernel, home, kernel.__name__))
    made = scope["make"](inner, sequence, outside, int32)
    return _at_home(made, home, made.__name__)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------
def rows16(x) -> bool:
    """Unit-stride rows, other strides multiples of 16 B, 16-byte aligned data: 16-byte vector access."""
    return x.strides[-1] == x.dtype.itemsize and all(st % 16 == 0 for st in x.strides[:-1]) and address(x) % 16 == 0


def check_dq_acc(dq_acc, dq_splits, n_bh, nq_pad, head_dim, n_kb):
    """ValueError unless dq_acc is the C-contiguous fp32 scratch of (dq_splits or 1) planes of n_bh heads,
    nq_pad rows and head_dim columns, and 1 <= dq_splits <= n_kb key blocks (or None)."""
    planes = dq_splits or 1
    if (tuple(dq_acc.shape) != (planes * n_bh, nq_pad, head_dim)
            or tuple(dq_acc.strides) != (nq_pad * head_dim * 4, head_dim * 4, 4)):
        raise ValueError(f"dq_acc has shape {tuple(dq_acc.shape)}, strides {tuple(dq_acc.strides)}; dq_splits="
                         f"{dq_splits} needs a C-contiguous fp32 array of shape ({planes * n_bh}, {nq_pad}, "
                         f"{head_dim}) (planes of B·H = {n_bh} heads, padded rows, HEAD_DIM)")
    if dq_splits is not None and not 1 <= dq_splits <= n_kb:
        raise ValueError(f"dq_splits={dq_splits}: 1 <= dq_splits <= {n_kb} key blocks")


def launch_dq_in_dkdv(build, grid_y, threads, smem, stream, args, scalars, n_kb, dq_splits, plane_rows,
                      zeroed=False, tail=()):
    """The launches of a dkdv kernel that also forms dQ; build(splits) -> its kernel (0: the atomic grid's
    build; 1 / 2: the deterministic splits' adding / storing builds). dq_splits None: one launch of every key
    block, all adding into one plane. Else a launch per dq_splits key blocks, block x of each into plane x:
    stream order orders the adds; the first launch stores, since nobody zeroed the planes (zeroed: the
    caller did, and every launch adds). tail: the varlen builds' last arguments (varlen_entry)."""
    if dq_splits is None:
        launch_kernel(build(0), (n_kb, grid_y), threads, stream, smem, *args, *scalars, *tail)
        return
    for kb0 in range(0, n_kb, dq_splits):
        launch_kernel(build(2 if kb0 == 0 and not zeroed else 1), (min(dq_splits, n_kb - kb0), grid_y), threads,
                      stream, smem, *args, *scalars, kb0, plane_rows, *tail)

