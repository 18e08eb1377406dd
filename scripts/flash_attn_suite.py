"""flash-attention's own tests/test_flash_attn.py, unmodified, with ``flash_attn`` resolving to numba_flash (GPU).

    python3 scripts/flash_attn_suite.py --tests PATH/test_flash_attn.py [--per-function 12] [--seed 0]
                                        [--jobs 12] [--out DIR]

The suite's grid is huge (hundreds of thousands of parametrizations), so each test function keeps a sample of
--per-function of its parametrizations, drawn with --seed (the same on every xdist worker). ``flash_attn`` is
tests/flash_attn_shim: numba_flash.flash_attn's functions, and the helpers the suite imports besides them
(bert_padding, flash_attn_interface, layers.rotary) in plain PyTorch. Each test ends as passed, failed, skipped
by the test itself, or not supported: a NotImplementedError from numba_flash, counted by the feature it names
(failures in supported cases are bugs). Writes flash-attn-suite-DATE.{json,md} (date, GPU, command, commit, the
table, every failure's message) with --out; prints the table.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "flash_attn_shim"

# the plugin: sampling at collection, one JSON line per finished test (the controller's reports only)
CONFTEST = r'''
import json, os, random

PER, SEED, OUT = int(os.environ["FA_SUITE_PER"]), int(os.environ["FA_SUITE_SEED"]), os.environ["FA_SUITE_OUT"]


def _fn(item):
    return getattr(item, "originalname", None) or item.name.split("[")[0]


def pytest_collection_modifyitems(session, config, items):
    groups = {}
    for item in items:
        groups.setdefault(_fn(item), []).append(item)
    rng = random.Random(SEED)
    keep = set()
    for fn in sorted(groups):
        names = sorted(i.nodeid for i in groups[fn])
        keep.update(names if len(names) <= PER else rng.sample(names, PER))
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":  # every worker collects the same; one writes
        with open(os.path.join(OUT, "collected.json"), "w") as f:
            json.dump({fn: len(g) for fn, g in groups.items()}, f)
    items[:] = [i for i in items if i.nodeid in keep]


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        text = str(report.longrepr) if report.longrepr is not None else ""
        with open(os.path.join(OUT, "results.jsonl"), "a") as f:
            f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                                "text": text[-3000:]}) + "\n")
'''

FEATURES = [  # (pattern in a NotImplementedError's message, the feature it names)
    (r"dropout_p=.* with varlen", "dropout with varlen"),
    (r"dropout_p=.*built into the mma", "dropout off the mma kernels (d % 8, d > 256, fp32)"),
    (r"dropout_p", "dropout"),
    (r"block_table", "paged KV cache (block_table)"),
    (r"rotary", "rotary embedding"),
    (r"flash-attn's internal", "flash-attn's internal ops (_flash_attn_varlen_forward, flash_attn_gpu)"),
    (r"cache_leftpad", "cache_leftpad"),
    (r"cache_batch_idx", "cache_batch_idx"),
    (r"flash_attn_with_kvcache with \d+ queries", "kvcache: > 16 queries or a non-causal step"),
    (r"flash_attn_with_kvcache window_size", "kvcache: window / softcap"),
    (r"flash_attn_with_kvcache alibi", "kvcache: ALiBi"),
    (r"varlen (forward|backward): built into the 'mma'", "varlen off the mma kernels (head dim > 128, d % 8, fp32)"),
    (r"with gradients: the backward builds them into the mma", "mods' backward off the mma kernels (d % 8, fp32)"),
    (r"the backward builds them into the 'mma' kernels only", "mods' backward off the mma kernels (d % 8, fp32)"),
]


def classify(row) -> tuple:
    """(status, feature or message) of one result line."""
    if row["outcome"] == "skipped":
        return "skipped", ""
    if row["outcome"] == "passed":
        return "passed", ""
    m = re.search(r"NotImplementedError: (.*)", row["text"])
    if m and "numba_flash" in row["text"]:
        msg = m.group(1)
        for pattern, feature in FEATURES:
            if re.search(pattern, msg):
                return "not supported", feature
        return "not supported", msg[:90]
    last = [ln for ln in row["text"].splitlines() if ln.startswith("E ")]
    return "failed", (last[-1] if last else row["text"][-200:]).strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tests", type=Path, required=True, help="flash-attention's tests/test_flash_attn.py")
    ap.add_argument("--per-function", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--timeout", type=int, default=420, help="seconds for the whole pytest run")
    ap.add_argument("--select", default="", help="pytest -k expression over the suite's tests")
    ap.add_argument("--source", default="", help="where the test file came from (repository@commit), for the record")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fa-suite-"))
    shutil.copy(args.tests, work / "test_flash_attn.py")
    (work / "conftest.py").write_text(CONFTEST)
    env = dict(os.environ, FA_SUITE_PER=str(args.per_function), FA_SUITE_SEED=str(args.seed), FA_SUITE_OUT=str(work),
               PYTHONPATH=os.pathsep.join([str(SHIM), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(args.jobs),
           str(work / "test_flash_attn.py")] + (["-k", args.select] if args.select else [])
    try:
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout)
        tail = r.stdout[-1500:]
    except subprocess.TimeoutExpired as e:
        tail = f"(pytest stopped at the {args.timeout} s limit; the tests finished by then are counted)\n" + \
            (e.stdout.decode()[-1000:] if isinstance(e.stdout, bytes) else str(e.stdout or "")[-1000:])
    print(tail)
    collected = json.loads((work / "collected.json").read_text()) if (work / "collected.json").exists() else {}
    rows = [json.loads(x) for x in (work / "results.jsonl").read_text().splitlines()] \
        if (work / "results.jsonl").exists() else []
    table = collections.defaultdict(lambda: collections.Counter())
    unsupported = collections.defaultdict(collections.Counter)
    failures = []
    for row in rows:
        fn = row["nodeid"].split("::")[1].split("[")[0]
        status, what = classify(row)
        table[fn][status] += 1
        if status == "not supported":
            unsupported[fn][what] += 1
        elif status == "failed":
            failures.append({"test": row["nodeid"].split("::")[1], "error": what})
    lines = ["| test function | parametrizations | sampled run | passed | failed | skipped (by the test) | "
             "not supported (feature: count) |", "|---|---|---|---|---|---|---|"]
    for fn in sorted(set(collected) | set(table)):
        c = table[fn]
        feats = "; ".join(f"{k}: {v}" for k, v in unsupported[fn].most_common())
        lines.append(f"| {fn} | {collected.get(fn, '?')} | {sum(c.values())} | {c['passed']} | {c['failed']} | "
                     f"{c['skipped']} | {feats} |")
    text = "\n".join(lines)
    print(text)
    for f in failures:
        print("FAILED", f["test"], "--", f["error"][:300])
    if args.out:
        sys.path.insert(0, str(ROOT))
        from numba_flash.bench import metadata

        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"flash-attn-suite-{datetime.date.today().isoformat()}"
        meta = metadata("python3 scripts/flash_attn_suite.py " + " ".join(sys.argv[1:]), simulator=False)
        (stem.with_suffix(".json")).write_text(json.dumps(
            {"meta": meta, "source": args.source, "per_function": args.per_function, "seed": args.seed, "collected": collected,
             "table": {fn: dict(c) for fn, c in table.items()},
             "not_supported": {fn: dict(c) for fn, c in unsupported.items()}, "failures": failures}, indent=1))
        (stem.with_suffix(".md")).write_text(
            f"# flash-attention's tests/test_flash_attn.py against numba_flash\n\n{meta['date']}, {meta['gpu']}, "
            f"commit {meta['commit']}, `{meta['command']}`; the suite: {args.source}\n\n{text}\n")
        print("wrote", stem.with_suffix(".md"))


if __name__ == "__main__":
    main()
