"""Small cases for compute-sanitizer (GPU): one of every shipped kernel build, checked against float64.

    python3 scripts/sanitize_case.py --list                                   # the cases and what they cover
    compute-sanitizer --tool memcheck  python3 scripts/sanitize_case.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_case.py backward         # one family
    compute-sanitizer --tool initcheck python3 scripts/sanitize_case.py --shard 3/12     # every 12th case
    compute-sanitizer --tool memcheck  python3 scripts/sanitize_case.py --case 31        # one case of --list

The cases are derived from the shipped tables, so a new entry gets a case of its own:
    forward   configs.MMA_TABLE (float16 and bfloat16; what sm_80-89 run), configs.MMA_WGMMA (sm_90's wgmma
              forward), configs.MMA_WGMMA_WS (sm_90's warp-specialised TMA forward, which plain calls take),
              configs.MMA_SMALL_SMEM (the tiles of GPUs with 99-163 KiB per block, reached by
              patching the shared memory the API sees; MMA_TABLE's tiles that do not fit this GPU are skipped),
              configs.TF32_TABLE (kernel 'tf32x3' and 'tf32'),
              configs.SIMT_CONFIGS (kernel 'simt', every compiled head dim)
    backward  configs.MMA_BWD_TABLE (its dkdv + dq kernels: deterministic=True where dQ takes the dq kernel;
              its dkdv_atomic: deterministic=False, the atomic grid, and where flagged deterministic_splits,
              deterministic=True by the splits), configs.MMA_BWD_WGMMA (sm_90: the wgmma dkdv_atomic, atomic and
              splits), configs.TF32_BWD_TABLE (likewise, per head dim and causal), simt_backward.BACKWARD_CONFIGS
    decode    the warp-split and the block-wide kernel (kernels/decode.decode_config), one split and several
On sm_90 api.mma_config takes MMA_WGMMA's tiles over MMA_TABLE's, and backward.mma_config MMA_BWD_WGMMA's
dkdv_atomic over MMA_BWD_TABLE's (ptx.current_wgmma); the mma.sync cases turn that off for their call (they are what sm_80-89 GPUs run), the wgmma cases need it (they are
skipped with a note on other GPUs). How dQ is formed also depends on the problem (backward.dq_scheme: too few
blocks for the splits take the dq kernel), so each case takes the first of a few small shapes on which the API
picks the build it is meant for; before running, each case checks that the API picks it (else it counts as
wrong). Shapes cut tiles at odd places (N not a tile multiple, Nq != Nk, fully masked causal rows, padded head
dims, GQA). bfloat16 needs ml_dtypes (NumPy bf16); without it those cases are skipped with a note.

Each case prints one line naming its build (the table entry and its tile, or the dQ scheme) and its error
against float64 (the reference package); the last line counts the cases. Exits non-zero if any is wrong.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

# --list works without a GPU: then the simulator answers the kernel choices (as an H200 would: its SM count)
if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" and os.environ.get("NUMBA_FLASH_SIM_SPEEDUP", "1") == "1":
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:  # the simulator without its busy loop (a case run there: the script's own test)
        import sim_speed

        sim_speed.install()
    except ImportError:
        pass

import numba_flash  # noqa: E402
from numba import config as nb_config  # noqa: E402
import reference  # noqa: E402
from numba_flash import api, backward_plan, configs, ptx  # noqa: E402
from numba_flash.api import Problem  # noqa: E402
from numba_flash.kernels import simt_backward  # noqa: E402

bwd = importlib.import_module("numba_flash.backward")  # the module (the package exports the function)
dec = importlib.import_module("numba_flash.decode")
kernels_mma_forward = importlib.import_module("numba_flash.kernels.mma_forward")

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

FAMILIES = ("forward", "backward", "decode")
# What the cases cover, by name: every key of each must be covered (tests/tools/test_scripts.py checks it).
TABLES = {
    "MMA_TABLE": configs.MMA_TABLE,
    "MMA_WGMMA": configs.MMA_WGMMA,
    "MMA_WGMMA_WS": configs.MMA_WGMMA_WS,
    "MMA_SMALL_SMEM": configs.MMA_SMALL_SMEM,
    "TF32_TABLE": configs.TF32_TABLE,
    "SIMT_CONFIGS": configs.SIMT_CONFIGS,
    "MMA_BWD_TABLE": configs.MMA_BWD_TABLE,
    "MMA_BWD_WGMMA": configs.MMA_BWD_WGMMA,
    "TF32_BWD_TABLE": configs.TF32_BWD_TABLE,
    "SIMT_BWD_CONFIGS": simt_backward.BACKWARD_CONFIGS,
    "DECODE": {(kind, splits): None for kind in ("warp_split", "block") for splits in ("one split", "splits")},
}
MMA_HEAD_DIMS, TF32_HEAD_DIMS = tuple(configs.MMA_HEAD_DIMS), (32, 64, 128)  # compiled (api.mma_config, tf32.head_dim_for)
# (B, H, Hkv, Nq, Nk): each case takes the first (from a rotating start) on which the API picks its build
SHAPES = [(1, 2, 1, 150, 200), (2, 2, 1, 200, 130), (1, 4, 2, 70, 133), (1, 2, 1, 33, 20), (1, 1, 1, 20, 33),
          (1, 4, 1, 300, 260)]
# max error / max(1, max |float64|): fp32 FMA-level, tf32 (10-bit inputs), 16-bit inputs with P (and dS) rounded
FWD_TOL = {"float32": 2e-5, "tf32": 5e-3, "float16": 5e-3, "bfloat16": 3e-2}
BWD_TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 4e-2}


@dataclass
class Case:
    family: str  # forward | backward | decode
    kernel: str  # the API's kernel argument (decode: the kernel it should pick)
    dtype: str
    d: int
    causal: bool
    covers: list  # [(table name, key)]
    build: str  # what runs, in words (the tile, the dQ scheme)
    deterministic: bool | None = None  # backward
    scheme: str | None = None  # backward tensor cores: the dQ scheme dq_scheme should pick
    wgmma: bool | None = None  # mma: with sm_90's MMA_WGMMA / MMA_BWD_WGMMA overrides, or without
    ws: bool = False  # forward mma with wgmma: MMA_WGMMA_WS's tile (the warp-specialised TMA forward) for a plain call
    small_smem: bool = False  # forward mma: as on a GPU of 99 KiB shared memory per block (MMA_SMALL_SMEM's tiles)
    splits: int | None = None  # decode: num_splits
    shape: tuple = ()  # (B, H, Hkv, Nq, Nk)
    lens: tuple | None = None  # decode: cache lengths
    reached: str = ""  # "" when the API picks this case's build, else what it picks
    mods: dict = field(default_factory=dict)  # window_size, softcap, alibi (True: slopes of shape (H,))

    def label(self) -> str:
        B, H, Hkv, n_q, n_k = self.shape
        text = (f"{self.family} {self.kernel} {self.dtype} B{B} H{H}/{Hkv} Nq{n_q} "
                f"{'Nmax' if self.family == 'decode' else 'Nk'}{n_k} d{self.d}")
        if self.family == "decode":
            return text + f" lens {list(self.lens)} splits {self.splits}"
        text += f" causal={self.causal}"
        if self.mods:
            text += " " + " ".join(f"{k}={v}" for k, v in self.mods.items())
        return text + (f" deterministic={self.deterministic}" if self.family == "backward" else "")

    def covered(self) -> str:
        return ", ".join(f"{name}[{key!r}]" for name, key in self.covers)


def _padded(hd: int, below: int, multiple: int) -> int:
    """A head dim between the compiled head dims below and hd, a multiple of ``multiple`` (cp.async rows)."""
    return (below + hd) // 2 // multiple * multiple + multiple


def _below(hd: int, dims) -> int:
    return max([h for h in dims if h < hd], default=0)


def _problem(case: Case, shape: tuple) -> Problem:
    B, H, Hkv, n_q, n_k = shape
    m = case.mods
    return Problem(kind="numpy", dtype=case.dtype, q_shape=(B, H, n_q, case.d), B=B, H=H, Hkv=Hkv, n_q=n_q,
                   n_k=n_k, d=case.d, causal=case.causal, softmax_scale=case.d ** -0.5, device=None,
                   window_size=m.get("window_size", (-1, -1)), softcap=m.get("softcap", 0.0),
                   alibi_shape=(H,) if m.get("alibi") else None)


SMALL_SMEM = (99 * 1024, 100 * 1024)  # an sm_86 / sm_89's opt-in shared memory per block and per SM


@contextlib.contextmanager
def tiles_of(case: Case):
    """The API's tile choice as the case needs it: wgmma_as(case.wgmma), and for a small_smem case the shared memory
    of a GPU that takes MMA_SMALL_SMEM's tiles."""
    with wgmma_as(case.wgmma, case.ws):
        if not case.small_smem:
            yield
            return
        saved = api._device_smem
        api._device_smem = lambda: SMALL_SMEM
        try:
            yield
        finally:
            api._device_smem = saved


