"""numba_flash.integrations.transformers with tiny random-init models (no downloads).

Anywhere transformers is installed: the adapter's semantics on the CPU, with numba_flash's two calls
(attention, decode) replaced by a float64 materialised twin that keeps their conventions (bottom-right
causal, flash-attn's window, GQA): logits, loss and gradients against transformers' sdpa implementation,
for Llama, Qwen2, Mistral (sliding window) and GPT-2 configs, greedy generation with a KV cache, padded batches
(unpadded to varlen, whose twin runs each packed sequence) and left-padded generation, and every mask the
adapter must refuse (float32 or compiled padding, packed sequences, a static cache). On a GPU (marked gpu) the same
models run the real kernels in float32 (3xTF32) and bf16, and compile with fullgraph=True.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gpu_helpers import HAVE_TORCH_CUDA, attention_mods_torch, needs_gpu  # noqa: E402

from numba_flash.integrations import transformers as nf_hf  # noqa: E402

NAME = nf_hf.register()


def _config(family, **over):
    common = dict(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=24)
    elif family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=97, n_embd=128, n_layer=2, n_head=4, n_positions=512)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _model(family, impl, device="cpu", dtype=torch.float64, seed=0):
    """The same weights for every dtype and implementation: initialised in float32 (an init in another dtype
    draws other numbers from the same seed), then converted."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation=impl,
                                                          dtype=torch.float32)
    return model.to(device=device, dtype=dtype).eval()


def _twin_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, **kw):
    """numba_flash.torch.attention's conventions, materialised (float64 on the CPU)."""
    return attention_mods_torch(q, k, v, causal, softmax_scale, window_size, softcap)


def _twin_decode(q, k, v, *, softmax_scale=None, **kw):
    return attention_mods_torch(q, k, v, True, softmax_scale), None


def _twin_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                 softcap=0.0, **kw):
    """numba_flash.torch.varlen_attention's conventions (packed (total, H, d), each sequence bottom-right causal),
    materialised per sequence; checks the offsets and maxima as the kernels read them."""
    lens_q, lens_k = (cu[1:] - cu[:-1] for cu in (cu_q, cu_k))
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q[-1] == q.shape[0] and cu_k[-1] == k.shape[0]
    assert max_q == int(lens_q.max()) and max_k == int(lens_k.max())
    outs = []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = (x[cu[b]:cu[b + 1]].transpose(0, 1) for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k)))
        outs.append(attention_mods_torch(qs, ks, vs, causal, softmax_scale, window_size, softcap).transpose(0, 1))
    return torch.cat(outs)


@pytest.fixture
def twin(monkeypatch):
    """The adapter's calls into numba_flash, counted and replaced by the twin (varlen's dtypes: the twin's too)."""
    calls = {"attention": 0, "decode": 0, "varlen": 0}

    def att(*a, **kw):
        calls["attention"] += 1
        return _twin_attention(*a, **kw)

    def dec(*a, **kw):
        calls["decode"] += 1
        return _twin_decode(*a, **kw)

    def var(*a, **kw):
        calls["varlen"] += 1
        return _twin_varlen(*a, **kw)

    monkeypatch.setattr(nf_hf, "attention", att)
    monkeypatch.setattr(nf_hf, "decode", dec)
    monkeypatch.setattr(nf_hf, "varlen_attention", var)
    monkeypatch.setattr(nf_hf, "VARLEN_DTYPES", nf_hf.VARLEN_DTYPES + (torch.float64,))
    return calls


FAMILIES = ["llama", "qwen2", "mistral", "gpt2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_match_sdpa(family, twin):
    ids = torch.randint(0, 97, (2, 60), generator=torch.Generator().manual_seed(1))
    results = []
    for impl in ("sdpa", NAME):
        model = _model(family, impl)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        results.append((out.logits.detach(), out.loss.detach(), grads))
    (lg0, l0, g0), (lg1, l1, g1) = results
    assert twin["attention"] == 2  # one call per layer, ours only
    torch.testing.assert_close(lg1, lg0, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(l1, l0, rtol=1e-9, atol=1e-9)
    assert len(g0) == len(g1)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_generation_with_a_cache_matches_sdpa(family, twin):
    """Prefill (causal), then one query per step against the DynamicCache (numba_flash.decode, or attention
    with the window: decode has none); the tokens and every step's logits as sdpa's."""
    ids = torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(2))  # no pad token (0)
    runs = []
    for impl in ("sdpa", NAME):
        model = _model(family, impl)
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                           return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        runs.append(g)
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].logits, runs[1].logits):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
    if family == "llama":
        assert twin["decode"] == 2 * 7  # 7 decoding steps x 2 layers; the prefill ran attention
    else:
        assert twin["decode"] == 0  # Mistral's window: attention every step


