"""Attention backward: from the materialised P, and block by block from L (3.6.7).

Both functions take the forward's outputs ``o`` and ``lse`` (= L) and the upstream gradient
``do`` and return ``(dq, dk, dv)`` of q's, k's and v's shapes. Conventions (shapes, GQA, scale,
bottom-right masks, the window, softcap and ALiBi, fully masked rows) are those of
``reference.attention``; the variants take the forward's arguments and must be given as they were.

The maths, with S₀ = scale·Q Kᵀ, S the final logits (softcap, ALiBi, mask applied to S₀) and
P = exp(S − L) (the softmax rebuilt from the saved L):

    dV = Pᵀ dO        dP = dO Vᵀ        D = rowsum(dO ∘ O)      (= rowsum(P ∘ dP))
    dS = P ∘ (dP − D)                   the gradient with respect to the final logits S
    dS₀ = dS ∘ (1 − tanh²(S₀ / softcap)) with a softcap, else dS₀ = dS; with a score_mod also
          ∘ score_mod_grad at the score_mod's input (the chain rule through s ← score_mod(s))
    dQ = scale · dS₀ K                  dK = scale · dS₀ᵀ Q

The ALiBi bias does not depend on q or k, so it adds nothing to dS₀; there is no gradient for
``alibi_slopes`` (flash-attn has none). A fully masked row (L = −inf) has P = 0, so it contributes
nothing and its dq row is 0; a hidden key has P = 0 in every row, so its dk and dv rows are 0.
"""

from __future__ import annotations

import numpy as np

from ._validation import as_real_array, check_positive_int
from .dropout import check_dropout, dropout_factor
from .attention import _prepare, q_block_range, tile_needs_mask

__all__ = ["attention_backward", "flash_attention_backward"]


def _prepare_backward(q, k, v, o, lse, do, *, causal, softmax_scale, dtype, window_size, softcap, alibi_slopes,
                      **user):
    """The forward's checks, plus: o and do are (*lead, Nq, d), lse is (*lead, Nq)."""
    o = as_real_array("o", o)
    lse = as_real_array("lse", lse)
    do = as_real_array("do", do)
    pr = _prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, dtype=dtype, window_size=window_size,
                  softcap=softcap, alibi_slopes=alibi_slopes, extra=(o, lse, do), **user)
    want = pr.lead + (pr.n_q, pr.d)
    for name, x, shape in (("o", o, want), ("do", do, want), ("lse", lse, want[:-1])):
        if x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}; the forward of these q, k, v gives {shape}")
    o, lse, do = (x.astype(pr.dtype, copy=False) for x in (o, lse, do))
    # a fully masked row (L = -inf) must get P = 0: subtracting +inf sends every entry to exp(-inf)
    lse_sub = np.where(np.isneginf(lse), np.inf, lse).astype(pr.dtype, copy=False)
    return pr, o, lse_sub, do


def attention_backward(q, k, v, o, lse, do, *, causal: bool = False, softmax_scale=None, dtype=None,
                       window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, mask_mod=None, score_mod=None,
                       score_mod_grad=None, mask_aux=(), score_aux=(), dropout_p: float = 0.0, dropout_seed: int = 0,
                       dropout_offset: int = 0):
    """Gradients of attention through the materialised Nq×Nk matrices P, dP and dS.

    ``q`` (..., Nq, d), ``k``, ``v`` (..., Nk, d) as for ``standard_attention``; ``o``
    (*lead, Nq, d) and ``lse`` (*lead, Nq) the forward's outputs for the same arguments; ``do``
    (*lead, Nq, d) the gradient of the loss with respect to O. ``causal``, ``softmax_scale``,
    ``dtype``, ``window_size``, ``softcap``, ``alibi_slopes``, ``mask_mod``, ``score_mod``, ``mask_aux``,
    ``score_aux`` as in the forward; ``score_mod_grad`` (d score_mod / d score) with a score_mod.

    Dropout (``dropout_p``, ``dropout_seed``, ``dropout_offset`` as the forward's; F = Z · 2^16 / keep16,
    reference.dropout): dV = (F ∘ P)ᵀ dO, dS = P ∘ (F ∘ dP − D), D = rowsum(dO ∘ O) as before.

    Returns ``(dq, dk, dv)`` with the shapes of q, k, v (summed over GQA groups and broadcast dims).
    """
    dropout_p = check_dropout(dropout_p, dropout_seed)
    pr, o, lse_sub, do = _prepare_backward(
        q, k, v, o, lse, do, causal=causal, softmax_scale=softmax_scale, dtype=dtype, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod,
        score_mod_grad=score_mod_grad, mask_aux=mask_aux, score_aux=score_aux,
    )
    S, dcap = pr.logits(0, pr.n_q, 0, pr.n_k, mask=pr.masked)
    P = np.exp(S - lse_sub[..., None])
    F = 1.0
    if dropout_p:
        F = dropout_factor(pr.lead, pr.n_q, pr.n_k, dropout_p, dropout_seed, dropout_offset, pr.dtype)
    dv = np.swapaxes(P * F, -1, -2) @ do
    dP = do @ np.swapaxes(pr.v, -1, -2)
    D = np.sum(do * o, axis=-1)
    dS = P * (dP * F - D[..., None])
    dS0 = dS if dcap is None else dS * dcap  # through the softcap and the score_mod to S₀ = scale·Q Kᵀ
    dq = (dS0 @ pr.k) * pr.scale
    dk = (np.swapaxes(dS0, -1, -2) @ pr.q) * pr.scale
    return pr.reduce_dq(dq), pr.reduce_dkv(dk), pr.reduce_dkv(dv)