@contextlib.contextmanager
def wgmma_as(on: bool | None, ws: bool = False):
    """api.mma_config and backward.mma_config with (True) or without (False) sm_90's MMA_WGMMA / MMA_BWD_WGMMA
    overrides, and with MMA_WGMMA_WS's tiles for plain calls only where ``ws``; None: as the GPU says."""
    if on is None:
        yield
        return
    saved = bwd.current_wgmma, api._wgmma_here, api._ws_here
    bwd.current_wgmma = api._wgmma_here = lambda: on
    api._ws_here = lambda: bool(on and ws)
    try:
        yield
    finally:
        bwd.current_wgmma, api._wgmma_here, api._ws_here = saved


def picks(case: Case, shape: tuple) -> str:
    """What the API runs for this case on this shape, compared with the case's build: "" when it is the one."""
    p = _problem(case, shape)
    if case.family == "forward":
        with tiles_of(case):
            family, cfg, _ = api.choose_kernel(p, case.kernel)
        table, key = case.covers[0]
        return "" if family == case.kernel and cfg == TABLES[table][key] else f"{family} {cfg}"
    if case.family == "decode":
        cfg, n_splits, _ = dec._tiles_and_splits(p, case.splits, None)
        kind = "warp_split" if cfg.warp_split else "block"
        got = (kind, "splits" if n_splits > 1 else "one split")
        return "" if got == case.covers[0][1] else f"{got}"
    with wgmma_as(case.wgmma):
        family, cfg, _ = bwd.choose_backward(p, case.kernel)
        if family != case.kernel:
            return family
        if family == "simt":
            return "" if cfg == TABLES["SIMT_BWD_CONFIGS"][case.covers[0][1]] else str(cfg)
        scheme = bwd.dq_scheme(p, cfg, case.deterministic, family)
        want_cfg = _backward_config(case)
    if cfg != want_cfg:
        return f"config {cfg}"
    return "" if scheme[0] == case.scheme else f"dQ {scheme[0]}"


