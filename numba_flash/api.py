"""Public entry points: one validation function, then dispatch to a kernel family."""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, replace
from typing import Any

from numba import config as nb_config
from numba import cuda

from . import arrays, plans, ptx
from .blocks.mask import window_bounds, window_kind
from .blocks import rng
from .blocks.mods import Mods
from .configs import (MAX_HEAD_DIM, MMA_HEAD_DIMS, MMA_SMALL_SMEM, MMA_TABLE, MMA_WGMMA, MMA_WGMMA_WS,
                      SMEM_PER_BLOCK_MAX,
                      SMEM_PER_SM, TF32_TABLE, simt_config)
from .kernels import mma_forward, simt_forward, tf32_forward, wgmma_forward, wgmma_ws_forward
from .launch import SIM_LOCK, address, current_device_id

KERNELS = ("auto", "simt", "mma", "tf32x3", "tf32")
MMA_MAX_HEAD_DIM = MMA_HEAD_DIMS[-1]  # the tensor-core forward (fp16 / bf16)
MMA_BWD_MAX_HEAD_DIM = 256  # the tensor-core backward (above d = 128: mma_dkdv's split layout)
TF32_MAX_HEAD_DIM = 128
TF32_KERNELS = {"tf32x3": 3, "tf32": 1}  # kernel name: tf32 products per fp32 product
GRID_Y_MAX = 65535
# The kernels form s·scale·log2(e) in fp32 (at most ~2**128): a scale <= 2**64 keeps it finite for every
# score |s| < 2**63, which covers any fp16 input (|s| <= 256·65504² < 2**41). No lower bound is needed:
# a scale·log2(e) that underflows to 0 gives uniform weights, the exact limit to fp32 precision.
MAX_SOFTMAX_SCALE = 2.0**64


class PerformanceWarning(UserWarning):
    """forward ran a slower kernel than the inputs' dtype could use (explain() says why)."""


_ACCEPTED_ARRAYS = (
    "a CuPy array, a PyTorch CUDA tensor, a Numba device array, any object with "
    "__cuda_array_interface__, or a NumPy array"
)


@dataclass
class Problem:
    """A validated forward call, normalised to (B, H, Nq, d) / (B, Hkv, Nk, d)."""

    kind: str
    dtype: str
    q_shape: tuple
    B: int
    H: int
    Hkv: int
    n_q: int
    n_k: int
    d: int
    causal: bool
    softmax_scale: float
    device: int | None
    window_size: tuple = (-1, -1)  # validated; -1 unbounded (a side >= Nk is stored as -1)
    softcap: float = 0.0
    alibi_shape: tuple | None = None  # the slopes' shape, (H,) or (B, H)
    varlen: bool = False  # packed sequences (numba_flash.varlen): q_shape (total_q, H, d), B sequences, n_q / n_k the longest
    mask_mod: Any = None  # blocks.mods.UserMod of a user mask (numba_flash.mods), its aux types in it
    score_mod: Any = None  # blocks.mods.UserMod of a user score mod
    dropout_p: float = 0.0  # > 0: dropout on P (blocks/rng.py)

    @property
    def mods(self) -> Mods:
        """The kernel switches: a window of (-1, 0) is causal and (-1, -1) none (their kernels, no window)."""
        return Mods(window=window_kind(self.causal, self.window_size) == "window", softcap=self.softcap > 0,
                    alibi=self.alibi_shape is not None, mask_mod=self.mask_mod, score_mod=self.score_mod,
                    dropout=self.dropout_p > 0)

    @property
    def mask_causal(self) -> bool:
        """causal as the kernels take it: window_size (-1, 0) is causal too."""
        return window_kind(self.causal, self.window_size) == "causal" or (self.causal and self.mods.window)

    @property
    def lse_shape(self) -> tuple:
        return (self.H, self.q_shape[0]) if self.varlen else self.q_shape[:-1]  # varlen: flash-attn's (H, total_q)


def _as_4d(shape: tuple) -> tuple:
    return (1,) * (4 - len(shape)) + tuple(shape)


def window_pair(window_size: Any) -> tuple:
    """flash-attn's window_size=(left, right) as two Python ints, each -1 (unbounded) or >= 0."""
    if type(window_size) is tuple and len(window_size) == 2:  # the common case, without the ABC checks below
        left, right = window_size
        if type(left) is int and type(right) is int and left >= -1 and right >= -1:
            return window_size
    ok = isinstance(window_size, (tuple, list)) or (hasattr(window_size, "ndim") and window_size.ndim == 1)
    if not ok or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, each -1 (unbounded) or >= 0; "
                        f"got {window_size!r}")
    out = []
    for side, x in zip(("left", "right"), window_size):
        if not isinstance(x, numbers.Integral) and getattr(x, "ndim", None) == 0 and hasattr(x, "item"):
            x = x.item()  # a 0-d tensor or array (flash-attn's tests draw the window with torch.randint)
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"window_size {side} must be an int (-1 for unbounded, or >= 0); got {x!r} in {window_size!r}")
        if x < -1:
            raise ValueError(f"window_size {side} = {x}: accepted -1 (unbounded) or >= 0; got {window_size!r}")
        out.append(int(x))
    return tuple(out)


def unbounded_past_keys(window: tuple, n_k: int) -> tuple:
    """flash-attn's rule: a window side >= Nk reaches past every key, so it is unbounded (-1)."""
    return tuple(-1 if side >= n_k else side for side in window)


def _check_softcap(softcap: Any) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (0.0: off); got {softcap!r}")
    try:
        cap = float(softcap)
    except OverflowError:  # an int past the float range: too large, as below
        cap = math.inf
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0.0: off; scores become softcap·tanh(s / softcap)); "
                         f"got {softcap!r}")
    return cap


