"""The tensor rollout batch: built from Samples, cut into shares, packed into micro-batches with
tensor ops that give exactly the Sample packing's tensors; the plan of shares is packing.py's plan."""

import random

import pytest
import torch

from dapo_megatron.actor.packing import pack_batch_micro_batch, pack_for_rank, pack_micro_batch
from dapo_megatron.dataplane.batch import RolloutBatch, ranges_index
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.dataplane.share import BatchShare, PackSettings, plan_shares, share_of_samples

MB_FIELDS = (
    "tokens",
    "position_ids",
    "seq_ids",
    "targets",
    "response_mask",
    "loss_mask",
    "advantages",
    "old_logprobs",
    "rollout_logprobs",
    "ref_logprobs",
)


def random_samples(n, *, seed, with_logprobs=True, masks=True):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(5, 300) for _ in range(rng.randint(1, 9))]
        response = [rng.randrange(5, 300) for _ in range(rng.randint(1, 14))]
        r = len(response)
        out.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                group_index=i // 4,
                reward=rng.choice([-1.0, 1.0]),
                advantage=rng.uniform(-2, 2),
                truncated=rng.random() < 0.3,
                rollout_logprobs=[-rng.random() * 5 for _ in range(r)] if with_logprobs else None,
                old_logprobs=[-rng.random() * 5 for _ in range(r)] if with_logprobs else None,
                loss_mask=[rng.choice([0, 1]) for _ in range(r)] if masks and i % 3 == 0 else None,
            )
        )
    return out


def test_hand_built_batch_layout():
    a = Sample(
        prompt_ids=[11, 12, 13],
        response_ids=[21, 22],
        group_index=0,
        advantage=0.5,
        reward=1.0,
        rollout_logprobs=[-1.0, -2.0],
    )
    b = Sample(
        prompt_ids=[31, 32],
        response_ids=[41, 42, 43],
        group_index=0,
        advantage=-1.0,
        truncated=True,
        rollout_logprobs=[-3.0, -4.0, -5.0],
        loss_mask=[1, 0, 1],
    )
    batch = RolloutBatch.from_groups([[a, b]])
    assert batch.tokens.tolist() == [11, 12, 13, 21, 22, 31, 32, 41, 42, 43] and batch.tokens.dtype == torch.int32
    assert batch.seq_offsets.tolist() == [0, 5, 10] and batch.response_offsets.tolist() == [0, 2, 5]
    assert batch.response_token_index().tolist() == [3, 4, 7, 8, 9]
    assert batch.loss_mask.tolist() == [1, 1, 1, 0, 1]
    assert batch.rollout_logprobs.tolist() == [-1, -2, -3, -4, -5] and batch.old_logprobs is None
    assert batch.truncated.tolist() == [False, True] and batch.group_index.tolist() == [0, 0]
    # 10 tokens x 4 + 5 loss-mask bytes + 5 log-probs x 4 + 2 sequences x (4 int32 + 2 fp32 + 1 bool = 21... ) bytes
    assert batch.nbytes() == 40 + 5 + 20 + 2 * (4 + 4 + 4 + 4 + 4 + 1)
    back = batch.select(torch.tensor([1, 0]))
    assert back.tokens.tolist() == [31, 32, 41, 42, 43, 11, 12, 13, 21, 22]
    assert back.rollout_logprobs.tolist() == [-3, -4, -5, -1, -2] and back.loss_mask.tolist() == [1, 0, 1, 1, 1]
    assert batch.narrow(1, 1).tokens.tolist() == [31, 32, 41, 42, 43]


def test_ranges_index_and_bad_records_name_the_sample():
    assert ranges_index(torch.tensor([5, 0, 9]), torch.tensor([2, 0, 3])).tolist() == [5, 6, 9, 10, 11]
    good = Sample(prompt_ids=[1], response_ids=[2], group_index=0, rollout_logprobs=[-1.0])
    with pytest.raises(ValueError, match="sample 1: rollout_logprobs is None"):
        RolloutBatch.from_samples([good, Sample(prompt_ids=[1], response_ids=[2], group_index=0)])
    with pytest.raises(ValueError, match="sample 0: old_logprobs has 1 entries, response_ids has 2"):
        RolloutBatch.from_samples([Sample(prompt_ids=[1], response_ids=[2, 3], group_index=0, old_logprobs=[0.0])])
    with pytest.raises(ValueError, match="sample 0: prompt_ids is empty"):
        RolloutBatch.from_samples([Sample(prompt_ids=[], response_ids=[2], group_index=0)])