def _backward_config(case: Case) -> dict:
    """The launches' config the case's table entries make (backward_plan.config_from_tiles)."""
    if case.kernel == "tf32x3":
        return backward_plan.tf32_config(case.d, case.causal)
    hd = bwd.mma_head_dim(case.d)
    tiles = backward_plan.table_tiles(configs.MMA_BWD_TABLE, hd)
    if case.wgmma:
        tiles.update(backward_plan.table_tiles(configs.MMA_BWD_WGMMA, hd))
    return backward_plan.config_from_tiles(tiles, hd)


def _place(case: Case, start: int) -> Case:
    """Give the case the first shape (from SHAPES[start]) on which the API picks its build."""
    order = SHAPES[start % len(SHAPES):] + SHAPES[:start % len(SHAPES)]
    if case.family == "decode":
        case.reached = picks(case, case.shape)
        return case
    for shape in order:
        if not picks(case, shape):
            case.shape = shape
            return case
    case.shape = order[0]
    case.reached = picks(case, order[0]) or "?"
    return case


def forward_cases() -> list[Case]:
    out = []
    # mma.sync (sm_80-89; MMA_SMALL_SMEM's where a block gets less shared memory), wgmma (sm_90)
    for table, wgmma in (("MMA_TABLE", False), ("MMA_SMALL_SMEM", False), ("MMA_WGMMA", True)):
        for (hd, causal), tile in sorted(TABLES[table].items()):
            for dtype in ("float16", "bfloat16"):  # one build each; float16 with a padded head dim
                d = _padded(hd, _below(hd, MMA_HEAD_DIMS), 8) if dtype == "float16" else hd
                out.append(Case("forward", "mma", dtype, d, causal, [(table, (hd, causal))], str(tile), wgmma=wgmma,
                                small_smem=table == "MMA_SMALL_SMEM"))
    # the warp-specialised TMA forward (sm_90's plain calls): its tiles, both dtypes, float16 with a padded head dim
    for (hd, causal), tile in sorted(configs.MMA_WGMMA_WS.items()):
        for dtype in ("float16", "bfloat16"):
            d = _padded(hd, _below(hd, MMA_HEAD_DIMS), 8) if dtype == "float16" else hd
            out.append(Case("forward", "mma", dtype, d, causal, [("MMA_WGMMA_WS", (hd, causal))], f"ws {tile}",
                            wgmma=True, ws=True))
    for kernel in ("tf32x3", "tf32"):
        for (hd, causal), tile in sorted(configs.TF32_TABLE.items()):
            d = _padded(hd, _below(hd, TF32_HEAD_DIMS), 4) if causal else hd
            words = f"{kernel} {tile}"
            if kernel == "tf32" and tile.has("presplit"):
                words += " (one pass: presplit unused)"
            out.append(Case("forward", kernel, "float32", d, causal, [("TF32_TABLE", (hd, causal))], words))
    for i, (hd, cfg) in enumerate(sorted(configs.SIMT_CONFIGS.items())):
        dtype = ("float32", "float16", "bfloat16")[i % 3]
        d = _padded(hd, _below(hd, configs.HEAD_DIMS), 1)
        out.append(Case("forward", "simt", dtype, d, bool(i % 2), [("SIMT_CONFIGS", hd)],
                        f"{cfg.block_q}x{cfg.block_k} {cfg.threads} threads d{hd}"))
    # the variants (blocks/mods.py): window, softcap and ALiBi builds of the shipped tiles
    for table, wgmma in (("MMA_TABLE", False), ("MMA_WGMMA", True)):
        for hd, causal, dtype, mods in ((64, True, "float16", MODS_ALL), (128, False, "bfloat16", MODS_WINDOW),
                                        (256, True, "bfloat16", MODS_ALL)):
            out.append(Case("forward", "mma", dtype, hd, causal, [(table, (hd, causal))],
                            f"{TABLES[table][hd, causal]} with {', '.join(mods)}", mods=dict(mods), wgmma=wgmma))
    for hd, causal, dtype, mods in ((64, True, "float32", MODS_ALL), (256, False, "float16", MODS_WINDOW)):
        cfg = configs.SIMT_CONFIGS[hd]
        out.append(Case("forward", "simt", dtype, hd, causal, [("SIMT_CONFIGS", hd)],
                        f"{cfg.block_q}x{cfg.block_k} {cfg.threads} threads d{hd} with {', '.join(mods)}",
                        mods=dict(mods)))
    return out


