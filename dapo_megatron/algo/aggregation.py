"""The loss aggregation modes, written once (docs/algorithm.md 5): what each mode divides by, and the
per-token weights that turn every mode into one weighted token sum.

Every mode is sum_t w_t * l_t / D over the mini-batch's trained tokens (mask m):
    token-mean           w = m                   D = masked tokens
    seq-mean-token-sum   w = m                   D = sequences with a masked token
    seq-mean-token-mean  w = m / n_seq(t)        D = the same sequences   (n_seq: masked tokens of t's sequence)
so a mini-batch cut into micro-batches, context-parallel shards or data-parallel shares still sums
exactly when D is the global count (summed over all of them).

Two layouts: [B, T] (one sequence a row: algo/policy_loss.py) and packed (a flat [T] micro-batch with
each token's sequence index, -1 on padding: the actor's micro-batches, actor/actor.py).
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def check_agg_mode(agg_mode: str) -> None:
    if agg_mode not in AGG_MODES:
        raise ValueError(f"loss agg_mode={agg_mode!r} is not allowed; choose one of {list(AGG_MODES)}")


def count_loss_units(mask: torch.Tensor, *, agg_mode: str) -> int:
    """D of a [B, T] mask alone: masked tokens (token-mean) or sequences with at least one masked token
    (seq modes). Sum it over micro-batches and ranks for the global value."""
    check_agg_mode(agg_mode)
    if agg_mode == "token-mean":
        return int((mask != 0).sum())
    if mask.dim() != 2:
        raise ValueError(f"count_loss_units: {agg_mode} needs a [B, T] mask, got shape {tuple(mask.shape)}")
    return int(((mask != 0).sum(dim=-1) > 0).sum())


def tokens_per_sequence(loss_mask: torch.Tensor, seq_ids: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """[num_sequences] masked (trained) tokens of each sequence of a packed micro-batch."""
    counts = torch.zeros(num_sequences + 1, dtype=torch.float32)
    counts.index_add_(0, seq_ids + 1, (loss_mask != 0).float())  # slot 0 collects the padding tail
    return counts[1:]


def count_loss_units_packed(
    loss_mask: torch.Tensor, seq_ids: torch.Tensor, num_sequences: int, *, agg_mode: str
) -> int:
    """D of a packed micro-batch alone (count_loss_units for the packed layout)."""
    check_agg_mode(agg_mode)
    if agg_mode == "token-mean":
        return int((loss_mask != 0).sum())
    return int((tokens_per_sequence(loss_mask, seq_ids, num_sequences) > 0).sum())


def sequence_token_counts(loss_mask: torch.Tensor, seq_ids: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """[T] n_seq(t) of a packed micro-batch: the masked tokens of each token's sequence (0 on padding);
    seq-mean-token-mean's weight is mask / n_seq.clamp(min=1)."""
    per_seq = tokens_per_sequence(loss_mask, seq_ids, num_sequences)
    n_seq = torch.zeros(seq_ids.shape[0], dtype=torch.float32)
    real = seq_ids >= 0
    n_seq[real] = per_seq[seq_ids[real]]
    return n_seq
