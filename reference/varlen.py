"""Packed sequences (flash-attn's varlen), as numba_flash.varlen computes them: each sequence on its own.

q is (total_q, H, d), k and v (total_k, Hkv, d); sequence b holds rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] − 1
and keys cu_seqlens_k[b] .. cu_seqlens_k[b + 1] − 1, and is attention over those alone, with every option
(causal aligned bottom-right with the sequence's own shift Nk_b − Nq_b, windows, softcap, ALiBi slopes (H,) or
(B, H)) meaning what it means for one dense sequence. lse comes back packed as (H, total_q).
"""
from __future__ import annotations

import numpy as np

from .attention import standard_attention
from .backward import attention_backward


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    if cu_q.shape != cu_k.shape or cu_q.ndim != 1:
        raise ValueError(f"cu_seqlens_q {cu_q.shape} and cu_seqlens_k {cu_k.shape}: one (B + 1,) each")
    return [(slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])) for b in range(len(cu_q) - 1)]


def _heads_first(x, rows):
    return np.swapaxes(np.asarray(x)[rows], 0, 1)  # (n, H, d) -> (H, n, d)


def _slopes(alibi_slopes, b):
    if alibi_slopes is None:
        return None
    s = np.asarray(alibi_slopes)
    return s if s.ndim == 1 else s[b]


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None, dtype=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """(out (total_q, H, d), lse (H, total_q)): standard_attention of every sequence."""
    work = np.result_type(np.asarray(q).dtype, np.float64) if dtype is None else dtype
    H = np.asarray(q).shape[1]
    out = np.zeros(np.asarray(q).shape, work)
    lse = np.full((H, out.shape[0]), -np.inf, work)
    for b, (rq, rk) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if rq.stop == rq.start or rk.stop == rk.start:
            continue  # no queries, or no keys: O = 0, L = -inf
        o, l = standard_attention(_heads_first(q, rq), _heads_first(k, rk), _heads_first(v, rk), causal=causal,
                                  softmax_scale=softmax_scale, dtype=dtype, window_size=window_size,
                                  softcap=softcap, alibi_slopes=_slopes(alibi_slopes, b))
        out[rq] = np.swapaxes(o, 0, 1)
        lse[:, rq] = l
    return out, lse


def varlen_attention_backward(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, *, causal=False,
                              softmax_scale=None, dtype=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    """(dq, dk, dv), packed as q, k, v: attention_backward of every sequence (dk, dv summed per GQA group)."""
    work = np.result_type(np.asarray(q).dtype, np.float64) if dtype is None else dtype
    dq = np.zeros(np.asarray(q).shape, work)
    dk = np.zeros(np.asarray(k).shape, work)
    dv = np.zeros(np.asarray(v).shape, work)
    lse = np.asarray(lse)
    for b, (rq, rk) in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if rq.stop == rq.start or rk.stop == rk.start:
            continue  # no queries, or no keys: no gradient
        g = attention_backward(_heads_first(q, rq), _heads_first(k, rk), _heads_first(v, rk), _heads_first(out, rq),
                               lse[:, rq], _heads_first(dout, rq), causal=causal, softmax_scale=softmax_scale,
                               dtype=dtype, window_size=window_size, softcap=softcap,
                               alibi_slopes=_slopes(alibi_slopes, b))
        dq[rq], dk[rk], dv[rk] = (np.swapaxes(x, 0, 1) for x in g)
    return dq, dk, dv