def flash_attention_backward(
    q, k, v, o, lse, do, *, block_q: int, block_k: int, causal: bool = False, softmax_scale=None, dtype=None,
    dq_splits: int | None = None, planes: list | None = None, window_size=(-1, -1), softcap: float = 0.0,
    alibi_slopes=None, mask_mod=None, score_mod=None, score_mod_grad=None, mask_aux=(), score_aux=(),
):
    """The FA2 backward: P recomputed tile by tile from the saved L, never an Nq×Nk array.

    D = rowsum(dO ∘ O) first (O(N)). Then the outer loop runs over K/V blocks (a kernel gives each
    to a thread block) keeping the accumulators ``dk_j``, ``dv_j`` on chip; the inner loop over
    the Q blocks that see the K/V block (:func:`~reference.attention.q_block_range`: with causal
    masking or a window the others are skipped; the tiles of ``tile_needs_mask`` are masked)
    recomputes s_ij, p_ij = exp(s_ij − L_i) and ds_ij (through the softcap: the module docstring) and
    adds the tile's share to ``dq`` in memory (atomic adds in a kernel). Arguments and returns as
    :func:`attention_backward`, plus ``block_q``, ``block_k`` (ints >= 1; last blocks may be short).

    ``dq_splits`` (an int >= 1): FA2's deterministic scheme, as the kernels' deterministic splits run it.
    The shares ds_ij K_j of K/V block j go to plane j mod dq_splits of an unscaled dQ scratch (in a
    kernel: block x of each launch of dq_splits K/V blocks owns plane x, so every plane's adds arrive
    in one order), and dq = scale · (plane 0 + plane 1 + ...), summed in that order at the end (the
    kernels' convert). ``planes``: a list that receives the planes (for comparing a kernel's scratch).
    """
    pr, o, lse_sub, do = _prepare_backward(
        q, k, v, o, lse, do, causal=causal, softmax_scale=softmax_scale, dtype=dtype, window_size=window_size,
        softcap=softcap, alibi_slopes=alibi_slopes, mask_mod=mask_mod, score_mod=score_mod,
        score_mod_grad=score_mod_grad, mask_aux=mask_aux, score_aux=score_aux,
    )
    block_q = check_positive_int("block_q", block_q)
    block_k = check_positive_int("block_k", block_k)
    if dq_splits is not None:
        dq_splits = check_positive_int("dq_splits", dq_splits)
    D = np.sum(do * o, axis=-1)
    dq = np.zeros(pr.lead + (pr.n_q, pr.d), dtype=pr.dtype)
    dq_planes = np.zeros((dq_splits or 0,) + dq.shape, dtype=pr.dtype)
    dk = np.empty(pr.lead + (pr.n_k, pr.d), dtype=pr.dtype)
    dv = np.empty(pr.lead + (pr.n_k, pr.d), dtype=pr.dtype)

    for k_start in range(0, pr.n_k, block_k):  # one thread block per K/V block
        k_stop = min(k_start + block_k, pr.n_k)
        k_j = pr.k[..., k_start:k_stop, :]
        v_j = pr.v[..., k_start:k_stop, :]
        dk_j = np.zeros(pr.lead + (k_stop - k_start, pr.d), dtype=pr.dtype)
        dv_j = np.zeros(pr.lead + (k_stop - k_start, pr.d), dtype=pr.dtype)
        first, stop = q_block_range(k_start, k_stop, pr.n_q, pr.n_k, block_q, pr.causal, pr.window)
        for q_start in range(first * block_q, stop * block_q, block_q):  # the Q blocks that see these keys
            q_stop = min(q_start + block_q, pr.n_q)
            q_i, do_i = pr.q[..., q_start:q_stop, :], do[..., q_start:q_stop, :]
            edge = tile_needs_mask(q_start, k_stop, pr.n_q, pr.n_k, pr.causal, pr.window,
                                   q_stop=q_stop, k_start=k_start)
            s_ij, dcap_ij = pr.logits(q_start, q_stop, k_start, k_stop, mask=edge)
            p_ij = np.exp(s_ij - lse_sub[..., q_start:q_stop, None])
            dv_j += np.swapaxes(p_ij, -1, -2) @ do_i
            dp_ij = do_i @ np.swapaxes(v_j, -1, -2)
            ds_ij = p_ij * (dp_ij - D[..., q_start:q_stop, None])
            if dcap_ij is not None:
                ds_ij = ds_ij * dcap_ij  # through the softcap and the score_mod
            if dq_splits:  # this K/V block's plane, unscaled
                dq_planes[(k_start // block_k) % dq_splits, ..., q_start:q_stop, :] += ds_ij @ k_j
            else:
                dq[..., q_start:q_stop, :] += (ds_ij @ k_j) * pr.scale
            dk_j += np.swapaxes(ds_ij, -1, -2) @ q_i
        dk[..., k_start:k_stop, :] = dk_j * pr.scale  # scale applied once, when dK is written
        dv[..., k_start:k_stop, :] = dv_j
    for plane in dq_planes:  # planes 0, 1, ... in order
        dq += plane
    if dq_splits:
        dq *= pr.scale
    if planes is not None:
        planes.extend(pr.reduce_dq(plane) for plane in dq_planes)
    return pr.reduce_dq(dq), pr.reduce_dkv(dk), pr.reduce_dkv(dv)
