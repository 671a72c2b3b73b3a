"""The dense-mask attention the torch backend used before actor/attention.py: the tests' reference only
(a boolean [T, T] mask; SDPA with it keeps a [heads, T, T]-sized mask for the backward). Not reachable
from any config."""

import torch
import torch.nn.functional as F

from dapo_megatron.actor.context_parallel import cp_local_indices


def block_causal_mask(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Boolean [T, T] mask, True = may attend: same sequence and key position <= query position.

    Sequence ids come from cu_seqlens (cu = [0, 3, 5] -> ids 0 0 0 1 1); tokens past cu[-1]
    (padding) get one extra id so every query row keeps at least itself (no all -inf rows)."""
    positions = torch.arange(total_tokens, device=cu_seqlens.device)
    seq_ids = torch.bucketize(positions, cu_seqlens[1:].to(positions.dtype), right=True)
    same_seq = seq_ids[:, None] == seq_ids[None, :]
    causal = positions[None, :] <= positions[:, None]
    return same_seq & causal


def cp_causal_mask(cu_seqlens_padded, *, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Boolean [T/cp, T] mask, True = may attend: this rank's queries (in local order) against every
    key in token order, same padded segment and key position <= query position."""
    bounds = torch.as_tensor([int(x) for x in cu_seqlens_padded], dtype=torch.int64)
    total = int(bounds[-1])
    query_positions = cp_local_indices(bounds, cp_size=cp_size, cp_rank=cp_rank)
    key_positions = torch.arange(total)
    query_segments = torch.bucketize(query_positions, bounds[1:], right=True)
    key_segments = torch.bucketize(key_positions, bounds[1:], right=True)
    mask = (query_segments[:, None] == key_segments[None, :]) & (key_positions[None, :] <= query_positions[:, None])
    return mask.to(device) if device is not None else mask


def dense_attention(q, k, v, mask, *, scale=None):
    """q [B, h, Tq, d], k, v [B, g, Tk, d] (K/V repeated to the query heads, as the old backend did)."""
    repeats = q.size(1) // k.size(1)
    if repeats > 1:
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
