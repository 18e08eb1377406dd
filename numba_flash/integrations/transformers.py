"""Hugging Face transformers (>= 5): numba_flash as an attention implementation.

    from numba_flash.integrations import transformers as nf_hf
    name = nf_hf.register()                     # "numba_flash_kernels" is refused: see NAME
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

``register`` adds two entries under one name: the attention function (AttentionInterface) and its
mask function (AttentionMaskInterface). transformers drops the padding mask of an implementation
that has no mask entry; this one instead says what it cannot run.

What runs: causal and bidirectional attention, GQA / MQA, causal sliding windows (``sliding_window``,
HF's: a query sees the sliding_window - 1 keys before it and itself), logit softcapping
(``softcap``), the model's ``scaling``, and generation with a DynamicCache (bottom-right causal
alignment is numba_flash's, so a query chunk against a longer cache needs no mask). Decoding steps
of at most 16 queries without gradients, window or softcap go to ``numba_flash.torch.decode``.

Padding (a 2D attention_mask with a False), in eager calls with float16 / bfloat16: the mask function
returns the (B, Nk) padding mask and the attention function unpads q, k, v to packed sequences and runs
``numba_flash.torch.varlen_attention`` (flash-attn's unpadding, as transformers' flash-attention path):
a padded prefill (left or right padding) and generation steps of a left-padded batch against the cache,
with gradients (head dim <= 256 where the GPU has the backward tiles' shared memory), GQA, causal sliding windows and softcap. The packed sizes are read back
(one host sync per forward).

What is refused with NotImplementedError (never dropped): padding with float32 (the varlen kernels are
float16 / bfloat16) or under torch.compile (unpadding has data-dependent shapes), packed sequences, mask
functions other than causal / bidirectional / causal sliding window (or_masks, chunked or block masks,
custom ones, bidirectional windows), a static cache (keys past the queries' end), position biases and
attention sinks, dropout, and 4D masks. Padding and packing depend on the data: eager calls check them on
the host (one sync per forward); under torch.compile the check is ``torch._assert_async``, a device-side
assert.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers import masking_utils as mu
from transformers.masking_utils import AttentionMaskInterface

from ..decode import MAX_DECODE_QUERIES
from ..torch import attention, decode, varlen_attention

# transformers treats an implementation whose name contains "flash" as a hub kernel to download
NAME = "numba"
VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # what numba_flash.torch.varlen_attention runs (padded batches)


def _refuse(what: str):
    raise NotImplementedError(f"numba_flash's attention implementation for transformers cannot run {what}; use "
                              "attn_implementation='sdpa' for this model or call")


def _cells(fn) -> list:
    return [c.cell_contents for c in (fn.__closure__ or ())]


def _closure_codes() -> dict:
    """The code objects of transformers' mask-function closures, compared by identity (dynamo, tracing a model,
    gives a closure's code but not always its name)."""
    codes = {"and": mu.and_masks(mu.causal_mask_function).__code__,
             "window": mu.sliding_window_overlay(1).__code__,
             "packed": mu.packed_sequence_mask_function(torch.zeros(1, 1)).__code__}
    if hasattr(mu, "sliding_window_bidirectional_overlay"):
        codes["window_bidirectional"] = mu.sliding_window_bidirectional_overlay(1).__code__
    if hasattr(mu, "remap_positions_for_packed_sequence"):  # packing: positions renumbered per document
        codes["remap"] = mu.remap_positions_for_packed_sequence(mu.causal_mask_function, torch.zeros(1, 1)).__code__
    return codes


_CODES = _closure_codes()  # at import: dynamo does not trace into an lru_cache


def _mask_parts(fn) -> list:
    """The pieces of one of transformers' mask functions, an and_masks composition taken apart: "causal",
    "bidirectional", ("window", w) and ("packed", ids); NotImplementedError for any other piece (or_masks, chunked
    attention, block overlays, a user's function): only these are the kernels' own masks."""
    if fn is None or fn is mu.causal_mask_function:
        return ["causal"]
    if fn is mu.bidirectional_mask_function:
        return ["bidirectional"]
    codes, code = _CODES, getattr(fn, "__code__", None)
    if code is codes["and"]:
        (parts,) = [c for c in _cells(fn) if isinstance(c, tuple)]  # and_masks' mask_functions
        return [p for sub in parts for p in _mask_parts(sub)]
    if code is codes["window"]:
        return [("window", next(c for c in _cells(fn) if isinstance(c, int)))]
    if code is codes.get("window_bidirectional"):
        _refuse("a bidirectional sliding window (|q - kv| <= w)")
    if code is codes["packed"]:
        return [("packed", next(c for c in _cells(fn) if isinstance(c, torch.Tensor)))]
    if code is codes.get("remap"):  # the wrapped mask's positions, per document: its parts (the packing is its own)
        return _mask_parts(next(c for c in _cells(fn) if callable(c)))
    _refuse("this mask function (or_masks, chunked or block masks, custom mask functions): only causal, "
            "bidirectional and sliding-window masks are the kernels' own")


