"""Score modifications, written once for every family that has them: softcap and ALiBi (flash-attn 2.x's).

The kernels keep S raw (q·k, unscaled) and fold softmax_scale into the exponent (blocks/softmax.py), so a
mod of the logit x = scale·s is applied in raw units, s ← mod(scale·s) / scale:

    softcap  x ← cap·tanh(x / cap):         s ← cap_b·tanh(cap_a·s),  cap_a = scale / cap, cap_b = cap / scale
    alibi    x ← x − slope·|row + shift − col|:  s ← s − slope_s·|row + shift − col|,  slope_s = slope / scale

softcap first, then the bias (flash-attn's order), then the mask (a capped −inf would be −cap). The bias is
exact for every row, causal or not (flash-attn's causal kernels add slope·col only, which moves L by
slope·(row + shift) and leaves O and the gradients as they are). The backward needs dx/ds of the cap,
1 − tanh² = 1 − (s_capped / cap_b)², from the capped score it recomputes (``softcap_grad``).

``Mods`` says which of them, and the window, a kernel is built with (compile-time switches); their values
(window bounds, cap_a / cap_b, the slopes) are launch arguments.

User mods (numba_flash.mods: MaskMod, ScoreMod) are ``UserMod`` build arguments: the Python function is
compiled into the kernel as a device function (the kernel factory closes over it), and its read-only aux
arrays are launch arguments after the six above (``user_aux_types``). ``fragment_user_mods`` applies them
to the S fragments: the score mod to the scaled logit x = scale·s after softcap and ALiBi, then the mask,
then the built-in mask (keys past n_k, causal, window): a score is visible iff every mask keeps it. The
mods are called only for rows < n_q and keys < n_k, so aux arrays of the problem's lengths are never read
out of bounds.
"""
from __future__ import annotations

import math
import types as pytypes
from dataclasses import dataclass

from numba import float32, int32

from ..ptx import inline_device


@dataclass(frozen=True)
class Mods:
    """The mask and score mods a kernel specialisation applies (values at launch)."""

    window: bool = False  # sliding window (blocks/mask.py window kind); causal with a window is a window
    softcap: bool = False
    alibi: bool = False
    mask_mod: "UserMod | None" = None  # a user mask (numba_flash.mods.MaskMod), compiled in
    score_mod: "UserMod | None" = None  # a user score modification (numba_flash.mods.ScoreMod)
    block_sparse: bool = False  # walk a BlockMask's key-tile lists (blocks/sparsity.py); needs mask_mod
    dropout: bool = False  # dropout on P (blocks/rng.py): its four words come last among the aux arguments

    def __post_init__(self):
        if self.block_sparse and self.mask_mod is None:
            raise ValueError("Mods: block_sparse walks the key-tile lists of a mask_mod's BlockMask; it needs mask_mod")

    @property
    def any(self) -> bool:
        return self.window or self.softcap or self.alibi or self.user or self.dropout

    @property
    def aux(self) -> bool:
        """The build takes aux arguments after MOD_ARGS (user mods' arrays, dropout's words): the user entries."""
        return self.user or self.dropout

    @property
    def user(self) -> bool:
        return self.mask_mod is not None or self.score_mod is not None

    def __str__(self) -> str:
        return "+".join(n for n in ("window", "softcap", "alibi", "mask_mod", "score_mod", "block_sparse", "dropout")
                        if getattr(self, n)) or "none"


NO_MODS = Mods()
ZERO = float32(0.0)
ONE = float32(1.0)


def softcap_args(softcap: float, softmax_scale: float) -> tuple:
    """(cap_a, cap_b) for a softcap > 0 (launch arguments; (0, 0) when off)."""
    if not softcap:
        return 0.0, 0.0
    return softmax_scale / softcap, softcap / softmax_scale


def launch_args(window, softcap, softmax_scale, alibi, stand_in) -> tuple:
    """The six launch arguments of a build with mods: window bounds (blocks/mask.window_bounds), cap_a, cap_b,
    the slopes (or ``stand_in``, a (1, 1) fp32 view of the call's own scratch when there is no ALiBi: never
    read, and a pointer plans can find) and 1 / softmax_scale."""
    cap_a, cap_b = softcap_args(softcap, softmax_scale)
    return (int(window[0]), int(window[1]), float32(cap_a), float32(cap_b),
            alibi if alibi is not None else stand_in, float32(1.0 / softmax_scale))


@inline_device
def head_slope(slopes, b, h, inv_scale):
    """ALiBi's slope / scale for (batch b, query head h); slopes (Ba, H), Ba = 1 broadcasting over the batch."""
    return slopes[min(b, slopes.shape[0] - 1), h] * inv_scale


