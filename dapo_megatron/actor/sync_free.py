"""Two megatron-core 0.16.1 code paths rewritten without device-to-host syncs, same values bit for bit.

The first GPU run (H100, 2026-11-26, tests/gpu run_all.sh step attention_20k) counted 542 host syncs in one
train step of a 22,528-token micro-batch, none in our code:
  - 336 in rope_utils._apply_rotary_pos_emb_thd, the unfused RoPE of packed (THD) sequences, used when
    Transformer Engine's fused one is not: per layer, for q and for k, it reads the sequence lengths
    (.tolist()), compares the frequency table's length with cu_seqlens[-1], and reads each sequence's
    offset (.item()), to slice and concatenate the table;
  - 198 in utils.local_multi_tensor_l2_norm, the gradient-norm fallback without Apex / Transformer Engine:
    torch.tensor(list of 0-d device tensors) reads every parameter's norm on the host.
Each sync stalls the CPU's launch queue until the GPU catches up. Here the RoPE table rows are gathered by
an index built on the device (the position of every token in its sequence, with megatron's context-parallel
chunking), and the norms are stacked on the device. The arithmetic on the values is megatron's own, so the
results are identical (tests/unit/test_sync_free_megatron.py compares with megatron's functions, bitwise).
"""

from __future__ import annotations

import torch
from torch import Tensor


def thd_positions(
    cu_seqlens: Tensor, num_local_tokens: int, *, cp_size: int, cp_rank: int, global_offsets: bool
) -> Tensor:
    """The frequency-table row of each local token of a THD micro-batch, as megatron's
    _get_thd_freqs_on_this_cp_rank slices it: sequence i (global length n_i, n_i / cp_size tokens here)
    holds on CP rank r the chunks r and 2 cp - 1 - r of its 2 cp chunks, so its first half here reads rows
    r h .. (r + 1) h - 1 and its second half rows n_i - (r + 1) h .. n_i - r h - 1, h = n_i / (2 cp).
    global_offsets: the table covers the whole batch (megatron's "exact mapping"): rows start at cu_seqlens[i]."""
    cu = cu_seqlens.to(torch.int64)
    starts = cu[:-1]
    local_lengths = (cu[1:] - starts) // cp_size
    local_cu = torch.cat([local_lengths.new_zeros(1), torch.cumsum(local_lengths, 0)])
    token = torch.arange(num_local_tokens, device=cu.device)
    seq = torch.searchsorted(local_cu[1:], token, right=True)  # i with local_cu[i] <= token < local_cu[i + 1]
    within = token - local_cu[seq]
    if cp_size == 1:
        rows = within
    else:
        length = local_lengths[seq]
        half = length // 2
        rows = torch.where(
            within < half, cp_rank * half + within, cp_size * length - (cp_rank + 1) * half + (within - half)
        )
    return rows + starts[seq] if global_offsets else rows


def apply_rotary_pos_emb_thd(
    t: Tensor,
    cu_seqlens: Tensor,
    freqs: Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
    cp_group: torch.distributed.ProcessGroup | None = None,
) -> Tensor:
    """megatron-core's rope_utils._apply_rotary_pos_emb_thd (same signature, same result), without reading
    cu_seqlens on the host: t [T, h, d] local tokens, cu_seqlens [b + 1] global, freqs [max_s, 1, 1, d]."""
    from megatron.core.models.common.embeddings import rope_utils

    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    # megatron compares freqs.size(0) with cu_seqlens[-1] (a sync); every sequence length is a multiple of
    # cp_size in THD with CP, so cu_seqlens[-1] is the local token count times cp_size, known on the host
    global_offsets = freqs.dim() >= 1 and freqs.size(0) == t.size(0) * cp_size
    rows = thd_positions(cu_seqlens, t.size(0), cp_size=cp_size, cp_rank=cp_rank, global_offsets=global_offsets)
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs[rows],
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention,
        mscale=mscale,
    ).squeeze(1)


def multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's utils.local_multi_tensor_l2_norm (the multi_tensor_applier op: the norm of every tensor
    of the lists, then their norm, as a [1] float32 tensor), with the per-tensor norms stacked on the device
    instead of read one by one on the host."""
    norms = [torch.norm(tensor) for tensor_list in tensor_lists for tensor in tensor_list]
    if not norms:  # megatron's answer for no tensors: a zero on the current device
        return torch.zeros(1, dtype=torch.float, device="cuda" if torch.cuda.is_available() else "cpu"), None
    return torch.norm(torch.stack(norms)).to(torch.float).reshape(1), None


def install() -> None:
    """Route megatron-core's two call sites to the functions above. Idempotent; both machines (on a GPU
    it is where the syncs cost; on CPU the tests prove the values)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:  # Apex's / TE's kernel, where installed, stays
        clip_grads.l2_norm_impl = multi_tensor_l2_norm
