"""The CP split: rank r holds chunks r and 2*cp-1-r of every sequence; merge inverts it."""

import pytest
import torch

from dapo_megatron.actor.context_parallel import cp_local_indices, merge_from_cp, split_for_cp


def test_cp2_split_of_one_sequence_matches_the_docstring_example():
    tokens = torch.arange(8)  # a..h
    cu = [0, 8]
    assert split_for_cp(tokens, cu, cp_size=2, cp_rank=0).tolist() == [0, 1, 6, 7]
    assert split_for_cp(tokens, cu, cp_size=2, cp_rank=1).tolist() == [2, 3, 4, 5]


def test_split_of_packed_sequences_with_padding_tail_and_cp3():
    cu = [0, 6, 18, 24]  # two sequences of 6 and 12 tokens plus a 6-token tail; 2*cp = 6
    # rank 1 of cp=3: chunks 1 and 4 of each segment (chunk sizes 1, 2, 1)
    assert cp_local_indices(cu, cp_size=3, cp_rank=1).tolist() == [1, 4, 8, 9, 14, 15, 19, 22]
    assert cp_local_indices(cu, cp_size=3, cp_rank=0).tolist() == [0, 5, 6, 7, 16, 17, 18, 23]


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_merge_inverts_split_on_a_2d_tensor(cp_size):
    cu = torch.tensor([0, 8 * cp_size, 16 * cp_size, 18 * cp_size], dtype=torch.int32)
    total = int(cu[-1])
    values = torch.randn(3, total)
    parts = [split_for_cp(values, cu, cp_size=cp_size, cp_rank=r, dim=1) for r in range(cp_size)]
    assert all(p.shape == (3, total // cp_size) for p in parts)
    assert torch.equal(merge_from_cp(parts, cu, dim=1), values)
    # the parts cover every position exactly once
    covered = torch.cat([cp_local_indices(cu, cp_size=cp_size, cp_rank=r) for r in range(cp_size)])
    assert sorted(covered.tolist()) == list(range(total))


def test_segment_not_a_multiple_of_2cp_is_a_value_error():
    with pytest.raises(ValueError, match="not a multiple of 2\\*cp = 4"):
        cp_local_indices([0, 6], cp_size=2, cp_rank=0)


# --- the dense reference of CP attention (tests/attention_reference.py; actor/attention.py is checked against it) ---


def test_cp_causal_mask_of_rank_1_by_hand():
    from attention_reference import cp_causal_mask

    # one 8-token sequence, cp=2: rank 1 holds positions 2 3 4 5 and sees keys up to its own position
    mask = cp_causal_mask([0, 8], cp_size=2, cp_rank=1)
    assert mask.tolist() == [
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0],
    ]


def test_cp_causal_mask_stops_at_segment_boundaries():
    from attention_reference import cp_causal_mask

    # two 4-token segments, cp=2: rank 0 holds positions 0, 3 (segment 0) and 4, 7 (segment 1)
    mask = cp_causal_mask([0, 4, 8], cp_size=2, cp_rank=0)
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0],  # position 4 starts segment 1: only itself
        [0, 0, 0, 0, 1, 1, 1, 1],
    ]


def test_gathered_to_token_order_undoes_the_rank_major_gather():
    from dapo_megatron.actor.context_parallel import gathered_to_token_order

    cu = [0, 8, 12]
    tokens = torch.arange(12) * 10
    gathered = torch.cat([split_for_cp(tokens, cu, cp_size=2, cp_rank=r) for r in range(2)])
    assert gathered.tolist() == [0, 10, 60, 70, 80, 110, 20, 30, 40, 50, 90, 100]
    order = gathered_to_token_order(cu, cp_size=2)
    assert torch.equal(gathered.index_select(0, order), tokens)


@pytest.mark.parametrize("cp_size", [2, 3])
def test_per_rank_attention_rows_equal_whole_sequence_attention(cp_size):
    """Each rank's queries against all keys under cp_causal_mask give exactly its rows of the
    block-diagonal causal attention over the packed micro-batch (fp64)."""
    import torch.nn.functional as F

    from attention_reference import block_causal_mask, cp_causal_mask

    m = 2 * cp_size
    cu = torch.tensor([0, 3 * m, 4 * m, 7 * m], dtype=torch.int32)  # 3 segments
    total = int(cu[-1])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, total, 8, generator=gen, dtype=torch.float64) for _ in range(3))  # [heads, T, dim]
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(cu, total))
    parts = []
    for rank in range(cp_size):
        q_local = split_for_cp(q, cu, cp_size=cp_size, cp_rank=rank, dim=1)
        mask = cp_causal_mask(cu, cp_size=cp_size, cp_rank=rank)
        parts.append(F.scaled_dot_product_attention(q_local, k, v, attn_mask=mask))
    torch.testing.assert_close(merge_from_cp(parts, cu, dim=1), whole, atol=1e-12, rtol=0)
    # not vacuous: attending over the whole row (no segment mask) gives other values
    unmasked = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (unmasked - whole).abs().max() > 1e-2