@inline_device
def alibi_bias(slope, row, col, shift):
    """slope·|row + shift − col| of one score (the fragment form, fragment_mods, avoids the int→float)."""
    return slope * float32(abs(row + shift - col))


@inline_device
def capped(s, cap_a, cap_b):
    """The softcapped raw score cap_b·tanh(cap_a·s) (libdevice tanhf: its error, ~1 ulp, is far below the
    fp16 rounding of the scores that the error rule measures against)."""
    return cap_b * math.tanh(cap_a * s)


@inline_device
def softcap_grad(s_capped, cap_b):
    """d capped / d s = 1 − tanh², from the capped score (1 ulp of tanh near ±1 is the error of 1 − t²)."""
    t = s_capped / cap_b
    return ONE - t * t


def fragment_mods(mods: Mods, BLOCK_K: int, M_TILES: int):
    """mod_tile(s, k0, row0, shift, g, t, cap_a, cap_b, slope): softcap, then the ALiBi bias, on a warp's
    mma.sync S fragments (the m16n8 C layout: rows row0 + 16 mt + g (+8), keys k0 + 8 nt + 2t (+1)).
    slope is slope / scale of the block's (batch, head). The bias costs an FADD and an FFMA per score: the
    distance is a row's float offset minus a compile-time column constant, so no int→float per score."""
    SOFTCAP, ALIBI = bool(mods.softcap), bool(mods.alibi)
    S_TILES = BLOCK_K // 8

    @inline_device
    def mod_tile(s, k0, row0, shift, g, t, cap_a, cap_b, slope):
        for mt in range(M_TILES):
            for r in range(4):
                # row + shift − col = base − (8 nt + (r & 1)), exact in fp32 below 2**24
                base = float32(row0 + 16 * mt + g + 8 * (r >> 1) + shift - k0 - 2 * t)
                for nt in range(S_TILES):
                    x = s[mt * S_TILES + nt, r]
                    if SOFTCAP:
                        x = capped(x, cap_a, cap_b)
                    if ALIBI:
                        x -= slope * abs(base - float32(8 * nt + (r & 1)))
                    s[mt * S_TILES + nt, r] = x

    return mod_tile


# --------------------------------------------------------------------------------------------
# User mods: a Python function compiled into the kernel, keyed by what decides its code
# --------------------------------------------------------------------------------------------
class UserMod:
    """A user mod as a kernel build argument: ``fn`` (a Python function or a cuda.jit device function), the
    arity it is called with (``leading`` index / score arguments, then one per aux array) and ``aux_types``,
    ((dtype name, ndim) per aux array). Equal and hashed by ``cache_key``: the function's identity
    (``code_key``) and the aux types, so an equal function (same code, closure and global values) reuses the
    compiled kernel, and a changed one builds another (kernel lru caches and jit_cache's file name both)."""

    __slots__ = ("fn", "leading", "aux_types", "cache_key", "grad")

    def __init__(self, fn, leading: int, aux_types: tuple, grad=None):
        self.fn = fn
        self.leading = int(leading)
        self.aux_types = tuple((str(dt), int(nd)) for dt, nd in aux_types)
        self.grad = grad  # a score mod's d mod / d score (the backward's builds), same arguments as fn
        self.cache_key = ("user_mod", self.leading, code_key(python_function(fn)), self.aux_types)
        if grad is not None:  # keyed only where present: the forward's keys (and jit_cache names) stay as they are
            self.cache_key += (("grad", code_key(python_function(grad))),)

    def __eq__(self, other):
        return isinstance(other, UserMod) and self.cache_key == other.cache_key

    def __hash__(self):
        return hash(self.cache_key)

    def __repr__(self):
        return f"UserMod({getattr(python_function(self.fn), '__qualname__', self.fn)!r}, aux={self.aux_types})"

    def numba_aux_types(self) -> tuple:
        """The aux arrays' Numba types (launch arguments)."""
        from numba import types

        return tuple(types.Array(getattr(types, dt), nd, "A") for dt, nd in self.aux_types)

    def device_call(self, first: int = 0, of=None):
        """call(*leading, aux): fn(*leading, aux[first], aux[first + 1], ...) as an inlined device function (aux:
        every user mod's arrays, the mask's first). of: another function of the same arguments (the grad)."""
        of = self.fn if of is None else of
        fn = of if hasattr(of, "py_func") else inline_device(of)
        names = ", ".join(f"a{i}" for i in range(self.leading))
        unpacked = "".join(f", aux[{first + i}]" for i in range(len(self.aux_types)))
        src = f"def call({names}, aux):\n    return fn({names}{unpacked})\n"
        scope = {"fn": fn}
        exec(compile(src, f"<user mod {python_function(of).__name__}>", "exec"), scope)
        return inline_device(scope["call"])


