"""algo/aggregation.py: the one definition of the loss aggregation modes, for [B, T] rows and for the
actor's packed micro-batches (hand-computed counts; the packed weighted sum equals policy_loss on rows).

    pytest tests/unit/test_algo_aggregation.py
"""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.algo.aggregation import (
    count_loss_units,
    count_loss_units_packed,
    sequence_token_counts,
    tokens_per_sequence,
)
from dapo_megatron.algo.policy_loss import policy_loss

# three sequences: 2, 0 and 3 trained tokens; packed as 3 + 2 + 4 tokens and a padding tail of 2
ROWS_MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
PACKED_MASK = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
SEQ_IDS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, -1, -1])


def test_counts_by_mode_in_both_layouts():
    assert tokens_per_sequence(PACKED_MASK, SEQ_IDS, 3).tolist() == [2.0, 0.0, 3.0]
    for mode, want in (("token-mean", 5), ("seq-mean-token-sum", 2), ("seq-mean-token-mean", 2)):
        assert count_loss_units(ROWS_MASK, agg_mode=mode) == want
        assert count_loss_units_packed(PACKED_MASK, SEQ_IDS, 3, agg_mode=mode) == want
    with pytest.raises(ValueError, match="agg_mode='sum'"):
        count_loss_units_packed(PACKED_MASK, SEQ_IDS, 3, agg_mode="sum")


def test_sequence_token_counts_are_each_tokens_sequence_total():
    assert sequence_token_counts(PACKED_MASK, SEQ_IDS, 3).tolist() == [2, 2, 2, 0, 0, 3, 3, 3, 3, 0, 0]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_the_packed_weighted_sum_is_policy_loss_on_rows(mode):
    """The actor's form (token-mean policy_loss with weights w and the mode's D) equals policy_loss
    with agg_mode on the same tokens laid out one sequence a row."""
    g = torch.Generator().manual_seed(0)
    rows_lp, rows_old = (
        -torch.rand(3, 4, generator=g, dtype=torch.float64),
        -torch.rand(3, 4, generator=g, dtype=torch.float64),
    )
    adv = torch.tensor([[1.0], [0.5], [-2.0]], dtype=torch.float64)
    kw = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    want, _ = policy_loss(rows_lp, rows_old, adv, ROWS_MASK.double(), agg_mode=mode, **kw)
    # the same tokens packed: row r's first len_r tokens (3, 2, 4), then padding
    lengths = [3, 2, 4]

    def take(x):
        return torch.cat([x[r, :n] for r, n in enumerate(lengths)] + [torch.zeros(2, dtype=x.dtype)])

    lp, old = take(rows_lp), take(rows_old)
    a = torch.cat([adv[r].expand(n) for r, n in enumerate(lengths)] + [torch.zeros(2, dtype=torch.float64)])
    mask = take(ROWS_MASK.double())
    assert mask.tolist() == PACKED_MASK.tolist()
    weight = mask
    if mode == "seq-mean-token-mean":
        weight = mask / sequence_token_counts(PACKED_MASK, SEQ_IDS, 3).double().clamp(min=1.0)
    denom = count_loss_units_packed(PACKED_MASK, SEQ_IDS, 3, agg_mode=mode)
    got, _ = policy_loss(lp, old, a, weight, agg_mode="token-mean", loss_denominator=float(denom), **kw)
    assert abs(got.item() - want.item()) < 1e-12
