"""User-defined masks and score modifications, compiled into the tensor-core forward kernels.

A mod is a few lines of Python, FlexAttention's semantics::

    def mask_mod(b, h, q_idx, kv_idx, *aux) -> bool          # True: query q_idx sees key kv_idx
    def score_mod(score, b, h, q_idx, kv_idx, *aux) -> float  # the modified logit

given to ``numba_flash.forward(..., mask_mod=MaskMod(fn, aux=(...)), score_mod=ScoreMod(fn, aux=(...)))`` (a bare
function is a mod without aux arrays). The kernel builder closes over the function and Numba compiles it as an
inlined device function, so a mod costs what its arithmetic costs. What a mod may do:

* Arguments: ``b`` (batch), ``h`` (query head), ``q_idx``, ``kv_idx`` are int32 absolute positions,
  0 <= q_idx < Nq and 0 <= kv_idx < Nk (the mods are never called past the ends). ``score`` is the float32
  scaled logit ``softmax_scale · q·k`` (after softcap and ALiBi when those are on); return a float (cast to
  float32). A mask returns a bool. Any mod may be called more than once per score, in any order.
* ``aux``: read-only device arrays (where q is: CuPy, PyTorch CUDA, Numba; NumPy with NumPy inputs),
  integer or float32 / float64 dtypes, any ndim, passed to the function after the indices in order. They
  are launch arguments: a new array of the same dtype and ndim reuses the compiled kernel. The kernels do
  not bounds-check them: the mod indexes them within their shapes (``aux_shapes=`` lets the call check
  the shapes, as document_mask does). Numba cannot
  capture a device array in a closure (globals are frozen into the kernel as constants), so a device
  array in the closure or globals is a TypeError naming it.
* The closure and globals may hold scalars, tuples, modules (``math``), host NumPy arrays (frozen into
  the kernel as constants) and other functions (compiled too). No side effects: no writes to aux, no
  atomics, no shared memory, no barriers or warp shuffles, no printing. Code Numba's CUDA target cannot
  compile raises at the first launch with Numba's own error.
* Composition: the visible scores are those that every mask keeps: the user mask AND causal / window AND
  keys < Nk. The order on a score is softcap, ALiBi, score_mod, then the masks. q_idx / kv_idx are
  absolute, so a user mask does not move causal's bottom-right alignment (shift = Nk − Nq); a mask
  written for the alignment it wants (``q_idx + Nk - Nq >= kv_idx``) is the same rule in Python.
* A row that sees no key gets O = 0 and L = −inf, as with every mask.
* Identity: a compiled kernel is keyed by the mod's code (bytecode, constants, names, nested code), the
  values of its closure cells and of the globals it names (recursively for functions it calls), and the
  aux arrays' dtypes and ndim. Redefining a function with the same code and values reuses the kernel
  (in this process and from the on-disk cache, numba_flash/jit_cache.py); any change builds another.

The backward (``numba_flash.backward(..., mask_mod=, score_mod=)``, and ``numba_flash.torch.attention`` with
gradients) takes the forward's mods, the same functions and aux arrays; it recomputes P with them exactly as
the forward and multiplies dS by the score mod's derivative (the chain rule through s ← score_mod(s)), which the
caller writes: ``ScoreMod(fn, grad=fn_grad)``, ``fn_grad(score, b, h, q_idx, kv_idx, *aux)`` -> d fn / d score at
that score (FlexAttention takes it by autograd; a Numba kernel cannot), under the same rules as fn (called only
where the score is in range, any number of times; where the mask hides a score its value is not used). A score
mod without grad is a ValueError naming grad there; a mask_mod needs none. The aux arrays get no gradient.

``document_mask(q_segment_ids, kv_segment_ids)`` is the packed-batch document mask as a MaskMod: token
q_idx sees key kv_idx iff both carry the same segment id (combine with causal=True for causal documents).
"""
from __future__ import annotations

from typing import Any, Callable

from .blocks.mods import UserMod, python_function

AUX_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64")


