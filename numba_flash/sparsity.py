"""Block sparsity of a user mask (FlexAttention's BlockMask idea): one class per (b, h, query tile, key tile).

``block_mask(mask_mod, B, H, n_q, n_k, block_q, block_k)`` runs the user's mask_mod on every score once, in a
small kernel (one thread block per tile, the mask's aux arrays as launch arguments, the same device call the
forwards inline), and classes each tile: EMPTY (no visible score: a forward never loads it), FULL (every score
visible: no per-score mask call) or PARTIAL. The mask alone decides the class: causal / window and the key
range are the forward's own masks, applied on top. Per query tile it compacts the visible key tiles in order
(kv_num_blocks, kv_indices, then -1) and, of those, the FULL ones (full_kv_num_blocks, full_kv_indices), the
layout of FlexAttention's BlockMask. It agrees with ``reference.block_mask``.

The result is a host-side object the caller builds once and reuses for every call with the same mask, sizes
and tile (``BlockMask.check`` says what differs). ``forward(..., block_mask=bm)`` walks it: the tensor-core
forwards visit only the listed key tiles of each query tile and call the mask_mod only on PARTIAL ones
(blocks/sparsity.py); the BlockMask carries its mask_mod (FlexAttention's flex_attention(q, k, v, score_mod,
block_mask)), and must be built at the forward's tile (``forward_tile`` names it). Its cost is one mask_mod call per score (B·H·Nq·Nk) and a
launch: a forward's own cost in mask calls, so it is not built behind the caller's back on every call and not
cached on the aux arrays' pointers (their contents may change under the same pointer).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import config as nb_config
from numba import cuda, int8, int32, types

from . import arrays, launch
from .api import aux_views
from .blocks.mods import UserMod
from .blocks.sparsity import host_lists
from .mods import MaskMod, as_mask_mod

EMPTY, PARTIAL, FULL = 0, 1, 2  # reference.block_mask's classes
CLASS_NAMES = ("EMPTY", "PARTIAL", "FULL")
THREADS = 128  # per tile; the simulator's blocks use 32 (a thread each is a Python thread there)


@functools.lru_cache(maxsize=32)
def _classify_kernel(spec: UserMod):
    """The compiled classify kernel of the mask ``spec`` (eager, one signature; the simulator's dispatcher)."""
    fn, sig = classify_source(spec)
    return cuda.jit(fn) if nb_config.ENABLE_CUDASIM else cuda.jit(sig)(fn)


def classify_source(spec: UserMod):
    """(Python kernel, signature): classes[b, h, a, c] of the mask ``spec`` (grid: (Q tiles · K tiles, B·H)); every thread of the block
    strides over the tile's in-range scores, then the block votes (bar.red.or / .and)."""
    mask_call = spec.device_call()
    aux_types = spec.numba_aux_types()
    sig = (types.Array(types.int8, 4, "A"), int32, int32, int32, int32, int32) + aux_types
    names = "".join(f", x{i}" for i in range(len(aux_types)))
    aux = f"({names[2:]}{',' if len(aux_types) == 1 else ''})"
    # one source, the kernel itself (the simulator swaps cuda's thread indices into a kernel's globals only)
    src = f"""def classify(classes, n_q, n_k, block_q, block_k, n_kb{names}):
    aux = {aux}
    n_heads = classes.shape[1]
    b = int32(cuda.blockIdx.y // n_heads)
    h = int32(cuda.blockIdx.y - b * n_heads)
    a = cuda.blockIdx.x // n_kb
    c = cuda.blockIdx.x - a * n_kb
    q0 = a * block_q
    k0 = c * block_k
    rows = min(block_q, n_q - q0)
    cols = min(block_k, n_k - k0)
    seen_any = False
    seen_all = True
    for e in range(cuda.threadIdx.x, rows * cols, cuda.blockDim.x):
        r = e // cols
        v = bool(mask_call(b, h, int32(q0 + r), int32(k0 + e - r * cols), aux))
        seen_any = seen_any or v
        seen_all = seen_all and v
    any_v = cuda.syncthreads_or(int32(seen_any))
    all_v = cuda.syncthreads_and(int32(seen_all))
    if cuda.threadIdx.x == 0:
        classes[b, h, a, c] = int8({FULL} if all_v else ({PARTIAL} if any_v else {EMPTY}))
"""
    scope = {"cuda": cuda, "int32": int32, "int8": int8, "mask_call": mask_call}
    exec(compile(src, "<block_mask classify>", "exec"), scope)
    return scope["classify"], sig


class BlockMask:
    """A mask's tile classes at one tile (``block_mask``'s result): ``classes`` (B, H, Q tiles, K tiles) int8,
    ``kv_num_blocks`` / ``kv_indices`` (the visible key tiles of each query tile, in order, then -1) and
    ``full_kv_num_blocks`` / ``full_kv_indices`` (the FULL ones among them), host NumPy int32."""

    def __init__(self, classes: np.ndarray, n_q: int, n_k: int, block_q: int, block_k: int, mod_key,
                 mask_mod: MaskMod | None = None):
        self.classes = classes
        self.n_q, self.n_k, self.block_q, self.block_k = n_q, n_k, block_q, block_k
        self.mod_key = mod_key  # UserMod.cache_key of the mask (its code, closure, globals, aux types)
        self.mask_mod = mask_mod  # the MaskMod it was built from: forward(block_mask=...) runs it on PARTIAL tiles
        self._lists: dict = {}  # (causal, window, device) -> device (counts, entries), built once each
        self.kv_num_blocks, self.kv_indices = _compact(classes != EMPTY)
        self.full_kv_num_blocks, self.full_kv_indices = _compact(classes == FULL)

    @property
    def shape(self) -> tuple:
        """(B, H, Nq, Nk) it was built for."""
        return self.classes.shape[:2] + (self.n_q, self.n_k)

    def counts(self) -> dict:
        """Tiles of each class over every (b, h): {"EMPTY": n, "PARTIAL": n, "FULL": n}."""
        return {name: int((self.classes == i).sum()) for i, name in enumerate(CLASS_NAMES)}

    def check(self, mask_mod, B: int, H: int, n_q: int, n_k: int, block_q: int, block_k: int) -> None:
        """ValueError unless this mask was built from ``mask_mod`` (same code and values) for these sizes
        and this tile."""
        spec = _spec(mask_mod, (B, H, n_q, n_k))
        if spec.cache_key != self.mod_key:
            raise ValueError(f"block_mask was built from another mask_mod than {as_mask_mod(mask_mod)!r}; build "
                             "it with numba_flash.block_mask(mask_mod, ...) from the mask passed with it")
        if self.shape != (B, H, n_q, n_k):
            raise ValueError(f"block_mask was built for (B, H, Nq, Nk) = {self.shape}; the call has "
                             f"{(B, H, n_q, n_k)}")
        if (self.block_q, self.block_k) != (block_q, block_k):
            raise ValueError(f"block_mask has {self.block_q}x{self.block_k} tiles; the forward's tile is "
                             f"{block_q}x{block_k}: build it with numba_flash.block_mask(mask_mod, {B}, {H}, {n_q}, "
                             f"{n_k}, block_q={block_q}, block_k={block_k}) (numba_flash.sparsity.forward_tile "
                             "names the tile of a head dim, causal and dropout)")

    def lists(self, causal: bool, window=(-1, -1)) -> tuple:
        """Host (counts, entries) of the forward's walk under causal / window (blocks.sparsity.host_lists)."""
        return host_lists(self.classes, self.n_q, self.n_k, self.block_q, self.block_k, causal, window)

    def device_lists(self, causal: bool, window=(-1, -1), device=None) -> tuple:
        """lists() on the GPU (the forward's launch arguments), copied once per (causal, window, device) and kept
        here: the classes never change, so neither do the lists."""
        key = (bool(causal), tuple(int(x) for x in window), device)
        if key not in self._lists:
            counts, entries = self.lists(causal, window)
            self._lists[key] = (cuda.to_device(counts), cuda.to_device(entries))  # synchronous: any stream may read
        return self._lists[key]

    def __repr__(self):
        c = self.counts()
        return (f"BlockMask({self.shape}, tile {self.block_q}x{self.block_k}: {c['EMPTY']} empty, "
                f"{c['FULL']} full, {c['PARTIAL']} partial)")


def _compact(keep: np.ndarray) -> tuple:
    """(count, indices then -1) of the True entries along the last axis."""
    num = keep.sum(-1).astype(np.int32)
    order = np.argsort(~keep, axis=-1, kind="stable").astype(np.int32)  # kept indices first, in order
    idx = np.where(np.arange(keep.shape[-1]) < num[..., None], order, np.int32(-1)).astype(np.int32)
    return num, idx


def _spec(mask_mod, sizes: tuple) -> UserMod:
    """The build argument of a mask_mod, its aux arrays checked as the forward checks them (api._check_user_mod,
    against the mod's aux_shapes at ``sizes`` = (B, H, Nq, Nk))."""
    from .api import _check_user_mod

    mod = as_mask_mod(mask_mod)
    if mod is None:
        raise TypeError("block_mask needs a mask_mod (a function mask_mod(b, h, q_idx, kv_idx, *aux) -> bool or "
                        "a numba_flash.mods.MaskMod); got None")
    first = mod.aux[0] if mod.aux else None  # the aux arrays' kind and device stand in for q's
    kind = arrays.kind_of(first) if first is not None else arrays.NUMPY
    device = arrays.device_of(first) if first is not None else None
    return _check_user_mod("mask_mod", mod, kind, device, sizes)


def block_mask(mask_mod, B: int, H: int, n_q: int, n_k: int, block_q: int = 128, block_k: int = 128,
               stream=0) -> BlockMask:
    """The BlockMask of ``mask_mod`` (a MaskMod or bare function) for (B, H, Nq, Nk) at block_q x block_k tiles
    (module docstring); the aux arrays where the forward takes them (NumPy is copied to the GPU)."""
    for name, x in (("B", B), ("H", H), ("n_q", n_q), ("n_k", n_k), ("block_q", block_q), ("block_k", block_k)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x <= 0:
            raise ValueError(f"block_mask: {name} must be a positive int; got {x!r}")
    mod: MaskMod = as_mask_mod(mask_mod)
    spec = _spec(mod, (B, H, n_q, n_k))
    n_qb, n_kb = -(-n_q // block_q), -(-n_k // block_k)
    if B * H > 65535:
        raise ValueError(f"block_mask: B·H = {B * H} > 65535 (the grid's y)")
    aux = aux_views(mod, stream)
    classes = cuda.device_array((B, H, n_qb, n_kb), np.int8, stream=stream)
    threads = 32 if nb_config.ENABLE_CUDASIM else THREADS
    launch.launch(_classify_kernel(spec), (n_qb * n_kb, B * H), threads, stream, 0, classes, int32(n_q),
                  int32(n_k), int32(block_q), int32(block_k), int32(n_kb), *aux)
    return BlockMask(classes.copy_to_host(stream=stream), int(n_q), int(n_k), int(block_q), int(block_k),
                     spec.cache_key, mod)


def forward_tile(head_dim: int, causal: bool = False, dropout: bool = False) -> tuple:
    """(block_q, block_k) of the tensor-core forward's tile for this head dim and causal on the current GPU (the
    tile a BlockMask for ``forward(..., block_mask=)`` is built at; numba_flash.explain names it too): on sm_90 the
    warp-specialised forward's where it has one (a BlockMask at the wgmma forward's tiles runs on that one).
    dropout=True: the mma.sync forward's, which runs every call with dropout_p > 0."""
    from .api import mma_config

    tile = mma_config(int(head_dim), bool(causal), plain=True, **({"sync": True} if dropout else {}))
    return tile.block_q, tile.block_k


def document_mask_blocks(q_segment_ids, kv_segment_ids=None, H: int = 1, block_q: int = 128,
                         block_k: int = 128) -> BlockMask:
    """The BlockMask of ``numba_flash.mods.document_mask(q_segment_ids, kv_segment_ids)`` for H heads, built on the
    host from the ids without the classify kernel: ids sorted along each batch row (a packed batch's documents one
    after another) make a tile's ids one run, so a (query tile, key tile) is FULL when both hold one and the same
    id, EMPTY when they share none, else PARTIAL (block_mask's classes, exactly). The ids: (B, Nq) and (B, Nk)
    integer arrays (NumPy, or device arrays, read back once)."""
    from .mods import document_mask

    mod = document_mask(q_segment_ids, kv_segment_ids)
    host = [_host_ids(name, x) for name, x in (("q_segment_ids", mod.aux[0]), ("kv_segment_ids", mod.aux[1]))]
    B, n_q = host[0].shape
    n_k = host[1].shape[1]
    for name, x in (("H", H), ("block_q", block_q), ("block_k", block_k)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x <= 0:
            raise ValueError(f"document_mask_blocks: {name} must be a positive int; got {x!r}")
    spec = _spec(mod, (B, H, n_q, n_k))
    q_ids, k_ids = host
    n_qb, n_kb = -(-n_q // block_q), -(-n_k // block_k)
    # sorted rows: a tile's smallest id is its first, its largest its last
    q_lo, q_hi = q_ids[:, ::block_q], q_ids[:, np.minimum(np.arange(1, n_qb + 1) * block_q, n_q) - 1]
    k_lo, k_hi = k_ids[:, ::block_k], k_ids[:, np.minimum(np.arange(1, n_kb + 1) * block_k, n_k) - 1]
    overlap = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    full = (q_lo == q_hi)[:, :, None] & (k_lo == k_hi)[:, None, :] & (q_lo[:, :, None] == k_lo[:, None, :])
    classes = np.where(full, FULL, np.where(overlap, PARTIAL, EMPTY)).astype(np.int8)
    for b, a, c in zip(*np.nonzero(overlap & ~full)):  # runs overlap in value: do they share an id?
        if not np.intersect1d(q_ids[b, a * block_q:(a + 1) * block_q], k_ids[b, c * block_k:(c + 1) * block_k]).size:
            classes[b, a, c] = EMPTY
    classes = np.ascontiguousarray(np.broadcast_to(classes[:, None], (B, H, n_qb, n_kb)))
    return BlockMask(classes, int(n_q), int(n_k), int(block_q), int(block_k), spec.cache_key, mod)


def _host_ids(name: str, x) -> np.ndarray:
    """Segment ids on the host, (B, N) integers sorted along each row, or ValueError."""
    if hasattr(x, "__cuda_array_interface__") and not isinstance(x, np.ndarray):
        x = cuda.as_cuda_array(x).copy_to_host()
    x = np.asarray(x)
    if x.ndim != 2 or x.dtype.kind not in "iu":
        raise ValueError(f"document_mask_blocks: {name} must be a (B, N) integer array; got {x.dtype} {x.shape}")
    if x.shape[1] > 1 and (np.diff(x.astype(np.int64), axis=1) < 0).any():
        raise ValueError(f"document_mask_blocks: {name} must be sorted along each batch row (documents packed one "
                         "after another); use numba_flash.block_mask(document_mask(...), ...) for other ids")
    return x
