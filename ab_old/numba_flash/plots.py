"""Plots of benchmark results (matplotlib: ``pip install 'numba-flash[plot]'``).

From a results JSON (``numba_flash.bench``; ``numba-flash plot RESULTS.json --out DIR``):

* ``tflops_vs_n``: achieved TFLOP/s against sequence length, one line per implementation.
* ``roofline``: the measured roofline. Arithmetic intensity = FLOPs / HBM bytes counted with
  ``reference.costs`` (standard attention: S and P through HBM; flash: Q, O once and K, V once per
  Q tile) against achieved TFLOP/s, under the H200's roofs: 4.8 TB/s (data sheet) and ~4.3 TB/s
  (measured copy), fp32 67 TFLOP/s (CUDA cores), dense fp16/bf16 989 TFLOP/s (tensor cores).
  Standard attention sits under the memory roof; a flash kernel moves right, towards the compute roof.
* ``peak_memory``: peak extra device memory against N: naive until it runs out, ours linear.

And without any results, computable anywhere:

* ``causal_tiles``: which (Q tile, K/V tile) pairs a causal forward skips, masks or uses whole
  for given Nq, Nk and block sizes (the tile plan of ``reference.attention``).

Only ``causal_tile_grid`` works without matplotlib; every plot function raises ImportError naming
the extra to install when it is missing.
"""
from __future__ import annotations

import math
import os
from collections import defaultdict

import numpy as np

from reference import costs
from reference.attention import kv_blocks_to_visit, tile_needs_mask

H200 = costs.H200
MEASURED_COPY_BYTES_PER_S = 4.3e12  # device-to-device copy measured on the H200 (the data sheet says 4.8 TB/s)

SKIPPED, MASKED, FULL = 0, 1, 2
TILE_NAMES = {SKIPPED: "skipped (above the diagonal)", MASKED: "masked (crosses the diagonal)", FULL: "full (no mask)"}
TILE_COLOURS = {SKIPPED: "#eeeeee", MASKED: "#f4a259", FULL: "#3b7dd8"}
DEFAULT_TILE_CASES = [(1000, 1000, 64, 64), (300, 1000, 64, 64)]  # square, and Nq < Nk (bottom-right aligned)


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'numba-flash[plot]' (or pip install matplotlib)") from e
    matplotlib.use("Agg")  # files only: no display needed, works on a headless GPU host
    import matplotlib.pyplot as plt

    return plt


# --- the causal tile grid -------------------------------------------------------------------------


def causal_tile_grid(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = True) -> np.ndarray:
    """(Q tiles, K/V tiles) array of SKIPPED / MASKED / FULL, as the forward's tile loop decides.

    A Q tile visits K/V tiles 0 .. kv_blocks_to_visit − 1 and skips the rest; of those it visits,
    the ones that cross the bottom-right aligned diagonal pay for the mask.
    """
    for name, x in (("n_q", n_q), ("n_k", n_k), ("block_q", block_q), ("block_k", block_k)):
        if not isinstance(x, (int, np.integer)) or x < 1:
            raise ValueError(f"{name} must be an int >= 1; got {x!r}")
    grid = np.full((math.ceil(n_q / block_q), math.ceil(n_k / block_k)), SKIPPED, dtype=np.int8)
    for i in range(grid.shape[0]):
        q_start, q_stop = i * block_q, min((i + 1) * block_q, n_q)
        for j in range(kv_blocks_to_visit(q_start, q_stop, n_q, n_k, block_k, causal)):
            k_stop = min((j + 1) * block_k, n_k)
            grid[i, j] = MASKED if tile_needs_mask(q_start, k_stop, n_q, n_k, causal) else FULL
    return grid


def tile_counts(grid: np.ndarray) -> dict:
    return {name.split(" ")[0]: int((grid == code).sum()) for code, name in TILE_NAMES.items()}


