"""``decode``: attention of a few new queries against a KV cache, split over the keys (FlashDecoding).

The wrapper validates (``api.validate`` for q, k, v plus the cache checks below), picks a tile
config and the number of splits, allocates the fp32 scratch with q's own framework and launches
numba_flash.kernels.decode (a split kernel, then a merge kernel when there is more than one split).
"""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np
from numba import config as nb_config
from numba import cuda

from . import arrays, plans
from .api import PerformanceWarning, _check_user_mod, check_score_mod_scale, _on_device, unbounded_past_keys, user_aux, validate, window_pair
from .blocks.mods import Mods
from .blocks.mask import window_bounds, window_kind
from .configs import head_dim_bucket
from .kernels import decode as decode_kernels
from .kernels.decode import DecodeConfig, decode_config
from .launch import DeviceView, c_strides, current_device_id

MAX_DECODE_QUERIES = 16  # a decoding step; more queries run, through more row blocks (a PerformanceWarning)
PAGE_MULTIPLE = 16  # page sizes: a warp_split tile (16 keys) never spans two pages
H200_SMS = 132  # the SM count the split rule assumes where it cannot ask a device (simulator)
MIN_TILES_PER_SPLIT = 4  # a split shorter than this pays more for its prologue and merge than it gains
MAX_SPLITS = 128  # of the automatic rule
MAX_USER_SPLITS = 8192  # the merge kernel keeps one weight per split in (<= 32 KiB of) shared memory
WAVE_EFFICIENCY_SLACK = 0.85
# Resident warps per SM a wave aims at: the H200 sweep (results/sweep-decode-2026-11-29.txt) saw
# 2-stage 4-warp blocks fastest at 2 per SM (1 split at B8 Hkv32, 4 at Hkv8), not at the 3 their
# shared memory allows; filling the third slot only added splits and merge traffic.
RESIDENT_WARPS_TARGET = 8



def _sm_count(device: int | None = None) -> int:
    """SMs of ``device``, which must be the current one (None: ask the driver which that is)."""
    if nb_config.ENABLE_CUDASIM:
        return H200_SMS
    return _sm_count_of(current_device_id() if device is None else device)


@functools.lru_cache(maxsize=None)
def _sm_count_of(device_id: int | None) -> int:  # one driver query per device, not per call
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def choose_num_splits(base_blocks: int, n_max: int, cfg: DecodeConfig, n_sms: int | None = None) -> int:
    """How many splits of the keys: the fewest that fill the GPU in whole waves.

    base_blocks = B · Hkv · row chunks blocks exist without splitting; a wave is n_sms · R blocks,
    R = min(cfg.blocks_per_sm, max(1, 8 // cfg.warps)): as many as shared memory lets an SM hold
    (2 for the shipped fp16 d = 128 tile), but no more than 8 resident warps need (measured: more
    blocks of the 2-stage tile did not help). With S splits the wave efficiency is

        eff(S) = base·S / (waves(S) · wave),   waves(S) = ceil(base·S / wave)

    (the fraction of block slots doing work, all splits taking equally long). The rule takes the
    smallest S within 85 % of the best eff over 1 <= S <= S_max, where S_max = min(128,
    n_tiles // 4) keeps every split at least 4 K/V tiles long (n_tiles = ceil(Nmax / split_keys),
    the longest cache: device lengths are not read on the host; split_keys = block_n, or
    warps · block_n for warp_split configs, whose warps each take every warps-th tile). Examples on an H200 (wave = 264
    for fp16 d = 128): B8 Hkv32 -> 256 blocks, eff(1) = 0.97, so 1 split (no merge); B8 Hkv8 ->
    64 blocks, 4 splits; B1 Hkv8 at Nmax = 32768 -> 29 splits.
    """
    return _choose_num_splits(base_blocks, n_max, cfg, n_sms or _sm_count())