MODS_ALL = {"window_size": (45, 0), "softcap": 5.0, "alibi": True}
MODS_WINDOW = {"window_size": (60, 17)}
SCHEME_WORDS = {"kernel": "dkdv + dq kernels", "atomic": "dkdv_atomic, atomic dQ", "splits": "dkdv_atomic, dQ splits"}


def backward_cases() -> list[Case]:
    out = []
    n = 0

    def add(kernel, hd, causal, scheme, covers, tiles, wgmma=None):
        nonlocal n
        dtype = "float32" if kernel == "tf32x3" else ("float16", "bfloat16")[n % 2]
        multiple = 4 if kernel == "tf32x3" else 8
        dims = TF32_HEAD_DIMS if kernel == "tf32x3" else MMA_HEAD_DIMS
        d = _padded(hd, _below(hd, dims), multiple) if n % 4 in (1, 2) else hd  # both dtypes, padded and not
        words = SCHEME_WORDS[scheme] + ": " + "; ".join(f"{kind} {tile}" for kind, tile in tiles.items())
        if wgmma is not None:
            words = ("wgmma " if wgmma else "mma.sync ") + words
        out.append(Case("backward", kernel, dtype, d, causal, covers, words, deterministic=scheme != "atomic",
                        scheme=scheme, wgmma=wgmma))
        n += 1

    def schemes(table, key, kernel, causal, wgmma=None):
        """The cases of one entry: the dkdv + dq kernels where it has them, its dkdv_atomic by each dQ scheme."""
        tiles = backward_plan.table_tiles(TABLES[table], *key)
        if {"dkdv", "dq"} <= set(tiles):
            add(kernel, key[0], causal, "kernel", [(table, ("dkdv", *key)), (table, ("dq", *key))],
                {k: tiles[k] for k in ("dkdv", "dq")}, wgmma)
        atomic = tiles.get("dkdv_atomic")
        if atomic is not None:
            covers = [(table, ("dkdv_atomic", *key))]
            # no causal in the key (mma): the atomic grid takes the other mask, so each entry sees both
            add(kernel, key[0], causal if len(key) > 1 else not causal, "atomic", covers, {"dkdv_atomic": atomic},
                wgmma)
            if atomic.has("deterministic_splits"):
                add(kernel, key[0], causal, "splits", covers, {"dkdv_atomic": atomic}, wgmma)

    for hd in sorted({key[1] for key in configs.MMA_BWD_TABLE}):  # sm_80+: the mma.sync builds
        schemes("MMA_BWD_TABLE", (hd,), "mma", hd == 128, wgmma=False)
    for hd in sorted({key[1] for key in configs.MMA_BWD_WGMMA}):  # sm_90: its overrides
        schemes("MMA_BWD_WGMMA", (hd,), "mma", hd == 64, wgmma=True)
    # the variants on the 16-bit paths: each dQ scheme once, wgmma and mma.sync
    for wgmma, hd, scheme, mods in ((True, 128, "splits", MODS_ALL), (True, 64, "atomic", MODS_WINDOW),
                                    (False, 128, "kernel", MODS_ALL), (False, 64, "atomic", MODS_ALL)):
        table = "MMA_BWD_WGMMA" if wgmma else "MMA_BWD_TABLE"
        kinds = ("dkdv", "dq") if scheme == "kernel" else ("dkdv_atomic",)
        tiles = {kind: TABLES[table][kind, hd] for kind in kinds}
        add("mma", hd, mods is MODS_ALL, scheme, [(table, (kind, hd)) for kind in kinds], tiles, wgmma)
        out[-1].mods = dict(mods)
        out[-1].build += f" with {', '.join(mods)}"
    for hd, causal in sorted({key[1:] for key in configs.TF32_BWD_TABLE}):
        schemes("TF32_BWD_TABLE", (hd, causal), "tf32x3", causal)
    for i, (hd, (cfg_kv, cfg_q)) in enumerate(sorted(simt_backward.BACKWARD_CONFIGS.items())):
        dtype = ("float32", "float16", "bfloat16")[i % 3]
        d = _padded(hd, _below(hd, configs.HEAD_DIMS), 1)
        out.append(Case("backward", "simt", dtype, d, bool(i % 2), [("SIMT_BWD_CONFIGS", hd)],
                        f"dkdv {cfg_kv.block_k}x{cfg_kv.block_q}, dq {cfg_q.block_q}x{cfg_q.block_k}, "
                        f"{cfg_kv.threads} threads d{hd}", deterministic=bool(i % 2 == 0)))
    return out


