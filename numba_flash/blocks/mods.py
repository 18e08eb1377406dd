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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from numba import float32

from ..ptx import inline_device


@dataclass(frozen=True)
class Mods:
    """The mask and score mods a kernel specialisation applies (values at launch)."""

    window: bool = False  # sliding window (blocks/mask.py window kind); causal with a window is a window
    softcap: bool = False
    alibi: bool = False

    @property
    def any(self) -> bool:
        return self.window or self.softcap or self.alibi

    def __str__(self) -> str:
        return "+".join(n for n in ("window", "softcap", "alibi") if getattr(self, n)) or "none"


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
