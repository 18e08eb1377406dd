"""numba_flash inside PyTorch models on the GPU: checks (PASS/FAIL) and the compiled training step.

    python3 scripts/bench_torch.py [--out DIR] [--quick]

1. Checks: tests/api/test_torch_ops.py, test_transformers.py, test_flash_attn_api.py and test_jit_cache.py
   under pytest (opcheck, torch.compile fullgraph against eager, CUDA graph capture and replay, Llama / Qwen2 /
   Mistral / GPT-2 logits, loss and gradients against sdpa, generation with a cache, the refused masks, the
   flash-attn API, the kernel cache across two processes), one PASS/FAIL line per test with the numbers the
   tests print.
2. A 4-layer random-init Llama (bf16, hidden 2048, 16 heads / 4 KV heads, head dim 128), B4 N2048:
   forward+backward tokens/s, eager and torch.compile'd, with numba_flash and with sdpa (PyTorch's
   default backend on the GPU), and each compiled model's graph-break count.
3. Host time per attention call (B1 H1 N128 d64 fp16, where the GPU work is a few microseconds): eager
   (forward, and forward + backward with inputs that require grad) and inside a compiled function, ours and
   sdpa's. ``--host-only`` runs this part alone; ``--old DIR`` (a folder holding an older ``numba_flash/``, e.g.
   ``mkdir -p DIR && git archive <commit> numba_flash | tar -x -C DIR``) measures that package too, in a
   subprocess, for a before / after on one machine.
Writes torch-DATE.json (date, GPU, command, commit) with --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# --old's child measures the package in the folder given after --package, not this tree's
sys.path.insert(0, sys.argv[sys.argv.index("--package") + 1] if "--package" in sys.argv else str(ROOT))


def checks(out_dir=None) -> list:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "-s",
           "tests/api/test_torch_ops.py", "tests/api/test_transformers.py", "tests/api/test_flash_attn_api.py",
           "tests/api/test_jit_cache.py"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out_dir:  # the whole pytest output, failures' tracebacks included
        (Path(out_dir) / f"torch-checks-{datetime.date.today().isoformat()}.txt").write_text(r.stdout + r.stderr)
    rows = []
    for line in r.stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|SKIPPED|ERROR)\s+(\S+)(.*)", line)
        if m:
            rows.append(dict(result=m.group(1), test=m.group(2), detail=m.group(3).strip(" -")))
        elif re.search(r": ours [0-9.e+-]+, sdpa|^(cold|warm): |^graphs \d+", line):
            rows.append(dict(result="INFO", test="", detail=line.strip()))
    for row in rows:
        word = {"PASSED": "PASS", "FAILED": "FAIL", "ERROR": "FAIL"}.get(row["result"], row["result"])
        print(f"{word:5s} {row['test']} {row['detail']}", flush=True)
    print(r.stdout.splitlines()[-1] if r.stdout else r.stderr[-2000:], flush=True)
    return rows


def llama(impl: str, quick: bool):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                                   num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl,
                                                         dtype=torch.bfloat16).cuda().train()


def timed_steps(model, ids, rounds: int) -> float:
    """Median seconds of forward+backward (labels = ids), after two warm-up steps (numba_flash.bench.time_call)."""
    from numba_flash.bench import time_call

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return time_call(step, warmup=2, reps=rounds)[0] / 1e3


def training_step(quick: bool) -> list:
    import torch._dynamo as dynamo
    from numba_flash.integrations import transformers as nf_hf

    name = nf_hf.register()
    B, N = (2, 1024) if quick else (4, 2048)
    ids = torch.randint(0, 32000, (B, N), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    rows = []
    for impl in ("sdpa", name):
        model = llama(impl, quick)
        eager = timed_steps(model, ids, 5 if quick else 10)
        dynamo.reset()
        breaks = dynamo.explain(model)(input_ids=ids, labels=ids, use_cache=False).graph_break_count
        t0 = time.perf_counter()
        compiled = torch.compile(model)
        comp = timed_steps(compiled, ids, 5 if quick else 10)
        wall = time.perf_counter() - t0
        row = dict(impl=impl, B=B, N=N, eager_s=eager, compiled_s=comp, eager_tok_s=B * N / eager,
                   compiled_tok_s=B * N / comp, graph_breaks=breaks, compile_and_time_wall_s=wall)
        rows.append(row)
        print(f"Llama 4L bf16 B{B} N{N} fwd+bwd {impl:6s}: eager {row['eager_tok_s']:9.0f} tok/s, compiled "
              f"{row['compiled_tok_s']:9.0f} tok/s, graph breaks {breaks}", flush=True)
        del model, compiled
        torch.cuda.empty_cache()
    return rows


def host_time() -> list:
    from numba_flash.torch import attention

    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    gout = torch.randn_like(q)
    fns = {"numba_flash eager": lambda: attention(q, k, v, causal=True),
           "sdpa eager": lambda: sdpa(q, k, v, is_causal=True),
           "numba_flash eager fwd+bwd": lambda: attention(qg, kg, vg, causal=True).backward(gout),
           "sdpa eager fwd+bwd": lambda: sdpa(qg, kg, vg, is_causal=True).backward(gout)}

    def loop_ours(q, k, v):
        o = q
        for _ in range(20):
            o = attention(o, k, v, causal=True)
        return o

    def loop_sdpa(q, k, v):
        o = q
        for _ in range(20):
            o = sdpa(o, k, v, is_causal=True)
        return o

    compiled = {"numba_flash compiled": torch.compile(loop_ours, fullgraph=True),
                "sdpa compiled": torch.compile(loop_sdpa, fullgraph=True)}
    rows = []
    for label, fn in list(fns.items()) + list(compiled.items()):
        calls = 20 if label.endswith("compiled") else 1
        run = (lambda fn=fn: fn(q, k, v)) if calls > 1 else fn
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        host = (time.perf_counter() - t0) / (n * calls)
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / (n * calls)
        rows.append(dict(label=label, host_us_per_call=host * 1e6, wall_us_per_call=total * 1e6))
        print(f"host time per call, {label:26s}: {host * 1e6:6.1f} us (wall incl. GPU {total * 1e6:6.1f} us)",
              flush=True)
    return rows


def host_time_old(old: str) -> list:
    """host_time() of the package in ``old``, in a subprocess."""
    r = subprocess.run([sys.executable, __file__, "--host-only", "--package", os.path.abspath(old), "--json-rows"],
                       cwd=ROOT, capture_output=True, text=True)
    try:
        rows = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print("old package failed:", (r.stdout + r.stderr)[-2000:], flush=True)
        return []
    for row in rows:
        print(f"host time per call, --old {row['label']:20s}: {row['host_us_per_call']:6.1f} us", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--host-only", action="store_true", help="the host time per call only")
    ap.add_argument("--old", help="folder holding an older numba_flash: its host time too (with --host-only)")
    ap.add_argument("--package", help=argparse.SUPPRESS)
    ap.add_argument("--json-rows", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.host_only:
        rows = host_time()
        if a.json_rows:
            print(json.dumps(rows))
            return 0
        old = host_time_old(a.old) if a.old else []
        if a.out:
            date = datetime.date.today().isoformat()
            path = Path(a.out) / f"torch-host-{date}.json"
            path.write_text(json.dumps(dict(date=date, gpu=torch.cuda.get_device_name(), command="python3 " +
                                            " ".join(sys.argv), commit=os.environ.get("NUMBA_FLASH_COMMIT", "unknown"),
                                            host=rows, old=old), indent=1))
            print("wrote", path)
        return 0
    result = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                  command="python3 " + " ".join(sys.argv), commit=os.environ.get("NUMBA_FLASH_COMMIT", "unknown"),
                  torch=torch.__version__)
    try:
        import transformers
        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    if not a.skip_checks:
        result["checks"] = checks(a.out)
    result["host"] = host_time()
    try:
        result["training_step"] = training_step(a.quick)
    except Exception as e:  # reported, and the checks and host times are still written
        result["training_step_error"] = f"{type(e).__name__}: {e}"
        print("training step failed:", result["training_step_error"][:2000], flush=True)
    if a.out:
        path = Path(a.out) / f"torch-{result['date']}.json"
        path.write_text(json.dumps(result, indent=1))
        print("wrote", path)
    fails = [r for r in result.get("checks", []) if r["result"] in ("FAILED", "ERROR")]
    bad = len(fails) + ("training_step_error" in result)
    print("PASS" if not bad else f"FAIL ({len(fails)} checks{', the training step' if 'training_step_error' in result else ''})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