def decode_cases() -> list[Case]:
    # (dtype, H, Hkv, Nq, d, num_splits, kernel it takes): G·Nq rows of 4-8 at 16 bits and d <= 128 take warp_split
    specs = [("float16", 8, 2, 1, 128, 1, "warp_split"), ("bfloat16", 8, 2, 2, 72, 3, "warp_split"),
             ("float32", 4, 2, 2, 100, 1, "block"), ("float16", 8, 2, 2, 200, 3, "block"),
             ("float32", 8, 2, 2, 128, 3, "block")]
    out = []
    for dtype, H, Hkv, n_q, d, splits, kind in specs:
        key = (kind, "splits" if splits > 1 else "one split")
        case = Case("decode", kind, dtype, d, True, [("DECODE", key)], f"{kind} kernel, {splits} split(s)",
                    splits=splits, shape=(2, H, Hkv, n_q, 300), lens=(300, 77))
        out.append(case)
    return out


def cases(families=FAMILIES) -> list[Case]:
    """Every case, placed on a shape where the API picks its build (else case.reached says what it picks)."""
    out = []
    for fam, make in (("forward", forward_cases), ("backward", backward_cases), ("decode", decode_cases)):
        if fam in families:
            out += make()
    return [_place(case, i) for i, case in enumerate(out)]


