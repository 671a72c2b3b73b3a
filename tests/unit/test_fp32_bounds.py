"""The layout-parity bounds of tests/helpers_fp32.py can fail: the fp32 evaluation they are measured from
passes them, and each of the mistakes a layout could make (a response token too few, log-probs shifted by
one position, a 1% wrong learning rate) is refused. On the tiny transformers Qwen2, one process."""

import random

import pytest
import torch

from dapo_megatron.dataplane.sample import Sample
from helpers_fp32 import (
    SAFETY,
    adam_first_step,
    adam_weight_bounds,
    check_weights,
    hf_policy_step,
    hf_token_logprobs,
    step_bounds,
    token_bounds,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    hf_dir = str(save_tiny_hf(tmp_path_factory.mktemp("qwen"), arch="qwen2", tied=False))
    rng = random.Random(5)
    samples = []
    for i in range(8):
        s = Sample(
            prompt_ids=[rng.randrange(5, 300) for _ in range(rng.randint(2, 9))],
            response_ids=[rng.randrange(5, 300) for _ in range(rng.randint(2, 12))],
            group_index=i // 2,
        )
        samples.append(s)
    logps, _ = hf_token_logprobs(hf_dir, samples, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)
    for i, (s, lp) in enumerate(zip(samples, logps)):
        s.old_logprobs = (lp + 0.3 * torch.randn(lp.shape, generator=gen, dtype=torch.float64)).tolist()
        s.advantage = [1.5, -1.0, 0.5, -1.5][i % 4]
    fp32 = hf_policy_step(hf_dir, samples, dtype=torch.float32)
    exact = hf_policy_step(hf_dir, samples, dtype=torch.float64)
    return hf_dir, samples, fp32, step_bounds(fp32, exact)


def test_the_fp32_evaluation_is_within_its_own_bounds(tiny):
    _, _, fp32, bounds = tiny
    assert bounds.check_loss(fp32.loss) <= 1.0
    assert bounds.check_grads(fp32.grads) <= 1 / SAFETY + 1e-3  # measured from it: a SAFETY-fold margin


def test_a_token_too_few_is_refused(tiny):
    hf_dir, samples, _, bounds = tiny
    short = [Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, group_index=s.group_index) for s in samples]
    for s, full in zip(short, samples):
        s.old_logprobs, s.advantage = full.old_logprobs, full.advantage
    short[3].loss_mask = [1] * (len(short[3].response_ids) - 1) + [0]  # its last token not trained
    wrong = hf_policy_step(hf_dir, short, dtype=torch.float32)
    with pytest.raises(AssertionError, match="from the float64"):
        bounds.check_loss(wrong.loss)
    with pytest.raises(AssertionError, match="from the float64 gradient"):
        bounds.check_grads(wrong.grads)


def test_logprobs_off_by_one_position_are_refused(tiny):
    hf_dir, samples, _, _ = tiny
    tokens = token_bounds(hf_dir, samples)
    shifted = [torch.cat([lp[1:], lp[-1:]]) for lp in tokens.logprobs]
    assert tokens.check(tokens.logprobs, tokens.entropies) == 0.0
    with pytest.raises(AssertionError, match="log-probs"):
        tokens.check(shifted, tokens.entropies)


def test_a_one_percent_wrong_learning_rate_is_refused(tiny):
    hf_dir, _, fp32, bounds = tiny
    from safetensors.torch import load_file

    before = load_file(f"{hf_dir}/model.safetensors")
    step = dict(lr=1e-3, eps=1e-4, weight_decay=0.1, grad_clip=1.0)
    want = adam_first_step(before, bounds.exact.grads, **step)
    limit = adam_weight_bounds(bounds, before, lr=1e-3, eps=1e-4, grad_clip=1.0)
    # the fp32 gradient's update, rounded to fp32 as a layout's weights are: within the bounds
    got = {k: v.float() for k, v in adam_first_step(before, fp32.grads, **step).items()}
    assert check_weights(got, want, limit) <= 1.0
    wrong = {k: v.float() for k, v in adam_first_step(before, fp32.grads, **{**step, "lr": 1.01e-3}).items()}
    with pytest.raises(AssertionError, match="from the float64 update"):
        check_weights(wrong, want, limit)
