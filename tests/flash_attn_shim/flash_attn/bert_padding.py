"""unpad_input / pad_input with flash-attn's signatures and returns, in plain PyTorch."""
import torch
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(rows of the valid tokens (total, ...), their indices in the flattened (batch·seqlen), cu_seqlens int32
    (batch + 1), the longest sequence's length, the used lengths (batch)); unused_mask counts as allocated."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    lens = all_masks.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    cu = F.pad(torch.cumsum(lens, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden_states.reshape(-1, *hidden_states.shape[2:])[indices]
    return rows, indices, cu, int(lens.max().item()), attention_mask.sum(dim=-1, dtype=torch.int32)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse: rows scattered back into (batch, seqlen, ...), zeros elsewhere (differentiable)."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
