"""Public ``backward``: gradients of attention from the forward's outputs (FA2, section 3.6.7).

    out, lse = numba_flash.forward(q, k, v, causal=True)
    dq, dk, dv = numba_flash.backward(q, k, v, out, lse, dout, causal=True)

The forward's checks (``api.validate``) plus the backward's own arguments, then the kernels (D, dK/dV,
and dQ in the dK/dV kernel or a kernel of its own: ``dq_scheme``; ``backward_plan`` launches them):
``kernels.mma_dkdv``, ``mma_dq`` and ``wgmma_backward`` (tensor cores) for float16/bfloat16 where the
forward would use tensor cores too, up to d = 256 (d 129..256 where the GPU has the tiles' shared memory: sm_90,
and sm_80 up to d = 192), ``kernels.tf32_backward`` (3xTF32 on tensor cores) for float32 where the
forward's tf32x3 conditions hold, else ``kernels.simt_backward``. For PyTorch autograd see
``numba_flash.torch``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import config as nb_config

from . import arrays, backward_plan, plans
from dataclasses import replace

from .api import (_ACCEPTED_ARRAYS, MMA_BWD_MAX_HEAD_DIM, PerformanceWarning, Problem, _device_smem, _mma_blockers,
                  _on_device, _tf32_blockers, _zero, check_dropout, mods_words, user_aux, validate, window_pair)
from .blocks.mask import window_bounds
from .configs import MMA_BWD_TABLE, MMA_BWD_WGMMA, REGS_PER_SM
from .decode import _sm_count
from .blocks import schedule
from .kernels import mma_dkdv, mma_dq, simt_backward, tf32_backward, wgmma_backward
from .ptx import current_wgmma
from .launch import address

KERNELS = ("auto", "simt", "mma", "tf32x3")


def validate_backward(q, k, v, out, lse, dout, *, causal: Any = False, softmax_scale: Any = None,
                      window_size: Any = (-1, -1), softcap: Any = 0.0, alibi_slopes: Any = None,
                      packed: tuple | None = None, mask_mod: Any = None, score_mod: Any = None,
                      dropout_p: float = 0.0) -> Problem:
    """``api.validate`` for q, k, v (and the mods), then: out and dout like q, lse float32 of shape q.shape[:-1]
    ((H, total_q) for a varlen call: packed as api.validate takes it). A score_mod must carry its derivative
    (numba_flash.mods.ScoreMod's grad): the Problem's score mod is then the build argument with it."""
    p = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                 alibi_slopes=alibi_slopes, packed=packed, mask_mod=mask_mod, score_mod=score_mod, dropout_p=dropout_p)
    if p.score_mod is not None:
        p = replace(p, score_mod=score_mod_with_grad(p.score_mod, score_mod))
    wanted = (
        ("out", out, p.q_shape, p.dtype, "q's shape", "q's dtype"),
        ("dout", dout, p.q_shape, p.dtype, "q's shape", "q's dtype"),
        ("lse", lse, p.lse_shape, "float32", "(H, total_q)" if p.varlen else "q.shape[:-1]",
         "float32, as forward returns it"),
    )
    for name, x, shape, dtype, shape_why, dtype_why in wanted:
        kind = arrays.kind_of(x)
        if kind is None:
            raise TypeError(f"{name} must be {_ACCEPTED_ARRAYS}; got {type(x).__module__}.{type(x).__name__}")
        if kind == arrays.TORCH and not x.is_cuda:
            raise TypeError(f"{name} is a PyTorch tensor on {x.device}; pass a CUDA tensor (or a NumPy array)")
        arrays.refuse_unreadable(name, x, kind)
        if (kind == arrays.NUMPY) != (p.kind == arrays.NUMPY):
            raise TypeError(
                f"{name} is a {kind} array but q is a {p.kind} array; all six must be on the GPU "
                f"or all be NumPy arrays"
            )
        dt = arrays.dtype_name(x)
        if dt != dtype:
            raise TypeError(f"{name} has dtype {dt}; accepted: {dtype} ({dtype_why})")
        shp = arrays.shape_of(x)
        if shp != shape:
            raise ValueError(f"{name} has shape {shp}; accepted: {shape} ({shape_why}, q is {p.q_shape})")
        dev = arrays.device_of(x)
        if dev is not None and p.device is not None and dev != p.device:
            raise ValueError(f"{name} is on device {dev} but q, k, v are on device {p.device}; put them on one GPU")
    return p


def score_mod_with_grad(spec, score_mod):
    """The score mod's kernel build argument (blocks.mods.UserMod) with its derivative, or ValueError naming grad."""
    from .blocks.mods import UserMod
    from .mods import as_score_mod

    grad = as_score_mod(score_mod).grad
    if grad is None:
        raise ValueError(f"score_mod {spec!r} has no grad: the backward needs d score_mod / d score; pass "
                         "numba_flash.mods.ScoreMod(fn, grad=fn_grad), fn_grad(score, b, h, q_idx, kv_idx, *aux) -> "
                         "d fn / d score (a mask_mod needs none)")
    return UserMod(spec.fn, spec.leading, spec.aux_types, grad=grad)


def choose_backward(p: Problem, kernel: str = "auto", views=None) -> tuple[str, Any, list[str]]:
    """(family, config, reasons): which backward kernels run for a validated problem, and why.

    The tensor-core path takes what the tensor-core forward takes, up to d = 256 (float16/bfloat16,
    sm_80+, cp.async-able layouts, the tiles' shared memory: smem_blockers), with dout's layout checked as well: ``views`` = device views of
    (q, k, v, dout), or None to assume contiguous arrays (explain on NumPy inputs).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; accepted: {', '.join(KERNELS)}")
    if p.mods.any:
        return _choose_with_mods(p, kernel, views)
    if p.mask_causal != p.causal:  # window_size (-1, 0): the causal kernels
        p = replace(p, causal=True, window_size=(-1, -1))
    # As in forward: auto keeps fp32 on SIMT in the CUDA simulator, where the tensor-core twins are slow.
    tf32_blockers = []
    if kernel == "tf32x3" or (kernel == "auto" and p.dtype == "float32" and not nb_config.ENABLE_CUDASIM):
        tf32_blockers = _tf32x3_blockers(p, views)
        if kernel == "tf32x3" and tf32_blockers:
            raise ValueError("kernel='tf32x3' cannot run this backward: " + "; ".join(tf32_blockers))
        if not tf32_blockers:
            return _choose_tf32x3(p)
    blockers = _mma_blockers(p, None if views is None else views[:3], MMA_BWD_MAX_HEAD_DIM)
    if views is not None and not blockers:
        blockers += _dout_blockers(views[3], "8 elements")
    if not blockers:
        blockers += smem_blockers(p.d)
    if kernel == "mma" and blockers:
        raise ValueError("kernel='mma' cannot run this backward: " + "; ".join(blockers))
    if kernel in ("auto", "mma") and not blockers:
        head_dim = mma_head_dim(p.d)
        cfg = mma_config(head_dim)
        (bn, bm), (bq, bk) = cfg["dkdv"], cfg["dq"]
        an, am = cfg["dkdv_atomic"]
        if cfg.get("dkdv_wgmma"):
            with_dq = (f"dkdv with dQ: warpgroup MMA (wgmma.mma_async, sm_90), {an}-key tiles x {am}-query tiles, "
                       f"{wgmma_backward.threads()} threads, "
                       f"{wgmma_backward.smem_bytes(head_dim, bool(cfg.get('dkdv_wgmma_defer_dq')))} B shared memory"
                       + (f"; each step's dQ added during the next with {' and '.join(cfg['dkdv_wgmma_defer_dq'])}"
                          " dQ" if cfg.get("dkdv_wgmma_defer_dq") else ""))
        else:
            with_dq = (f"dkdv with dQ: {an}-key tiles x {am}-query tiles, {mma_dkdv.threads(an, head_dim)} "
                       f"threads, {mma_dkdv.smem_bytes(an, am, head_dim, True)} B shared memory")
        reasons = [
            f"mma backward: tensor cores (mma.sync m16n8k16"
            f"{', and wgmma for the dkdv with dQ' if cfg.get('dkdv_wgmma') else ''}, {p.dtype} in, fp32 accumulate); "
            "D and L·log2(e), "
            "then dK/dV over K/V tiles, and dQ either in the same kernel (dS·K added into fp32 planes) or by a "
            "dq kernel over Q tiles",
            with_dq,
            f"dkdv without dQ: {bn}-key tiles x {bm}-query tiles, {mma_dkdv.threads(bn, head_dim)} "
            f"threads, {mma_dkdv.smem_bytes(bn, bm, head_dim)} B shared memory; "
            f"dq: {bq}-query tiles x {bk}-key tiles, {mma_dq.threads(bq)} threads, "
            f"{mma_dq.smem_bytes(bq, bk, head_dim)} B shared memory",
        ]
        if mma_dkdv.col_split(head_dim) > 1:
            reasons.append(split_words(head_dim))
        if head_dim != p.d:
            reasons.append(f"head dim {p.d} is zero-padded to {head_dim} inside the kernels")
    else:
        cfg = simt_backward.backward_configs(p.d)
        cfg_kv, cfg_q = cfg
        reasons = [
            "simt backward: D = rowsum(dO∘O), then dK/dV over K/V tiles, then dQ over Q tiles (no atomics)",
            f"dkdv: {cfg_kv.block_k}-row K/V tiles x {cfg_kv.block_q}-row Q tiles, {cfg_kv.threads} threads, "
            f"{cfg_kv.smem_bytes} B shared memory",
            f"dq: {cfg_q.block_q}-row Q tiles x {cfg_q.block_k}-row K/V tiles, {cfg_q.threads} threads, "
            f"{cfg_q.smem_bytes} B shared memory",
        ]
        if cfg_kv.head_dim != p.d:
            reasons.append(f"head dim {p.d} is zero-padded to {cfg_kv.head_dim} inside the kernels")
        if p.dtype == "float32":
            if kernel == "simt":
                why = "kernel='simt' was asked for"
            elif tf32_blockers:
                why = "; ".join(tf32_blockers)
            else:  # only the simulator gets here: auto skips tf32x3 there
                why = "the CUDA simulator runs fp32 on SIMT unless kernel='tf32x3' is asked for (its twins are slow)"
            reasons.append(f"float32 on the SIMT path (fp32 FMA), not the tf32x3 tensor-core kernels: {why}")
    if p.H != p.Hkv:
        reasons.append(f"GQA: each dK/dV block loops over the {p.H // p.Hkv} query heads of its group")
    if blockers or kernel == "simt":
        if p.dtype in mma_dkdv.DTYPES:  # last: backward's PerformanceWarning quotes this line
            why = "kernel='simt' was asked for" if kernel == "simt" else "; ".join(blockers)
            reasons.append(f"{p.dtype} widened to fp32 on the SIMT path, not tensor cores: {why}")
    family = "mma" if kernel in ("auto", "mma") and not blockers else "simt"
    return family, cfg, reasons


def _choose_with_mods(p: Problem, kernel: str, views):
    """A window, softcap or ALiBi: the tensor-core backward builds them (mma.sync dkdv / dq, the wgmma dkdv on
    sm_90), with dQ by the same schemes as without (dq_scheme; the splits' planes zeroed)."""
    blockers = _mma_blockers(p, None if views is None else views[:3], MMA_BWD_MAX_HEAD_DIM)
    if views is not None and not blockers:
        blockers += _dout_blockers(views[3], "8 elements")
    if not blockers:
        blockers += smem_blockers(p.d)
    if kernel not in ("auto", "mma") or blockers:
        why = [f"kernel={kernel!r} was asked for"] if kernel not in ("auto", "mma") else blockers
        raise NotImplementedError(
            f"{mods_words(p)}: the backward builds them into the 'mma' kernels only (float16/bfloat16, head dim "
            f"<= {MMA_BWD_MAX_HEAD_DIM}, sm_80+, 16-byte aligned rows, the tiles' shared memory); this call cannot "
            f"take it: {'; '.join(why)}")
    head_dim = mma_head_dim(p.d)
    cfg = mma_config(head_dim)
    (bn, bm), (bq, bk), (an, am) = cfg["dkdv"], cfg["dq"], cfg["dkdv_atomic"]
    wgmma = ", and wgmma for the dkdv with dQ" if cfg.get("dkdv_wgmma") else ""
    reasons = [
        f"mma backward with mods: tensor cores (mma.sync m16n8k16{wgmma}, {p.dtype} in, fp32 accumulate); D and "
        "L·log2(e), then dK/dV over K/V tiles, and dQ in the same kernel (fp32 planes) or by a dq kernel",
        "mods: " + mods_words(p) + (" (Q and K/V tiles outside every row's window are skipped)"
                                    if p.mods.window else ""),
        f"dkdv with dQ: {an}-key tiles x {am}-query tiles; dkdv without dQ: {bn}-key tiles x {bm}-query tiles; "
        f"dq: {bq}-query tiles x {bk}-key tiles",
    ]
    if mma_dkdv.col_split(head_dim) > 1:
        reasons.append(split_words(head_dim))
    if head_dim != p.d:
        reasons.append(f"head dim {p.d} is zero-padded to {head_dim} inside the kernels")
    if p.H != p.Hkv:
        reasons.append(f"GQA: each dK/dV block loops over the {p.H // p.Hkv} query heads of its group")
    return "mma", cfg, reasons


MMA_BWD_HEAD_DIMS = sorted({hd for _, hd in MMA_BWD_TABLE})  # the compiled head dims: d is padded up to one


def mma_head_dim(d: int) -> int:
    """The tensor-core backward's compiled head dim for head dim d (<= MMA_BWD_MAX_HEAD_DIM)."""
    return next(hd for hd in MMA_BWD_HEAD_DIMS if hd >= d)


def split_words(head_dim: int) -> str:
    """explain's line for the dkdv kernel's split layout (mma_dkdv.col_split)."""
    return (f"d = {head_dim}: the dkdv kernel runs two warps per 16 keys (dK, dV of 16 keys x {head_dim} would not "
            "fit one warp's registers), each forming Sᵀ, dPᵀ for half the queries and dK, dV for half the "
            "columns, with Pᵀ and dSᵀ through shared memory")


def smem_blockers(d: int) -> list[str]:
    """Why this GPU's blocks lack the shared memory of the tensor-core backward's dkdv or dq tile at head dim d
    (empty when they have it): d 129..256 on sm_86 / sm_89 (99 KiB a block), d 193..256 on sm_80 (163 KiB).
    The dQ-in-dkdv tile is dq_scheme's to check (the dq kernel replaces it)."""
    if d > MMA_BWD_MAX_HEAD_DIM:
        return []
    head_dim = mma_head_dim(d)
    cfg = mma_config(head_dim)
    optin = _device_smem()[0]
    need = {"dkdv": mma_dkdv.smem_bytes(*cfg["dkdv"], head_dim), "dq": mma_dq.smem_bytes(*cfg["dq"], head_dim)}
    return [f"the {name} tile at head dim {head_dim} needs {n} B of shared memory, this GPU gives a block {optin}"
            for name, n in need.items() if n > optin]


def mma_config(head_dim: int) -> dict:
    """The tensor-core backward's config at a compiled head dim: MMA_BWD_TABLE's entry, with MMA_BWD_WGMMA's
    overrides on a GPU that has wgmma (sm_90: the dQ-in-dkdv kernel on warpgroup MMA) and in the simulator."""
    tiles = backward_plan.table_tiles(MMA_BWD_TABLE, head_dim)
    if current_wgmma():
        tiles.update(backward_plan.table_tiles(MMA_BWD_WGMMA, head_dim))
    return backward_plan.config_from_tiles(tiles, head_dim)


def _dq_slots(threads: int, smem: int, smem_per_sm: int) -> int:
    """Blocks of the dQ-in-dkdv kernel the GPU holds at once: SMs x blocks per SM, from its threads at 255
    registers (what ptxas gives every shipped tile; pinned by the compile tests) and its shared memory."""
    per_sm = min(REGS_PER_SM // (256 * threads), smem_per_sm // (smem + 1024))  # 1 KiB reserved per block
    return max(per_sm, 1) * _sm_count()


def dq_scheme(p: Problem, cfg: dict, deterministic: bool, family: str = "mma", scratch_max: int | None = None) -> tuple:
    """How the tensor-core backward (family "mma" or "tf32x3") gets dQ: ("atomic", None) for
    deterministic=False; for the default ("splits", S) where the table allows it, S planes fit in
    scratch_max bytes (default schedule.DQ_SCRATCH_MAX_BYTES) and S deterministic splits are predicted within SPLITS_SLOWER_OK of the
    atomic grid's time, else ("kernel", None), the separate dq kernel; and a line saying why. Both modes take
    the dq kernel where the table has no "dkdv_atomic" tile or the device's blocks lack its shared memory."""
    kernel = "dQ: a separate dq kernel over Q tiles (7 tile products instead of 5, no atomics): "
    if p.mods.dropout and not cfg.get("dkdv_wgmma"):
        return "kernel", None, kernel + "dropout (the dq kernel regenerates the forward's keep mask; the mma.sync " \
            "dQ-in-dkdv builds with dropout are not yet GPU-tested, the sm_90 wgmma one is)"
    if "dkdv_atomic" not in cfg:
        return "kernel", None, kernel + f"the table has no dQ-in-dkdv tile at head dim {cfg['head_dim']}"
    bn, bm = cfg["dkdv_atomic"]
    if family == "tf32x3":
        smem = tf32_backward.smem_bytes("dkdv", bn, bm, cfg["head_dim"], atomic_dq=True)
        threads = tf32_backward.threads(bn)
    elif cfg.get("dkdv_wgmma"):  # the larger build (a second dSᵀ tile where dQ is deferred in either scheme)
        smem = wgmma_backward.smem_bytes(cfg["head_dim"], bool(cfg.get("dkdv_wgmma_defer_dq")))
        threads = wgmma_backward.threads()
    else:
        smem = mma_dkdv.smem_bytes(bn, bm, cfg["head_dim"], True)
        threads = mma_dkdv.threads(bn, cfg["head_dim"])
    optin, per_sm = _device_smem()
    if smem > optin:  # smaller GPUs (sm_86/89: 99 KiB a block, A100: 163): the dq kernel's smaller tiles
        return "kernel", None, kernel + (f"the dQ-in-dkdv kernel ({bn} keys x {bm} queries) needs {smem} B of "
                                         f"shared memory, this GPU gives a block {optin}")
    if not deterministic:
        return "atomic", None, (f"dQ (deterministic=False): the dkdv kernel ({bn} keys x {bm} queries) adds dS·K "
                                "into one fp32 plane with atomic adds; the order, hence the last bits, vary")
    if cfg.get("deterministic_dq") != "splits":
        return "kernel", None, kernel + f"the table's choice at head dim {cfg['head_dim']}"
    if p.B * p.H * p.n_q * p.n_k == 0:
        return "kernel", None, kernel + "an empty problem (no kernel runs)"
    plane = p.B * p.H * schedule.padded_rows(p.n_q) * cfg["head_dim"] * 4
    budget = schedule.DQ_SCRATCH_MAX_BYTES if scratch_max is None else scratch_max
    max_splits = min(schedule.MAX_DQ_SPLITS, budget // plane)
    if max_splits < 1:
        return "kernel", None, kernel + (f"one fp32 plane of dQ ({plane} B) exceeds the splits' scratch budget "
                                         f"({budget} B)")
    slots = _dq_slots(threads, smem, per_sm)
    # (a window's key blocks each see about as many Q tiles: the model's non-causal work, to first order)
    splits, ratio = schedule.dq_splits(p.n_q, p.n_k, bn, bm, p.mask_causal and not p.mods.window, p.H // p.Hkv,
                                       p.B * p.Hkv, slots, max_splits)
    if ratio > schedule.SPLITS_SLOWER_OK:
        return "kernel", None, kernel + (f"{splits} deterministic splits of the {bn}-key dkdv (at most {max_splits} "
                                         f"planes of {plane} B) would take {ratio:.2f}x the atomic grid's time "
                                         f"(> {schedule.SPLITS_SLOWER_OK}) with {p.B * p.Hkv} kv heads on "
                                         f"{slots} block slots")
    return "splits", splits, (
        f"dQ: deterministic splits (FA2's deterministic scheme): {splits} fp32 planes of dQ ({splits * plane} B); "
        f"the dkdv kernel ({bn} keys x {bm} queries) runs as launches of {splits} key blocks per kv head, block x "
        "of each adding dS·K into plane x (the first launch stores), and a last kernel sums the planes in order: "
        f"bitwise repeatable, 5 tile products (predicted {ratio:.2f}x the atomic grid's time on {slots} block slots)")


def _dout_blockers(do, elements):
    """Why dout's device view cannot be read by cp.async (empty when it can)."""
    if do.strides[-1] != do.dtype.itemsize or any(st % 16 for st in do.strides[:-1]):
        return [f"dout strides {tuple(do.strides)} B: cp.async needs a unit-stride last dim and other strides that "
                f"are multiples of 16 B ({elements})"]
    if address(do) % 16:
        return ["dout data pointer is not 16-byte aligned (cp.async)"]
    return []


def _tf32x3_blockers(p: Problem, views) -> list[str]:
    """Why the tf32x3 backward cannot run: the forward's tf32 conditions plus dout's layout (empty when it can)."""
    blockers = _tf32_blockers(p, None if views is None else views[:3])
    if views is not None and not blockers:
        blockers += _dout_blockers(views[3], "4 elements")
    return blockers


def _choose_tf32x3(p: Problem) -> tuple[str, Any, list[str]]:
    """choose_backward's tf32x3 branch, once nothing blocks it: the config and the reasons."""
    cfg = backward_plan.tf32_config(p.d, p.causal)
    hd = cfg["head_dim"]
    (bn, bm), (bq, bk) = cfg["dkdv"], cfg["dq"]
    reasons = [
        "tf32x3 backward: fp32 on tensor cores (mma.sync m16n8k8 tf32, each fp32 product as 3 tf32 products: "
        "fp32-level accuracy, as SDPA's memory-efficient fp32 backward); D and L·log2(e), then dK/dV over K/V "
        "tiles, and dQ as the dQ lines say",
        f"dkdv: {bn}-key tiles x {bm}-query tiles, {tf32_backward.threads(bn)} threads, "
        f"{tf32_backward.smem_bytes('dkdv', bn, bm, hd)} B shared memory",
        f"dq: {bq}-query tiles x {bk}-key tiles, {tf32_backward.threads(bq)} threads, "
        f"{tf32_backward.smem_bytes('dq', bq, bk, hd)} B shared memory"
        + (f"; dQ in dkdv: {cfg['dkdv_atomic'][0]}-key tiles x {cfg['dkdv_atomic'][1]}-query tiles, "
           f"{tf32_backward.smem_bytes('dkdv', *cfg['dkdv_atomic'], hd, atomic_dq=True)} B shared memory"
           if "dkdv_atomic" in cfg else ""),
    ]
    if hd != p.d:
        reasons.append(f"head dim {p.d} is zero-padded to {hd} inside the kernels")
    if p.H != p.Hkv:
        reasons.append(f"GQA: each dK/dV block loops over the {p.H // p.Hkv} query heads of its group")
    return "tf32x3", cfg, reasons


def explain_backward(q, k, v, *, causal=False, softmax_scale=None, kernel="auto", window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, mask_mod=None, score_mod=None, dropout_p=0.0) -> str:
    """Which kernels ``backward`` runs for inputs like these, their tile configs, and why (for the
    tensor-core path: how dQ is formed with the default deterministic=True and with False)."""
    dropout_p, _ = check_dropout(dropout_p, 0, 0)
    p = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                 alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod, dropout_p=dropout_p)
    if p.score_mod is not None:
        p = replace(p, score_mod=score_mod_with_grad(p.score_mod, score_mod))
    views = None
    if p.kind != arrays.NUMPY:  # device arrays: check their real layout (q's stands in for dout's)
        with _on_device(p.device):
            views = tuple(arrays.to_device_view(x, 0) for x in (q, k, v, q))
    with _on_device(p.device):  # the device decides the tensor-core config (wgmma on sm_90)
        family, cfg, reasons = choose_backward(p, kernel, views)
    if family in ("mma", "tf32x3"):  # after its three kernel lines
        with _on_device(p.device):
            reasons[3:3] = [dq_scheme(p, cfg, det, family)[2] for det in (True, False)]
    return "\n".join(reasons)


def _zeros_like_kind(kind: str, ref: Any, shape: tuple, dtype: str, stream):
    """Zero gradients for the degenerate cases (no queries or no keys): no kernel runs (not recorded
    for a plan: such calls keep the ordinary path)."""
    return arrays.to_host_kind(kind, arrays.alloc_like_kind(kind, ref, shape, dtype, stream, zeroed=True)[0],
                               dtype, stream)


def _zeros_scratch(kind: str, ref: Any, shape: tuple, stream):
    """Zeroed fp32 device scratch, allocated (and memset) by q's framework on its stream; a view."""
    return arrays.zeros_like_kind(kind, ref, shape, "float32", stream)[1]


def tensor_core_scratch(p: Problem, q, cfg: dict, scheme: str, splits, stream) -> tuple:
    """(l2, dd, dq_acc): fp32 L·log2(e) and D rows (B·H, NQ_PAD) and the dQ planes of dq_scheme's choice (None
    for the dq kernel). The planes are zeroed unless the splits' first launch stores each (no mods, not varlen:
    a window's or a pack's key blocks do not cover a plane's rows from its first on)."""
    rows = (p.B * p.H, schedule.padded_rows(p.n_q))
    l2 = arrays.empty_like_kind(p.kind, q, rows, "float32", stream)[1]
    dd = arrays.empty_like_kind(p.kind, q, rows, "float32", stream)[1]
    planes = {"atomic": 1, "splits": splits, "kernel": 0}[scheme]
    shape = (planes * rows[0], rows[1], cfg["head_dim"])
    if scheme == "splits" and not p.mods.any and not p.varlen:  # convert reads only the rows a first launch stored
        return l2, dd, arrays.empty_like_kind(p.kind, q, shape, "float32", stream)[1]
    return l2, dd, (_zeros_scratch(p.kind, q, shape, stream) if planes else None)


def backward(q, k, v, out, lse, dout, *, causal=False, softmax_scale=None, kernel="auto", deterministic=True,
             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, mask_mod=None, score_mod=None, dropout_p=0.0,
             dropout_seed=None, dropout_offset=0):
    """Gradients (dq, dk, dv) of attention, recomputing P tile by tile from the saved L.

    Args:
        q, k, v: the forward's inputs, exactly as for ``forward`` (shapes (B, H, Nq, d) and
            (B, Hkv, Nk, d) or the batch-less forms; GQA/MQA with H % Hkv == 0; float32,
            float16 or bfloat16; CuPy / PyTorch CUDA / Numba / ``__cuda_array_interface__``
            arrays viewed without copies, or NumPy arrays copied to the GPU and back).
        out, lse: the forward's outputs for these q, k, v and the same ``causal`` and
            ``softmax_scale``: out of q's shape and dtype, lse float32 of shape q.shape[:-1]
            (natural-log logsumexp; -inf marks a fully masked row).
        dout: the gradient of the loss with respect to out, q's shape and dtype. Any strides
            are read correctly; a last dim that is not contiguous costs coalescing.
        causal, softmax_scale: as for ``forward`` (mask aligned bottom-right: query i sees key
            j iff j <= i + Nk - Nq; scale defaults to 1/sqrt(d)).
        window_size, softcap, alibi_slopes: as for ``forward`` (the same values the forward had). They run on
            the "mma" kernels (mma.sync, and the wgmma dkdv on sm_90) with dQ as below (the deterministic
            splits' planes are then zeroed and every launch adds); softcap's gradient is (1 - tanh²), ALiBi's
            slopes get none.
        mask_mod, score_mod: the forward's user mods (numba_flash.mods), the same functions and aux arrays. A
            score_mod needs its derivative: ``ScoreMod(fn, grad=fn_grad)`` with fn_grad(score, b, h, q_idx,
            kv_idx, *aux) -> d fn / d score at that score (FlexAttention gets it by autograd; here the caller
            writes it); dS is multiplied by it (after softcap's 1 − tanh²). A score_mod without grad is a
            ValueError naming grad. Built into the "mma" kernels (mma.sync dkdv / dq, the wgmma dkdv on sm_90)
            with every dQ scheme; kernel "simt" / "tf32x3" (float32) raise NotImplementedError; no varlen.
        dropout_p, dropout_seed, dropout_offset: the forward's (``forward`` says how the keep mask is drawn): the
            kernels regenerate its mask, dV = (Z ∘ P)ᵀ dO · s and dS = P ∘ (Z ∘ dP · s − D) with s = 2^16 / keep16.
            On the "mma" kernels: sm_90 the wgmma dkdv with dQ as ``deterministic`` says (splits or the dq kernel;
            False: atomic adds, not bitwise repeatable); sm_80-89 the mma.sync dkdv and the dq kernel either way
            (bitwise repeatable, 7 tile products). float32 / SIMT and varlen raise NotImplementedError.
        kernel: "auto" (default), "mma", "simt" or "tf32x3". Auto runs tensor cores where the
            forward would: "mma" for float16/bfloat16 with d <= 256 (above d = 128 where the GPU's blocks have
            the tiles' shared memory: sm_90 every d, sm_80 d <= 192, sm_86 / sm_89 none), "tf32x3" for float32 with
            d <= 128 and d % 4 == 0 (each fp32 product as three tf32 products, hi·hi + hi·lo +
            lo·hi: fp32-level accuracy, as SDPA's memory-efficient fp32 backward), both on sm_80+
            with q, k, v and dout rows starting 16-byte aligned; else the SIMT kernels (with a
            ``PerformanceWarning`` for half precision). In the CUDA simulator auto keeps float32
            on SIMT (the tensor-core twins are slow). A named kernel that cannot run raises
            ValueError saying what blocks it; ``explain_backward`` prints the choice and why.
        deterministic: True (default): the same inputs (in the same memory layout: the D pass
            reads 16 bytes at a time only from aligned rows, and adds in another order otherwise)
            give the same bits every run on the same GPU. The tensor-core paths then take, where
            the config says so (fp16/bf16: every head dim on sm_90, configs.MMA_BWD_WGMMA, else d > 64,
            configs.MMA_BWD_TABLE; configs.TF32_BWD_TABLE: every fp32 head dim), the GPU has the
            shared memory, the planes fit
            1 GiB and enough blocks fill the GPU, FA2's deterministic scheme: the dK/dV kernel also forms dQ
            = dS·K (5 tile products instead of 7) and adds it into S fp32 planes of dQ, block x of
            each of ceil(key blocks / S) launches owning plane x, so every element's adds come
            from one lane in stream order; a last kernel sums the planes in order. S follows the
            GPU's SM count (explain_backward prints it), so other GPUs may round differently.
            Otherwise a separate dQ kernel recomputes S and dP over Q tiles (no atomics).
            False: FA2's atomic scheme on the tensor-core paths: every dK/dV block adds dQ into one
            fp32 buffer with atomic adds (summation order, hence the last bits of dq, vary run to
            run); fp16 B4 H16 N4096 d128 on an H200: 329 vs 273 TFLOP/s through autograd
            (benchmarks/DESIGN.md). Where the device lacks the shared memory, both take the dQ
            kernel. The SIMT path is deterministic either way.

    Returns:
        (dq, dk, dv) with the shape, dtype and kind of q, k and v respectively. For GQA/MQA,
        dk and dv are summed over the query heads of each group. A fully masked query row
        contributes nothing and gets dq = 0; keys no query sees get dk = dv = 0. Nq = 0 or
        Nk = 0 give zero (or empty) gradients.

    Method: FA2 (section 3.6.7). D = rowsum(dO ∘ O); a kernel over K/V tiles keeps dK, dV in
    registers while recomputing P = exp(S·scale - L) and dS = P ∘ (dO Vᵀ - D) over the Q tiles,
    and either forms dQ = scale·dS K there too (into fp32 planes, see ``deterministic``) or
    leaves it to a second kernel over Q tiles that recomputes P and dS. Accumulation is fp32.
    float16 / bfloat16 run on tensor cores (mma.sync, and on sm_90 wgmma for the dK/dV kernel
    that forms dQ; P and dS rounded to the input dtype for their products, as in FA2), float32
    on tensor cores as 3xTF32 (or on the SIMT cores). Head dims are zero-padded to the next
    compiled size as in forward.

    Stream: as ``forward`` (the inputs' framework stream; device inputs return without
    synchronising, NumPy inputs after the copy back). Scratch: fp32, one number per query row
    (SIMT), two per query row padded to a multiple of 128 rows (tensor cores), plus where the
    dK/dV kernel forms dQ an fp32 copy of dq's size (rows padded likewise, d to 64, 128, 192 or 256) per
    plane: one, zeroed, for deterministic=False; S (at most schedule.MAX_DQ_SPLITS = 8, and
    1 GiB in all) for the deterministic splits.

    Raises:
        TypeError / ValueError naming what was given and what is accepted: the forward's checks
        for q, k, v, plus out / dout shape and dtype (q's), lse shape (q.shape[:-1]) and dtype
        (float32), all six on one device (or all NumPy).

    Repeated calls with one signature replay a plan, as ``forward`` (numba_flash.plans).
    """
    left, right = window_pair(window_size)
    if mask_mod is not None or score_mod is not None or not _zero(dropout_p):  # (no plan key: each call checks)
        return _backward(q, k, v, out, lse, dout, alibi_slopes, causal, softmax_scale, kernel, deterministic, left,
                         right, softcap, mask_mod, score_mod, dropout_p, dropout_seed, dropout_offset)
    return plans.call(_backward, (q, k, v, out, lse, dout, alibi_slopes),
                      (causal, softmax_scale, kernel, deterministic, left, right, softcap))


def _backward(q, k, v, out, lse, dout, alibi_slopes, causal, softmax_scale, kernel, deterministic, left=-1, right=-1,
              softcap=0.0, mask_mod=None, score_mod=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """``backward`` without plans (plans.call runs it for a new signature and watches)."""
    dropout_p, dropout_words = check_dropout(dropout_p, dropout_seed, dropout_offset)
    p = validate_backward(q, k, v, out, lse, dout, causal=causal, softmax_scale=softmax_scale,
                          window_size=(left, right), softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod,
                          score_mod=score_mod, dropout_p=dropout_p)
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; accepted: {', '.join(KERNELS)}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool; got {deterministic!r}")
    kv_shape = arrays.shape_of(k)
    kinds = (p.kind, arrays.kind_of(k), arrays.kind_of(v))
    with _on_device(p.device):
        stream = arrays.current_stream(q)
        if p.B * p.H * p.n_q * p.n_k == 0:
            choose_backward(p, kernel)  # no kernel runs, but one that cannot take the inputs is refused all the same
            return tuple(_zeros_like_kind(kind, ref, shape, p.dtype, stream)
                         for kind, ref, shape in zip(kinds, (q, k, v), (p.q_shape, kv_shape, kv_shape)))
        qd, kd, vd, od, dod = (arrays.to_device_view(x, stream) for x in (q, k, v, out, dout))
        family, cfg, reasons = choose_backward(p, kernel, (qd, kd, vd, dod))
        if family == "simt" and kernel == "auto" and p.dtype in mma_dkdv.DTYPES:
            plans.warn("numba_flash.backward: " + reasons[-1], PerformanceWarning)
        dq_obj, dq_dev = arrays.empty_like_kind(kinds[0], q, p.q_shape, p.dtype, stream)
        dk_obj, dk_dev = arrays.empty_like_kind(kinds[1], k, kv_shape, p.dtype, stream)
        dv_obj, dv_dev = arrays.empty_like_kind(kinds[2], v, kv_shape, p.dtype, stream)
        lse_d = arrays.to_device_view(lse, stream, ndim=3)
        grads = (arrays.as_4d(dq_dev), arrays.as_4d(dk_dev), arrays.as_4d(dv_dev))
        if family in ("tf32x3", "mma"):
            scheme, splits, _ = dq_scheme(p, cfg, deterministic, family)
            l2, dd, dq_acc = tensor_core_scratch(p, q, cfg, scheme, splits, stream)
            if family == "tf32x3":
                backward_plan.launch_tf32(qd, kd, vd, od, dod, lse_d, l2, dd, *grads, causal=p.mask_causal,
                                          softmax_scale=p.softmax_scale, d=p.d, config=cfg, stream=stream,
                                          dq_acc=dq_acc, dq_splits=splits)
            else:
                mods = p.mods
                alibi = None if alibi_slopes is None else arrays.to_device_view(alibi_slopes, stream, 2)
                backward_plan.launch_mma(qd, kd, vd, od, dod, lse_d, l2, dd, *grads, causal=p.mask_causal,
                                         softmax_scale=p.softmax_scale, dtype=p.dtype, d=p.d, config=cfg,
                                         stream=stream, dq_acc=dq_acc, dq_splits=splits, mods=mods,
                                         window=window_bounds(p.causal, p.window_size) if mods.window else (0, 0),
                                         softcap=p.softcap, alibi=alibi,
                                         aux=user_aux(p, mask_mod, score_mod, stream) + dropout_words)
        else:
            _, delta = arrays.empty_like_kind(p.kind, q, (p.B, p.H, p.n_q), "float32", stream)  # D, scratch
            simt_backward.launch(
                cfg, qd, kd, vd, od, dod, lse_d, delta, *grads,
                causal=p.mask_causal, softmax_scale=p.softmax_scale, dtype=p.dtype, d=p.d, stream=stream,
            )
        return tuple(arrays.to_host_kind(kind, obj, p.dtype, stream)
                     for kind, obj in zip(kinds, (dq_obj, dk_obj, dv_obj)))
