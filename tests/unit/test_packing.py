"""Packing: token-budget micro-batches balanced over DP ranks, the flat layout, and its inverse."""

import random

import pytest
import torch

from dapo_megatron.actor.packing import pack_for_rank, pack_micro_batch, plan_micro_batches, unpack_response_values
from dapo_megatron.dataplane.sample import Sample


def _sample(prompt, response, **kw):
    return Sample(prompt_ids=list(prompt), response_ids=list(response), group_index=0, **kw)


def test_layout_of_two_sequences_matches_the_hand_written_example():
    a = _sample([11, 12, 13], [21, 22], advantage=0.5, old_logprobs=[-1.0, -2.0])
    b = _sample([31, 32], [41, 42, 43], advantage=-1.0, old_logprobs=[-3.0, -4.0, -5.0], loss_mask=[1, 0, 1])
    mb = pack_micro_batch([a, b], [0, 1], length=12, pad_token_id=7)
    assert mb.tokens.tolist() == [11, 12, 13, 21, 22, 31, 32, 41, 42, 43, 7, 7]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert mb.seq_ids.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1, -1]
    assert mb.targets.tolist() == [12, 13, 21, 22, 0, 32, 41, 42, 43, 0, 0, 0]
    assert mb.response_mask.int().tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0]
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 0, 0]
    assert mb.advantages.tolist() == [0, 0, 0.5, 0.5, 0, 0, -1, -1, -1, 0, 0, 0]
    assert mb.old_logprobs.tolist() == [0, 0, -1, -2, 0, 0, -3, -4, -5, 0, 0, 0]
    assert mb.rollout_logprobs is None
    assert mb.cu_seqlens.tolist() == [0, 5, 10]
    assert mb.cu_seqlens_padded.tolist() == [0, 5, 10, 12]
    # the positions that predict each response token hold exactly that token as target
    back = unpack_response_values(mb.targets, mb, [a, b])
    assert back[0].tolist() == [21, 22] and back[1].tolist() == [41, 42, 43]


def test_per_sequence_padding_and_truncation_mask():
    a = _sample([1, 2], [3], truncated=True)  # 3 tokens -> padded to 4
    b = _sample([4], [5, 6, 7, 8])  # 5 tokens -> 8
    mb = pack_micro_batch([a, b], [0, 1], length=12, seq_pad_multiple=4, mask_truncated=True)
    assert mb.seq_lengths_padded == [4, 8]
    assert mb.seq_ids.tolist() == [0] * 4 + [1] * 8
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert mb.cu_seqlens_padded.tolist() == [0, 4, 12]
    assert mb.response_mask.int().tolist() == [0, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert mb.loss_mask.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]  # sample a is truncated


def test_plan_balances_tokens_and_gives_every_rank_the_same_number_of_micro_batches():
    lengths = [90, 70, 60, 50, 40, 30, 20, 10, 5]
    plan = plan_micro_batches(lengths, micro_batch_tokens=100, dp_size=2)
    # LPT by hand: 90->r0, 70->r1, 60->r1 (70 < 90), 50->r0 (90 < 130), 40->r1 (130 < 140),
    # 30->r0 (140 < 170), 20->r0 (170 = 170, fewer samples: r0 has 3, r1 has 3 -> lower rank r0),
    # 10->r1 (170 < 190), 5->r1 (180 < 190): r0 = 90+50+30+20 = 190, r1 = 70+60+40+10+5 = 185
    loads, shares = [0, 0], [[], []]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min((0, 1), key=lambda r: (loads[r], len(shares[r]), r))
        shares[r].append(i)
        loads[r] += lengths[i]
    assert loads == [190, 185]
    assert [sorted(i for mb in share for i in mb) for share in plan] == [sorted(s) for s in shares]
    assert len(plan[0]) == len(plan[1]) == 2  # ceil(190 / 100) = 2 and it fits
    for share in plan:
        for mb in share:
            assert sum(lengths[i] for i in mb) <= 100
    assert sorted(i for share in plan for mb in share for i in mb) == list(range(len(lengths)))


def test_plan_is_deterministic_and_covers_every_sample_once():
    rng = random.Random(0)
    lengths = [rng.randint(1, 64) for _ in range(37)]
    a = plan_micro_batches(lengths, micro_batch_tokens=64, dp_size=3)
    b = plan_micro_batches(list(lengths), micro_batch_tokens=64, dp_size=3)
    assert a == b
    assert len({len(share) for share in a}) == 1
    flat = sorted(i for share in a for mb in share for i in mb)
    assert flat == list(range(37))
    for share in a:
        assert all(sum(lengths[i] for i in mb) <= 64 for mb in share)
    loads = [sum(lengths[i] for mb in share for i in mb) for share in a]
    assert max(loads) - min(loads) <= max(lengths)


