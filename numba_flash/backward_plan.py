"""The tensor-core backward's launches: which kernels run, in which order, on one stream.

    prep      D = rowsum(dO ∘ O) and L2 = L·log2(e) into fp32 scratch rows (kernels/bwd_prep.py)
    dkdv      dK, dV over key blocks (kernels/mma_dkdv.py; on sm_90 with dQ: kernels/wgmma_backward.py;
              fp32: kernels/tf32_backward.py), with dQ formed there too where dq_acc is given
    dq        dQ over query tiles (kernels/mma_dq.py, kernels/tf32_backward.py) where it is not; else
    convert   dq = scale · the fp32 dQ planes summed in order (kernels/bwd_prep.py)

``launch_mma`` (fp16 / bf16) and ``launch_tf32`` (float32, 3xTF32) take device arrays the caller has
validated; numba_flash.backward picks the config and the dQ scheme (backward.dq_scheme).
"""
from __future__ import annotations

import numpy as np
from numba import float32

from . import ptx
from .blocks.entry import check_dq_acc, rows16
from .blocks.mods import NO_MODS, launch_args
from .blocks.numerics import LOG2E
from .blocks.tf32 import head_dim_for, split_round_for_device
from .configs import TF32_BWD_TABLE
from .tiles import Tile
from .kernels import bwd_prep, mma_dkdv, mma_dq, tf32_backward, wgmma_backward
from .launch import unused_slopes

WORD = np.dtype(np.uint16)


def _words(x):
    """The array as 16-bit words (bf16 already arrives as uint16; f16 is reinterpreted)."""
    return x if x.dtype == WORD else x.view(WORD)


