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