def test_more_ranks_than_samples_gives_empty_micro_batches():
    plan = plan_micro_batches([5], micro_batch_tokens=8, dp_size=2)
    assert plan == [[[0]], [[]]]
    s = [_sample([1, 2], [3, 4, 5])]
    share = pack_for_rank(s, micro_batch_tokens=8, dp_size=2, dp_rank=1, pad_multiple=2)
    (mb,) = share.micro_batches
    assert mb.length == 2 and mb.loss_mask.sum() == 0 and mb.seq_ids.tolist() == [-1, -1]


def test_interleaved_pipeline_gets_micro_batches_in_whole_groups_of_pp():
    """Megatron's interleaved schedule (VPP) refuses a last group of fewer than pp micro-batches: 5 x 30
    tokens at a 40-token budget need 3 micro-batches on 1 rank; with pp=2 the plan makes 4 (the samples
    spread over them, one left empty), with pp=3 it stays 3, with pp=4 it makes 4."""
    lengths = [30] * 5
    assert len(plan_micro_batches(lengths, micro_batch_tokens=70, dp_size=1)[0]) == 3
    for multiple, count in ((2, 4), (3, 3), (4, 4)):
        (share,) = plan_micro_batches(lengths, micro_batch_tokens=70, dp_size=1, micro_batch_multiple=multiple)
        assert len(share) == count, multiple
        assert sorted(i for mb in share for i in mb) == list(range(5))
        assert all(sum(lengths[i] for i in mb) <= 70 for mb in share)
    (share,) = plan_micro_batches([30], micro_batch_tokens=70, dp_size=1, micro_batch_multiple=2)
    assert share == [[0], []]  # one sequence: an empty micro-batch completes the group
    with pytest.raises(ValueError, match="micro_batch_multiple must be >= 1, got 0"):
        plan_micro_batches(lengths, micro_batch_tokens=70, dp_size=1, micro_batch_multiple=0)


def test_sequence_longer_than_the_budget_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"sample 1 has 12 tokens.*micro_batch_tokens=10"):
        plan_micro_batches([3, 12], micro_batch_tokens=10, dp_size=1)
    with pytest.raises(ValueError, match="sample 0: old_logprobs has 1 entries, response_ids has 2"):
        pack_for_rank([_sample([1], [2, 3], old_logprobs=[0.0])], micro_batch_tokens=10, dp_size=1, dp_rank=0)
    with pytest.raises(ValueError, match="sample 0: prompt_ids is empty"):
        pack_for_rank([_sample([], [2, 3])], micro_batch_tokens=10, dp_size=1, dp_rank=0)


def test_uniform_length_pads_every_micro_batch_of_every_rank_to_the_longest():
    samples = [_sample([1] * 3, [2] * k) for k in (9, 2, 6, 1, 4)]  # lengths 12, 5, 9, 4, 7
    shares = [
        pack_for_rank(samples, micro_batch_tokens=14, dp_size=2, dp_rank=r, pad_multiple=4, uniform_length=True)
        for r in (0, 1)
    ]
    lengths = {mb.length for share in shares for mb in share.micro_batches}
    # LPT shares: r0 = {12, 5} (17 tokens), r1 = {9, 7, 4} (20); M = ceil(20 / 14) = 2 micro-batches;
    # r0 -> [12], [5]; r1 -> [9], [7, 4] = 11; the fullest holds 12 tokens, a multiple of 4 already
    assert [[mb.sample_indices for mb in share.micro_batches] for share in shares] == [[[0], [1]], [[2], [3, 4]]]
    assert lengths == {12}
    assert shares[0].num_micro_batches == shares[1].num_micro_batches
    # every response token of every sample appears exactly once across ranks, with its advantage
    seen = {}
    for share in shares:
        for mb in share.micro_batches:
            for index, values in unpack_response_values(mb.targets, mb, samples).items():
                seen[index] = values.tolist()
    assert seen == {i: s.response_ids for i, s in enumerate(samples)}


def test_unpack_inverts_per_position_values():
    samples = [_sample([1, 2, 3], [4, 5]), _sample([6], [7, 8, 9])]
    mb = pack_micro_batch(samples, [1, 0], length=10)
    values = torch.arange(10, dtype=torch.float32)
    back = unpack_response_values(values, mb, samples)
    # sample 1 first: positions 0..2 predict 7 8 9; sample 0 starts at 4: positions 6, 7
    assert back[1].tolist() == [0, 1, 2] and back[0].tolist() == [6, 7]