@functools.lru_cache(maxsize=1024)  # up to 2 x 128 efficiencies: ~20 us of Python per decode call uncached
def _choose_num_splits(base_blocks: int, n_max: int, cfg: DecodeConfig, n_sms: int) -> int:
    wave = n_sms * min(cfg.blocks_per_sm, max(1, RESIDENT_WARPS_TARGET // cfg.warps))
    n_tiles = -(-n_max // cfg.split_keys)
    s_max = max(1, min(MAX_SPLITS, n_tiles // MIN_TILES_PER_SPLIT))
    if base_blocks <= 0:
        return 1

    def eff(s):
        blocks = base_blocks * s
        return blocks / (-(-blocks // wave) * wave)

    best = max(eff(s) for s in range(1, s_max + 1))
    return next(s for s in range(1, s_max + 1) if eff(s) >= WAVE_EFFICIENCY_SLACK * best)


def _check_index(name, x, p, dtypes, shape_ok, shape_says):
    """The checks every index argument (cache_seqlens, block_table, ...) shares: its kind (NumPy, or q's
    kind on q's device), dtype and shape; returns its kind."""
    accepted = f"an {' or '.join(dtypes)} array of shape {shape_says}, NumPy or the same kind as q, or None"
    kind = arrays.kind_of(x)
    if kind is None:
        raise TypeError(f"{name} must be {accepted}; got {type(x).__module__}.{type(x).__name__}")
    if kind == arrays.TORCH and not x.is_cuda:
        raise TypeError(f"{name} is a PyTorch tensor on {x.device}; pass a CUDA tensor on q's device or a NumPy array")
    arrays.refuse_unreadable(name, x, kind)
    if kind != arrays.NUMPY and kind != p.kind:
        raise TypeError(f"{name} is a {kind} array but q is a {p.kind} array; accepted: {accepted}")
    dtype = arrays.dtype_name(x)
    if dtype not in dtypes:
        raise TypeError(f"{name} has dtype {dtype}; accepted: {' or '.join(dtypes)}")
    shape = arrays.shape_of(x)
    if not shape_ok(shape):
        raise ValueError(f"{name} has shape {shape}; accepted: {shape_says}")
    device = arrays.device_of(x)
    if device is not None and p.device is not None and device != p.device:
        raise ValueError(f"{name} is on device {device} but q on device {p.device}; put them on one GPU")
    return kind


def _check_seqlens(cache_seqlens, p, n_max):
    """Validate cache_seqlens against the problem; returns its dtype name (or None)."""
    if cache_seqlens is None:
        return None
    kind = _check_index("cache_seqlens", cache_seqlens, p, decode_kernels.LENS_DTYPES, lambda s: s == (p.B,),
                        f"(B,) = ({p.B},), one length per sequence")
    if kind == arrays.NUMPY:  # device lengths would need a copy and a sync: the kernel clamps them instead
        bad = np.flatnonzero((cache_seqlens < 0) | (cache_seqlens > n_max))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"cache_seqlens[{i}] = {int(cache_seqlens[i])}; accepted: 0 <= length <= Nmax = {n_max} "
                             f"(the caches' dim 2, or pages x page size)")
    return arrays.dtype_name(cache_seqlens)


def _check_in_range(name, values, lo, hi, says):
    """lo <= values < hi (hi may be an array of values' shape), else a ValueError naming the first bad entry."""
    bad = np.flatnonzero((values < lo) | (values >= hi))
    if bad.size:
        i = np.unravel_index(int(bad[0]), values.shape)
        raise ValueError(f"{name}[{', '.join(map(str, i))}] = {int(values[i])}; accepted: {says}")


def _check_cache_layout(p, k_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad):
    """The paged / indexed cache arguments; returns Nmax, the most keys a sequence can have.

    NumPy indices are checked by value (device ones would need a copy and a sync: the kernel clamps them into
    the arrays instead, so a bad index reads a wrong row, never out of bounds)."""
    rows, n_cache = arrays.shape_of(k_cache)[0], p.n_k
    check_cache_combination(block_table, cache_batch_idx, cache_leftpad)
    if block_table is not None:
        _check_index("block_table", block_table, p, ("int32",), lambda s: len(s) == 2 and s[0] == p.B,
                     f"(B, max_pages) = ({p.B}, max_pages)")
        if n_cache % PAGE_MULTIPLE or n_cache < PAGE_MULTIPLE:
            raise ValueError(f"the paged caches have pages of {n_cache} keys (k_cache of shape "
                             f"{arrays.shape_of(k_cache)} = (num_pages, Hkv, page_size, d)); accepted: page_size a "
                             f"multiple of {PAGE_MULTIPLE} (16 to 256 are tested)")
        n_max = arrays.shape_of(block_table)[1] * n_cache
        if arrays.kind_of(block_table) == arrays.NUMPY and cache_seqlens is not None and rows > 0 and \
                arrays.kind_of(cache_seqlens) == arrays.NUMPY:  # device lengths: the whole table is checked
            lens = np.minimum(np.maximum(np.asarray(cache_seqlens), 0), n_max)
            used = np.arange(arrays.shape_of(block_table)[1])[None, :] < -(-lens[:, None] // n_cache)
            _check_in_range("block_table", np.where(used, block_table, 0), 0, rows,
                            f"page indices in [0, num_pages = {rows}) for the pages that hold keys")
        elif arrays.kind_of(block_table) == arrays.NUMPY:
            _check_in_range("block_table", block_table, 0, rows, f"page indices in [0, num_pages = {rows})")
        return n_max
    if cache_batch_idx is not None:
        kind = _check_index("cache_batch_idx", cache_batch_idx, p, ("int32",), lambda s: s == (p.B,), f"({p.B},)")
        if kind == arrays.NUMPY:
            _check_in_range("cache_batch_idx", cache_batch_idx, 0, rows, f"cache rows in [0, {rows})")
    elif rows != p.B:
        raise ValueError(f"batch mismatch: q has B={p.B}, k_cache / v_cache have {rows} rows; pass "
                         f"cache_batch_idx to pick rows of a larger cache")
    if cache_leftpad is not None:
        kind = _check_index("cache_leftpad", cache_leftpad, p, ("int32",), lambda s: s == (p.B,), f"({p.B},)")
        if kind == arrays.NUMPY:  # against NumPy lengths, else against Nmax
            known = cache_seqlens is not None and arrays.kind_of(cache_seqlens) == arrays.NUMPY
            ends = np.asarray(cache_seqlens) if known else np.full(p.B, n_cache)
            _check_in_range("cache_leftpad", cache_leftpad, 0, ends + 1,
                            "0 <= cache_leftpad[b] <= cache_seqlens[b] (or Nmax), the end of sequence b's keys")
    return n_cache



def check_cache_combination(block_table, cache_batch_idx, cache_leftpad) -> None:
    """Refuse the cache arguments that do not go together (flash-attn refuses them too); also run by
    flash_attn_with_kvcache before it appends to the cache, so a refused call leaves the cache as it was."""
    if block_table is None:
        return
    if cache_batch_idx is not None:
        raise ValueError("block_table and cache_batch_idx were both given; a paged cache has no cache rows to "
                         "pick (as flash-attn: pass one or the other)")
    if cache_leftpad is not None:
        raise NotImplementedError("cache_leftpad with block_table (a paged cache) is not supported (nor by "
                                  "flash-attn); left-pad a contiguous cache, or start each sequence on a page")

def validate_decode(q, k_cache, v_cache, *, cache_seqlens=None, softmax_scale=None, num_splits=None,
                    config=None, block_table=None, cache_batch_idx=None, cache_leftpad=None, causal=True,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, mask_mod=None, score_mod=None):
    """All checks of a decode call; returns (Problem, seqlens dtype or None). Raises like ``validate``.

    The Problem's n_k is Nmax, the most keys a sequence can have (a paged cache: pages x page size)."""
    p = validate(q, k_cache, v_cache, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                 softcap=softcap, alibi_slopes=alibi_slopes, kv_batch_free=True)  # cache rows, user mods: below
    if len(p.q_shape) != 4:
        raise ValueError(f"decode needs q of shape (B, H, Nq, d) and caches of shape (B, Hkv, Nmax, d) (paged: "
                         f"(num_pages, Hkv, page_size, d)); got q {p.q_shape}, k_cache {arrays.shape_of(k_cache)}")
    p.n_k = _check_cache_layout(p, k_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad)
    # validate took k_cache's rows for Nk (a paged cache: one page): a window side is unbounded only past Nmax
    p.window_size = unbounded_past_keys(window_pair(window_size), p.n_k)
    if score_mod is not None:
        check_score_mod_scale(p.softmax_scale)
    for name, mod in (("mask_mod", mask_mod), ("score_mod", score_mod)):  # aux shapes against Nmax, not a page
        if mod is not None:
            setattr(p, name, _check_user_mod(name, mod, p.kind, p.device, (p.B, p.H, p.n_q, p.n_k)))
    lens_dtype = _check_seqlens(cache_seqlens, p, p.n_k)
    if num_splits is not None:
        if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, numbers.Integral):
            raise TypeError(f"num_splits must be an int >= 1 or None (automatic); got {num_splits!r}")
        if not 1 <= num_splits <= MAX_USER_SPLITS:
            raise ValueError(f"num_splits must be an int in [1, {MAX_USER_SPLITS}] or None (automatic); "
                             f"got {num_splits}")
    if config is not None:
        if not isinstance(config, DecodeConfig):
            raise TypeError(f"config must be a numba_flash.kernels.decode.DecodeConfig or None; got {config!r}")
        problems = config.problems()
        if config.dtype != p.dtype:
            problems.append(f"its dtype {config.dtype} is not the inputs' {p.dtype}")
        if config.head_dim < p.d or config.head_dim % 16:
            problems.append(f"its head_dim {config.head_dim} does not hold d = {p.d} "
                            f"(use {head_dim_bucket(p.d)} or more, a multiple of 16)")
        if problems:
            raise ValueError(f"config {config} cannot run this problem: {'; '.join(problems)}")
    return p, lens_dtype


def plan(q, k_cache, v_cache, *, cache_seqlens=None, softmax_scale=None, num_splits=None, config=None,
         block_table=None, cache_batch_idx=None, cache_leftpad=None, causal=True, window_size=(-1, -1), softcap=0.0,
         alibi_slopes=None):
    """(Problem, config, num_splits, row chunks) that ``decode`` would use for these inputs."""
    p, _ = validate_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
                           num_splits=num_splits, config=config, block_table=block_table,
                           cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, causal=causal,
                           window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    with _on_device(p.device):
        return (p, *_tiles_and_splits(p, num_splits, config))


def _tiles_and_splits(p, num_splits, config) -> tuple:
    """(config, num_splits, row chunks) of a validated problem; p.device (if known) must be current."""
    group = p.H // p.Hkv if p.Hkv else 1  # H = Hkv = 0: empty outputs, no kernel runs
    cfg = config or decode_config(p.d, p.dtype, group * max(p.n_q, 1))
    chunks = decode_kernels.n_row_chunks(cfg, group, max(p.n_q, 1))
    if num_splits is None:
        num_splits = choose_num_splits(p.B * p.Hkv * chunks, _keys_seen(p), cfg, _sm_count(p.device))
    return cfg, int(num_splits), chunks


def _keys_seen(p) -> int:
    """The most keys one sequence's rows see together: Nmax, or a window's left + Nq when shorter (the last row
    sits at the last key, so a right side adds none; the split rule sizes the splits by what the kernel loads:
    tiles left of every row's window are not)."""
    left, _ = p.window_size
    if window_kind(p.causal, p.window_size) != "window" or left < 0:
        return p.n_k
    return min(p.n_k, left + max(p.n_q, 1))


def decode(q, k_cache, v_cache, *, cache_seqlens=None, softmax_scale=None, num_splits=None, config=None,
           block_table=None, cache_batch_idx=None, cache_leftpad=None, causal=True, window_size=(-1, -1),
           softcap=0.0, alibi_slopes=None, mask_mod=None, score_mod=None):
    """One decoding step: Nq new queries per sequence attend to a KV cache.

    Args:
        q: (B, H, Nq, d), Nq >= 0 (Nq = 0 gives empty outputs). Up to 16 queries is the decoding
            step the kernel is built for (speculative decoding, GQA groups); more run through row
            blocks of the same kernel on CUDA cores, each block reading the cache once, with a
            PerformanceWarning when a group's G·Nq rows take more than one block.
        k_cache, v_cache: (B, Hkv, Nmax, d), H % Hkv == 0 (GQA / MQA: query head h reads kv head
            h // (H // Hkv)); with cache_batch_idx (Bc, Hkv, Nmax, d), any Bc; with block_table
            (num_pages, Hkv, page_size, d) pages (flash-attn's (num_pages, page_size, Hkv, d) with its
            middle dims swapped: a view, no copy), page_size a multiple of 16. Same array kinds,
            dtypes (float32, float16, bfloat16) and head dims 1 <= d <= 256 as ``forward``; any
            strides (16-byte aligned rows are copied with cp.async, others with scalar loads).
        cache_seqlens: where each sequence's keys end, int32 or int64 of shape (B,), a NumPy array
            or the same kind as q (on q's device); None means Nmax for every sequence (paged:
            max_pages · page_size). NumPy lengths are checked (0 <= length <= Nmax); device lengths
            are not (that needs a host copy and a sync) and the kernel clamps them to [0, Nmax].
        softmax_scale: default 1/sqrt(d); 0 < softmax_scale <= 2**64, as ``forward``.
        num_splits: how many ranges the keys of each sequence are cut into (one thread block
            each, then a merge); None chooses from occupancy (see ``choose_num_splits``), 1 is no
            split. Splits are whole tiles, ceil(tiles / num_splits) each; splits past the last
            tile are empty and cost one block each.
        config: a ``kernels.decode.DecodeConfig`` to override the tile configuration (tuning,
            tests); None picks ``decode_config(d, dtype, G·Nq)``.
        block_table: (B, max_pages) int32: key j of sequence b is row j % page_size of page
            block_table[b, j // page_size]; the kernel reads the pages through the table (no gather).
            Entries past a sequence's last page are never read.
        cache_batch_idx: (B,) int32: sequence b reads cache row cache_batch_idx[b] (not with
            block_table, as flash-attn).
        cache_leftpad: (B,) int32: sequence b's keys are rows [cache_leftpad[b], cache_seqlens[b])
            of its cache (len_b = their number; not with block_table, as flash-attn).
        NumPy indices are checked by value; device ones are clamped into the arrays by the kernel
        (a bad index reads a wrong row, never outside the arrays).
        causal: True (default): bottom-right causal, below; False: every query sees all len_b keys.
        window_size: flash-attn's (left, right), -1 unbounded: query i (at position pos = i + len_b - Nq)
            sees keys pos - left <= j <= pos + right (causal makes right 0). Tiles left of every row's
            window are never loaded, so a window of W keys reads about W + Nq keys per sequence.
        softcap: > 0 caps the scaled scores, softcap·tanh(x / softcap) (flash-attn's; 0.0 off).
        alibi_slopes: float32 (H,) or (B, H), where q is: subtracts slope·|pos - j| from the (capped)
            scaled scores (flash-attn's ALiBi with each sequence's own alignment).
        mask_mod, score_mod: numba_flash.mods.MaskMod / ScoreMod (or bare functions), as ``forward``'s, compiled
            into the kernel: mask_mod(b, h, q_idx, kv_idx, *aux) -> bool and score_mod(score, b, h, q_idx, kv_idx,
            *aux) with q_idx the query's index in q (0 .. Nq - 1; its position in the sequence is q_idx + len_b -
            Nq) and kv_idx the key's index in its sequence (after cache_leftpad), called on keys < len_b only; the
            score mod on the scaled logit after softcap and ALiBi, the mask ANDed with causal / window. Calls with
            them do not replay plans (each checks its aux arrays). Aux arrays sized by the keys are checked against
            Nmax (a paged cache: block_table's pages x page size), the most keys a sequence can have.

    Masking: the Nq queries are the last Nq positions of each sequence, so with causal query i of
    sequence b sees key j iff j <= i + len_b - Nq (bottom-right causal alignment, as ``forward`` with
    causal=True on the valid keys); keys >= len_b are never read into the result. A query that
    sees no key (len_b = 0, or i < Nq - len_b) gets O = 0 and L = -inf. NaN / inf: as ``forward`` (IEEE: a NaN in q or a
    valid key gives NaN in O and L; slots past len_b are never read).

    Returns:
        (out, lse): out has q's shape, dtype and kind; lse is float32 of shape (B, H, Nq), the
        natural-log logsumexp of each query's scaled, masked scores.

    The result depends on num_splits only through rounding (fp32 accumulation throughout); for
    a given num_splits it is bitwise deterministic. Streams as ``forward``.

    Raises:
        TypeError / ValueError naming what was given and what is accepted; NotImplementedError for
        cache_leftpad with block_table.

    Repeated calls with one signature replay a plan, as ``forward`` (numba_flash.plans); NumPy
    lengths are checked on every call (they take the ordinary path).
    """
    left, right = window_pair(window_size)
    if mask_mod is not None or score_mod is not None:  # (no plan key: each call checks its aux arrays)
        return _decode(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, alibi_slopes,
                       softmax_scale, num_splits, config, causal, left, right, softcap, mask_mod, score_mod)
    return plans.call(_decode, (q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
                                alibi_slopes), (softmax_scale, num_splits, config, causal, left, right, softcap))


def _decode(q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad, alibi_slopes,
            softmax_scale, num_splits, config, causal, left=-1, right=-1, softcap=0.0, mask_mod=None, score_mod=None):
    """``decode`` without plans (plans.call runs it for a new signature and watches)."""
    p, _ = validate_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
                           num_splits=num_splits, config=config, block_table=block_table,
                           cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, causal=causal,
                           window_size=(left, right), softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod,
                           score_mod=score_mod)
    with _on_device(p.device):  # once per call: each context switch or query is a driver call
        cfg, n_splits, chunks = _tiles_and_splits(p, num_splits, config)
        if p.n_q > MAX_DECODE_QUERIES and chunks > 1:
            plans.warn(f"decode with Nq = {p.n_q} queries: the {p.H // p.Hkv * p.n_q} rows of each GQA group take "
                       f"{chunks} blocks of {cfg.rows}, each reading the whole cache, with scores on CUDA cores; "
                       f"for long query blocks on a contiguous cache numba_flash.forward is faster", PerformanceWarning)
        stream = arrays.current_stream(q)
        out_obj, out_dev = arrays.empty_like_kind(p.kind, q, p.q_shape, p.dtype, stream)
        lse_obj, lse_dev = arrays.empty_like_kind(p.kind, q, p.lse_shape, "float32", stream)
        if p.B * p.H * p.n_q > 0:
            qd = arrays.to_device_view(q, stream)
            kd, vd = (_kv_words(arrays.to_device_view(x, stream), p.dtype) for x in (k_cache, v_cache))
            lens = _seqlens_view(cache_seqlens, stream)
            table, index, starts = (None if x is None else arrays.to_device_view(x, stream, ndim=n)
                                    for x, n in ((block_table, 2), (cache_batch_idx, 1), (cache_leftpad, 1)))
            partials, keep_alive = None, None
            if n_splits > 1:
                keep_alive, partials = _scratch(p, q, n_splits, stream)
            window = window_bounds(p.causal, p.window_size) if p.mods.window else None
            alibi = None if alibi_slopes is None else arrays.to_device_view(alibi_slopes, stream, 2)
            decode_kernels.launch(cfg, qd, kd, vd, lens, out_dev, lse_dev, softmax_scale=p.softmax_scale,
                                  d=p.d, num_splits=n_splits, partials=partials, stream=stream,
                                  block_table=table, cache_batch_idx=index, cache_leftpad=starts,
                                  causal=p.mask_causal, window=window, softcap=p.softcap, alibi=alibi,
                                  user=Mods(mask_mod=p.mask_mod, score_mod=p.score_mod),
                                  aux=user_aux(p, mask_mod, score_mod, stream))
            del keep_alive  # stream-ordered allocators: freeing after the launch is safe
        return (
            arrays.to_host_kind(p.kind, out_obj, p.dtype, stream),
            arrays.to_host_kind(p.kind, lse_obj, "float32", stream),
        )


def _scratch(p, q, n_splits: int, stream):
    """(owner, (m_part, l_part, acc_part)): the fp32 scratch of scratch_shapes() as views of one
    allocation of q's kind (one allocator call instead of three)."""
    total, parts = _scratch_layout(p.B, p.H, p.n_q, n_splits, p.d)
    obj, flat = arrays.empty_like_kind(p.kind, q, (total,), "float32", stream)
    if isinstance(flat, DeviceView):
        views = [DeviceView(flat.ptr + 4 * start, shape, strides, _F32, obj) for start, shape, strides in parts]
    else:  # simulator arrays
        views = [flat[start:start + math.prod(shape)].reshape(shape) for start, shape, _ in parts]
    acc_part, m_part, l_part = views
    return obj, (m_part, l_part, acc_part)


_F32 = np.dtype(np.float32)


@functools.lru_cache(maxsize=256)  # the same few shapes every step of a generation loop
def _scratch_layout(B: int, H: int, n_q: int, n_splits: int, d: int) -> tuple:
    """(total floats, ((start, shape, byte strides) of acc_part, m_part, l_part)); acc_part first,
    at the allocation's (aligned) base."""
    m_shape, l_shape, acc_shape = decode_kernels.scratch_shapes(B, H, n_q, n_splits, d)
    parts, start = [], 0
    for shape in (acc_shape, m_shape, l_shape):
        parts.append((start, shape, c_strides(shape, 4)))
        start += math.prod(shape)
    return start, tuple(parts)


def _kv_words(dev, dtype: str):
    """16-bit caches as uint16 words: the kernel only copies and unpacks them."""
    return dev.view(np.uint16) if dtype == "float16" else dev


_NO_LENS = DeviceView(0, (0,), (4,), np.int32)  # never dereferenced: the kernel checks the length


def _seqlens_view(cache_seqlens, stream):
    """A 1-D device view of the lengths; a 0-length one means 'Nmax for every sequence'."""
    sim = nb_config.ENABLE_CUDASIM
    if cache_seqlens is None:
        if sim:
            return cuda.device_array(0, dtype=np.int32, stream=stream)
        return _NO_LENS
    return arrays.to_device_view(cache_seqlens, stream, ndim=1)
