"""Hugging Face transformers (>= 5): numba_flash as an attention implementation.

    from numba_flash.integrations import transformers as nf_hf
    name = nf_hf.register()                     # "numba_flash_kernels" is refused: see NAME
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

``register`` adds two entries under one name: the attention function (AttentionInterface) and its
mask function (AttentionMaskInterface). transformers drops the padding mask of an implementation
that has no mask entry; this one instead says what it cannot run.

What runs: causal and bidirectional attention, GQA / MQA, sliding windows (``sliding_window``,
HF's: a query sees the sliding_window - 1 keys before it and itself), logit softcapping
(``softcap``), the model's ``scaling``, and generation with a DynamicCache (bottom-right causal
alignment is numba_flash's, so a query chunk against a longer cache needs no mask). Decoding steps
of at most 16 queries without gradients, window or softcap go to ``numba_flash.torch.decode``.

What is refused with NotImplementedError (never dropped): padding (a 2D attention_mask with a
False), packed sequences and or/and mask functions, a static cache (keys past the queries' end),
position biases and attention sinks, dropout, and 4D masks. With a 2D mask, eager calls check it
on the host (one sync per forward); under torch.compile the check is ``torch._assert_async``, a
device-side assert.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..torch import attention, decode

# transformers treats an implementation whose name contains "flash" as a hub kernel to download
NAME = "numba"
DECODE_MAX_QUERIES = 16  # numba_flash.decode's limit


def _refuse(what: str):
    raise NotImplementedError(f"numba_flash's attention implementation for transformers cannot run {what}; use "
                              "attn_implementation='sdpa' for this model or call")


def mask_interface(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, allow_is_causal_skip=True, allow_is_bidirectional_skip=False, **kwargs):
    """None where (is_causal, sliding_window) and the key order say everything; else NotImplementedError."""
    if not (allow_is_causal_skip or allow_is_bidirectional_skip):
        _refuse("this mask: packed sequences, or/and mask functions, or a compileable (static) cache while "
                "decoding need an arbitrary mask")
    ends = (q_offset + q_length, kv_offset + kv_length)
    if all(isinstance(x, int) for x in ends) and ends[0] != ends[1]:
        _refuse(f"a cache whose keys end at position {ends[1]} while the queries end at {ends[0]} (a static cache: "
                "numba_flash aligns the last query with the last key)")
    if attention_mask is not None:
        if attention_mask.ndim != 2:
            _refuse(f"a {attention_mask.ndim}-D attention mask")
        padding = attention_mask[:, -kv_length:]
        if torch.compiler.is_compiling():
            torch._assert_async(padding.all(), "numba_flash: padding in attention_mask (a False entry); unsupported")
        elif not bool(padding.all()):
            _refuse("padding (a False entry in attention_mask): no varlen or padding mask yet")
    return None


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, **kwargs):
    """transformers' attention signature: (B, H, N, d) query, (B, Hkv, N, d) key/value; returns ((B, N, H, d), None)."""
    if attention_mask is not None:
        _refuse("a materialised attention mask (it came from another mask function than this one's)")
    if dropout:
        _refuse(f"attention dropout ({dropout})")
    for name in ("position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            _refuse(f"{name}")
    if kwargs.get("output_attentions"):
        _refuse("output_attentions=True (the probabilities are never materialised)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal)
    window = (-1, -1)
    if sliding_window:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    cap = float(softcap) if softcap else 0.0
    n_q = query.shape[2]
    grads = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if (causal or n_q == 1) and n_q <= DECODE_MAX_QUERIES and window == (-1, -1) and not cap and not grads:
        out, _ = decode(query, key, value, softmax_scale=scaling)  # bottom-right causal to the end of the cache
    else:
        out = attention(query, key, value, causal=causal, softmax_scale=scaling, window_size=window, softcap=cap)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> str:
    """Register the attention and mask functions under ``name``; returns it (for attn_implementation=...)."""
    if "flash" in name:
        raise ValueError(f"name {name!r} contains 'flash': transformers would try to load a hub kernel by that name")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_interface)
    return name
