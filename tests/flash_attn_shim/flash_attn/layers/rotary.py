"""apply_rotary_emb as the suite's reference uses it, in plain PyTorch (flash-attn's kernel's semantics)."""
import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """x (batch, seqlen, heads, d); cos, sin (seqlen_ro, rotary_dim / 2): the first rotary_dim dims of each head
    rotated by position seqlen_offsets + i (an int or a (batch,) tensor), halves (GPT-NeoX) or interleaved
    pairs (GPT-J); the rest unchanged."""
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_emb with cu_seqlens (the suite's varlen rotary is not used here)")
    seqlen = x.shape[1]
    ro = cos.shape[-1] * 2
    pos = torch.arange(seqlen, device=x.device)[None, :] + (
        seqlen_offsets[:, None] if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets)
    c = cos[pos][:, :, None, :].to(torch.float32)  # (batch, seqlen, 1, ro / 2)
    s = sin[pos][:, :, None, :].to(torch.float32)
    xr = x[..., :ro].to(torch.float32)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : ro // 2], xr[..., ro // 2:]
        y = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    out = torch.cat([y.to(x.dtype), x[..., ro:]], dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out
