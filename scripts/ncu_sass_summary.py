"""Summarise ncu's per-instruction stall sampling (no GPU needed: it reads an exported CSV).

    ncu --section SourceCounters ... -o rep python3 scripts/profile_case.py float16       # on the GPU
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.sass.csv             # on the GPU
    python3 scripts/ncu_sass_summary.py rep.sass.csv [more.csv ...]                       # anywhere

For every kernel in each file: the stall reasons and opcodes that hold the samples, and the main loop
read from the counts (its trip count is the most executed BAR.SYNC's): instructions executed per warp
and trip, and the share of samples and instructions between that barrier and the loop's first HMMA
(the streamed tiles' copies and address set-up, in the tensor-core kernels). It made
benchmarks/results/ncu-sass-2026-12-01*; benchmarks/DESIGN.md reads them.
"""
from __future__ import annotations

import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(path):
    """[(kernel name, header, rows)] of one ncu source-page CSV (one block per kernel)."""
    out = []
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            out.append([row[1], None, []])
        elif row and row[0] == "Address" and out:
            out[-1][1] = row
        elif row and row[0].startswith("0x") and out:
            out[-1][2].append(row)
    return out


def opcode(sass):
    parts = sass.split()
    op = parts[1] if parts[0].startswith("@") else parts[0]
    return op.split(".")[0]


def summary(name, header, rows):
    ix = {h: i for i, h in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    n = lambda r, key: int(r[ix[key]] or 0)  # noqa: E731
    total = sum(n(r, SAMPLES) for r in rows) or 1
    reasons, ops = collections.Counter(), collections.Counter()
    for r in rows:
        for h in stalls:
            reasons[h[6:]] += n(r, h)
        ops[opcode(r[1])] += n(r, SAMPLES)
    lines = [name[:100], f"  samples {total}; by reason: "
             + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in reasons.most_common(6)),
             "  by opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in ops.most_common(8))]
    bars = [r for r in rows if "BAR.SYNC" in r[1]]
    if bars:
        trips = max(n(r, EXECUTED) for r in bars)
        i0 = next(i for i, r in enumerate(rows) if "BAR.SYNC" in r[1] and n(r, EXECUTED) == trips)
        i1 = next((i for i in range(i0, len(rows)) if "HMMA" in rows[i][1]), i0)
        head = rows[i0:i1]
        per = lambda rs, pred=lambda r: True: sum(n(r, EXECUTED) for r in rs if pred(r)) / trips  # noqa: E731
        lines.append(f"  loop: {trips} warp-trips, {per(rows):.0f} instructions (the whole kernel) per warp-trip "
                     f"({per(rows, lambda r: 'HMMA' in r[1]):.0f} HMMA); barrier -> first HMMA: "
                     f"{per(head):.0f} instructions ({per(head, lambda r: 'LDGSTS' in r[1]):.1f} LDGSTS), "
                     f"{100 * sum(n(r, SAMPLES) for r in head) / total:.1f}% of samples")
    return "\n".join(lines)


def main(argv=None):
    for path in (argv if argv is not None else sys.argv[1:]):
        print(f"== {path}")
        for name, header, rows in kernels(path):
            print(summary(name, header, rows))


if __name__ == "__main__":
    main()