def launch_mma(q, k, v, out, dout, lse, l2, dd, dq, dk, dv, *, causal, softmax_scale, dtype, d, config,
               stream=0, kernels=("prep", "dkdv", "dq"), dq_acc=None, dq_splits=None, mods=NO_MODS, window=(0, 0),
               softcap=0.0, alibi=None, varlen=None, aux=()):
    """Run prep, dkdv and dq (or convert) on device arrays; the caller has validated the problem and the layout.

    q, out, dout, dq: (B, H, Nq, d); k, v, dk, dv: (B, Hkv, Nk, d), all 16-bit (float16, or uint16
    holding bf16 bits); q, k, v, dout with unit last stride, other strides multiples of 16 B and
    16-byte aligned data (cp.async); lse: (B, H, Nq) fp32; l2, dd: fp32 scratch of shape
    (B·H, padded_rows(Nq)), C-contiguous. ``config``: {"dkdv": (BLOCK_N, BLOCK_M), "dq": (BLOCK_M,
    BLOCK_N), "head_dim": HEAD_DIM[, "dkdv_atomic": (BLOCK_N, BLOCK_M)][, "dkdv_wgmma": bool,
    "dkdv_wgmma_defer_dq": schemes]}, as backward.mma_config returns it (dkdv_atomic: the dkdv tile used
    with dq_acc, default the "dkdv" one; dkdv_wgmma: that kernel on warpgroup MMA, sm_90). Nq, Nk > 0.
    ``kernels`` picks which of the three run (the sweep times them one by one; dkdv and dq read prep's
    scratch). dq_acc: None (deterministic: the dq kernel), or zeroed C-contiguous fp32 scratch of shape
    (B·H, padded_rows(Nq), HEAD_DIM): dkdv then adds dQ into it atomically (not bitwise repeatable)
    and a last kernel writes dq = scale · dq_acc; the dq kernel does not run.
    dq_splits: None (with dq_acc: one dkdv block per key block, all adding into one plane), or the
    deterministic splits S (blocks.schedule.dq_splits' choice): dq_acc then has S planes, shape (S·B·H, NQ_PAD,
    HEAD_DIM); dkdv runs as ceil(n_kb / S) launches of S key blocks per kv head, block x of every launch
    adding into plane x, and the last kernel sums the planes in order: bitwise repeatable (FA2's
    deterministic scheme, its key-block loop on the host).
    mods, window, softcap, alibi: as mma_forward.launch takes them (blocks/mods.py); causal with a window is
    the window's right = 0. With mods the splits' planes must be zeroed (as deterministic=False's one plane):
    every launch adds, since a window's key blocks do not cover a plane's rows from its first on.
    varlen: None, or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) for packed sequences (as
    mma_forward.launch takes it): the arrays are packed ones viewed as batches (arrays.packed_as_batch), the
    scratch rows and planes those of a dense batch of the longest sequences, and the planes zeroed.
    aux: the user mods' aux arrays (device views, the mask's first; mods.mask_mod / score_mod, the score mod with
    its grad) for every kernel with them.
    """
    B, H, n_q, _ = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    seqs = None
    if varlen is not None:
        n_q, n_k = int(varlen[2]), int(varlen[3])
        seqs = tuple(varlen[:2])
    head_dim = config["head_dim"]
    partial = bool(d % 8)  # a part-data chunk per row (the sources' PARTIAL_CHUNK)
    scalars = (n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E), float32(softmax_scale))
    atomic = dq_acc is not None
    if mods.any:
        scalars += launch_args(window, softcap, softmax_scale, alibi, unused_slopes(l2))
    vec = d % 8 == 0 and all(rows16(_words(x)) for x in (out, dout, dq))  # 16-byte prep and convert
    if "prep" in kernels:
        bwd_prep.launch_prep(dtype, head_dim, vec, out, dout, lse, l2, dd, n_q, d, B * H, stream, varlen=seqs)
    words = tuple(_words(x) for x in (q, k, v, dout))
    bn, bm = config.get("dkdv_atomic", config["dkdv"]) if atomic else config["dkdv"]
    n_kb = (n_k + bn - 1) // bn
    if atomic:
        check_dq_acc(dq_acc, dq_splits, B * H, l2.shape[1], head_dim, n_kb)
    if dq_splits is not None and not atomic:
        raise ValueError(f"dq_splits={dq_splits}: needs dq_acc")
    wgmma = atomic and bool(config.get("dkdv_wgmma", False))
    if wgmma and not ptx.current_wgmma():
        cc = "".join(map(str, ptx.compute_capability()))
        raise ValueError(f"dkdv_wgmma: wgmma needs an sm_90 GPU, this one is sm_{cc} (backward.mma_config adds the "
                         "key only there)")
    grads = (_words(dk), _words(dv))
    if "dkdv" in kernels and wgmma:  # the sm_90 warpgroup-MMA build of the dQ-in-dkdv kernel
        if (bn, bm) != (wgmma_backward.BLOCK_N, wgmma_backward.BLOCK_M):
            raise ValueError(f"dkdv_wgmma: the wgmma dkdv takes ({wgmma_backward.BLOCK_N}, "
                             f"{wgmma_backward.BLOCK_M}) tiles (dkdv_atomic), got ({bn}, {bm})")
        defer = ("atomic" if dq_splits is None else "splits") in config.get("dkdv_wgmma_defer_dq", ())
        wgmma_backward.launch(*words, l2, dd, *grads, dq_acc, scalars, head_dim=head_dim, causal=causal, dtype=dtype,
                              stream=stream, partial_chunk=partial, dq_splits=dq_splits, defer_dq=defer, mods=mods,
                              varlen=seqs, aux=aux)
    elif "dkdv" in kernels:
        mma_dkdv.launch(*words, l2, dd, *grads, scalars, tile=(bn, bm), head_dim=head_dim, causal=causal,
                        dtype=dtype, stream=stream, partial_chunk=partial, dq_acc=dq_acc, dq_splits=dq_splits,
                        mods=mods, varlen=seqs, aux=aux)
    if atomic:
        if "dq" in kernels:  # (mods, varlen: zeroed planes, every row read; the rows no block wrote are zeros)
            bwd_prep.launch_convert(dtype, vec, dq_acc, _words(dq), n_q, d, softmax_scale, n_k, bn, bm,
                                    causal and not mods.any and seqs is None, B * H, stream, varlen=seqs)
        return
    if "dq" in kernels:
        mma_dq.launch(*words, l2, dd, _words(dq), scalars, tile=config["dq"], head_dim=head_dim, causal=causal,
                      dtype=dtype, stream=stream, partial_chunk=partial, mods=mods, varlen=seqs, aux=aux)


KERNELS = ("dkdv", "dq", "dkdv_atomic")  # the backward tables' kernel names (configs.py)


def table_tiles(table: dict, *key) -> dict:
    """{kernel: Tile} of one entry of a backward table (configs.py), key = (head dim[, causal])."""
    return {kind: table[(kind, *key)] for kind in KERNELS if (kind, *key) in table}