def missing(case_list) -> dict:
    """{table: keys no case covers} (empty when every entry of every table is covered)."""
    covered = {(name, key) for case in case_list for name, key in case.covers}
    gaps = {name: sorted((k for k in table if (name, k) not in covered), key=repr) for name, table in TABLES.items()}
    return {name: keys for name, keys in gaps.items() if keys}


# --------------------------------------------------------------------------------------------
# Running a case
# --------------------------------------------------------------------------------------------
def _host(x, dtype):
    return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def _err(got, ref) -> float:
    ref = np.asarray(ref, np.float64)
    return float(np.abs(np.asarray(got).astype(np.float64) - ref).max(initial=0) / max(1.0, np.abs(ref).max(initial=0)))


def run_case(case: Case, rng) -> tuple[float, float]:
    """(max relative error, tolerance) of one case."""
    B, H, Hkv, n_q, n_k = case.shape
    d, dt = case.d, case.dtype
    q, k, v, do = (_host(rng.standard_normal((B, h, n, d)), dt)
                   for h, n in ((H, n_q), (Hkv, n_k), (Hkv, n_k), (H, n_q)))
    q32, k32, v32, do32 = (x.astype(np.float32) for x in (q, k, v, do))  # the reference on the rounded inputs
    mods = {key: val for key, val in case.mods.items() if key != "alibi"}
    if case.mods.get("alibi"):
        mods["alibi_slopes"] = (rng.random(H) * 0.3 + 0.05).astype(np.float32)
    if case.family == "forward":
        with tiles_of(case):
            out, _ = numba_flash.forward(q, k, v, causal=case.causal, kernel=case.kernel, **mods)
        ref, _ = reference.standard_attention(q32, k32, v32, causal=case.causal, **mods)
        return _err(out, ref), FWD_TOL["tf32" if case.kernel == "tf32" else dt]
    if case.family == "decode":
        lens = np.array(case.lens, np.int32)
        out, _ = numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=case.splits)
        err = 0.0
        for b in range(B):
            ref, _ = reference.standard_attention(q32[b], k32[b, :, :lens[b]], v32[b, :, :lens[b]], causal=True)
            err = max(err, _err(out[b], ref))
        return err, FWD_TOL[dt]
    out, lse = reference.standard_attention(q32, k32, v32, causal=case.causal, **mods)
    out, lse = _host(out, dt), lse.astype(np.float32)
    refs = reference.attention_backward(q32, k32, v32, out.astype(np.float32), lse, do32, causal=case.causal,
                                        **mods)
    with wgmma_as(case.wgmma):
        grads = numba_flash.backward(q, k, v, out, lse, do, causal=case.causal, kernel=case.kernel,
                                     deterministic=case.deterministic, **mods)
    return max(_err(g, r) for g, r in zip(grads, refs)), BWD_TOL[dt]


