#!/usr/bin/env python
"""Reproduce the online-softmax hand calculation of section 3.6.5, step by step.

For each block: m̃, m_new, α, p, ℓ and O, beside the standard (whole-row) computation, in both
block orders. The default input is the chapter's: x = [1, 3, 2, 5], v = [10, 20, 30, 40], blocks
[1, 3] then [2, 5]; it prints ℓ = 1.2034 and O = 36.88 and checks every number the chapter prints.
Any small example can be traced:

    python scripts/hand_calc.py --x 1 3 2 5 --v 10 20 30 40 --blocks 2 2 --order 1 0
    python scripts/hand_calc.py --x 0 2 4 --v 1 1 1 --blocks 2 1 --expect-o 1
    python scripts/hand_calc.py --x 1 2 3 --v 1 0 0 1 1 1 --d 2 --blocks 1 2     # v is (n, d)

Exits 1 when the online result and the standard one disagree beyond float64 rounding, when the
chapter's numbers are not reproduced (default input), or when ``--expect-l`` / ``--expect-o``
(your own hand-rounded answers) do not match. ``--json`` prints everything as JSON.
This is a thin wrapper over ``reference.trace``, which ``numba-flash trace`` also uses.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

try:
    import reference
except ImportError:  # run from a checkout without installing: the repository root holds reference/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from reference import format_trace, online_softmax_trace

CHAPTER_X = (1.0, 3.0, 2.0, 5.0)
CHAPTER_V = (10.0, 20.0, 30.0, 40.0)
CHAPTER_BLOCKS = (2, 2)
L_DECIMALS, O_DECIMALS = 4, 2  # the chapter rounds ℓ to 4 decimals and O to 2

# every number 3.6.5 prints for the natural order, with the decimals it is printed to
CHAPTER_NUMBERS = [
    ("standard m", lambda t: t.standard_m, 5, 0),
    ("standard exp(x - m)", lambda t: t.standard_p, (0.0183, 0.1353, 0.0498, 1.0), 4),
    ("standard ℓ", lambda t: t.standard_l, 1.2034, 4),
    ("standard Σp·v", lambda t: t.standard_weighted_sum, 44.38, 2),
    ("standard O", lambda t: t.standard_O, 36.88, 2),
    ("block 1 m̃", lambda t: t.steps[0].m_tilde, 3, 0),
    ("block 1 m_new", lambda t: t.steps[0].m_new, 3, 0),
    ("block 1 α", lambda t: t.steps[0].alpha, 0, 0),
    ("block 1 p", lambda t: t.steps[0].p, (0.1353, 1.0), 4),
    ("block 1 ℓ", lambda t: t.steps[0].l, 1.1353, 4),
    ("block 1 O", lambda t: t.steps[0].O, 21.353, 3),
    ("block 2 m̃", lambda t: t.steps[1].m_tilde, 5, 0),
    ("block 2 m_new", lambda t: t.steps[1].m_new, 5, 0),
    ("block 2 α", lambda t: t.steps[1].alpha, 0.1353, 4),
    ("block 2 p", lambda t: t.steps[1].p, (0.0498, 1.0), 4),
    ("block 2 ℓ", lambda t: t.steps[1].l, 1.2034, 4),
    ("block 2 O", lambda t: t.steps[1].O, 44.383, 3),
    ("O_final", lambda t: t.O, 36.88, 2),
]


def _rounded(x, decimals):
    return tuple(_rounded(y, decimals) for y in x) if isinstance(x, tuple) else round(x, decimals)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _check(name, got, expected, ok) -> dict:
    return {"name": name, "got": got, "expected": expected, "ok": bool(ok)}


def compare_online_standard(trace, *, rtol: float = 1e-12) -> list[dict]:
    """Online ℓ, O, L against the standard computation of the same row.

    rtol 1e-12: n keys and a few blocks cost at most ~(n + 2·blocks + 50)·eps ≈ 1e-14 here;
    1e-12 leaves room for rows of a few hundred keys, while any mistake is O(1).
    """
    checks = []
    for name, online, standard in (
        ("online ℓ = standard ℓ", trace.l, trace.standard_l),
        ("online O = standard O", trace.O, trace.standard_O),
        ("online L = standard L", trace.L, trace.standard_L),
    ):
        a, b = _as_tuple(online), _as_tuple(standard)
        scale = max([1.0, *(abs(y) for y in b if math.isfinite(y))])
        ok = all((x == y) or abs(x - y) <= rtol * scale for x, y in zip(a, b))
        checks.append(_check(name + f" (rtol {rtol:g})", online, standard, ok))
    return checks


def check_chapter(trace) -> list[dict]:
    """Every number 3.6.5 prints, rounded as the chapter rounds it (natural block order)."""
    checks = []
    for name, get, printed, decimals in CHAPTER_NUMBERS:
        got = _rounded(get(trace), decimals)
        want = _rounded(printed if isinstance(printed, tuple) else float(printed), decimals)
        checks.append(_check(f"chapter: {name} ≈ {printed}", got, want, got == want))
    return checks


def check_expected(trace, *, expect_l=None, expect_o=None) -> list[dict]:
    """The reader's own answers: ℓ to 4 decimals and O to 2, as the chapter rounds them."""
    checks = []
    if expect_l is not None:
        got = round(trace.l, L_DECIMALS)
        checks.append(_check(f"expected ℓ ≈ {expect_l}", got, expect_l, got == round(expect_l, L_DECIMALS)))
    if expect_o is not None:
        got = _rounded(_as_tuple(trace.O), O_DECIMALS)
        want = _rounded(tuple(expect_o), O_DECIMALS)
        checks.append(_check(f"expected O ≈ {list(expect_o)}", list(got), list(want), got == want))
    return checks