def python_function(fn):
    """The Python function behind fn (a cuda.jit / register_jitable dispatcher's py_func)."""
    return getattr(fn, "py_func", fn)


def _value_key(name, x, seen):
    """A process-independent key of a value a mod's code reads (closure cell or global), or TypeError."""
    import numpy as np

    if isinstance(x, (bool, int, float, str, bytes, type(None))):
        return (type(x).__name__, x)
    if isinstance(x, complex):
        return ("complex", repr(x))
    if isinstance(x, np.generic):
        return ("np", x.dtype.str, x.item())
    if isinstance(x, tuple):
        return ("tuple",) + tuple(_value_key(name, v, seen) for v in x)
    if isinstance(x, pytypes.ModuleType):
        return ("module", x.__name__)
    if isinstance(x, np.ndarray):  # Numba freezes a global / captured host array into the kernel as a constant
        import hashlib

        return ("ndarray", x.dtype.str, x.shape, hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest())
    f = python_function(x)
    if isinstance(f, pytypes.FunctionType):
        return code_key(f, seen)
    if isinstance(x, type) or callable(x) and getattr(x, "__module__", "") in ("builtins", "math", "numba",
                                                                                "numpy"):
        return ("named", getattr(x, "__module__", ""), getattr(x, "__qualname__", repr(x)))
    raise TypeError(f"a mod reads {name!r}, a {type(x).__module__}.{type(x).__name__}: a mod may read scalars, "
                    "tuples, modules, host NumPy constants and other functions from its closure or globals; pass "
                    "device arrays as aux=(...) (launch arguments)")


_LIBRARY_MODULES = frozenset({"math", "cmath", "operator", "numpy", "numba", "numba_cuda"})  # keyed by name


def _code_key(code):
    consts = tuple(_code_key(c) if isinstance(c, pytypes.CodeType) else (type(c).__name__, repr(c))
                   for c in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_varnames, code.co_argcount)


def code_key(fn, seen=None) -> tuple:
    """What decides a mod's compiled code: its bytecode, constants and names (nested code objects too), the
    values of its closure cells and of the globals it names (recursively for the functions it calls)."""
    seen = set() if seen is None else seen
    if id(fn) in seen:  # recursion: the name is enough
        return ("recursive", fn.__qualname__)
    seen.add(id(fn))
    code = fn.__code__
    cells = tuple(_value_key(n, c.cell_contents, seen) for n, c in zip(code.co_freevars, fn.__closure__ or ()))
    names = set(code.co_names)
    for c in code.co_consts:  # names read by nested code (comprehensions, lambdas)
        if isinstance(c, pytypes.CodeType):
            names |= set(c.co_names)
    glob = tuple((n, _value_key(n, fn.__globals__[n], seen)) for n in sorted(names) if n in fn.__globals__)
    # Numba freezes a user module's attributes (mymod.WINDOW) into the kernel: key the ones the code can name
    user_modules = [(n, x) for n, x in list(fn.__globals__.items()) + [(n, c.cell_contents) for n, c in zip(
        code.co_freevars, fn.__closure__ or ())] if n in names | set(code.co_freevars)
        and isinstance(x, pytypes.ModuleType) and x.__name__.split(".")[0] not in _LIBRARY_MODULES]
    attrs = tuple((n, a, _value_key(f"{n}.{a}", getattr(x, a), seen)) for n, x in sorted(user_modules, key=str)
                  for a in sorted(names) if hasattr(x, a) and not isinstance(getattr(x, a), pytypes.ModuleType))
    return ("fn", fn.__qualname__, _code_key(code), cells, glob, attrs, fn.__defaults__ and
            tuple(_value_key("default", d, seen) for d in fn.__defaults__))