def _padded_batch(n=24, seed=4):
    """Three rows: left padding (5), none, right padding (7); pad tokens 0."""
    ids = torch.randint(1, 97, (3, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(3, n, dtype=torch.long)
    mask[0, :5] = 0
    mask[2, -7:] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_padded_batch_matches_sdpa(family, twin):
    """A padded batch (left, none, right) unpadded to packed sequences: logits on the real tokens, the loss over
    them (labels -100 on pads) and every gradient as sdpa's; Mistral's window (24) runs through varlen too."""
    ids, mask = _padded_batch(40 if family == "mistral" else 24)
    labels = ids.masked_fill(mask == 0, -100)
    results = []
    for impl in ("sdpa", NAME):
        model = _model(family, impl)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        results.append((out.logits.detach()[mask.bool()], out.loss.detach(), grads))
    (lg0, l0, g0), (lg1, l1, g1) = results
    assert twin["varlen"] == 2 and twin["attention"] == 0
    torch.testing.assert_close(lg1, lg0, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(l1, l0, rtol=1e-9, atol=1e-9)
    assert len(g0) == len(g1)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def test_generation_with_left_padding_matches_sdpa(twin):
    """Batched greedy generation of a left-padded batch: the prefill and every step against the cache unpad to
    varlen (the step's query is each row's last token); the tokens and every step's logits as sdpa's."""
    ids, mask = _padded_batch(16)
    mask[2] = 1  # generation pads on the left only
    mask[1, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    runs = []
    for impl in ("sdpa", NAME):
        model = _model("llama", impl)
        runs.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                   return_dict_in_generate=True, output_logits=True, pad_token_id=0))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for a, b in zip(runs[0].logits, runs[1].logits):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9)
    assert twin["varlen"] == 2 * 6 and twin["decode"] == 0  # prefill + 5 steps, 2 layers each


def test_an_all_true_padding_mask_is_fine_and_float32_padding_is_refused(twin):
    model = _model("llama", NAME)
    ids = torch.randint(0, 97, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    model(input_ids=ids, attention_mask=mask)
    assert twin["varlen"] == 0
    mask[0, :3] = 0
    with pytest.raises(NotImplementedError, match="padding .* with torch.float32: the packed-sequence"):
        _model("llama", NAME, dtype=torch.float32)(input_ids=ids, attention_mask=mask)


def test_compiled_padding_is_refused_with_the_reason(twin):
    """Under torch.compile unpadding would need data-dependent shapes: padding fails the device-side check, whose
    message says so."""
    model = _model("llama", NAME)
    ids, mask = _padded_batch(20)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError, match="padding .* under torch.compile: unpadding"):
        compiled(input_ids=ids, attention_mask=mask, use_cache=False)


def test_packed_sequences_are_refused(twin):
    model = _model("llama", NAME)
    ids = torch.randint(0, 97, (1, 20))
    pos = torch.cat([torch.arange(10), torch.arange(10)])[None]  # two documents in one row
    with pytest.raises(NotImplementedError, match="packed sequences"):
        model(input_ids=ids, position_ids=pos, use_cache=False)  # (with a cache transformers does not look)


def test_a_static_cache_is_refused(twin):
    model = _model("llama", NAME)
    ids = torch.randint(1, 97, (1, 12))
    with pytest.raises(NotImplementedError, match="static cache|compileable"):
        model.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation="static", pad_token_id=0)


def test_compiled_model_is_one_graph(twin):
    """Under dynamo transformers passes a packed-sequence id tensor for every batch (it cannot read values while
    tracing): the adapter's check becomes a device-side assert, not a refusal or a graph break."""
    import torch._dynamo as dynamo

    model = _model("llama", NAME)
    ids = torch.randint(0, 97, (2, 40))
    dynamo.reset()
    ex = dynamo.explain(model)(input_ids=ids, use_cache=False)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    eager = model(input_ids=ids, use_cache=False).logits
    compiled = torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(compiled, eager)
    pos = torch.cat([torch.arange(20), torch.arange(20)])[None].expand(2, -1)  # two documents per row
    with pytest.raises(RuntimeError, match="numba_flash: the mask is not causal"):
        torch.compile(model, fullgraph=True, backend="eager")(input_ids=ids, position_ids=pos, use_cache=False)


def test_compiled_window_model_refuses_packing(twin):
    """Mistral's window (24) with a last document longer than it: the last query row alone agrees with the window
    mask, the key before each document's first token does not."""
    model = _model("mistral", NAME)
    ids = torch.randint(0, 97, (1, 40))
    pos = torch.cat([torch.arange(10), torch.arange(30)])[None]
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(input_ids=ids, use_cache=False).logits,
                               model(input_ids=ids, use_cache=False).logits)
    with pytest.raises(RuntimeError, match="numba_flash: the mask is not causal"):
        compiled(input_ids=ids, position_ids=pos, use_cache=False)