@pytest.mark.parametrize("seq_pad,mask_truncated", [(1, False), (4, True), (3, False)])
def test_tensor_packing_equals_sample_packing(seq_pad, mask_truncated):
    samples = random_samples(9, seed=seq_pad)
    batch = RolloutBatch.from_samples(samples)
    order = [7, 2, 5, 0]
    part = batch.select(torch.tensor(order))
    length = 4 * 32
    want = pack_micro_batch(
        samples, order, length=length, seq_pad_multiple=seq_pad, pad_token_id=3, mask_truncated=mask_truncated
    )
    got = pack_batch_micro_batch(
        part, 0, 4, length=length, seq_pad_multiple=seq_pad, pad_token_id=3, mask_truncated=mask_truncated
    )
    for name in MB_FIELDS:
        a, b = getattr(want, name), getattr(got, name)
        assert (a is None and b is None and name == "ref_logprobs") or (a.dtype == b.dtype and torch.equal(a, b)), name
    assert got.seq_lengths == want.seq_lengths and got.seq_lengths_padded == want.seq_lengths_padded
    assert torch.equal(got.cu_seqlens_padded, want.cu_seqlens_padded)
    empty = pack_batch_micro_batch(part, 2, 2, length=8, seq_pad_multiple=seq_pad)
    assert empty.num_sequences == 0 and empty.loss_mask.sum() == 0 and empty.old_logprobs is None
    assert empty.position_ids.tolist() == list(range(8)) and empty.seq_ids.tolist() == [-1] * 8


@pytest.mark.parametrize(
    "settings,dp",
    [
        (PackSettings(micro_batch_tokens=40), 2),
        (PackSettings(micro_batch_tokens=48, seq_pad_multiple=4, pad_multiple=8), 3),  # CP=2 with TP=2 + SP
        (PackSettings(micro_batch_tokens=30, uniform_length=True, micro_batch_multiple=2), 2),  # PP=2, VPP
    ],
)
def test_each_rank_share_packs_as_pack_for_rank_did(settings, dp):
    """A one-mini-batch share is exactly what pack_for_rank built from the same Samples (the layout
    every actor test was written against), on every DP rank."""
    samples = random_samples(11, seed=dp)
    for rank in range(dp):
        want = pack_for_rank(
            samples,
            micro_batch_tokens=settings.micro_batch_tokens,
            dp_size=dp,
            dp_rank=rank,
            pad_multiple=settings.pad_multiple,
            seq_pad_multiple=settings.seq_pad_multiple,
            uniform_length=settings.uniform_length,
            micro_batch_multiple=settings.micro_batch_multiple,
        )
        share = share_of_samples(samples, settings=settings, dp_size=dp, dp_rank=rank)
        spans = share.micro_batch_spans(settings)
        assert len(spans) == want.num_micro_batches
        for (a, b, length), mb in zip(spans, want.micro_batches):
            got = pack_batch_micro_batch(share.batch, a, b, length=length, seq_pad_multiple=settings.seq_pad_multiple)
            assert share.source_indices[a:b].tolist() == mb.sample_indices
            for name in MB_FIELDS:
                x, y = getattr(mb, name), getattr(got, name)
                assert (x is None and y is None) or torch.equal(x, y), (rank, name)


