"""Building blocks that every kernel family assembles, each written once.

copies.py   the swizzled 16-bit tile layouts (mma.sync's XOR swizzle, wgmma's column atoms) and the
            cp.async copy plans that fill them
rows.py     row sums over (B, H, N, d) arrays: the backward's D = rowsum(dO ∘ O) pass
tf32.py     fp32 products on tf32 tensor cores: the hi/lo split and the 3xTF32 product
numerics.py constants of the softmax and the fast-math flags that keep -inf exact
softmax.py  the online-softmax step (eager and lazy rescaling) on mma fragments and on SIMT register tiles
mask.py     the masking step: which K/V tiles a Q tile sees, which tiles need masking, which scores are -inf
"""