class _Mod:
    LEADING = 0
    WHAT = ""

    def __init__(self, fn: Callable, aux: tuple = (), aux_shapes: Callable | None = None):
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}: fn must be a Python function {self.WHAT}; got {fn!r}")
        if not isinstance(aux, (tuple, list)):
            raise TypeError(f"{type(self).__name__}: aux must be a tuple of arrays; got {type(aux).__name__}")
        self.fn = fn
        self.aux = tuple(aux)
        self.aux_shapes = aux_shapes  # (B, H, Nq, Nk) -> the aux arrays' shapes (None: any), checked per call

    def spec(self, aux_types: tuple) -> UserMod:
        """The kernel build argument for aux arrays of these (dtype name, ndim)."""
        return UserMod(self.fn, self.LEADING, aux_types)

    def __repr__(self):
        return f"{type(self).__name__}({getattr(python_function(self.fn), '__qualname__', self.fn)}, " \
               f"aux={len(self.aux)} arrays)"


class MaskMod(_Mod):
    """mask_mod(b, h, q_idx, kv_idx, *aux) -> bool (True: visible), with its aux arrays (module docstring)."""

    LEADING = 4
    WHAT = "mask_mod(b, h, q_idx, kv_idx, *aux) -> bool"


class ScoreMod(_Mod):
    """score_mod(score, b, h, q_idx, kv_idx, *aux) -> score, with its derivative ``grad`` (same arguments,
    returns d score_mod / d score) and its aux arrays (module docstring)."""

    LEADING = 5
    WHAT = "score_mod(score, b, h, q_idx, kv_idx, *aux) -> score"

    def __init__(self, fn: Callable, grad: Callable | None = None, aux: tuple = (), aux_shapes=None):
        super().__init__(fn, aux, aux_shapes)
        if grad is not None and not callable(grad):
            raise TypeError(f"ScoreMod: grad must be a function grad(score, b, h, q_idx, kv_idx, *aux) -> "
                            f"d score_mod / d score, or None; got {grad!r}")
        self.grad = grad


def _as_mod(name: str, cls, other, x: Any):
    """None, a ``cls`` instance, or a bare function (a ``cls`` without aux); TypeError for anything else."""
    if x is None or isinstance(x, cls):
        return x
    if isinstance(x, other):
        raise TypeError(f"{name} got a {other.__name__}; pass it as {other.__name__.replace('Mod', '').lower()}"
                        f"_mod=, or wrap the function in {cls.__name__}")
    if callable(x):
        return cls(x)
    raise TypeError(f"{name} must be a function {cls.WHAT} or a numba_flash.mods.{cls.__name__}; got "
                    f"{type(x).__name__}")


def as_mask_mod(x: Any) -> MaskMod | None:
    """None, a MaskMod, or a bare function (a MaskMod without aux)."""
    return _as_mod("mask_mod", MaskMod, ScoreMod, x)


def as_score_mod(x: Any) -> ScoreMod | None:
    """None, a ScoreMod, or a bare function (a ScoreMod without aux or gradient)."""
    return _as_mod("score_mod", ScoreMod, MaskMod, x)


def same_document(b, h, q_idx, kv_idx, q_segment_ids, kv_segment_ids):
    """document_mask's rule: the query's segment id equals the key's."""
    return q_segment_ids[b, q_idx] == kv_segment_ids[b, kv_idx]


def document_mask(q_segment_ids, kv_segment_ids=None) -> MaskMod:
    """The document mask of a packed batch: integer segment ids of shape (B, Nq) for the queries and (B, Nk)
    for the keys (one array for both when Nq = Nk); query q_idx of batch b sees key kv_idx iff
    q_segment_ids[b, q_idx] == kv_segment_ids[b, kv_idx]. With causal=True: causal within each document."""
    kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
    return MaskMod(same_document, aux=(q_segment_ids, kv_segment_ids),
                   aux_shapes=lambda B, H, n_q, n_k: ((B, n_q), (B, n_k)))