def mask_interface(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, local_size=None, **kwargs):
    """None where (is_causal, sliding_window) and the key order say everything; else NotImplementedError.

    Eager calls take the mask function apart (``_mask_parts``) and check packing and padding on the host. Under
    torch.compile dynamo cannot read a closure's cells, and transformers hands every batch a packed-sequence id
    tensor (it cannot look at the values while tracing): there an and_masks composition is checked by its last
    query row, evaluated on the device and compared with the causal / window row it must be (exact for the
    packing, causal and window masks transformers builds; a custom and_mask_function that agrees on that row
    would pass), and padding likewise, each by torch._assert_async (a device-side assert)."""
    if isinstance(q_offset, torch.Tensor):  # transformers' StaticLayer gives its offset as a tensor
        _refuse("a static cache (its keys run past the queries: numba_flash aligns the last query with the last key)")
    ends = (q_offset + q_length, kv_offset + kv_length)
    if all(isinstance(x, int) for x in ends) and ends[0] != ends[1]:
        _refuse(f"a cache whose keys end at position {ends[1]} while the queries end at {ends[0]} (a static cache: "
                "numba_flash aligns the last query with the last key)")
    if torch.compiler.is_compiling():
        _check_traced(mask_function, batch_size, q_offset, q_length, kv_length, kv_offset, local_size,
                      kwargs.get("device"), "allow_is_bidirectional_skip" in kwargs)
    else:
        for part in _mask_parts(mask_function):
            if isinstance(part, tuple) and part[0] == "packed":
                _check_all(part[1][:, -1] == 0, "packed sequences (several documents in one batch row)")
    if attention_mask is not None:
        if attention_mask.ndim != 2:
            _refuse(f"a {attention_mask.ndim}-D attention mask")
        keys = attention_mask[:, -kv_length:]
        if torch.compiler.is_compiling():
            _check_all(keys, "padding (a False entry in attention_mask) under torch.compile: unpadding to packed "
                             "sequences has data-dependent shapes (run padded batches eagerly)")
        elif not bool(keys.all()):
            return keys.bool()  # attention_forward unpads to packed sequences (numba_flash.torch.varlen_attention)
    return None


def _check_traced(fn, batch_size, q_offset, q_length, kv_length, kv_offset, local_size, device, bidirectional):
    """Under tracing: the mask function evaluated on the device where a packed, chunked or custom and_masks
    composition differs from the causal / window mask: the last query row, and every query against the key just
    before it (a document or chunk start hides it)."""
    if fn is None or fn is mu.causal_mask_function or fn is mu.bidirectional_mask_function:
        return
    code = getattr(fn, "__code__", None)
    if bidirectional or (code is not _CODES["and"] and code is not _CODES["window"]):
        _refuse("this mask function under torch.compile (or_masks, chunked or block masks, custom mask functions, "
                "windows on a bidirectional mask): only causal, bidirectional and causal sliding-window masks are the "
                "kernels' own")
    q_last = q_offset + q_length - 1
    b = torch.arange(batch_size, device=device)[:, None]
    kv = torch.arange(kv_length, device=device)[None, :] + kv_offset
    q = torch.full_like(kv, q_last)
    want = kv <= q
    if local_size is not None:
        want = want & (kv > q - local_size)
    ok = (fn(b, 0, q, kv) == want).all()
    first = max(q_offset, kv_offset + 1)
    if q_last >= first and (local_size is None or local_size > 1):
        qs = torch.arange(first, q_last + 1, device=device)[None, :]
        ok = ok & fn(b, 0, qs, qs - 1).all()
    torch._assert_async(ok, "numba_flash: the mask is not causal / sliding-window (packed sequences, chunks or a "
                            "custom mask function); unsupported")


def _check_all(ok, what):
    if torch.compiler.is_compiling():
        torch._assert_async(ok.all(), f"numba_flash: {what}; unsupported")
    elif not bool(ok.all()):
        _refuse(f"{what}: the kernels have no varlen or padding mask")


def _padded(query, key, value, keys, **kw):
    """Attention of a padded batch as packed sequences (flash-attn's unpadding, as transformers' flash-attention
    path does): keys (B, Nk) bool, True on real tokens; the queries are the last Nq positions of each row (a
    prefill, Nq = Nk, with any padding; a step against the cache with left padding). Returns (B, Nq, H, d), zeros
    at padded query positions. Eager only: the packed sizes are read back (one host sync per call)."""
    if query.dtype not in VARLEN_DTYPES:
        _refuse(f"padding (a False entry in attention_mask) with {query.dtype}: the packed-sequence (varlen) kernels "
                "take float16 / bfloat16")
    B, H, n_q, d = query.shape
    n_k = key.shape[2]

    def unpad(mask):
        lens = mask.sum(-1, dtype=torch.int32)
        cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
        return torch.nonzero(mask.flatten()).flatten(), cu, int(lens.max())

    idx_k, cu_k, max_k = unpad(keys)
    idx_q, cu_q, max_q = unpad(keys[:, -n_q:])
    q = query.transpose(1, 2).reshape(B * n_q, H, d)[idx_q]
    k, v = (x.transpose(1, 2).reshape(B * n_k, x.shape[1], d)[idx_k] for x in (key, value))
    out = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    return out.new_zeros(B * n_q, H, d).index_put((idx_q,), out).view(B, n_q, H, d)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, **kwargs):
    """transformers' attention signature: (B, H, N, d) query, (B, Hkv, N, d) key/value; returns ((B, N, H, d), None).
    attention_mask: None, or the (B, Nk) bool padding mask ``mask_interface`` returns (unpadded to varlen)."""
    if attention_mask is not None and (attention_mask.ndim != 2 or attention_mask.dtype != torch.bool):
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
        if not causal:
            _refuse(f"a bidirectional sliding window (sliding_window={sliding_window})")
        window = (sliding_window - 1, 0)  # transformers' overlay: kv > q - sliding_window
    cap = float(softcap) if softcap else 0.0
    n_q = query.shape[2]
    grads = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if attention_mask is not None:
        out = _padded(query, key, value, attention_mask, causal=causal, softmax_scale=scaling, window_size=window,
                      softcap=cap)
        return out, None
    if (causal or n_q == 1) and n_q <= MAX_DECODE_QUERIES and window == (-1, -1) and not cap and not grads:
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