def fragment_user_mods(mods: Mods, BLOCK_K: int, M_TILES: int):
    """user_tile(s, k0, row0, n_q, n_k, b, h, scale, inv_scale, g, t, aux): the user score mod, then the user
    mask, on a warp's mma.sync S fragments (fragment_mods' layout; raw scores: the mod sees scale·s and its
    result goes back as result / scale). Scores of rows >= n_q or keys >= n_k are left as they are (the
    built-in mask hides the keys; those rows are never stored). A block_sparse build's user_tile takes
    ``masked`` last: False on a FULL tile of the BlockMask, where the mask_mod is not called (nor anything,
    without a score mod)."""
    MASK, SCORE = mods.mask_mod is not None, mods.score_mod is not None
    mask_call = mods.mask_mod.device_call() if MASK else None
    score_call = mods.score_mod.device_call(len(mods.mask_mod.aux_types) if MASK else 0) if SCORE else None
    S_TILES = BLOCK_K // 8
    NEG_INF = float32(-math.inf)

    if mods.block_sparse:
        @inline_device
        def user_tile_sparse(s, k0, row0, n_q, n_k, b, h, scale, inv_scale, g, t, aux, masked):
            if SCORE or masked:  # a FULL tile without a score mod: nothing to do
                b32, h32 = int32(b), int32(h)
                for mt in range(M_TILES):
                    for r in range(4):
                        row = int32(row0 + 16 * mt + g + 8 * (r >> 1))
                        for nt in range(S_TILES):
                            col = int32(k0 + 8 * nt + 2 * t + (r & 1))
                            if row < n_q and col < n_k:
                                x = s[mt * S_TILES + nt, r]
                                if SCORE:
                                    x = float32(score_call(x * scale, b32, h32, row, col, aux)) * inv_scale
                                if MASK and masked:
                                    if not mask_call(b32, h32, row, col, aux):
                                        x = NEG_INF
                                s[mt * S_TILES + nt, r] = x

        return user_tile_sparse

    @inline_device
    def user_tile(s, k0, row0, n_q, n_k, b, h, scale, inv_scale, g, t, aux):
        b32, h32 = int32(b), int32(h)
        for mt in range(M_TILES):
            for r in range(4):
                row = int32(row0 + 16 * mt + g + 8 * (r >> 1))
                for nt in range(S_TILES):
                    col = int32(k0 + 8 * nt + 2 * t + (r & 1))
                    if row < n_q and col < n_k:
                        x = s[mt * S_TILES + nt, r]
                        if SCORE:
                            x = float32(score_call(x * scale, b32, h32, row, col, aux)) * inv_scale
                        if MASK:
                            if not mask_call(b32, h32, row, col, aux):
                                x = NEG_INF
                        s[mt * S_TILES + nt, r] = x

    return user_tile


def user_aux_types(mods: Mods) -> tuple:
    """The aux arguments' Numba types, the mask's arrays then the score mod's (launch arguments after the six
    above); a block_sparse build then takes the BlockMask's key-tile lists (blocks/sparsity.LIST_TYPES), a dropout
    build last its four uint32 words (blocks/rng.DROPOUT_TYPES: seed_lo, seed_hi, offset, keep16)."""
    from .rng import DROPOUT_TYPES
    from .sparsity import LIST_TYPES

    user = sum((m.numba_aux_types() for m in (mods.mask_mod, mods.score_mod) if m is not None), ())
    return user + (LIST_TYPES if mods.block_sparse else ()) + (DROPOUT_TYPES if mods.dropout else ())


def list_first(mods: Mods) -> int:
    """The index in aux of a block_sparse build's first key-tile list (blocks/sparsity.lists_of)."""
    from .rng import DROPOUT_TYPES

    return len(user_aux_types(mods)) - 2 - (len(DROPOUT_TYPES) if mods.dropout else 0)


def dropout_first(mods: Mods) -> int:
    """The index in aux of a dropout build's first word (blocks/rng.words_of)."""
    from .rng import DROPOUT_TYPES

    return len(user_aux_types(mods)) - len(DROPOUT_TYPES)


def user_score_grad(mods: Mods):
    """user_score(x, row, col, b, h, scale, inv_scale, aux) -> (x', dx'/dx) for the backward kernels, one raw score
    x of query row, key col (both in range: the caller checks row < n_q, col < n_k): the user score mod on
    scale·x exactly as fragment_user_mods applies it (so P is the forward's), its derivative from the ScoreMod's
    grad (the chain rule through x ← mod(scale·x) / scale: d/dx = grad(scale·x)), then the user mask (−inf, and
    a derivative of 1: P = 0 there). Either layout calls it: the indices are the caller's."""
    MASK, SCORE = mods.mask_mod is not None, mods.score_mod is not None
    if SCORE and mods.score_mod.grad is None:
        raise ValueError(f"user_score_grad: the score mod {mods.score_mod!r} has no grad (the backward needs "
                         "ScoreMod(fn, grad=...))")
    mask_call = mods.mask_mod.device_call() if MASK else None
    first = len(mods.mask_mod.aux_types) if MASK else 0
    score_call = mods.score_mod.device_call(first) if SCORE else None
    grad_call = mods.score_mod.device_call(first, mods.score_mod.grad) if SCORE else None
    NEG_INF = float32(-math.inf)

    @inline_device
    def user_score(x, row, col, b, h, scale, inv_scale, aux):
        b32, h32, row32, col32 = int32(b), int32(h), int32(row), int32(col)
        dx = ONE
        if SCORE:
            xs = x * scale
            x = float32(score_call(xs, b32, h32, row32, col32, aux)) * inv_scale
            dx = float32(grad_call(xs, b32, h32, row32, col32, aux))
        if MASK:
            if not mask_call(b32, h32, row32, col32, aux):
                x = NEG_INF
                dx = ONE
        return x, dx

    return user_score