def check_dropout(dropout_p: Any, dropout_seed: Any, dropout_offset: Any) -> tuple:
    """(dropout_p, (seed_lo, seed_hi, offset, keep16)) of a call's dropout arguments, checked; () words for p = 0.
    The kept fraction is keep16 / 2^16 with keep16 = round((1 - p)·2^16) (blocks/rng.py)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a real number in [0, 1) (0.0: off); got {dropout_p!r}")
    if int(round((1.0 - float(dropout_p)) * 65536)) == 0:
        raise ValueError(f"dropout_p = {dropout_p!r} keeps less than one draw in 2**16 (the kernels' resolution: the "
                         "kept fraction is round((1 - p)·2**16) / 2**16); accepted: p < 1 - 2**-17")
    p = float(dropout_p)
    if not p:
        return 0.0, ()
    for name, x, bits in (("dropout_seed", dropout_seed, 64), ("dropout_offset", dropout_offset, 32)):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= int(x) < 2**bits:
            raise TypeError(f"{name} must be an int in [0, 2**{bits}) with dropout_p > 0 (the backward needs the "
                            f"same one to regenerate the mask); got {x!r}")
    seed_lo, seed_hi = rng.seed_words(int(dropout_seed))
    return p, (seed_lo, seed_hi, int(dropout_offset), rng.keep16_of(p))


def _fp32_ratio_ok(x: float) -> bool:
    """x (a launch argument the kernels take in fp32) is finite and nonzero there."""
    return 2.0**-126 <= abs(x) < 2.0**128


def side_array(name: str, x: Any, kind_q: str, device, dtype: str, shape_words: str) -> tuple:
    """The shape of an array argument beside q, k, v (the ALiBi slopes, varlen's offsets), after the checks they
    share: one of the accepted kinds, on the GPU where q is (one device) or NumPy with NumPy q, readable, and of
    ``dtype`` (shape_words: the accepted shape, for the message)."""
    kind = arrays.kind_of(x)
    if kind is None:
        raise TypeError(f"{name} must be a {dtype} array of shape {shape_words} ({_ACCEPTED_ARRAYS}); "
                        f"got {type(x).__module__}.{type(x).__name__}")
    if (kind == arrays.NUMPY) != (kind_q == arrays.NUMPY):
        raise TypeError(f"{name} is a {kind} array and q a {kind_q} array: pass both on the GPU, or both NumPy")
    if kind == arrays.TORCH and not x.is_cuda:
        raise TypeError(f"{name} is a PyTorch tensor on {x.device}; pass a CUDA tensor")
    arrays.refuse_unreadable(name, x, kind)
    dt = arrays.dtype_name(x)
    if dt != dtype:
        raise TypeError(f"{name} has dtype {dt}; accepted: {dtype} (as flash-attn takes it)")
    dev = arrays.device_of(x)
    if dev is not None and device is not None and dev != device:
        raise ValueError(f"{name} is on device {dev} and q on device {device}; put them on one GPU")
    return tuple(arrays.shape_of(x))


def _check_alibi(alibi_slopes: Any, kind_q: str, B: int, H: int, device, q_ndim: int = 4) -> tuple:
    """The shape of validated ALiBi slopes: float32, (H,) or (B, H) (a batch axis needs q's), where q is; NumPy
    slopes must be finite (device slopes are not read back to check)."""
    shape = side_array("alibi_slopes", alibi_slopes, kind_q, device, "float32", "(H,) or (B, H)")
    accepted = ((H,), (B, H)) if q_ndim == 4 else ((H,),)
    if shape not in accepted:
        what = f"(H,) = ({H},) or (B, H) = ({B}, {H})" if q_ndim == 4 else f"(H,) = ({H},) (q has no batch axis)"
        raise ValueError(f"alibi_slopes has shape {shape}; accepted: {what}")
    if arrays.kind_of(alibi_slopes) == arrays.NUMPY:
        import numpy as np

        if not np.isfinite(alibi_slopes).all():
            raise ValueError("alibi_slopes must be finite; got a NaN or inf (slope · 0 would be NaN at the diagonal)")
    return shape


def validate(q: Any, k: Any, v: Any, *, causal: Any = False, softmax_scale: Any = None, window_size: Any = (-1, -1),
             softcap: Any = 0.0, alibi_slopes: Any = None, packed: tuple | None = None, mask_mod: Any = None,
             score_mod: Any = None, kv_batch_free: bool = False, dropout_p: float = 0.0) -> Problem:
    """Check everything about a forward call in one place; raise with what was given and accepted.

    mask_mod, score_mod: numba_flash.mods.MaskMod / ScoreMod (or bare functions), their aux arrays checked.

    packed: (B, max_seqlen_q, max_seqlen_k) of a varlen call (numba_flash.varlen, which checks them): q, k, v are
    then packed (total, heads, d) arrays of B sequences. kv_batch_free: k / v's first dim is not q's batch (a
    paged cache's pages, or the rows cache_batch_idx picks; numba_flash.decode checks it)."""
    kinds = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        kind = arrays.kind_of(x)
        if kind is None:
            raise TypeError(f"{name} must be {_ACCEPTED_ARRAYS}; got {type(x).__module__}.{type(x).__name__}")
        if kind == arrays.TORCH and not x.is_cuda:
            raise TypeError(f"{name} is a PyTorch tensor on {x.device}; pass a CUDA tensor (or a NumPy array)")
        arrays.refuse_unreadable(name, x, kind)
        kinds[name] = kind
    host = {n for n, kd in kinds.items() if kd == arrays.NUMPY}
    if host and len(host) != 3:
        raise TypeError(
            f"q, k, v must all be on the GPU or all be NumPy arrays; got q={kinds['q']}, "
            f"k={kinds['k']}, v={kinds['v']}"
        )

    dtypes = {n: arrays.dtype_name(x) for n, x in (("q", q), ("k", k), ("v", v))}
    for name, dt in dtypes.items():
        if dt not in arrays.DTYPES:
            raise TypeError(f"{name} has dtype {dt}; accepted: {', '.join(arrays.DTYPES)} (all three the same)")
    if len(set(dtypes.values())) != 1:
        raise TypeError(
            f"q, k, v must share one dtype; got q={dtypes['q']}, k={dtypes['k']}, v={dtypes['v']}"
        )

    shapes = {n: arrays.shape_of(x) for n, x in (("q", q), ("k", k), ("v", v))}
    for name, shp in shapes.items():
        if packed is not None and len(shp) != 3:
            raise ValueError(f"{name} has shape {shp}; varlen takes packed arrays: (total_q, H, d) for q, "
                             "(total_k, Hkv, d) for k and v")
        if len(shp) not in (2, 3, 4):
            raise ValueError(
                f"{name} has shape {shp}; accepted: (B, H, N, d), (H, N, d) or (N, d)"
            )
    if not len(shapes["q"]) == len(shapes["k"]) == len(shapes["v"]):
        raise ValueError(f"q, k, v must have the same number of dims; got shapes {shapes['q']}, {shapes['k']}, {shapes['v']}")
    if packed is not None:  # (total, heads, d): the lengths are the sequences' (the caller checked them)
        B, n_q, n_k = packed
        Bk = B
        _, H, d = shapes["q"]
        _, Hkv, dk = shapes["k"]
    else:
        B, H, n_q, d = _as_4d(shapes["q"])
        Bk, Hkv, n_k, dk = _as_4d(shapes["k"])
    if shapes["k"] != shapes["v"]:
        raise ValueError(f"k and v must have the same shape; got k {shapes['k']}, v {shapes['v']}")
    if Bk != B and not kv_batch_free:
        raise ValueError(f"batch mismatch: q has B={B}, k/v have B={Bk}")
    if dk != d:
        raise ValueError(f"head dim mismatch: q has d={d}, k/v have d={dk} (v's head dim must equal q's)")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim d={d} is not supported; accepted: 1 <= d <= {MAX_HEAD_DIM}")
    if (Hkv < 1 or H % Hkv) and not H == Hkv == 0:  # no heads at all: empty outputs, as forward's docstring says
        raise ValueError(
            f"q has H={H} heads and k/v have Hkv={Hkv}; H must be a multiple of Hkv >= 1 (GQA/MQA), "
            f"or H = Hkv = 0 (empty outputs)"
        )
    if B * H > GRID_Y_MAX:
        raise ValueError(f"B*H = {B * H} (B={B}, H={H}); at most {GRID_Y_MAX} batch-heads per call")

    if not isinstance(causal, (bool,)) and not (hasattr(causal, "dtype") and causal.dtype == bool):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    if getattr(causal, "size", 1) != 1:  # bool() of it would be numpy's 'truth value is ambiguous'
        raise TypeError(f"causal must be a bool (a Python bool, or a NumPy bool scalar or one-element bool array); "
                        f"got a bool array of shape {tuple(causal.shape)}")
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(d)  # from the user's d, not the padded one
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a real number or None; got {softmax_scale!r}")
        try:
            scale = float(softmax_scale)
        except OverflowError:  # an int past the float range (10**400): too large, or <= 0, as below
            scale = 2 * MAX_SOFTMAX_SCALE if softmax_scale > 0 else -1.0
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"softmax_scale must be finite and > 0; got {softmax_scale!r}")
        if scale > MAX_SOFTMAX_SCALE:
            raise ValueError(f"softmax_scale = {softmax_scale!r} is too large; accepted: finite, > 0 and at most "
                             f"2**64 = {MAX_SOFTMAX_SCALE:.4g} (the kernels form score·scale·log2(e) in fp32, which "
                             "a larger scale can overflow for scores of fp16 size)")

    devices = {n: arrays.device_of(x) for n, x in (("q", q), ("k", k), ("v", v))}
    known = {dv for dv in devices.values() if dv is not None}
    if len(known) > 1:
        raise ValueError(f"q, k, v are on different devices: {devices}; put them on one GPU")

    window = window_pair(window_size)
    if causal and window[1] not in (-1, 0):
        raise ValueError(f"causal=True is window_size right = 0; got window_size={window_size!r} (pass right = 0 "
                         "or -1 with causal, or causal=False with the window you mean)")
    window = unbounded_past_keys(window, n_k)
    cap = _check_softcap(softcap)
    if cap and not (_fp32_ratio_ok(cap / scale) and _fp32_ratio_ok(scale / cap)):
        raise ValueError(f"softcap = {softcap!r} with softmax_scale = {scale:g}: the kernels take softcap / scale and "
                         "scale / softcap in fp32; accepted: both between 2**-126 and 2**128, i.e. "
                         f"{scale * 2.0**-126:.3g} <= softcap < {scale * 2.0**127:.3g}")
    device = known.pop() if known else None
    alibi_shape = None
    if alibi_slopes is not None:
        alibi_shape = _check_alibi(alibi_slopes, kinds["q"], B, H, device, 4 if packed else len(shapes["q"]))
        if not _fp32_ratio_ok(1.0 / scale):
            raise ValueError(f"softmax_scale = {scale:g} with alibi_slopes: the kernels take 1 / scale in fp32; accepted "
                             "with ALiBi: softmax_scale >= 2**-127")
    if score_mod is not None:
        check_score_mod_scale(scale)
    user = {}
    for name, mod in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        if mod is not None:
            if packed is not None:
                raise NotImplementedError(f"{name} with varlen (packed sequences): not built; pass a dense batch, "
                                          "or numba_flash.mods.document_mask for packed documents")
            user[name] = _check_user_mod(name, mod, kinds["q"], device, (B, H, n_q, n_k))
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be a real number in [0, 1) (0.0: off); got {dropout_p!r}")
    if dropout_p and packed is not None:
        raise NotImplementedError(f"dropout_p={dropout_p} with varlen (packed sequences): not built; dropout runs on "
                                  "dense batches")
    return Problem(
        kind=kinds["q"], dtype=dtypes["q"], q_shape=shapes["q"], B=B, H=H, Hkv=Hkv,
        n_q=n_q, n_k=n_k, d=d, causal=bool(causal), softmax_scale=scale,
        device=device, window_size=window, softcap=cap, alibi_shape=alibi_shape, varlen=packed is not None,
        dropout_p=float(dropout_p), **user,
    )


def check_score_mod_scale(scale: float) -> None:
    """A score mod sees scale·s and the kernels take its result back with 1 / scale in fp32: refuse a scale whose
    inverse overflows (it would turn every score into inf or NaN)."""
    if not _fp32_ratio_ok(1.0 / scale):
        raise ValueError(f"softmax_scale = {scale:g} with a score_mod: the kernels take 1 / scale in fp32; accepted "
                         "with a score_mod: softmax_scale >= 2**-127")


def _check_user_mod(name: str, mod: Any, kind_q: str, device, sizes: tuple):
    """The kernel build argument (blocks.mods.UserMod) of a validated user mod: its aux arrays where q is, of the
    dtypes numba_flash.mods.AUX_DTYPES, shaped as the mod says (document_mask: (B, Nq), (B, Nk))."""
    from . import mods as user_mods

    mod = user_mods.as_mask_mod(mod) if name == "mask_mod" else user_mods.as_score_mod(mod)
    types = []
    expected = tuple(mod.aux_shapes(*sizes)) if mod.aux_shapes is not None else (None,) * len(mod.aux)
    if len(expected) != len(mod.aux):
        raise ValueError(f"{name}: aux_shapes gave {len(expected)} shapes for {len(mod.aux)} aux arrays; accepted: "
                         "one shape (or None) per array")
    for i, (x, want) in enumerate(zip(mod.aux, expected)):
        what = f"{name} aux[{i}]"
        kind = arrays.kind_of(x)
        dt = arrays.dtype_name(x) if kind is not None else None
        shape = side_array(what, x, kind_q, device, dt if dt in user_mods.AUX_DTYPES else "one of "
                           + "/".join(user_mods.AUX_DTYPES), "any")
        if not shape:
            raise ValueError(f"{what} is 0-dimensional; pass an array of at least one dim (a scalar belongs in the "
                             "mod's closure)")
        if want is not None and tuple(shape) != tuple(want):
            raise ValueError(f"{what} has shape {tuple(shape)}; accepted: {tuple(want)}")
        types.append((dt, len(shape)))
    return mod.spec(tuple(types))


def user_aux(p: Problem, mask_mod: Any, score_mod: Any, stream) -> tuple:
    """The user mods' aux arrays as device views, the mask's first (the kernels' launch arguments)."""
    from . import mods as user_mods

    mods = (user_mods.as_mask_mod(mask_mod), user_mods.as_score_mod(score_mod))
    return sum((aux_views(mod, stream) for mod in mods if mod is not None), ())


def aux_views(mod, stream) -> tuple:
    """A user mod's aux arrays as device views (NumPy ones copied to the GPU on ``stream``)."""
    return tuple(arrays.to_device_view(x, stream, len(arrays.shape_of(x))) for x in mod.aux)


def _mma_blockers(p: Problem, views=None, max_head_dim: int = MMA_MAX_HEAD_DIM) -> list[str]:
    """Why the tensor-core kernel cannot take this problem (empty when it can); max_head_dim: the forward's
    (the backward passes MMA_BWD_MAX_HEAD_DIM)."""
    out = []
    if p.dtype not in mma_forward.DTYPES:
        out.append(f"dtype {p.dtype}: kernel 'mma' takes float16/bfloat16 (float32 has kernel='tf32x3')")
    if p.d > max_head_dim:
        out.append(f"head dim {p.d} > {max_head_dim}")
    if not nb_config.ENABLE_CUDASIM and cuda.is_available():
        cc = ptx.compute_capability(p.device)  # None (Numba, CAI arrays): the current device
        if cc < (8, 0):
            out.append(f"GPU compute capability {cc} < (8, 0): no mma.sync m16n8k16 / cp.async")
    if not out:
        out += _cp_async_blockers(p, views, 2)
    return out


def _cp_async_blockers(p: Problem, views, itemsize: int) -> list[str]:
    """Layout the tensor-core kernels' 16-byte cp.async copies need, for elements of itemsize bytes."""
    per = 16 // itemsize
    if views is None:  # NumPy inputs are copied C-contiguous: only the row length matters
        if (p.d * itemsize) % 16:
            return [f"rows of {p.d} x {itemsize} B: cp.async needs rows that are multiples of 16 B (d % {per} == 0)"]
        return []
    out = []
    for name, x in zip("qkv", views):
        if x.strides[-1] != x.dtype.itemsize or any(st % 16 for st in x.strides[:-1]):
            out.append(f"{name} strides {tuple(x.strides)} B: cp.async needs a unit-stride last dim "
                       f"and other strides that are multiples of 16 B ({per} elements)")
        elif address(x) % 16:
            out.append(f"{name} data pointer is not 16-byte aligned (cp.async)")
    return out


def _tf32_blockers(p: Problem, views=None) -> list[str]:
    """Why the fp32 tensor-core kernel cannot take this problem (empty when it can)."""
    out = []
    if p.dtype != "float32":
        out.append(f"dtype {p.dtype}: the tf32 kernels take float32 (float16/bfloat16 have kernel='mma')")
    if p.d > TF32_MAX_HEAD_DIM:
        out.append(f"head dim {p.d} > {TF32_MAX_HEAD_DIM}")
    if not nb_config.ENABLE_CUDASIM and cuda.is_available():
        cc = ptx.compute_capability(p.device)
        if cc < (8, 0):
            out.append(f"GPU compute capability {cc} < (8, 0): no tf32 mma.sync / cp.async")
    if not out:
        out += _cp_async_blockers(p, views, 4)
    return out


def tf32_config(d: int, causal: bool):
    """fp32 tensor-core tile (configs.TF32_TABLE): the Tile tf32_forward.launch takes."""
    return TF32_TABLE[tf32_forward.head_dim_for(d), bool(causal)]


def mma_config(d: int, causal: bool, plain: bool = False, sync: bool = False):
    """The tensor-core forward's tile for head dim d (from the sweeps): on sm_90 MMA_WGMMA_WS's for a ``plain``
    call (flag "ws": kernels/wgmma_ws_forward.py; see ws_blockers) where it has one, else MMA_WGMMA's (flag
    "wgmma": kernels/wgmma_forward.py); elsewhere MMA_TABLE's, or MMA_SMALL_SMEM's on a GPU with less shared memory
    per block than that tile needs (sm_80: 163 KiB, sm_86 / sm_89: 99 KiB). Launch it with launch_mma_forward,
    which picks the kernel module by the flag. sync: the mma.sync tile on any GPU (dropout: the only forward with it)."""
    key = next(hd for hd in MMA_HEAD_DIMS if hd >= d), bool(causal)
    if plain and not sync and key in MMA_WGMMA_WS and _ws_here():
        return MMA_WGMMA_WS[key]
    if not sync and key in MMA_WGMMA and _wgmma_here():
        return MMA_WGMMA[key]
    tile = MMA_TABLE[key]
    if key in MMA_SMALL_SMEM and mma_forward.smem_bytes(tile) > _device_smem()[0]:
        return MMA_SMALL_SMEM[key]
    return tile


def _wgmma_here() -> bool:
    """The current device has warpgroup MMA (sm_90; the simulator's twins too); False without a GPU (explain on
    shapes describes the mma.sync tiles every sm_80+ GPU runs)."""
    return bool(nb_config.ENABLE_CUDASIM or cuda.is_available()) and ptx.current_wgmma()


def _ws_here() -> bool:
    """The warp-specialised TMA forward is auto's choice here: an sm_90 GPU. Not in the CUDA simulator, where its
    twins run (tests/kernels/test_wgmma_ws_forward.py) but 12 simulated warps a block would slow every forward
    test; tests that want it there patch this."""
    return not nb_config.ENABLE_CUDASIM and _wgmma_here()


def ws_blockers(p: Problem, views=None) -> list[str]:
    """Why a tensor-core call does not take the warp-specialised forward's tile (empty when it does): TMA needs every
    stride of a dim > 1 positive (varlen's views repeat the pack along the batch with stride 0: its maps cover the
    pack once) and 16-byte rows of O (d % 8 == 0). The masks and mods (window, softcap, ALiBi, user mods, a
    BlockMask) and varlen run in it."""
    out = []
    if p.n_k == 0:
        out.append("Nk = 0: no keys to load (the wgmma forward writes O = 0, L = -inf)")
    if p.d % 8:  # O is ours, contiguous: its map (TMA store) needs 16-byte rows
        out.append(f"O rows of {p.d} x 2 B are not a multiple of 16 B, which a TMA map needs")
    for name, x in zip("qkv", views or ()):
        dims = list(zip(x.strides, x.shape))[1 if p.varlen else 0:]
        if any(st <= 0 for st, n in dims if n > 1):
            out.append(f"{name} strides {tuple(x.strides)} B: a TMA map needs positive strides (a broadcast dim "
                       "runs on the wgmma forward)")
    return out


def launch_mma_forward(q, k, v, out, lse, tile, **kw):
    """The tensor-core forward of a tile from mma_config: kernels/wgmma_ws_forward.py for a "ws" tile (its TMA maps
    check the layout themselves), kernels/wgmma_forward.py for a "wgmma" tile, else kernels/mma_forward.py (keyword
    arguments: their launch's)."""
    if tile.has("ws"):
        if tile.has("persistent"):
            from .decode import _sm_count  # (decode imports this module)

            kw["n_sm"] = _sm_count()
        return wgmma_ws_forward.launch(q, k, v, out, lse, tile, **{key: val for key, val in kw.items()
                                                                    if key != "layout_checked"})
    return (wgmma_forward if tile.has("wgmma") else mma_forward).launch(q, k, v, out, lse, tile, **kw)


def _device_smem() -> tuple:
    """(opt-in shared memory per block, shared memory per SM) of the current device; the simulator, no GPU (explain
    on shapes) and device stand-ins without the attributes: an H200's."""
    if nb_config.ENABLE_CUDASIM or not cuda.is_available():
        return SMEM_PER_BLOCK_MAX, SMEM_PER_SM
    return _device_smem_of(current_device_id())


@functools.lru_cache(maxsize=None)
def _device_smem_of(device_id) -> tuple:  # one driver query per device
    dev = cuda.get_current_device()
    return (int(getattr(dev, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", SMEM_PER_BLOCK_MAX)),
            int(getattr(dev, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", SMEM_PER_SM)))


_TF32_VARIANT_WORDS = {"presplit": "K/V split into tf32 hi/lo once per tile, not per warp",
                       "grid_bh_x": "heaviest causal Q tiles of every head first"}
# the mma kernel's flags (None: what every mma tile does, no flag selects it), in the order explain says them
_VARIANT_WORDS = {"smem_epilogue": "O stored through shared memory (16-byte stores)",
                  "grid_bh_x": "heaviest causal Q tiles of every head first",
                  "stages": "double-buffered K/V", "warp_skip": "warps skip tiles their rows cannot see",
                  "lazy_rescale": "running max moved only when a tile exceeds it by 2^8 (O rescaled rarely)"}
_MMA_ALWAYS = ("stages", "lazy_rescale")
# the warp-specialised forward's flags (kernels/wgmma_ws_forward.py), in the order explain says them
_WS_VARIANT_WORDS = {"setmaxnreg": "registers moved from the producer to the consumers (setmaxnreg)",
                     "pingpong": "the two consumers' products take turns, one's softmax under the other's GEMMs",
                     "overlap": "Q·K_{j+1}ᵀ in flight during tile j's softmax",
                     "tma_store": "O stored through shared memory by TMA",
                     "grid_bh_x": "heaviest causal Q tiles of every head first"}


def choose_kernel(p: Problem, kernel: str = "auto", views=None, not_ws: list | None = None
                  ) -> tuple[str, Any, list[str]]:
    """(family, config, reasons): which kernel runs for a validated problem, and why.

    ``views`` (the device views of q, k, v) lets the layout checks run; without them (explain on
    shapes only) a contiguous layout is assumed. ``not_ws``: why the warp-specialised forward cannot take it
    (_choose_with_mods asks for the plain problem's tile with its mods' reasons).
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; accepted: {', '.join(KERNELS)}")
    if p.mods.any:
        return _choose_with_mods(p, kernel, views, not_ws)
    if p.mask_causal != p.causal:  # window_size (-1, 0): the causal kernel
        from dataclasses import replace

        p = replace(p, causal=True, window_size=(-1, -1))
    # In the CUDA simulator auto keeps fp32 on SIMT: the tf32 kernel's tensor-core twins are slow there
    # (each mma is a 32-thread rendezvous: six forward tests took 7.7 min); kernel="tf32x3" runs it anyway.
    if kernel in TF32_KERNELS or (kernel == "auto" and p.dtype == "float32" and not nb_config.ENABLE_CUDASIM):
        tf32_blockers = _tf32_blockers(p, views)
        if kernel != "auto" and tf32_blockers:
            raise ValueError(f"kernel={kernel!r} cannot run this problem: " + "; ".join(tf32_blockers))
        if not tf32_blockers:
            passes = TF32_KERNELS.get(kernel, 3)
            cfg = tf32_config(p.d, p.causal)
            how = ("each fp32 product as 3 tf32 products (hi·hi + hi·lo + lo·hi): fp32-level accuracy, as PyTorch "
                   "SDPA's memory-efficient kernel does for fp32" if passes == 3 else
                   "inputs rounded to tf32 (10-bit mantissa): about 1e-3 relative error, like torch's allow_tf32")
            reasons = [f"{'tf32x3' if passes == 3 else 'tf32'}: fp32 on tensor cores (mma.sync m16n8k8 tf32, fp32 "
                       f"accumulate), {how}; {cfg.block_q}x{cfg.block_k} tiles, {cfg.block_q // 16} warps x 16 "
                       f"rows, head dim {cfg.head_dim}"]
            variants = [words for key, words in _TF32_VARIANT_WORDS.items()
                        if cfg.has(key) and not (key == "presplit" and passes == 1)]  # one pass has no lo to split
            if variants:
                reasons.append("variants: " + "; ".join(variants))
            if cfg.head_dim != p.d:
                reasons.append(f"head dim {p.d} is zero-padded to {cfg.head_dim} inside the kernel")
            return ("tf32x3" if passes == 3 else "tf32"), cfg, reasons
    blockers = _mma_blockers(p, views)
    if kernel == "mma" and blockers:
        raise ValueError("kernel='mma' cannot run this problem: " + "; ".join(blockers))
    if kernel in ("auto", "mma") and not blockers:
        ws_here = _ws_here()
        ws_why = (not_ws or ws_blockers(p, views)) if ws_here else []
        cfg = mma_config(p.d, p.causal, plain=True) if ws_here and not ws_why else mma_config(p.d, p.causal)
        head_dim, m_tiles = cfg.head_dim, mma_forward.m_tiles(cfg)
        if cfg.has("ws"):
            reasons = [f"mma: tensor cores (sm_90, warp-specialised: a producer warpgroup loads Q, K and V by TMA "
                       f"into a {cfg.stages}-slot mbarrier ring, {wgmma_ws_forward.consumers(cfg)} consumer "
                       f"warpgroups x 64 rows run wgmma.mma_async m64n{cfg.block_k}k16 for Q·Kᵀ and "
                       f"m64n{head_dim}k16 for P·V with P from registers; {p.dtype} in, fp32 accumulate), "
                       f"{cfg.block_q}x{cfg.block_k} tiles, head dim {head_dim}"]
            variants = [words for key, words in _WS_VARIANT_WORDS.items()
                        if cfg.has(key) and not (key == "tma_store" and p.varlen)]
            if p.varlen and cfg.has("tma_store"):
                reasons.append("varlen: O stored from the fragments, not by the tile's TMA store (a Q tile's box "
                               "runs past its sequence's rows)")
        elif cfg.has("wgmma"):
            reasons = [f"mma: tensor cores (sm_90 warpgroup MMA: wgmma.mma_async m64n{cfg.block_k}k16 for Q·Kᵀ, "
                       f"m64n{head_dim}k16 for P·V with P from registers; {p.dtype} in, fp32 accumulate), "
                       f"{cfg.block_q}x{cfg.block_k} tiles, {cfg.warps // 4} warpgroups x 64 rows, head dim {head_dim}"]
            variants = [words for key, words in _VARIANT_WORDS.items() if key in _MMA_ALWAYS or cfg.has(key)]
            if (cfg.head_dim, p.causal) in MMA_WGMMA_WS and ws_why:
                reasons.append("not the warp-specialised TMA forward: " + "; ".join(ws_why))
        else:
            reasons = [f"mma: tensor cores (mma.sync m16n8k16, {p.dtype} in, fp32 accumulate), "
                       f"{cfg.block_q}x{cfg.block_k} tiles, {cfg.warps} warps x {16 * m_tiles} rows, "
                       f"head dim {head_dim}"]
            variants = [words for key, words in _VARIANT_WORDS.items() if key in _MMA_ALWAYS or cfg.has(key)]
        reasons.append("variants: " + "; ".join(variants))
        if cfg.has("smem_epilogue") and p.d % 8:  # out is ours, contiguous: rows of 2·d bytes
            reasons.append(f"O rows of {p.d} x 2 B are not 16-byte aligned: O is stored from the fragments, "
                           "not through shared memory")
        if head_dim != p.d:
            reasons.append(f"head dim {p.d} is zero-padded to {head_dim} inside the kernel")
        if p.d % 8:
            reasons.append(f"head dim {p.d} % 8 != 0: each row's last 16-byte copy is part data, part zeros "
                           "(cp.async src-size: two more instructions per copy than the all-or-nothing form)")
        return "mma", cfg, reasons
    cfg = simt_config(p.d)
    reasons = [f"simt: {cfg.block_q}x{cfg.block_k} tiles, {cfg.threads} threads, "
               f"{cfg.smem_bytes} B shared memory, fp32 FMA"]
    if cfg.head_dim != p.d:
        reasons.append(f"head dim {p.d} is zero-padded to {cfg.head_dim} inside the kernel")
    if p.dtype in mma_forward.DTYPES:
        why = "kernel='simt' was asked for" if kernel == "simt" else "; ".join(blockers)
        reasons.append(f"{p.dtype} widened to fp32 on the SIMT path, not tensor cores: {why}")
    elif p.dtype == "float32":
        if kernel == "simt":
            why = "kernel='simt' was asked for"
        elif _tf32_blockers(p, views):
            why = "; ".join(_tf32_blockers(p, views))
        else:  # only the simulator gets here: auto skips tf32x3 there
            why = "the CUDA simulator runs fp32 on SIMT unless kernel='tf32x3' is asked for (its twins are slow)"
        reasons.append(f"float32 on the SIMT path (fp32 FMA), not the tf32x3 tensor-core kernel: {why}")
    return "simt", cfg, reasons


def mods_words(p: Problem) -> str:
    """The problem's window / softcap / ALiBi in words (explain, errors)."""
    words = []
    if p.mods.window:
        left, right = window_bounds(p.causal, p.window_size)
        side = lambda x: "unbounded" if x == window_bounds(False, (-1, -1))[0] else str(x)  # noqa: E731
        words.append(f"sliding window (left {side(left)}, right {side(right)}{', causal' if p.causal else ''})")
    if p.mods.softcap:
        words.append(f"softcap {p.softcap:g}")
    if p.mods.alibi:
        words.append(f"ALiBi slopes {p.alibi_shape}")
    for name in ("score_mod", "mask_mod"):
        mod = getattr(p, name)
        if mod is not None:
            words.append(f"{name} {mod!r} (compiled in, called on every score of every visited tile)")
    if p.mods.dropout:
        keep16 = rng.keep16_of(p.dropout_p)
        words.append(f"dropout p={p.dropout_p:g} (Philox4x32-10 in the kernel, kept fraction {keep16}/65536, kept "
                     f"values scaled by 65536/{keep16})")
    return ", ".join(words)


def _choose_with_mods(p: Problem, kernel: str, views, not_ws: list | None = None):
    """A window, softcap or ALiBi: the mma kernel (fp16 / bf16, d <= 256) or the SIMT kernel (any dtype and head
    dim; auto takes it, with its PerformanceWarning, where mma cannot run); the tf32 kernels have no mods."""
    if kernel in TF32_KERNELS:
        raise NotImplementedError(
            f"{mods_words(p)}: not built into kernel={kernel!r}; float32 with them runs on kernel 'simt' (fp32 FMA; "
            "auto takes it; dropout has no float32 kernel)")
    blockers = _mma_blockers(p, views)
    if kernel == "mma" and blockers:
        raise ValueError("kernel='mma' cannot run this problem: " + "; ".join(blockers))
    if p.mods.dropout and (kernel == "simt" or blockers):
        raise NotImplementedError(
            f"dropout_p={p.dropout_p}: built into the mma.sync forward only (kernel 'mma': float16 / bfloat16, "
            f"d <= {MMA_MAX_HEAD_DIM}, 16-byte aligned rows); not into kernel 'simt', which "
            + ("was asked for" if kernel == "simt" else "this problem needs: " + "; ".join(blockers)))
    if p.mods.user and (kernel == "simt" or blockers):
        raise NotImplementedError(
            f"mask_mod / score_mod: built into the tensor-core forwards only (kernel 'mma': float16 / bfloat16, "
            f"d <= {MMA_MAX_HEAD_DIM}, 16-byte aligned rows); not into kernel 'simt', which "
            + ("was asked for" if kernel == "simt" else "this problem needs: " + "; ".join(blockers)))
    words = "mods: " + mods_words(p) + (" (tiles outside every row's window are never loaded)" if p.mods.window
                                        else "")
    if kernel == "simt" or blockers:
        kind, cfg, reasons = choose_kernel(_plain(p), "simt", views)
        if kernel == "auto":  # why not mma (fp32: the tf32 kernels have no mods)
            why = "; ".join(b for b in blockers if not b.startswith("dtype float32")) or \
                "float32 with mods: the tf32x3 kernel has none"
            reasons[-1] = f"{p.dtype} on the SIMT path (fp32 FMA), not tensor cores: {why}"
        reasons.insert(1, words)
        return kind, cfg, reasons
    kind, cfg, reasons = choose_kernel(_plain(p), "mma", views, not_ws=list(not_ws or ()) + ws_blockers(p, views))
    # window (-1, 0) with softcap / ALiBi: the causal tiles (_plain's causal is mask_causal)
    reasons.insert(1, words)
    if p.mods.dropout and (cfg.has("ws") or cfg.has("wgmma")):  # dropout: the mma.sync forward's (DESIGN.md)
        cfg = mma_config(p.d, p.mask_causal, sync=True)
        reasons[0] = (f"mma: tensor cores (mma.sync m16n8k16, {p.dtype} in, fp32 accumulate), {cfg.block_q}x"
                      f"{cfg.block_k} tiles, {cfg.warps} warps x {16 * mma_forward.m_tiles(cfg)} rows, head dim "
                      f"{cfg.head_dim}; dropout: the sm_80 kernel, not this GPU's wgmma forwards (built without "
                      "dropout)")
        reasons[2:] = [r for r in reasons[2:] if not r.startswith(("variants:", "not the warp-specialised",
                                                                   "varlen:"))]
        variants = [words for key, words in _VARIANT_WORDS.items() if key in _MMA_ALWAYS or cfg.has(key)]
        reasons.insert(2, "variants: " + "; ".join(variants))
    return kind, cfg, reasons


def _plain(p: Problem) -> Problem:
    from dataclasses import replace

    return replace(p, causal=p.mask_causal, window_size=(-1, -1), softcap=0.0, alibi_shape=None, mask_mod=None,
                   score_mod=None, dropout_p=0.0)


def _on_device(device: int | None):
    """Context manager that makes the inputs' GPU current (a no-op when unknown); in the simulator, the lock
    that serialises calls from several threads (launch.SIM_LOCK: builds and launches)."""
    import contextlib

    if nb_config.ENABLE_CUDASIM:
        return SIM_LOCK
    if device is None or current_device_id() == device:
        return contextlib.nullcontext()  # switching contexts costs a driver round trip per call
    return cuda.gpus[device]


def forward(q, k, v, *, causal=False, softmax_scale=None, kernel="auto", window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, mask_mod=None, score_mod=None, block_mask=None, dropout_p=0.0, dropout_seed=None,
            dropout_offset=0):
    """Exact attention O = softmax(Q Kᵀ · scale) V without materialising the N×N scores.

    Args:
        q: (B, H, Nq, d), or batch-less (H, Nq, d) / (Nq, d).
        k, v: (B, Hkv, Nk, d) with H % Hkv == 0 (GQA / MQA: query head h reads kv head
            h // (H // Hkv)); same number of dims as q.
            Accepted arrays: CuPy, PyTorch CUDA tensors, Numba device arrays, any object with
            ``__cuda_array_interface__`` (viewed, never copied; any strides work, a contiguous
            last dim gives coalesced loads), or NumPy (copied to the GPU and back; this is how
            the CUDA simulator runs).
            dtypes: float32, float16, bfloat16 (PyTorch tensors, or NumPy with ml_dtypes;
            CuPy has no bfloat16), the same for all three. Accumulation is always fp32.
            Head dim 1 <= d <= 256, zero-padded inside the kernel to a multiple of 16.
        causal: mask aligned bottom-right as in flash-attention >= 2.1: query i sees key j iff
            j <= i + Nk - Nq. A row that sees no key gets O = 0 and L = -inf.
        softmax_scale: default 1/sqrt(d) with the user's d; 0 < softmax_scale <= 2**64 (the kernels
            form score·scale·log2(e) in fp32; see MAX_SOFTMAX_SCALE).
        kernel: "auto" (default), "mma", "tf32x3", "tf32" or "simt". Auto runs a tensor-core kernel
            on sm_80+ when every row of q, k, v starts 16-byte aligned (cp.async): "mma" (fp32
            accumulation; warpgroup MMA on sm_90, mma.sync on sm_80-89) for float16/bfloat16 with d <= 256, "tf32x3" for float32 with d <= 128 (each
            fp32 product as three tf32 products, hi·hi + hi·lo + lo·hi: errors at the level of fp32
            FMA, as PyTorch SDPA's memory-efficient kernel computes fp32). Otherwise the SIMT kernel
            (fp32 FMA), with a ``PerformanceWarning``. "tf32" (float32 only, never chosen by auto)
            rounds the inputs to tf32 once: faster (68-90 TFLOP/s at d = 128 in the H200 sweeps, against
            tf32x3's 54), ~1e-3 relative error, like ``torch.backends.cuda.matmul.allow_tf32``. ``explain`` prints the choice and why.
            Under the CUDA simulator auto keeps float32 on SIMT (the tensor-core twins are slow
            there); kernel="tf32x3" runs the tensor-core kernel in the simulator as well.
        window_size: (left, right), flash-attn's sliding window: query i sees key j iff
            i + Nk - Nq - left <= j <= i + Nk - Nq + right; -1 (or a side >= Nk, as in flash-attn) is
            unbounded. causal=True is right = 0
            (right must then be 0 or -1). (-1, 0) is causal and (-1, -1) no window. K/V tiles outside
            every row's window are never loaded.
        softcap: > 0 caps the scaled scores x as softcap·tanh(x / softcap) (Gemma 2); 0.0 is off.
        alibi_slopes: float32 (H,) or (B, H), where q is: adds -slope·|i + Nk - Nq - j| to the (capped)
            scaled score of query i and key j (flash-attn's ALiBi; L includes the whole bias, where
            flash-attn's causal kernels drop the row-constant slope·(i + Nk - Nq) from it).
            The three run on kernel "mma" (float16 / bfloat16) and on "simt" (float32,
            or unaligned rows: auto takes it there, with its PerformanceWarning); "tf32x3" / "tf32" raise
            NotImplementedError. The backward has them on the mma kernels only (d <= 256).
        mask_mod, score_mod: user mods, Python functions compiled into the tensor-core kernel
            (numba_flash.mods: ``MaskMod(fn, aux=(arrays...))``, ``ScoreMod(fn, grad=..., aux=...)``, or a bare
            function; FlexAttention's mask_mod(b, h, q_idx, kv_idx) -> bool and score_mod(score, b, h, q_idx,
            kv_idx) -> score on the scaled logit). The user mask ANDs with causal / window. Kernel "mma"
            only (float16 / bfloat16): elsewhere NotImplementedError. numba_flash.mods says what a mod may do.
        block_mask: a numba_flash.BlockMask (numba_flash.block_mask) of the mask_mod, built for (B, H, Nq, Nk)
            at the forward's tile (numba_flash.sparsity.forward_tile(d, causal), with dropout=True for a call with
            dropout); it carries its mask_mod, so
            mask_mod may be left out (a mask_mod given must be the one it was built from). The kernel then visits
            only the key tiles the BlockMask lists for each query tile (EMPTY ones never loaded) and calls the
            mask_mod only on PARTIAL tiles; causal / window and the sequence end still apply on top.
        dropout_p, dropout_seed, dropout_offset: dropout on the attention probabilities, as in training (flash-attn's
            dropout_p): 0 <= dropout_p < 1; with p > 0 an int seed (< 2**64) and offset (< 2**32) are required, and
            ``backward`` must get the same three. Each score of (batch b, query head h, query i, key j) is kept
            iff the 16-bit draw of Philox4x32-10 (key = seed, counter from (i, j, b·H + h, offset): blocks/rng.py,
            reference/dropout.py) is below keep16 = round((1 − p)·2^16); kept values are scaled by 2^16 / keep16
            (the kept fraction exactly, so E[O] is the undropped O). lse is the undropped softmax's. Built into the
            mma.sync forward (float16 / bfloat16, d <= 256): on sm_90 that kernel runs instead of the wgmma ones
            (explain says so); float32 / SIMT, varlen raise NotImplementedError. No plan is kept for these calls.

    Returns:
        (out, lse): out has q's shape, dtype and kind (CuPy in, CuPy out; NumPy in, NumPy
        out); lse is float32 of shape q.shape[:-1], the natural-log logsumexp of the scaled
        scores of each query row (L = m + log l).

    Empty inputs: Nq = 0 (or B = 0, or H = 0 with any Hkv) gives empty outputs; Nk = 0 gives O = 0, L = -inf.

    NaN and inf: IEEE arithmetic, in every kernel family, backward and decode, as in the NumPy reference. A
    row whose visible scores hold a NaN or +inf gets NaN in O and L (only l = 0, a row that sees no key, gives
    O = 0, L = -inf); -inf scores are masked keys. A NaN or inf in v reaches the O (not L) of every row that
    sees its key, and may reach rows of the same tiles that do not (0 · NaN). tf32x3 splits an inf in q or k
    into inf + NaN, so there an inf gives NaN in every score it enters.

    Stream: CuPy inputs run on CuPy's current stream, PyTorch inputs on PyTorch's current
    stream of their device, other device arrays on the default stream. Device inputs return
    without synchronising; NumPy inputs return after the copy back.

    Raises:
        TypeError / ValueError naming what was given and what is accepted.

    A repeated call with the same signature (array kinds, shapes, strides, dtypes, device, pointer
    alignment, other arguments) replays the first call's plan (numba_flash.plans): the same kernel,
    config and parameters, without the checks and choices in Python.
    """
    left, right = window_pair(window_size)
    if mask_mod is not None or score_mod is not None or block_mask is not None or not _zero(dropout_p):
        # (no plan key: each call checks; a plan per dropout seed would replace the plans of every other call)
        return _forward(q, k, v, alibi_slopes, causal, softmax_scale, kernel, left, right, softcap, mask_mod,
                        score_mod, block_mask, dropout_p, dropout_seed, dropout_offset)
    return plans.call(_forward, (q, k, v, alibi_slopes), (causal, softmax_scale, kernel, left, right, softcap))


def _zero(dropout_p) -> bool:
    """dropout_p is a real 0 (the plan path); anything else goes to the checks (None, "0.1" included)."""
    return isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool) and dropout_p == 0


def _forward(q, k, v, alibi_slopes, causal, softmax_scale, kernel, left=-1, right=-1, softcap=0.0, mask_mod=None,
             score_mod=None, block_mask=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """``forward`` without plans (plans.call runs it for a new signature and watches)."""
    mask_mod = _block_mask_mod(block_mask, mask_mod)
    dropout_p, dropout_words = check_dropout(dropout_p, dropout_seed, dropout_offset)
    p = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(left, right), softcap=softcap,
                 alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod, dropout_p=dropout_p)
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; accepted: {', '.join(KERNELS)}")
    with _on_device(p.device):
        stream = arrays.current_stream(q)
        out_obj, out_dev = arrays.empty_like_kind(p.kind, q, p.q_shape, p.dtype, stream)
        lse_obj, lse_dev = arrays.empty_like_kind(p.kind, q, p.lse_shape, "float32", stream)
        # no kernel runs, but one that cannot take the inputs is refused; Nk = 0 with a named kernel too (auto runs
        # the SIMT kernel there, which writes O = 0, L = -inf, so plans replay it; the tensor-core copies refuse
        # the empty k, v's zero strides)
        if p.B * p.H * p.n_q == 0 or (p.n_k == 0 and kernel != "auto"):
            choose_kernel(p, kernel)
            if p.n_k == 0 and p.B * p.H * p.n_q:  # no keys: every row is fully masked, O = 0 and L = -inf
                out_obj = arrays.alloc_like_kind(p.kind, q, p.q_shape, p.dtype, stream, zeroed=True)[0]
                lse_obj = arrays.full_like_kind(p.kind, q, p.lse_shape, "float32", -math.inf, stream)[0]
        else:
            qd, kd, vd = (arrays.to_device_view(x, stream) for x in (q, k, v))
            family, cfg, reasons = choose_kernel(p, kernel, (qd, kd, vd), not_ws=_block_mask_not_ws(p, block_mask))
            # a tensor-core kernel exists for every dtype (the simulator's fp32 choice is not a slow path)
            if family == "simt" and kernel == "auto" and not (nb_config.ENABLE_CUDASIM and p.dtype == "float32"):
                plans.warn("numba_flash.forward: " + reasons[-1], PerformanceWarning)
            out4, lse3 = arrays.as_4d(out_dev), arrays.as_4d(lse_dev, 3)  # unit dims in front: views
            if family == "mma":
                mods = p.mods
                alibi = None if alibi_slopes is None else arrays.to_device_view(alibi_slopes, stream, 2)
                aux = user_aux(p, mask_mod, score_mod, stream)
                if block_mask is not None:  # the BlockMask's key-tile lists (blocks/sparsity.py)
                    mods, aux = replace(mods, block_sparse=True), aux + _walked_lists(p, block_mask, mask_mod, cfg)
                extra = {"dropout": dropout_words} if dropout_words else {}  # (the mma.sync launch's only)
                launch_mma_forward(qd, kd, vd, out4, lse3, cfg, causal=p.mask_causal, softmax_scale=p.softmax_scale,
                                   stream=stream, layout_checked=True, mods=mods,
                                   window=window_bounds(p.causal, p.window_size) if mods.window else (0, 0),
                                   softcap=p.softcap, alibi=alibi, aux=aux, **extra)
            elif family in TF32_KERNELS:
                tf32_forward.launch(qd, kd, vd, out4, lse3, cfg, causal=p.mask_causal, softmax_scale=p.softmax_scale,
                                    passes=TF32_KERNELS[family], stream=stream, layout_checked=True)
            else:
                mods = p.mods
                alibi = None if alibi_slopes is None else arrays.to_device_view(alibi_slopes, stream, 2)
                simt_forward.launch(cfg, qd, kd, vd, out4, lse3, causal=p.mask_causal,
                                    softmax_scale=p.softmax_scale, dtype=p.dtype, d=p.d, stream=stream, mods=mods,
                                    window=window_bounds(p.causal, p.window_size) if mods.window else (0, 0),
                                    softcap=p.softcap, alibi=alibi)
        return (
            arrays.to_host_kind(p.kind, out_obj, p.dtype, stream),
            arrays.to_host_kind(p.kind, lse_obj, "float32", stream),
        )


def explain(q, k, v, *, causal=False, softmax_scale=None, kernel="auto", window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, mask_mod=None, score_mod=None, block_mask=None, dropout_p=0.0) -> str:
    """Which kernel ``forward`` would run for these inputs, its tile config, and why (with block_mask: the tiles
    the kernel walks)."""
    mask_mod = _block_mask_mod(block_mask, mask_mod)
    dropout_p, _ = check_dropout(dropout_p, 0, 0)
    p = validate(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                 alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod, dropout_p=dropout_p)
    views = None
    if p.kind != arrays.NUMPY:  # device arrays: check their real layout (views, no copies)
        with _on_device(p.device):
            views = tuple(arrays.to_device_view(x, 0) for x in (q, k, v))
    family, cfg, reasons = choose_kernel(p, kernel, views, not_ws=_block_mask_not_ws(p, block_mask))
    if block_mask is not None:  # user mods run on the tensor-core forwards only (choose_kernel raised otherwise)
        reasons.append(_walk_line(p, block_mask, mask_mod, cfg))
    elif mask_mod is not None and hasattr(cfg, "block_q"):
        reasons.append(_block_mask_line(p, mask_mod, cfg))
    return "\n".join(reasons)


def _block_mask_not_ws(p: Problem, block_mask: Any) -> list:
    """Why a call with this block_mask keeps off the warp-specialised forward: the BlockMask was built at other
    tiles than its (sparsity.forward_tile gives its tiles where it runs; a BlockMask at the wgmma forward's tiles
    runs there)."""
    if block_mask is None or not _ws_here():
        return []
    ws = mma_config(p.d, p.mask_causal, plain=True)
    if not ws.has("ws") or (block_mask.block_q, block_mask.block_k) == (ws.block_q, ws.block_k):
        return []
    return [f"the block_mask was built at {block_mask.block_q}x{block_mask.block_k} tiles, not its "
            f"{ws.block_q}x{ws.block_k} (sparsity.forward_tile gives them)"]


def _block_mask_mod(block_mask: Any, mask_mod: Any) -> Any:
    """The mask_mod of a call with a block_mask: its own (FlexAttention's: the BlockMask carries the mask), or the
    one given, which BlockMask.check (at the launch) holds to the one it was built from."""
    if block_mask is None:
        return mask_mod
    from .sparsity import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a numba_flash.BlockMask (numba_flash.block_mask(mask_mod, B, H, Nq, Nk, "
                        f"block_q, block_k)) or None; got {type(block_mask).__name__}")
    if mask_mod is None:
        if block_mask.mask_mod is None:
            raise ValueError("block_mask carries no mask_mod (it was not built by numba_flash.block_mask): pass the "
                             "mask_mod it was built from")
        return block_mask.mask_mod
    return mask_mod


def _walked_lists(p: Problem, block_mask: Any, mask_mod: Any, cfg) -> tuple:
    """The device (counts, entries) a block_sparse forward walks: the BlockMask checked against the call (mask,
    sizes, the forward's tile ``cfg``), intersected with causal / window, built once per BlockMask."""
    block_mask.check(mask_mod, p.B, p.H, p.n_q, p.n_k, cfg.block_q, cfg.block_k)
    return block_mask.device_lists(p.causal, p.window_size, None if nb_config.ENABLE_CUDASIM else current_device_id())


def _walk_line(p: Problem, block_mask: Any, mask_mod: Any, cfg) -> str:
    """explain's line for a call with a block_mask: the tiles the kernel visits (over every (b, h, query tile))."""
    block_mask.check(mask_mod, p.B, p.H, p.n_q, p.n_k, cfg.block_q, cfg.block_k)
    counts, entries = block_mask.lists(p.causal, p.window_size)
    listed = entries[entries >= 0]
    full = int((listed & 1).sum())
    in_range = sum(int(c) for c in counts.reshape(-1))
    total = block_mask.classes.size
    return (f"block_mask walked: {full} FULL tiles (no mask_mod call) and {in_range - full} PARTIAL (mask_mod per "
            f"score) visited; {total - in_range} of {total} (b, h, query tile, key tile) tiles never loaded (EMPTY "
            f"or outside causal / window), at {cfg.block_q}x{cfg.block_k} tiles")


def _block_mask_line(p: Problem, mask_mod: Any, cfg) -> str:
    """explain's line of the mask's tile classes at the forward's tile (sparsity.block_mask: one mask_mod call per
    score, so it needs a GPU or the simulator)."""
    if not (nb_config.ENABLE_CUDASIM or cuda.is_available()):
        return f"block mask at {cfg.block_q}x{cfg.block_k} tiles: not computed (no GPU to run mask_mod on)"
    from .sparsity import block_mask

    with _on_device(p.device):
        bm = block_mask(mask_mod, p.B, p.H, p.n_q, p.n_k, cfg.block_q, cfg.block_k)
    c, total = bm.counts(), bm.classes.size
    return (f"block mask at {cfg.block_q}x{cfg.block_k} tiles (mask_mod alone, over every (b, h)): {c['EMPTY']} EMPTY, "
            f"{c['FULL']} FULL, {c['PARTIAL']} PARTIAL of {total}")
