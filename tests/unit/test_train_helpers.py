"""Pure helpers of the training loop: mini-batch split, per-step reduction, mismatch."""

import pytest

from dapo_megatron.batch import Sample
from dapo_megatron.train import logprob_mismatch, mini_batches, reduce_updates


def test_mini_batches_never_split_a_group():
    samples = list(range(24))  # 6 prompts x 4 responses, group-major as the sampler returns them
    batches = mini_batches(samples, group_size=4, prompts_per_update=2)
    assert batches == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    assert mini_batches([], group_size=4, prompts_per_update=2) == []


def test_reduce_updates_means_sums_and_maxima():
    a = {"loss": 1.0, "grad_norm": 2.0, "ratio_max": 1.5, "num_tokens": 10.0, "nonfinite": 0.0, "update_skipped": 0.0}
    b = {"loss": 3.0, "grad_norm": 6.0, "ratio_max": 1.2, "num_tokens": 30.0, "nonfinite": 1.0, "update_skipped": 1.0}
    out = reduce_updates([a, b])
    assert out["actor/loss"] == 2.0 and out["actor/grad_norm"] == 4.0  # means
    assert out["actor/num_tokens"] == 40.0 and out["actor/nonfinite"] == 1.0  # sums
    assert out["actor/ratio_max"] == 1.5 and out["actor/grad_norm_max"] == 6.0  # maxima
    assert out["actor/num_updates"] == 2.0
    assert reduce_updates([]) == {"actor/num_updates": 0.0}  # a step with nothing kept


def test_logprob_mismatch_over_sampled_tokens():
    s1 = Sample(prompt_ids=[1], response_ids=[2, 3], group_index=0, old_logprobs=[-1.0, -2.0],
                rollout_logprobs=[-1.5, -2.0])
    s2 = Sample(prompt_ids=[1], response_ids=[4], group_index=0, old_logprobs=[-0.25], rollout_logprobs=[0.0])
    out = logprob_mismatch([s1, s2])
    assert out["mismatch/max"] == 0.5
    assert out["mismatch/mean"] == pytest.approx((0.5 + 0.0 + 0.25) / 3, abs=1e-15)
    assert logprob_mismatch([]) == {}
