"""NumPy reference for numba_flash: every kernel's maths, in float64, with the kernels' names.

Softmax (``reference.softmax``): ``standard_softmax``, ``naive_softmax``, ``logsumexp``, the
online recurrence ``online_softmax_step`` / ``OnlineSoftmaxState`` (m, ℓ, O of section 3.6.4;
``m_i``, ``l_i``, ``acc`` in the kernels) and ``online_softmax_attention``.
Attention (``reference.attention``): ``standard_attention`` (materialises S and P, 3.6.2) and
``flash_attention`` (the FA2 tile loop, 3.6.6), with the tile-plan helpers the kernels mirror;
``block_mask``, ``host_lists`` and ``block_sparse_attention``: the BlockMask walk of the block-sparse forward.
Backward (``reference.backward``): ``attention_backward`` and ``flash_attention_backward`` (3.6.7).
Decode (``reference.decode``): split-KV ``decode_partials`` + ``merge_partials`` = ``decode_attention``.
Varlen (``reference.varlen``): ``varlen_attention`` and ``varlen_attention_backward``, packed sequences one by one.
Trace (``reference.trace``): ``online_softmax_trace`` and ``format_trace`` (3.6.5).
Cost models (``reference.costs``): bytes, FLOPs and roofline figures for the exercises.

Conventions (see ``reference.attention`` for the full list): softmax_scale defaults to
1/sqrt(d); masks align bottom-right with shift = Nk − Nq: query i sees key j iff 0 ≤ j < Nk and,
with flash-attn's ``window_size=(left, right)`` (−1: no bound), j ≥ i + shift − left and
j ≤ i + shift + right, where ``causal=True`` is right = 0 (j ≤ i + shift); the logits are
s = softmax_scale·q·k, then ``softcap``·tanh(s/``softcap``) (softcap > 0), then
− slope·|i + shift − j| (``alibi_slopes``, (H,) or (B, H)); L = m + log ℓ is the natural-log
logsumexp of each row of those logits; a fully masked row gives O = 0, L = −inf and zero
gradients; decoding uses each sequence's shift len_b − Nq; computation is float64 unless
``dtype=`` asks otherwise.
This package imports nothing from numba_flash.
"""

from . import costs
from .attention import (
    block_mask,
    block_sparse_attention,
    causal_mask,
    first_q_block_to_visit,
    flash_attention,
    host_lists,
    kv_block_range,
    kv_blocks_to_visit,
    q_block_range,
    standard_attention,
    tile_needs_mask,
    visible_mask,
)
from .backward import attention_backward, flash_attention_backward
from .decode import decode_attention, decode_partials, merge_partials, split_bounds
from .softmax import (
    OnlineSoftmaxState,
    OnlineStep,
    logsumexp,
    naive_softmax,
    online_softmax_attention,
    online_softmax_step,
    standard_softmax,
)
from .varlen import varlen_attention, varlen_attention_backward
from .trace import OnlineSoftmaxTrace, TraceStep, format_trace, online_softmax_trace

__all__ = [
    "block_mask",
    "block_sparse_attention",
    "host_lists",
    "varlen_attention",
    "varlen_attention_backward",
    "decode_attention",
    "decode_partials",
    "merge_partials",
    "split_bounds",
    "standard_softmax",
    "naive_softmax",
    "logsumexp",
    "OnlineStep",
    "online_softmax_step",
    "OnlineSoftmaxState",
    "online_softmax_attention",
    "standard_attention",
    "flash_attention",
    "visible_mask",
    "kv_block_range",
    "q_block_range",
    "tile_needs_mask",
    "causal_mask",
    "kv_blocks_to_visit",
    "first_q_block_to_visit",
    "attention_backward",
    "flash_attention_backward",
    "TraceStep",
    "OnlineSoftmaxTrace",
    "online_softmax_trace",
    "format_trace",
    "costs",
]