def test_names_with_flash_are_refused():
    with pytest.raises(ValueError, match="flash"):
        nf_hf.register("numba_flash")


# --------------------------------------------------------------------------------------------
# Real GPU: the kernels themselves
# --------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="needs PyTorch with CUDA")


@pytest.mark.gpu
@needs_gpu
@gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_models_match_sdpa(family, dtype):
    """Logits, loss and gradients of the real kernels against sdpa in the same dtype: within 2x sdpa's own error
    against float64 (+ small), the flash-attention rule applied to the whole model."""
    dt = getattr(torch, dtype)
    ids = torch.randint(0, 97, (2, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    if family == "mistral" and dtype == "float32":  # the fp32 backward (3xTF32) has no window: said up front
        with pytest.raises(NotImplementedError, match="window_size"):
            _model(family, NAME, "cuda", dt)(input_ids=ids, labels=ids)
        return
    outs = {}
    for impl, d in (("sdpa", torch.float64), ("sdpa", dt), (NAME, dt)):
        model = _model(family, impl, "cuda", d)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grad = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
        outs[impl, d] = (out.logits.double().detach(), out.loss.double().detach(), grad)
    truth, theirs, ours = outs["sdpa", torch.float64], outs["sdpa", dt], outs[NAME, dt]
    for i, name in enumerate(("logits", "loss", "grads")):
        err = (ours[i] - truth[i]).abs().max().item()
        ref_err = (theirs[i] - truth[i]).abs().max().item()
        mag = truth[i].abs().max().item()
        print(f"{family} {dtype} {name}: ours {err:.3e}, sdpa {ref_err:.3e}, max {mag:.3e}")
        assert err <= 2 * ref_err + 1e-5 * mag, f"{name}: ours {err:.3e} vs sdpa {ref_err:.3e}"


@pytest.mark.gpu
@needs_gpu
@gpu
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_gpu_padded_batch_matches_sdpa(family):
    """A padded bf16 batch (left, none, right padding) through the varlen kernels: logits on the real tokens, the
    loss over them and the gradients within 2x sdpa's own bf16 error against float64 (+ small); then greedy
    generation of a left-padded batch gives sdpa's tokens for the first steps (bf16 argmax ties aside)."""
    ids, mask = (x.cuda() for x in _padded_batch(200 if family == "llama" else 120))
    labels = ids.masked_fill(mask == 0, -100)
    outs = {}
    for impl, d in (("sdpa", torch.float64), ("sdpa", torch.bfloat16), (NAME, torch.bfloat16)):
        model = _model(family, impl, "cuda", d)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        grad = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
        outs[impl, d] = (out.logits.double().detach()[mask.bool()], out.loss.double().detach(), grad)
    truth, theirs, ours = outs["sdpa", torch.float64], outs["sdpa", torch.bfloat16], outs[NAME, torch.bfloat16]
    for i, name in enumerate(("logits", "loss", "grads")):
        err = (ours[i] - truth[i]).abs().max().item()
        ref_err = (theirs[i] - truth[i]).abs().max().item()
        mag = truth[i].abs().max().item()
        print(f"padded {family} bfloat16 {name}: ours {err:.3e}, sdpa {ref_err:.3e}, max {mag:.3e}")
        assert err <= 2 * ref_err + 1e-5 * mag, f"{name}: ours {err:.3e} vs sdpa {ref_err:.3e}"
    gen_mask = mask.clone()
    gen_mask[2] = 1
    gen_ids = ids.masked_fill(gen_mask == 0, 0)
    seqs = [_model(family, impl, "cuda", torch.float64 if impl == "sdpa" else torch.bfloat16).generate(
        gen_ids, attention_mask=gen_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        for impl in ("sdpa", NAME)]
    assert (seqs[0][:, -4:-2] == seqs[1][:, -4:-2]).float().mean().item() >= 0.5, seqs


@pytest.mark.gpu
@needs_gpu
@gpu
def test_gpu_compiled_model_has_no_graph_breaks():
    import torch._dynamo as dynamo

    model = _model("llama", NAME, "cuda", torch.bfloat16)
    ids = torch.randint(0, 97, (2, 128), device="cuda")
    dynamo.reset()
    ex = dynamo.explain(model)(input_ids=ids, use_cache=False)
    print(f"graphs {ex.graph_count}, graph breaks {ex.graph_break_count}")
    assert ex.graph_break_count == 0, ex.break_reasons
    eager = model(input_ids=ids, use_cache=False).logits
    compiled = torch.compile(model, fullgraph=True)(input_ids=ids, use_cache=False).logits
    err = (compiled.float() - eager.float()).abs().max().item()
    assert err <= 0.05 * eager.float().abs().max().item(), err  # inductor fuses the rest in bf16