def skip_reason(case: Case) -> str:
    if case.dtype == "bfloat16" and ml_dtypes is None:
        return "bfloat16 needs ml_dtypes (NumPy bf16), not installed"
    if case.wgmma and not ptx.current_wgmma():
        return f"the wgmma {case.family} needs an sm_90 GPU"
    if case.ws and nb_config.ENABLE_CUDASIM:
        return "the warp-specialised forward runs in the simulator only through its tests (12 simulated warps)"
    if case.family == "forward" and case.covers[0][0] == "MMA_TABLE":
        tile = configs.MMA_TABLE[case.covers[0][1]]
        if kernels_mma_forward.smem_bytes(tile) > api._device_smem()[0]:
            return f"{tile} needs more shared memory per block than this GPU gives (it runs MMA_SMALL_SMEM's tile)"
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", nargs="?", choices=FAMILIES, help="one family only")
    ap.add_argument("--list", action="store_true", help="print the cases and what they cover; run nothing")
    ap.add_argument("--shard", default="0/1", help="I/N: only the cases whose index is I mod N")
    ap.add_argument("--case", type=int, nargs="+", default=None,
                    help="only these case indices (as --list numbers them)")
    args = ap.parse_args(argv)
    try:
        shard, n_shards = (int(x) for x in args.shard.split("/"))
        assert 0 <= shard < n_shards
    except (ValueError, AssertionError):
        ap.error(f"--shard {args.shard!r}: I/N with 0 <= I < N")
    everything = cases((args.family,) if args.family else FAMILIES)
    mine = [(i, c) for i, c in enumerate(everything)
            if i % n_shards == shard and (args.case is None or i in args.case)]
    if args.list:
        for i, case in mine:
            reach = f"  NOT REACHED: the API picks {case.reached}" if case.reached else ""
            print(f"{i:3d} {case.label()}\n      {case.build}\n      covers {case.covered()}{reach}")
        gaps = missing(everything)
        unreached = sum(bool(c.reached) for c in everything)
        print(f"{len(everything)} cases, {len(mine)} in shard {shard}/{n_shards}; {unreached} not reached; "
              f"uncovered table entries: {gaps or 'none'}")
        return 1 if gaps or unreached else 0

    rng = np.random.default_rng(0)
    counts = {"ok": 0, "WRONG": 0, "skipped": 0}
    for i, case in mine:
        why = skip_reason(case)
        if why:
            counts["skipped"] += 1
            print(f"skip {case.label()} [{case.build}]: {why}", flush=True)
            continue
        if case.reached:  # the API would run another build than this case's: a table or a rule changed
            counts["WRONG"] += 1
            print(f"{case.label()} [{case.build}]: NOT REACHED, the API picks {case.reached}", flush=True)
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", numba_flash.PerformanceWarning)
            err, tol = run_case(case, rng)
        verdict = "ok" if err <= tol else "WRONG"
        counts[verdict] += 1
        print(f"{case.label()} [{case.build}; {case.covered()}]: max rel err {err:.2e} (tol {tol:.0e}) {verdict}",
              flush=True)
    print(f"sanitize_case shard {shard}/{n_shards}: {len(mine)} cases, {counts['ok']} ok, {counts['WRONG']} wrong, "
          f"{counts['skipped']} skipped", flush=True)
    return 1 if counts["WRONG"] else 0


if __name__ == "__main__":
    sys.exit(main())