def test_plan_splits_every_mini_batch_over_dp_and_shares_partition_the_step():
    samples = random_samples(24, seed=5)  # 6 groups of 4; 2 prompts per update -> 3 mini-batches of 8
    batch = RolloutBatch.from_samples(samples)
    settings = PackSettings(micro_batch_tokens=40)
    plans = plan_shares(batch.seq_lengths, sequences_per_mini_batch=8, settings=settings, dp_size=2)
    seen = sorted(i for p in plans for i in p.indices.tolist())
    assert seen == list(range(24))  # every sequence exactly once
    for plan in plans:
        assert plan.micro_batches_per_mini.tolist() == plans[0].micro_batches_per_mini.tolist()
        assert int(plan.micro_batch_sizes.sum()) == plan.indices.numel()
    shares = [BatchShare.from_plan(batch, p, step_sequences=24) for p in plans]
    for rank, share in enumerate(shares):
        minis = list(share.mini_batches())
        assert len(minis) == 3
        for j, mini in enumerate(minis):  # mini-batch j holds sequences of [8j, 8j + 8) only
            assert all(8 * j <= i < 8 * j + 8 for i in mini.source_indices.tolist())
            # and is this rank's part of packing.py's plan of that mini-batch alone
            alone = share_of_samples(samples[8 * j : 8 * j + 8], settings=settings, dp_size=2, dp_rank=rank)
            assert (alone.source_indices + 8 * j).tolist() == mini.source_indices.tolist()
            assert torch.equal(alone.batch.tokens, mini.batch.tokens)
    # token balance: the two shares of each mini-batch differ by at most one sequence
    for j in range(3):
        loads = [int(list(s.mini_batches())[j].batch.seq_lengths.sum()) for s in shares]
        assert abs(loads[0] - loads[1]) <= max(s.num_tokens for s in samples[8 * j : 8 * j + 8])


def test_routed_experts_travel_as_a_token_field_and_pack_at_their_tokens():
    """MoE routing replay: the engine's experts ([tokens - 1, layers x top-k] per sample) become one
    int16 [T, layers x top-k] field aligned with `tokens`, -1 where the engine reported nothing; a
    share's cut keeps them with their tokens and the packing puts them at the packed positions."""
    from dapo_megatron.actor.routing_replay import pack_batch_routed_experts, validate_batch_routed_experts

    rows_a = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1]], dtype=torch.uint8)  # 2 layers x top-2
    rows_c = torch.tensor([[3, 2, 1, 0], [1, 0, 3, 2]], dtype=torch.int16)
    a = Sample(prompt_ids=[1, 2], response_ids=[3, 4], group_index=0, routed_experts=rows_a)
    b = Sample(prompt_ids=[5], response_ids=[6, 7], group_index=0)  # the engine returned none
    c = Sample(prompt_ids=[8, 9], response_ids=[10], group_index=1, routed_experts=rows_c)
    batch = RolloutBatch.from_samples([a, b, c])
    field = batch.token_fields["routed_experts"]
    none = [[-1] * 4]
    assert field.dtype == torch.int16 and field.shape == (10, 4)
    assert field.tolist() == rows_a.tolist() + none + none * 3 + rows_c.tolist() + none
    assert (
        batch.select(torch.tensor([2, 0])).token_fields["routed_experts"].tolist()
        == rows_c.tolist() + none + rows_a.tolist() + none
    )

    # sequences 0..2 padded to 4 tokens each (seq_pad_multiple 2), packed length 14
    experts, valid = pack_batch_routed_experts(batch, [0, 1, 2], [4, 4, 4], length=14, num_layers=2, topk=2)
    default = torch.arange(2).expand(14, 2, 2)
    want = default.clone()
    want[0:3] = rows_a.long().view(3, 2, 2)
    want[8:10] = rows_c.long().view(2, 2, 2)
    assert torch.equal(experts, want)
    assert valid.nonzero()[:, 0].tolist() == [0, 1, 2, 8, 9]
    experts, valid = pack_batch_routed_experts(batch, [2], [4], length=4, num_layers=2, topk=2)  # one sequence
    assert experts[:2].tolist() == rows_c.long().view(2, 2, 2).tolist() and valid.tolist() == [True, True, False, False]

    with pytest.raises(ValueError, match="sequence 1 of the batch: routed_experts is None"):
        validate_batch_routed_experts(batch, num_layers=2, topk=2)
    with pytest.raises(ValueError, match="routed_experts has 4 ids per token, the model needs 6"):
        validate_batch_routed_experts(batch.select(torch.tensor([0])), num_layers=3, topk=2)
    with pytest.raises(ValueError, match="carries no routed_experts"):
        validate_batch_routed_experts(RolloutBatch.from_samples([b]), num_layers=2, topk=2)
    validate_batch_routed_experts(batch.select(torch.tensor([0, 2])), num_layers=2, topk=2)
    with pytest.raises(ValueError, match=r"sample 1: routed_experts has shape \(2, 4\), expected \(3, 4\)"):
        RolloutBatch.from_samples(
            [a, Sample(prompt_ids=[1, 2], response_ids=[3, 4], group_index=0, routed_experts=rows_c)]
        )
