"""The context-parallel split of packed sequences, and its inverse for per-token outputs.

With causal attention, token i attends to i tokens, so cutting a sequence into cp contiguous pieces
gives the last rank ~2x the average work. The load-balanced split (Megatron / Transformer Engine,
THD format) cuts every sequence into 2*cp equal chunks and gives CP rank r the chunks r and
2*cp-1-r: for cp=2 and a sequence of 8 tokens, chunks of 2:

    tokens   a b | c d | e f | g h
    chunk      0     1     2     3
    rank 0 holds chunks 0 and 3: a b g h
    rank 1 holds chunks 1 and 2: c d e f

Each sequence must be padded to a multiple of 2*cp (packing.py's seq_pad_multiple does it); the
segment boundaries are `cu_seqlens_padded` (the padding tail of a micro-batch is one more segment).
A rank's local tensor is the concatenation, sequence by sequence, of its two chunks: the order
Transformer Engine's `thd_get_partitioned_indices` produces, so TE attention with
`cu_seqlens_q_padded` sees its expected layout.

Attention across the chunks (the torch attention backend, actor/attention.py; TE has its own kernels):
every rank all-gathers K and V of the whole micro-batch over the CP group, puts them back in token
order and attends with its own queries by true positions:

    query at packed position q may see key k  <=>  same padded segment and k <= q

Without a mask: chunk c of a segment starting at s (chunk length n) is a block of n queries against
the keys [s, s + (c+1) n), causal aligned at the lower right (attention.document_blocks), so each
rank computes exactly the attention rows of its two chunks. The all-gather's backward is a
reduce-scatter (sum over the CP group) of dK / dV: every rank's queries contribute to every key's
gradient, and the owner of the key receives the sum. This is megatron-core's cp_comm_type
"all_gather" (transformer_config.py: "All-gather to get full sequence of KV before attention"),
as in Transformer Engine's AttnFuncWithCPAndKVAllGather (attention/dot_product_attention/
context_parallel.py, Llama 3 paper section 3.3.2), which re-orders the gathered chunks with
get_seq_chunk_ids_for_reordering_before_attn and reduce-scatters dK/dV in backward; TE supports it
only for bshd/sbhd (it asserts qkv_format != "thd"), here it also covers THD packed sequences
because the query blocks, not the kernel, carry the segment boundaries. Why not the other comm types:
"p2p" (ring of K/V chunks, overlapped with compute) pays off only with async streams and a
flash kernel that merges partial softmaxes; "a2a" (Ulysses) scatters heads over CP and needs the
KV heads per TP rank to be divisible by cp (a 2-KV-head model at tp=2 has 1). Cost here: the
gathered K/V of one layer (T x kv_heads/tp x head_dim, kept for backward); no [T/cp, T] mask.
"""

from __future__ import annotations

import torch


def cp_local_indices(cu_seqlens_padded: torch.Tensor | list[int], *, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions (into the packed [T] tensor) held by CP rank `cp_rank`, in local order."""
    bounds = [int(x) for x in cu_seqlens_padded]
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(
                f"a packed segment of {length} tokens (offset {start}) is not a multiple of 2*cp = {2 * cp_size}: "
                "pad every sequence with seq_pad_multiple=2*cp"
            )
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def split_for_cp(tensor: torch.Tensor, cu_seqlens_padded, *, cp_size: int, cp_rank: int, dim: int = 0) -> torch.Tensor:
    """This rank's part of a packed tensor (any shape with the token axis at `dim`)."""
    if cp_size == 1:
        return tensor
    index = cp_local_indices(cu_seqlens_padded, cp_size=cp_size, cp_rank=cp_rank).to(tensor.device)
    return tensor.index_select(dim, index)


def merge_from_cp(parts: list[torch.Tensor], cu_seqlens_padded, *, dim: int = 0) -> torch.Tensor:
    """Inverse of split_for_cp: parts[r] is rank r's local tensor; returns the packed tensor."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    total = int(list(cu_seqlens_padded)[-1])
    shape = list(parts[0].shape)
    shape[dim] = total
    out = parts[0].new_empty(shape)
    for rank, part in enumerate(parts):
        index = cp_local_indices(cu_seqlens_padded, cp_size=cp_size, cp_rank=rank).to(part.device)
        out.index_copy_(dim, index, part)
    return out


def gathered_to_token_order(cu_seqlens_padded, *, cp_size: int) -> torch.Tensor:
    """Index that puts an all-gathered tensor (rank 0's local tokens, then rank 1's, ...) back in
    packed token order: token_order = gathered.index_select(0, index)."""
    gathered_positions = torch.cat(
        [cp_local_indices(cu_seqlens_padded, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]
    )
    return torch.argsort(gathered_positions)


def gather_for_cp(local: torch.Tensor, *, token_order: torch.Tensor, cp_group) -> torch.Tensor:
    """All-gather a [T/cp, ...] tensor over the CP group and return it in token order [T, ...].

    Differentiable: megatron's all-gather-along-the-first-dim autograd function (the one sequence
    parallelism uses, tensor_parallel/mappings.py _GatherFromSequenceParallelRegion) with
    tensor_parallel_output_grad=True, i.e. the backward reduce-scatters (sums) the gradient over
    cp_group; it runs on NCCL and on gloo. The re-ordering is an index_select (its backward
    scatters the gradient back)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    gathered = gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=cp_group)
    return gathered.index_select(0, token_order.to(gathered.device))
