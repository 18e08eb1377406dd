"""numba-flash: FlashAttention as readable Numba CUDA kernels.

    out, lse = numba_flash.forward(q, k, v, causal=True)

See ``forward`` for the full contract and ``explain`` for which kernel runs and why.
"""
from .api import KERNELS, PerformanceWarning, explain, forward, validate
from .backward import backward, explain_backward
from .decode import decode
from .dropout import dropout_mask
from .sparsity import BlockMask, block_mask
from .varlen import varlen_backward, varlen_forward

__all__ = ["forward", "backward", "decode", "varlen_forward", "varlen_backward", "explain", "explain_backward",
           "validate", "KERNELS", "PerformanceWarning", "block_mask", "BlockMask", "dropout_mask"]
__version__ = "0.1.0"