def causal_tile_counts(n_q: int, n_k: int, block_q: int, block_k: int, causal: bool = True) -> dict:
    """tile_counts(causal_tile_grid(...)) one Q tile at a time, for grids too large to draw.

    Along a row of tiles the mask only grows with j, so the first row of the Q tile, which sees keys
    up to q_start + Nk − Nq, splits the visited tiles into full ones, then masked ones.
    """
    full = visited = 0
    for q_start in range(0, n_q, block_q):
        visit = kv_blocks_to_visit(q_start, min(q_start + block_q, n_q), n_q, n_k, block_k, causal)
        last_seen = q_start + n_k - n_q
        visited += visit
        full += visit if not causal or last_seen >= n_k - 1 else min(visit, max(0, (last_seen + 1) // block_k))
    total = math.ceil(n_q / block_q) * math.ceil(n_k / block_k)
    return {"skipped": total - visited, "masked": visited - full, "full": full}


def causal_tiles(path: str, cases=DEFAULT_TILE_CASES) -> str:
    """One panel per (Nq, Nk, block_q, block_k): the tile grid a causal forward walks."""
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(1, len(cases), figsize=(5.2 * len(cases), 5), squeeze=False)
    cmap = ListedColormap([TILE_COLOURS[c] for c in (SKIPPED, MASKED, FULL)])
    for ax, (n_q, n_k, bq, bk) in zip(axes[0], cases):
        grid = causal_tile_grid(n_q, n_k, bq, bk)
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=2, aspect="auto", interpolation="nearest")
        ax.set_xticks(np.arange(-0.5, grid.shape[1], 1), minor=True)
        ax.set_yticks(np.arange(-0.5, grid.shape[0], 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
        c = tile_counts(grid)
        ax.set_title(f"Nq={n_q}, Nk={n_k}, tiles {bq}×{bk}\n"
                     f"{c['full']} full, {c['masked']} masked, {c['skipped']} skipped of {grid.size}", fontsize=10)
        ax.set_xlabel("K/V tile j")
        ax.set_ylabel("Q tile i (one thread block each)")
    fig.legend(handles=[Patch(color=TILE_COLOURS[c], label=TILE_NAMES[c]) for c in (FULL, MASKED, SKIPPED)],
               loc="lower center", ncol=3, frameon=False)
    fig.suptitle("Causal forward: the tile loop skips K/V tiles above the diagonal (bottom-right aligned)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    return _save(fig, path)


# --- plots of a results JSON ----------------------------------------------------------------------------


def _timed_rows(result: dict) -> list[dict]:
    return [r for r in result.get("forward") or () if r.get("tflops")]


def _label(meta: dict) -> str:
    sim = " — simulator times, not performance figures" if meta.get("backend") == "simulator" else ""
    return f"{meta.get('gpu', '?')}, {meta.get('date', '?')[:10]}, commit {meta.get('commit') or '?'}{sim}"


def tflops_vs_n(result: dict, path: str) -> str:
    """TFLOP/s against N, one panel per (dtype, d), one line per (implementation, causal)."""
    plt = _pyplot()
    rows = _timed_rows(result)
    if not rows:
        raise ValueError("no timed forward rows in the results (every row failed or the list is empty)")
    panels = sorted({(r["dtype"], r["d"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    impls = sorted({r["impl"] for r in rows})
    colours = {impl: plt.cm.tab10(i % 10) for i, impl in enumerate(impls)}
    for ax, (dtype, d) in zip(axes[0], panels):
        lines = defaultdict(list)
        for r in rows:
            if (r["dtype"], r["d"]) == (dtype, d):
                lines[(r["impl"], bool(r["causal"]))].append((r["N"], r["tflops"]))
        for (impl, causal), pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colours[impl],
                    linestyle="--" if causal else "-", label=f"{impl}{' (causal)' if causal else ''}")
        ax.set_xscale("log", base=2)
        values = [r["tflops"] for r in rows if (r["dtype"], r["d"]) == (dtype, d)]
        if max(values) > 100 * min(values):  # implementations orders of magnitude apart
            ax.set_yscale("log")
        ax.set_title(f"{dtype}, d={d}")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("TFLOP/s (4·B·H·N²·d / time, half for causal)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Forward throughput\n{_label(result.get('meta', {}))}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def roofline(result: dict, path: str, device=H200) -> str:
    """Achieved TFLOP/s against arithmetic intensity (counted HBM bytes), under the device's roofs."""
    plt = _pyplot()
    rows = _timed_rows(result)
    if not rows:
        raise ValueError("no timed forward rows in the results (every row failed or the list is empty)")
    points = []
    for r in rows:
        if r.get("hbm_bytes_ideal") is None:  # results written before the rows carried their counts
            from numba_flash.bench import annotate

            r = annotate(dict(r))
        points.append((r["impl"], r["dtype"], r["traffic_model"], r["flops"] / r["hbm_bytes"],
                       r["flops"] / r["hbm_bytes_ideal"], r["tflops"]))

    fig, ax = plt.subplots(figsize=(8, 6))
    xs = np.logspace(-1, 5, 200)
    for bw, style, name in ((device.hbm_bytes_per_s, "-", "data sheet"), (MEASURED_COPY_BYTES_PER_S, ":", "measured copy")):
        ax.plot(xs, bw * xs / 1e12, color="black", linestyle=style, linewidth=1,
                label=f"HBM {bw / 1e12:.1f} TB/s ({name})")
    for precision, colour in (("fp32", "tab:green"), ("fp16", "tab:red")):
        peak = device.peak_flops[precision]
        ax.axhline(peak / 1e12, color=colour, linewidth=1,
                   label=f"{precision} peak {peak / 1e12:.0f} TFLOP/s" + (" (CUDA cores)" if precision == "fp32" else
                                                                           " (dense tensor cores; bf16 too)"))
    impls = sorted({p[0] for p in points})
    colours = {impl: plt.cm.tab10(i % 10) for i, impl in enumerate(impls)}
    markers = {"float32": "o", "float16": "s", "bfloat16": "^"}
    seen = set()
    for impl, dtype, model, ai, ai_ideal, tf in points:
        key = (impl, dtype)
        if ai_ideal > ai:  # flash: the real intensity lies between no-cache and ideal traffic
            ax.plot([ai, ai_ideal], [tf, tf], color=colours[impl], linewidth=0.8, alpha=0.6)
            ax.scatter(ai_ideal, tf, facecolor="none", edgecolor=colours[impl], marker=markers.get(dtype, "x"), s=36)
        ax.scatter(ai, tf, color=colours[impl], marker=markers.get(dtype, "x"), s=36,
                   edgecolor="black" if model == "standard" else "none",
                   label=f"{impl}, {dtype} ({model} traffic)" if key not in seen else None)
        seen.add(key)
    ax.set_xscale("log")
    ax.set_yscale("log")
    lo = min([p[5] for p in points] + [1.0])
    ax.set_ylim(lo / 3, device.peak_flops["fp16"] / 1e12 * 2)
    ax.set_xlim(min([p[3] for p in points] + [1.0]) / 3, max([p[4] for p in points] + [1e3]) * 3)
    ax.set_xlabel("arithmetic intensity, FLOP per HBM byte counted with reference.costs\n"
                  "(flash: filled = K/V read once per Q tile, hollow = each tensor once; L2 reuse puts the truth between)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"Measured roofline\n{_label(result.get('meta', {}))}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _save(fig, path)


def peak_memory(result: dict, path: str, device=H200) -> str:
    """Peak extra device memory against N from the results' "memory" list."""
    plt = _pyplot()
    mem = result.get("memory")
    if not mem:
        raise ValueError("the results have no \"memory\" list (it is measured on a GPU only)")
    ns = [r["N"] for r in mem]
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.plot(ns, [r["numba_flash"] for r in mem], marker="o", label="numba_flash (measured)")
    ax.plot(ns, [r["ours_expected"] for r in mem], linestyle=":", color="grey", label="out + lse (expected, O(N))")
    naive = [(r["N"], r["naive-torch"]) for r in mem if r.get("naive-torch") is not None]
    if naive:
        ax.plot([p[0] for p in naive], [p[1] for p in naive], marker="s", color="tab:red", label="naive torch (S, P in HBM)")
    oom = [r["N"] for r in mem if r.get("naive-torch") is None]
    if oom:
        y = max(v for r in mem for v in (r["numba_flash"], r.get("naive-torch")) if v)
        ax.scatter([oom[0]], [y], marker="x", s=80, color="tab:red", label=f"naive out of memory at N={oom[0]}")
    ax.axhline(device.hbm_capacity_bytes, color="black", linewidth=1, linestyle="--",
               label=f"{device.name} memory ({device.hbm_capacity_bytes / 1e9:.0f} GB)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    r0 = mem[0]
    ax.set_title(f"Peak extra device memory, {r0.get('dtype')} B{r0.get('B')} H{r0.get('H')} d{r0.get('d')}\n"
                 f"{_label(result.get('meta', {}))}", fontsize=10)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("bytes beyond q, k, v")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)
    _pyplot().close(fig)  # pyplot keeps every figure alive until closed
    return path


PLOTS = {  # file name -> plot of a results dict
    "forward-tflops.png": tflops_vs_n,
    "forward-roofline.png": roofline,
    "forward-memory.png": peak_memory,
}


def render_all(result: dict | None, out_dir: str, tile_cases=DEFAULT_TILE_CASES) -> tuple[list[str], list[str]]:
    """Every plot the results allow, plus the causal tile grid: (written paths, skipped with why)."""
    _pyplot()  # fail before anything is drawn when matplotlib is missing
    written, skipped = [], []
    for name, plot in (PLOTS.items() if result is not None else ()):
        try:
            written.append(plot(result, os.path.join(out_dir, name)))
        except ValueError as e:  # a plot whose data the results lack is skipped, not fatal
            skipped.append(f"{name}: {e}")
    written.append(causal_tiles(os.path.join(out_dir, "causal-tiles.png"), tile_cases))
    return written, skipped