def default_blocks(n: int) -> list[int]:
    """Two blocks (first one the larger) for n >= 2, else one."""
    return [n] if n < 2 else [n - n // 2, n // 2]


def run(x, v, *, blocks=None, orders=None, d=1, expect_l=None, expect_o=None) -> dict:
    """Trace every requested order and run the checks; returns a JSON-ready dict with 'ok'."""
    x = [float(a) for a in x]
    n = len(x)
    if d < 1 or len(v) != n * d:
        raise ValueError(f"--v needs n·d = {n}·{d} = {n * d} numbers (d per key), got {len(v)}")
    values = [float(a) for a in v] if d == 1 else [[float(a) for a in v[i * d : (i + 1) * d]] for i in range(n)]
    blocks = list(blocks) if blocks else default_blocks(n)
    if orders is None:
        n_blocks = len(blocks)
        orders = [list(range(n_blocks))] + ([list(range(n_blocks))[::-1]] if n_blocks > 1 else [])
    traces = [online_softmax_trace(x, values, blocks=blocks, order=o) for o in orders]
    chapter_input = tuple(x) == CHAPTER_X and d == 1 and tuple(values) == CHAPTER_V and tuple(blocks) == CHAPTER_BLOCKS
    checks = []
    for t in traces:
        checks += [dict(c, order=list(t.order)) for c in compare_online_standard(t)]
    if chapter_input:
        natural = online_softmax_trace(x, values, blocks=blocks)
        checks += check_chapter(natural)
        expect_l = 1.2034 if expect_l is None else expect_l
        expect_o = [36.88] if expect_o is None else expect_o
    checks += check_expected(traces[0], expect_l=expect_l, expect_o=expect_o)
    final = traces[0]
    return {
        "x": x,
        "v": values,
        "blocks": blocks,
        "chapter_input": chapter_input,
        "l": round(final.l, L_DECIMALS),
        "O": _rounded(final.O, O_DECIMALS) if d == 1 else list(_rounded(final.O, O_DECIMALS)),
        "traces": [t.to_dict() for t in traces],
        "text": [format_trace(t) for t in traces],
        "checks": checks,
        "ok": all(c["ok"] for c in checks),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--x", type=float, nargs="+", help="one row of scores (default: the chapter's)")
    parser.add_argument("--v", type=float, nargs="+", help="values, d per key (default: the chapter's, with its x)")
    parser.add_argument("--d", type=int, default=1, help="value dimension: --v holds n·d numbers, key by key (default 1)")
    parser.add_argument("--blocks", type=int, nargs="+", help="block sizes summing to len(x) (default: two halves)")
    parser.add_argument("--order", type=int, nargs="+", help="block order, a permutation (default: natural and reversed)")
    parser.add_argument("--expect-l", type=float, help="your ℓ, to 4 decimals: exit 1 if it does not match")
    parser.add_argument("--expect-o", type=float, nargs="+", help="your O_final (d numbers), to 2 decimals")
    parser.add_argument("--json", action="store_true", help="print the traces and checks as JSON")
    args = parser.parse_args(argv)
    if args.x is not None and args.v is None:
        parser.error("--x was given without --v; give the values too (d per key)")
    try:
        result = run(
            list(CHAPTER_X) if args.x is None else args.x,
            list(CHAPTER_V) if args.v is None else args.v,
            blocks=args.blocks,
            orders=[args.order] if args.order else None,
            d=args.d,
            expect_l=args.expect_l,
            expect_o=args.expect_o,
        )
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps(result, indent=1, ensure_ascii=False))
    else:
        for text in result["text"]:
            print(text, end="\n\n")
        print(f"ℓ = {result['l']:.{L_DECIMALS}f}, O = {result['O']}")
        for c in result["checks"]:
            print(f"  [{'ok' if c['ok'] else 'MISMATCH'}] {c['name']}: got {c['got']}" + ("" if c["ok"] else f", expected {c['expected']}"))
        print("all checks pass" if result["ok"] else "MISMATCH: see above")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
