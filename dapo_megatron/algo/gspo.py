"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the importance ratio and its clip
are taken per sequence, not per token.

For sequence i with trained tokens t (mask m) and advantage A_i:
    s_i = exp(mean_t (logp_t - logp_old_t))         = (pi(y_i) / pi_old(y_i)) ^ (1 / |y_i|)
    l_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - eps_low, 1 + eps_high))
    loss = sum_i l_i / D                              D: sequences with a trained token (global)
so d l_i / d logp_t = l_i'(s_i) * s_i / |y_i|: every token of a sequence gets the same weight, and a
clipped sequence gives no gradient at all. No dual clip (the paper has none).

Packed: the actor's weight of seq-mean-token-mean, w_t = m_t / |y_i|, sums to 1 over a sequence, so
loss = sum_t w_t * l_{i(t)} / D is the formula above (config.py requires that aggregation mode). A
sequence's tokens must all be in the call (config.py refuses actor.cp > 1 with gspo).

With eps_low 0.2, eps_high 0.28 (tests/unit/test_algo_objective.py):
    log-ratios [0.3, 0.1], A = +1            -> s = e^0.2  = 1.2214, l = -1.2214                [in range]
    log-ratios [-0.6, -0.4, -0.2], A = -1    -> s = e^-0.4 = 0.6703, l = max(0.6703, 0.8) = 0.8 [clipped low]
    log-ratios [0.5, (3.0 masked)], A = +2   -> s = e^0.5  = 1.6487, l = max(-3.2974, -2.56) = -2.56
    loss = (-1.2214 + 0.8 - 2.56) / 3 = -0.99380
Tokens of the first sequence get d loss / d logp = -1 * 1.2214 / 2 / 3 = -0.20357; the others 0.
"""

from __future__ import annotations

import torch

from dapo_kernels.reference import policy_loss_stats
from dapo_megatron.algo.policy_loss import POLICY_LOSSES, ClipSettings, LossTokens


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(tokens: LossTokens, clip: ClipSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum_i l_i / D over the call's sequences (module docstring); the stats are over tokens, each
    token carrying its sequence's ratio (clipfrac_high: the weight of tokens whose sequence clipped high)."""
    t = tokens
    if clip.fused:
        raise ValueError("algorithm.policy_loss='gspo' has no fused kernel: set actor.fused_policy_loss=false")
    if clip.clip_ratio_c is not None:
        raise ValueError(
            f"algorithm.policy_loss='gspo' has no dual clip: set algorithm.clip_ratio_c=null "
            f"(it is {clip.clip_ratio_c})"
        )
    dtype, device = t.logprob.dtype, t.logprob.device
    mask = t.mask.to(dtype)
    seq = t.seq_ids.to(device=device, dtype=torch.int64)
    zeros = torch.zeros(t.num_sequences, dtype=dtype, device=device)
    trained = zeros.index_add(0, seq, mask).clamp(min=1.0)  # a sequence with no trained token: weight 0 anyway
    log_ratio = zeros.index_add(0, seq, (t.logprob - t.old_logprob) * mask) / trained  # differentiable
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    # one advantage per sequence (every token of a sequence carries the same one): scattered, not averaged,
    # so it is the value itself and not a mean with a rounding error
    advantage = zeros.scatter(0, seq, t.advantages.to(dtype))
    per_sequence = torch.maximum(
        -advantage * ratio, -advantage * torch.clamp(ratio, 1.0 - clip.eps_low, 1.0 + clip.eps_high)
    )
    loss = (t.weight.to(dtype) * per_sequence[seq]).sum() / t.loss_denominator
    stats = policy_loss_stats(
        log_ratio.detach()[seq],
        ratio.detach()[seq],
        advantage[seq],
        t.weight.detach().to(dtype),
        eps_low=clip.eps_low,
        eps_high=clip.eps_high,
        clip_ratio_c=None,
    )
    return loss, {key: value.float() for key, value in stats.items()}
