"""numba_flash.torch as PyTorch custom ops: torch.compile, opcheck, CUDA graphs.

Without a GPU (PyTorch installed, CUDA or not) the ops are traced on meta tensors: their fake
implementations give the outputs' shapes, dtypes and strides, and torch.compile(fullgraph=True)
of a function that calls ``attention`` (forward and backward) has one graph and no break; eager calls skip the
op dispatcher and give the op path's bits (launches replaced by a float64 twin on the CPU). On a GPU
(marked gpu) the same ops run for real: torch.library.opcheck, compiled against eager (within the
rounding of inductor's fused loss), and capture and replay in a CUDA graph against eager on fresh inputs.
"""
from __future__ import annotations

import concurrent.futures
import math
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gpu_helpers import HAVE_TORCH_CUDA, attention_f64_torch, needs_gpu  # noqa: E402

import numba_flash.torch as nft  # noqa: E402
from numba_flash.torch import attention, decode  # noqa: E402


def _meta(*shape, dtype=torch.float16, grad=True):
    return torch.empty(*shape, device="meta", dtype=dtype).requires_grad_(grad)


def test_fake_outputs_have_the_real_outputs_layout():
    """out (q's shape, contiguous, q's dtype), lse float32 of q.shape[:-1]; gradients like q, k, v."""
    q = _meta(2, 8, 300, 64).transpose(1, 2)  # a strided (B, N, H, d) view: outputs are still contiguous
    k, v = _meta(2, 300, 2, 64).transpose(1, 2), _meta(2, 300, 2, 64).transpose(1, 2)
    out, lse = nft.fwd(q, k, v, True, None, -1, -1, 0.0, None, True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32 and lse.is_contiguous()
    dq, dk, dv = nft.bwd(out, q, k, v, out, lse, True, None, True, -1, -1, 0.0, None)
    for g, x in zip((dq, dk, dv), (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype and g.is_contiguous()
    o, l_ = nft.decode_op(_meta(3, 8, 4, 128, grad=False), _meta(3, 2, 500, 128, grad=False),
                          _meta(3, 2, 500, 128, grad=False), None, 0.1, 2)
    assert o.shape == (3, 8, 4, 128) and l_.shape == (3, 8, 4) and l_.dtype == torch.float32


def test_compile_fullgraph_without_graph_breaks():
    """dynamo sees one node per call, never the launcher (torch.Stream.cuda_stream, the plan keys): forward, the
    mods, return_lse and the backward trace into one graph."""
    import torch._dynamo as dynamo

    q, k, v = _meta(2, 4, 64, 32), _meta(2, 2, 80, 32), _meta(2, 2, 80, 32)
    slopes = torch.empty(4, device="meta", dtype=torch.float32)

    def f(q, k, v):
        a = attention(q, k, v, causal=True, window_size=(16, 0), softcap=30.0)
        b, lse = attention(q, k, v, alibi_slopes=slopes, softmax_scale=0.2, return_lse=True, deterministic=False)
        return (a.float() * b.float()).sum() + lse.sum()

    dynamo.reset()
    ex = dynamo.explain(f)(q, k, v)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()  # the backward graph holds numba_flash::bwd
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("kw, err, match", [
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(causal=np.array([True, False])), TypeError, "causal must be a bool"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a real number"),
    (dict(softmax_scale=True), TypeError, "softmax_scale must be a real number"),
    (dict(softcap=None), TypeError, "softcap must be a real number"),
    (dict(alibi_slopes=[0.5] * 4), TypeError, "alibi_slopes must be a float32 torch tensor"),
    (dict(window_size={1, 2}), TypeError, "window_size must be a pair"),
])
def test_bad_scalar_arguments_are_named(kw, err, match):
    q, k, v = _meta(1, 4, 16, 32), _meta(1, 4, 16, 32), _meta(1, 4, 16, 32)
    with pytest.raises(err, match=match):
        attention(q, k, v, **kw)


def test_numpy_scalars_are_accepted():
    q, k, v = _meta(1, 4, 16, 32), _meta(1, 4, 16, 32), _meta(1, 4, 16, 32)
    out = attention(q, k, v, causal=np.bool_(True), softmax_scale=np.float32(0.25), softcap=np.float64(20.0))
    assert out.shape == q.shape


def test_decode_refuses_host_lengths():
    q = _meta(1, 4, 1, 32, grad=False)
    kc = _meta(1, 4, 64, 32, grad=False)
    with pytest.raises(TypeError, match="cache_seqlens must be a torch tensor"):
        decode(q, kc, kc, cache_seqlens=np.array([10], np.int32))
    with pytest.raises(TypeError, match="num_splits must be a Python int"):
        decode(q, kc, kc, num_splits=2.0)


def test_varlen_attention_with_gradients_up_to_the_backward_head_dims_is_not_refused_at_once():
    """The varlen forward and backward both run d <= 256 (the backward's d > 128 on the split-layout dkdv): with or
    without gradients, d = 200 is not refused before the op (which then needs CUDA tensors)."""
    q = torch.randn(10, 2, 200, dtype=torch.float16, requires_grad=True)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(Exception) as info:
        nft.varlen_attention(q, q, q, cu, cu, 6, 6)
    assert not isinstance(info.value, NotImplementedError)
    with torch.no_grad(), pytest.raises(Exception) as info:
        nft.varlen_attention(q, q, q, cu, cu, 6, 6)
    assert not isinstance(info.value, NotImplementedError)


# --------------------------------------------------------------------------------------------
# The eager path: the ops' bodies without the dispatcher (CPU, launches replaced by a float64 twin)
# --------------------------------------------------------------------------------------------
def _through_dispatcher() -> bool:
    """Whether the caller runs inside a torch.library custom op (its Python frames are on the stack)."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        if "torch/_library" in f.f_code.co_filename.replace("\\", "/"):
            return True
        f = f.f_back
    return False


@pytest.fixture
def twin_launches(monkeypatch):
    """numba_flash.forward / backward / decode / varlen_* as the ops' bodies call them, replaced by materialised
    float64 twins on CPU tensors; each call records whether it came through the op dispatcher."""
    from gpu_helpers import _masked_scores, _softmax_pv

    seen = []

    def forward(q, k, v, *, causal, softmax_scale, window_size, softcap, alibi_slopes):
        seen.append(("forward", _through_dispatcher()))
        with torch.no_grad():
            out, lse = _softmax_pv(*_masked_scores(q.double(), k.double(), v.double(), causal, softmax_scale,
                                                   window_size, softcap, alibi_slopes))
        return out.to(q.dtype).contiguous(), lse.float()

    def backward(q, k, v, out, lse, dout, *, causal, softmax_scale, deterministic, window_size, softcap,
                 alibi_slopes):
        seen.append(("backward", _through_dispatcher()))

        def grads():
            leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
            o = _softmax_pv(*_masked_scores(*leaves, causal, softmax_scale, window_size, softcap, alibi_slopes))[0]
            return tuple(g.to(q.dtype) for g in torch.autograd.grad(o, leaves, dout.double()))

        # an op's body runs below the autograd dispatch key (thread-local state): a fresh thread records a graph
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(grads).result()

    def decode(q, k, v, *, cache_seqlens, softmax_scale, num_splits, causal=True, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, **cache_layout):
        assert all(x is None for x in cache_layout.values()), cache_layout  # the twin knows contiguous caches only
        seen.append(("decode", _through_dispatcher()))
        out, lse = _softmax_pv(*_masked_scores(q, k, v, causal, softmax_scale, window_size, softcap, alibi_slopes))
        return out.contiguous(), lse.float()

    def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        seen.append(("varlen_forward", _through_dispatcher()))
        return torch.zeros_like(q), q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)

    def varlen_backward(q, k, v, out, lse, dout, *args, **kw):
        seen.append(("varlen_backward", _through_dispatcher()))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    for name, fn in (("forward", forward), ("backward", backward), ("_decode", decode),
                     ("varlen_forward", varlen_forward), ("varlen_backward", varlen_backward)):
        monkeypatch.setattr(nft, name, fn)
    return seen


def _cpu(*shape, seed=0, grad=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)


def test_eager_calls_skip_the_op_dispatcher(twin_launches):
    """Eager calls run the ops' bodies directly (an autograd.Function where gradients are needed): forward,
    backward, decode and varlen, with and without grad."""
    q, k, v = _cpu(2, 4, 24, 16, seed=1), _cpu(2, 2, 30, 16, seed=2), _cpu(2, 2, 30, 16, seed=3)
    attention(q, k, v, causal=True).sum().backward()
    with torch.no_grad():
        attention(q, k, v)
    decode(q.detach()[:, :, -1:], k.detach(), v.detach())
    qv, kv = _cpu(10, 4, 16, seed=4), _cpu(12, 2, 16, seed=5)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    nft.varlen_attention(qv, kv, kv, cu_q, cu_k, 6, 7, causal=True).sum().backward()
    assert [name for name, _ in twin_launches] == ["forward", "backward", "forward", "decode", "varlen_forward",
                                                   "varlen_backward"]
    assert not any(through for _, through in twin_launches), twin_launches


def test_eager_and_op_paths_give_identical_results(twin_launches):
    """The eager autograd.Function and the op (with its registered autograd) run the same bodies: out, lse and
    every gradient bitwise equal, with the mods (window, softcap, ALiBi) and GQA."""
    slopes = torch.rand(4, dtype=torch.float32) * 0.2
    kw = dict(causal=True, softmax_scale=0.3, window_size=(9, 0), softcap=7.0, alibi_slopes=slopes)
    runs = []
    for eager in (True, False):
        q, k, v = (_cpu(*shape, seed=seed, dtype=torch.float16)  # float16: the mods' backward dtypes
                   for shape, seed in (((2, 4, 20, 16), 6), ((2, 2, 26, 16), 7), ((2, 2, 26, 16), 8)))
        if eager:
            out, lse = attention(q, k, v, return_lse=True, **kw)
        else:
            out, lse = nft.fwd(q, k, v, True, 0.3, 9, 0, 7.0, slopes, True)
        (out.double() * torch.linspace(-1, 1, 16, dtype=torch.float64)).sum().backward()
        runs.append([out.detach(), lse, q.grad, k.grad, v.grad])
    assert [through for _, through in twin_launches] == [False, False, True, True]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), name
    q, k, v = (x.detach() for x in (q, k, v))  # decode takes the same mods, eagerly and through its op
    eager = decode(q[:, :, -2:], k, v, causal=True, softmax_scale=0.3, window_size=(9, 0), softcap=7.0,
                   alibi_slopes=slopes)
    op = nft.decode_op(q[:, :, -2:], k, v, None, 0.3, None, None, None, None, True, 9, 0, 7.0, slopes)
    assert [through for _, through in twin_launches[-2:]] == [False, True]
    assert torch.equal(eager[0], op[0]) and torch.equal(eager[1], op[1])
    plain = decode(q[:, :, -2:], k, v, causal=True, softmax_scale=0.3)
    assert not torch.equal(eager[0], plain[0]), "the twin must see the mods"


def test_traced_calls_keep_the_op(twin_launches):
    """Under torch.compile (fullgraph, one graph) and under a dispatch mode the call goes through the op, and the
    compiled function matches eager; meta tensors take the op's fake."""
    import torch._dynamo as dynamo
    from torch.utils._python_dispatch import TorchDispatchMode

    def f(q, k, v):
        return attention(q, k, v, causal=True).square().sum()

    q, k, v = _cpu(1, 2, 12, 8, seed=9), _cpu(1, 2, 12, 8, seed=10), _cpu(1, 2, 12, 8, seed=11)
    dynamo.reset()
    ex = dynamo.explain(f)(q, k, v)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    twin_launches.clear()
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    assert twin_launches and all(through for _, through in twin_launches), twin_launches
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    eager_loss = f(q, k, v)
    eager_loss.backward()
    assert torch.equal(loss, eager_loss) and all(torch.equal(a, x.grad) for a, x in zip(grads, (q, k, v)))

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    twin_launches.clear()
    with Passthrough():
        attention(q.detach(), k.detach(), v.detach())
    assert twin_launches == [("forward", True)]


# --------------------------------------------------------------------------------------------
# Real GPU
# --------------------------------------------------------------------------------------------
gpu = [pytest.mark.gpu, needs_gpu, pytest.mark.skipif(not HAVE_TORCH_CUDA, reason="needs PyTorch with CUDA")]

OP_CASES = [  # (dtype, B, H, Hkv, n_q, n_k, d, causal, layout)
    ("float16", 2, 4, 2, 200, 300, 64, True, "bhnd"),      # GQA, Nq != Nk, causal
    ("bfloat16", 1, 4, 4, 256, 256, 128, False, "bnhd"),    # (B, N, H, d) storage, transposed views
    ("float32", 1, 2, 1, 100, 130, 64, True, "bhnd"),      # fp32 (3xTF32 tensor cores), MQA
]


def _inputs(dtype, B, H, Hkv, n_q, n_k, d, layout, seed, grad=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)

    def mk(h, n):
        if layout == "bnhd":
            x = torch.randn(B, n, h, d, device="cuda", generator=g).to(dt).transpose(1, 2)
        else:
            x = torch.randn(B, h, n, d, device="cuda", generator=g).to(dt)
        return x.requires_grad_(grad)

    return mk(H, n_q), mk(Hkv, n_k), mk(Hkv, n_k)


def _gpu(fn):
    for mark in reversed(gpu):
        fn = mark(fn)
    return fn


@_gpu
@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_opcheck(case):
    """torch.library.opcheck of fwd (schema: no input mutated, outputs alias nothing; fake tensors; autograd
    registration; AOT dispatch with dynamic shapes, gradients included) and of bwd, at every dtype."""
    dtype, B, H, Hkv, n_q, n_k, d, causal, layout = case
    q, k, v = _inputs(dtype, B, H, Hkv, n_q, n_k, d, layout, seed=zlib.crc32(repr(case).encode()))
    torch.library.opcheck(nft.fwd, (q, k, v, causal, None, -1, -1, 0.0, None, True))
    with torch.no_grad():
        out, lse = nft.fwd(q, k, v, causal, None, -1, -1, 0.0, None, True)
    dout = torch.randn_like(out)
    torch.library.opcheck(nft.bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, causal, None, True,
                                    -1, -1, 0.0, None))


@_gpu
def test_opcheck_mods_and_decode():
    q, k, v = _inputs("bfloat16", 2, 4, 2, 300, 300, 64, "bhnd", seed=7)
    slopes = torch.rand(4, device="cuda") * 0.1
    torch.library.opcheck(nft.fwd, (q, k, v, True, 0.11, 100, 0, 25.0, slopes, True))
    qd, kc, vc = _inputs("float16", 3, 8, 2, 4, 700, 128, "bhnd", seed=8, grad=False)
    lens = torch.tensor([700, 1, 333], device="cuda", dtype=torch.int32)
    torch.library.opcheck(nft.decode_op, (qd, kc, vc, lens, None, None))
    torch.library.opcheck(nft.decode_op, (qd, kc, vc, None, 0.05, 3))
    slopes8 = torch.rand(8, device="cuda") * 0.1
    torch.library.opcheck(nft.decode_op, (qd, kc, vc, lens, None, None, None, None, None, True, 200, 0, 30.0, slopes8))


def _train_step(q, k, v, w, **kw):
    out = attention(q, k, v, **kw)
    return (out.float() * w).square().sum()


@_gpu
@pytest.mark.parametrize("case", OP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_compiled_matches_eager(case):
    """torch.compile(fullgraph=True, inductor) with no graph break; loss and gradients as eager's up to the rounding
    of inductor's fused loss (its own summation order and dout: the attention kernels are the same)."""
    import torch._dynamo as dynamo

    dtype, B, H, Hkv, n_q, n_k, d, causal, layout = case
    q, k, v = _inputs(dtype, B, H, Hkv, n_q, n_k, d, layout, seed=3)
    w = torch.randn(q.shape, device="cuda")
    dynamo.reset()
    ex = dynamo.explain(_train_step)(q, k, v, w, causal=causal)
    assert ex.graph_break_count == 0, ex.break_reasons
    results = []
    for fn in (_train_step, torch.compile(_train_step, fullgraph=True)):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        loss = fn(*leaves, w, causal=causal)
        loss.backward()
        results.append([loss.detach()] + [x.grad for x in leaves])
    tol = 1e-4 if dtype == "float32" else 1e-2  # of max |eager|; a wrong layout or mask is O(1)
    for name, a, b in zip(("loss", "dq", "dk", "dv"), *results):
        assert torch.isfinite(a).all(), name
        err, mag = (a.double() - b.double()).abs().max().item(), b.double().abs().max().item()
        print(f"{dtype} {name}: compiled vs eager {err:.3e}, max {mag:.3e}")
        assert err <= tol * mag, f"{name}: compiled differs from eager by {err:.3e} (max {mag:.3e})"


def _reference_grads(q, k, v, w, causal):
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    loss = (attention_f64_torch(*leaves, causal)[0] * w.double()).square().sum()
    loss.backward()
    return [loss.detach()] + [x.grad for x in leaves]


@_gpu
@pytest.mark.parametrize("deterministic", [True, False])
def test_cuda_graph_capture_and_replay(deterministic):
    """Forward and backward captured in one torch.cuda.graph, replayed on new inputs copied into the static
    ones: the result matches eager on those inputs (bitwise with deterministic=True) and float64 by the error
    rule's scale. Capture fails on a host sync or an allocation outside the graph's pool."""
    B, H, Hkv, n, d, causal = 2, 8, 2, 512, 128, True
    q, k, v = _inputs("bfloat16", B, H, Hkv, n, n, d, "bhnd", seed=11)
    w = torch.randn(q.shape, device="cuda")
    static = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def step():
        loss = _train_step(*static, w, causal=causal, deterministic=deterministic)
        return [loss] + list(torch.autograd.grad(loss, static))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile the kernels, fill the plan cache
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (21, 22):
        fresh = _inputs("bfloat16", B, H, Hkv, n, n, d, "bhnd", seed=seed, grad=False)
        with torch.no_grad():
            for s, x in zip(static, fresh):
                s.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        eager = [x.detach() for x in step()]
        ref = _reference_grads(*fresh, w, causal)
        for name, a, b, r in zip(("loss", "dq", "dk", "dv"), captured, eager, ref):
            a = a.detach()
            assert torch.isfinite(a).all(), name
            if deterministic:
                assert torch.equal(a, b), name
            err = (a.double() - r).abs().max().item()
            assert err <= 0.05 * r.abs().max().item() + 1e-3, f"{name}: replay vs float64 {err:.3e}"


@_gpu
def test_compile_reduce_overhead_uses_cuda_graphs():
    """mode='reduce-overhead' (inductor's CUDA graph trees) with the ops inside: replays match eager."""
    q, k, v = _inputs("float16", 1, 4, 4, 256, 256, 64, "bhnd", seed=5, grad=False)

    def f(q, k, v):
        return attention(q, k, v, causal=True) * 2

    from torch._dynamo.utils import counters

    counters.clear()
    cf = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        got = cf(q, k, v).clone()
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])  # the graph was captured
    assert torch.equal(got, f(q, k, v))
    assert math.isfinite(got.float().abs().max().item())


def test_varlen_fake_outputs_and_compile_without_graph_breaks():
    """varlen_fwd's fake gives out like q and lse (H, total_q); varlen_attention (the offsets' device asserts
    included) and its backward trace into one graph."""
    import torch._dynamo as dynamo

    q, k, v = _meta(300, 8, 64), _meta(200, 2, 64), _meta(200, 2, 64)
    cu_q = torch.empty(4, device="meta", dtype=torch.int32)
    cu_k = torch.empty(4, device="meta", dtype=torch.int32)
    out, lse = nft.varlen_fwd(q, k, v, cu_q, cu_k, 150, 100, True, None, -1, -1, 0.0, None, True)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (8, 300) and lse.dtype == torch.float32
    grads = nft.varlen_bwd(out, q, k, v, out, lse, cu_q, cu_k, 150, 100, True, None, True, -1, -1, 0.0, None)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]

    def f(q, k, v):
        o = nft.varlen_attention(q, k, v, cu_q, cu_k, 150, 100, causal=True, window_size=(32, 0))
        return o.float().sum()

    dynamo.reset()
    ex = dynamo.explain(f)(q, k, v)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize("kw, err, match", [
    (dict(cu_seqlens_q=np.array([0, 8], np.int32)), TypeError, "cu_seqlens_q must be an int32 torch tensor"),
    (dict(cu_seqlens_k=torch.empty(2, device="meta", dtype=torch.int64)), TypeError,
     r"cu_seqlens_k must be an int32 torch tensor of shape \(B \+ 1,\) on q's device; got torch.int64"),
    (dict(max_seqlen_q=8.0), TypeError, "max_seqlen_q must be an int"),
    (dict(causal=1), TypeError, "causal must be a bool"),
])
def test_varlen_bad_arguments_are_named(kw, err, match):
    q = _meta(8, 4, 32)
    args = dict(cu_seqlens_q=torch.empty(2, device="meta", dtype=torch.int32),
                cu_seqlens_k=torch.empty(2, device="meta", dtype=torch.int32), max_seqlen_q=8, max_seqlen_k=8)
    args.update(kw)
    causal = args.pop("causal", False)
    with pytest.raises(err, match=match):
        nft.varlen_attention(q, q, q, args["cu_seqlens_q"], args["cu_seqlens_k"], args["max_seqlen_q"],
                             args["max_seqlen_k"], causal=causal)