def config_from_tiles(tiles: dict, head_dim: int) -> dict:
    """The launches' config from a backward table's Tiles {kernel: Tile} (configs.py): {"dkdv": (BLOCK_N keys,
    BLOCK_M queries), "dq": (BLOCK_M queries, BLOCK_N keys), "head_dim": HEAD_DIM[, "dkdv_atomic": (BLOCK_N,
    BLOCK_M), "deterministic_dq": "splits" | "kernel"][, "dkdv_wgmma": True, "dkdv_wgmma_defer_dq": schemes]}:
    the kernels' own (owned, streamed) order, as launch_mma / launch_tf32 and the sweeps take it."""
    unknown = sorted(set(tiles) - set(KERNELS))
    if unknown or not {"dkdv", "dq"} <= set(tiles) or not all(isinstance(t, Tile) for t in tiles.values()):
        raise ValueError(f"backward tiles: {{kernel: Tile}} with kernels from {KERNELS}, dkdv and dq among them; "
                         f"got {tiles!r}")
    cfg = {"dkdv": (tiles["dkdv"].block_k, tiles["dkdv"].block_q), "dq": (tiles["dq"].block_q, tiles["dq"].block_k),
           "head_dim": head_dim}
    atomic = tiles.get("dkdv_atomic")
    if atomic is not None:
        cfg["dkdv_atomic"] = (atomic.block_k, atomic.block_q)
        cfg["deterministic_dq"] = "splits" if atomic.has("deterministic_splits") else "kernel"
        if atomic.has("wgmma"):
            cfg["dkdv_wgmma"] = True
            cfg["dkdv_wgmma_defer_dq"] = tuple(s for s in ("atomic", "splits") if atomic.has(f"defer_dq_{s}"))
    return cfg


def tf32_config(d, causal):
    """config_from_tiles of configs.TF32_BWD_TABLE's entry for head dim d: dkdv_atomic, the tile of the dkdv
    kernel that also forms dQ (launch_tf32's dq_acc); deterministic_dq, backward.dq_scheme's table choice."""
    head_dim = head_dim_for(d)
    return config_from_tiles(table_tiles(TF32_BWD_TABLE, head_dim, bool(causal)), head_dim)


def launch_tf32(q, k, v, out, dout, lse, l2, dd, dq, dk, dv, *, causal, softmax_scale, d, config=None, stream=0,
                kernels=("prep", "dkdv", "dq"), dq_acc=None, dq_splits=None, split_round=None):
    """Run prep, dkdv and dq (or convert) on float32 device arrays; the caller has validated the problem and
    layout.

    q, out, dout, dq: (B, H, Nq, d); k, v, dk, dv: (B, Hkv, Nk, d); q, k, v, dout with unit last
    stride, other strides multiples of 16 B and 16-byte aligned data (cp.async); lse (B, H, Nq) fp32;
    l2, dd: C-contiguous fp32 scratch (B·H, padded_rows(Nq)). config: as tf32_config(d, causal) returns it
    (default). Nq, Nk > 0. kernels: which of the three run (dkdv and dq read prep's scratch).
    dq_acc, dq_splits: as launch_mma's (the dkdv tile config["dkdv_atomic"] then forms dQ: one
    zeroed plane with atomics, or dq_splits planes, and a convert kernel replaces the dq kernel).
    split_round: blocks.tf32.SPLIT_ROUNDS (default: "rn" on sm_90+, "rna" below it)."""
    B, H, n_q, _ = q.shape
    Hkv, n_k = k.shape[1], k.shape[2]
    config = tf32_config(d, causal) if config is None else config
    head_dim = config["head_dim"]
    if d > head_dim:
        raise ValueError(f"head dim {d} > HEAD_DIM={head_dim}")
    scalars = (n_q, n_k, d, H // Hkv, float32(softmax_scale * LOG2E), float32(softmax_scale))
    split_round = split_round_for_device(split_round)
    atomic = dq_acc is not None
    if "prep" in kernels:  # 16-byte loads where every chunk is all data (d % 4 == 0) and the rows are aligned
        vec = d % 4 == 0 and rows16(out) and rows16(dout)
        bwd_prep.launch_prep("float32", head_dim, vec, out, dout, lse, l2, dd, n_q, d, B * H, stream)
    if atomic:
        if "dkdv_atomic" not in config:
            raise ValueError(f"dq_acc given but the config has no dkdv_atomic tile: {config}")
        bn, bm = config["dkdv_atomic"]
        check_dq_acc(dq_acc, dq_splits, B * H, l2.shape[1], head_dim, (n_k + bn - 1) // bn)
    elif dq_splits is not None:
        raise ValueError(f"dq_splits={dq_splits} needs dq_acc")
    opts = dict(head_dim=head_dim, causal=causal, stream=stream, split_round=split_round)
    if "dkdv" in kernels and atomic:
        tf32_backward.launch("dkdv", (q, k, v, dout, l2, dd, dk, dv), scalars, tile=(bn, bm), dq_acc=dq_acc,
                             dq_splits=dq_splits, **opts)
    elif "dkdv" in kernels:
        tf32_backward.launch("dkdv", (q, k, v, dout, l2, dd, dk, dv), scalars, tile=config["dkdv"], **opts)
    if "dq" in kernels and atomic:
        bwd_prep.launch_convert("float32", d % 8 == 0 and rows16(dq), dq_acc, dq, n_q, d, softmax_scale, n_k, bn, bm,
                                causal, B * H, stream)
    elif "dq" in kernels:
        tf32_backward.launch("dq", (q, k, v, dout, l2, dd, dq), scalars, tile=config["dq"], **opts)
