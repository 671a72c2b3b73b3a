"""The float64 reference of a train step under a sequence-level rollout correction (algo/rollout_correction.py),
written out one response at a time on the transformers model, and the samples that exercise it."""

from __future__ import annotations

import math

import torch

from helpers_actor import fill_rl_fields, hf_logprobs, make_samples
from helpers_fp32 import PolicyStep, hf_response_logprobs, policy_step_of

# per response: the mean log ratio d = log pi_old - log pi_rollout of its tokens (plus a little noise)
SHIFTS = [0.02, -0.05, 0.3, 0.12, -0.25, 0.1, 0.0, 0.04, -0.1, 0.15, 0.3, -0.02]
# one of its 10 tokens gets d = -3.5 (pi_old / pi_rollout = 0.03): its geometric mean stays near 1, the veto drops it
VETOED_SAMPLE = 10


def corrected_samples(hf_dir):
    """12 samples (responses of 1 to 12 tokens) with old log-probs near the model's and engine log-probs
    shifted per response by SHIFTS."""
    samples = make_samples(12, seed=4)
    logps, _ = hf_logprobs(hf_dir, samples)
    samples = fill_rl_fields(samples, logps, seed=3)
    gen = torch.Generator().manual_seed(11)
    for i, s in enumerate(samples):
        old = torch.tensor(s.old_logprobs)
        d = SHIFTS[i] + 0.03 * torch.randn(old.shape, generator=gen)
        if i == VETOED_SAMPLE:
            d[0] = -3.5
        s.rollout_logprobs = (old - d).tolist()
    assert len(samples[VETOED_SAMPLE].response_ids) > 1
    return samples


def reference_factors(samples, *, seq_is_cap, upper, lower, veto):
    """c of each response (every token of it): min(exp(S), cap) * [lower <= exp(S / n) <= upper] *
    [no trained token with exp(d) < veto], from the fp32 log-probs in float64."""
    out = []
    for s in samples:
        mask = s.response_mask()
        d = [o - r for o, r, m in zip(s.old_logprobs, s.rollout_logprobs, mask) if m]
        total = sum(d)
        weight = min(math.exp(max(min(total, 20.0), -20.0)), seq_is_cap)
        kept = lower <= math.exp(total / max(len(d), 1)) <= upper and all(x >= math.log(veto) for x in d)
        out.append(weight * float(kept))
    return out


def hf_corrected_step(hf_dir, samples, *, dtype, factors, eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0) -> PolicyStep:
    """token-mean: loss = sum_i c_i sum_t m_t l_t / sum_i sum_t m_t (a masked response stays in D)."""
    model, lp_all = hf_response_logprobs(hf_dir, samples, dtype=dtype)
    total, denom = torch.zeros((), dtype=dtype), 0.0
    for s, c, lp in zip(samples, factors, lp_all.split([len(s.response_ids) for s in samples])):
        old = torch.tensor(s.old_logprobs, dtype=dtype)
        mask = torch.tensor(s.response_mask(), dtype=dtype)
        adv = s.advantage
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))
        loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
        if adv < 0:
            loss = torch.minimum(loss, torch.full_like(loss, -adv * clip_ratio_c))
        total = total + c * (mask * loss).sum()
        denom += float(mask.sum())
    return policy_step_of(model, lp_all, total / denom)