def test_user_mods_are_eager_only():
    """A custom op cannot take a Python function: attention with mask_mod / score_mod runs forward (and its
    autograd.Function) directly, refuses a score_mod without grad where inputs require grad (at the call), fake
    tensors and torch.compile."""
    from numba_flash.mods import MaskMod

    q = _meta(1, 2, 16, 64)
    mask = MaskMod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    with pytest.raises(ValueError, match="grad=fn_grad"):
        attention(q, q, q, score_mod=lambda s, b, h, i, j: s)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="fake tensors"):
        attention(q, q, q, mask_mod=mask)

    def compiled(q):
        return attention(q, q, q, score_mod=lambda s, b, h, i, j: s)

    with pytest.raises(Exception, match="torch.compile"):
        torch.compile(compiled, fullgraph=True, backend="eager")(_meta(1, 2, 16, 64, grad=False))


def test_decode_refuses_inputs_that_require_grad():
    """decode has no gradient: inputs that require grad are refused at the call, not returned without a grad_fn."""
    q = torch.randn(1, 2, 1, 16, requires_grad=True)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(NotImplementedError, match="no gradient"):
        decode(q, k, k)
    with torch.no_grad(), pytest.raises(Exception) as info:  # without grad the call goes on (and meets the CPU check)
        decode(q, k, k)
    assert "no gradient" not in str(info.value)


def test_backward_refusals_come_at_the_call(monkeypatch):
    """Mods or varlen with gradients where the mma backward is not built (dtype, head dim, or this GPU's shared
    memory) raise at the call, not at loss.backward()."""
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="dtype torch.float32"):
        attention(q.detach().float().requires_grad_(), q, q, softcap=5.0)
    with pytest.raises(NotImplementedError, match="head dim 264 > 256"):
        attention(torch.randn(1, 2, 8, 264, dtype=torch.float16, requires_grad=True), q, q, softcap=5.0)
    monkeypatch.setattr(nft, "smem_blockers", lambda d: [f"the dkdv tile at head dim {d} needs more"])
    with pytest.raises(NotImplementedError, match="the dkdv tile at head dim 64 needs more"):
        attention(q, q, q, softcap=5.0)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    qp = torch.randn(8, 2, 64, dtype=torch.float16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="varlen_attention with gradients.*head dim 64 needs more"):
        nft.varlen_attention(qp, qp, qp, cu, cu, 8, 8)
