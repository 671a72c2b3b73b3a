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
`cu_seqlens_q_padded` sees its expected layout. Runs on clusters with TE; tested here on CPU.
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
