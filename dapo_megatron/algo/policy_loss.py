"""The DAPO policy loss: clip-higher PPO surrogate with dual clip, and its aggregation (docs/algorithm.md 5).

Per token, with A the advantage and r the importance ratio:

    r  = exp(clamp(logp - logp_old, -20, 20))
    l1 = -A * r
    l2 = -A * clip(r, 1 - eps_low, 1 + eps_high)
    l  = max(l1, l2)                       # pessimistic: clipping only ever removes gradient
    l  = min(l, -A * c)   where A < 0      # dual clip: a negative-advantage token with a huge ratio
                                           # stops at -A * c instead of growing without bound

With eps_low 0.2, eps_high 0.28, c 3 (gradient d l / d logp in brackets, since dr/dlogp = r):
    A = +1, r = 1.5  -> l = max(-1.5, -1.28) = -1.28                  [0: clipped high]
    A = -1, r = 0.5  -> l = max( 0.5,  0.8 ) =  0.8                   [0: clipped low]
    A = -1, r = 4.0  -> l = min(max(4.0, 1.28), 3) = 3                [0: dual clip]
    A = -1, r = 2.0  -> l = min(2.0, 3) = 2.0                         [-A * r = 2.0]

Aggregation (mask = response tokens that train):
    token-mean          sum(mask * l) / loss_denominator     (default sum(mask))
    seq-mean-token-mean sum_seq(sum_t mask*l / sum_t mask) / loss_denominator   (default: sequences
                        with at least one masked token)
    seq-mean-token-sum  sum_seq(sum_t mask*l) / loss_denominator               (same default)
The registered losses (POLICY_LOSSES below, a Registry[PolicyLossFn]; algorithm.policy_loss selects one)
take the actor's packed form of one micro-batch (LossTokens: flat tensors of this rank's trained
positions, each token's aggregation weight w and the global D) and return sum_t w_t * l_t / D with its stats:
    "dapo"  the formula above (clip-higher eps_low/eps_high, dual clip); the fused Triton kernel when
            ClipSettings.fused (actor.fused_policy_loss): same value, gradient and stats
    "grpo"  the naive-GRPO baseline of the DAPO paper (Table 1, rung 0): the same PPO surrogate with ONE
            symmetric clip range (eps_high must equal eps_low: clip-higher is "dapo"); the sequence-level
            mean is its aggregation (config.py requires loss_agg_mode=seq-mean-token-mean)
    "gspo"  algo/gspo.py
Gradient accumulation: pass the GLOBAL count of the mini-batch (all micro-batches, all data-parallel
ranks; `count_loss_units` gives one micro-batch's share to sum) so that the micro-batch losses add up
to the loss of one big batch, and so do their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dapo_kernels import policy_loss as fused_policy_loss

# the per-token formula and the stats: the one torch reference of both (kernels/reference.py); this
# module adds the aggregation modes and the argument checks of the trainer's configuration
from dapo_kernels.reference import POLICY_LOSS_STAT_KEYS, policy_loss_stats, policy_loss_terms
from dapo_megatron.algo.aggregation import AGG_MODES, check_agg_mode, count_loss_units
from dapo_megatron.algo.registry import Registry

__all__ = [
    "policy_loss",
    "count_loss_units",
    "AGG_MODES",
    "STAT_KEYS",
    "LossTokens",
    "ClipSettings",
    "PolicyLossFn",
    "POLICY_LOSSES",
]

# The stats every policy-loss implementation returns (kernels/policy_loss.py returns the same keys).
STAT_KEYS = POLICY_LOSS_STAT_KEYS


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None = None,
    agg_mode: str = "token-mean",
    loss_denominator: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Aggregated clipped policy-gradient loss (scalar, differentiable in `logprob`) and its stats.

    logprob, old_logprob, mask: [B, T] (token-mean accepts any shape); advantages broadcast to them
    ([B, T] per token or [B, 1] per sequence). Stats are detached 0-dim float32 tensors over this
    call's masked tokens, keys STAT_KEYS: clipfrac_low = frac of (A < 0) & (r < 1 - eps_low),
    clipfrac_high = frac of (A > 0) & (r > 1 + eps_high), dualclip_frac = frac of (A < 0) & (r > c),
    approx_kl = mean 0.5 * (logp - logp_old)^2, ratio_mean, ratio_max, num_tokens = sum(mask).
    """
    _check_policy_loss_inputs(
        logprob,
        old_logprob,
        advantages,
        mask,
        eps_low=eps_low,
        eps_high=eps_high,
        clip_ratio_c=clip_ratio_c,
        agg_mode=agg_mode,
    )
    adv = advantages.to(logprob.dtype).expand_as(logprob)
    weight = mask.to(logprob.dtype)
    per_token, ratio, log_ratio = policy_loss_terms(
        logprob, old_logprob, adv, eps_low=eps_low, eps_high=eps_high, clip_ratio_c=clip_ratio_c
    )

    total = _aggregate(per_token, weight, agg_mode=agg_mode)
    denom = _loss_denominator(mask, agg_mode=agg_mode, loss_denominator=loss_denominator)
    loss = total / denom

    stats = policy_loss_stats(
        log_ratio.detach(),
        ratio.detach(),
        adv.detach(),
        weight.detach(),
        eps_low=eps_low,
        eps_high=eps_high,
        clip_ratio_c=clip_ratio_c,
    )
    return loss, {key: value.float() for key, value in stats.items()}


def _check_policy_loss_inputs(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None,
    agg_mode: str,
) -> None:
    """policy_loss's arguments: clip bounds in range, shapes that agree, an aggregation that fits them."""
    check_agg_mode(agg_mode)
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"policy_loss: eps_low={eps_low}, eps_high={eps_high} must be >= 0")
    if eps_low >= 1:
        raise ValueError(f"policy_loss: eps_low={eps_low} must be < 1 (the lower clip bound is 1 - eps_low)")
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"policy_loss: clip_ratio_c={clip_ratio_c} must be > 1 or None")
    if logprob.shape != old_logprob.shape or logprob.shape != mask.shape:
        raise ValueError(
            f"policy_loss: logprob {tuple(logprob.shape)}, old_logprob {tuple(old_logprob.shape)} and "
            f"mask {tuple(mask.shape)} must have the same shape"
        )
    if logprob.dim() == 2 and advantages.dim() == 1:
        raise ValueError(
            f"policy_loss: advantages {tuple(advantages.shape)} is 1-D but logprob is [B, T]; pass "
            "per-sequence advantages as [B, 1] (advantages[:, None])"
        )
    try:
        torch.broadcast_shapes(advantages.shape, logprob.shape)
    except RuntimeError:
        raise ValueError(
            f"policy_loss: advantages {tuple(advantages.shape)} do not broadcast to logprob {tuple(logprob.shape)}"
        ) from None
    if agg_mode != "token-mean" and logprob.dim() != 2:
        raise ValueError(f"policy_loss: agg_mode={agg_mode} needs [B, T] tensors, got {tuple(logprob.shape)}")


def _aggregate(per_token: torch.Tensor, weight: torch.Tensor, *, agg_mode: str) -> torch.Tensor:
    """The masked per-token losses summed as agg_mode says (token sum, or per-sequence sums/means summed)."""
    masked = per_token * weight
    if agg_mode == "token-mean":
        return masked.sum()
    per_seq = masked.sum(dim=-1)
    if agg_mode == "seq-mean-token-mean":
        per_seq = per_seq / weight.sum(dim=-1).clamp(min=1.0)  # an empty sequence contributes 0
    return per_seq.sum()


def _loss_denominator(
    mask: torch.Tensor, *, agg_mode: str, loss_denominator: float | int | torch.Tensor | None
) -> float | torch.Tensor:
    """What the aggregated loss is divided by: the given denominator, or this call's own loss units."""
    if loss_denominator is None:
        return float(max(count_loss_units(mask, agg_mode=agg_mode), 1))
    # a tensor (e.g. all-reduced on the GPU) is not checked: reading it would synchronize
    if not isinstance(loss_denominator, torch.Tensor) and loss_denominator <= 0:
        raise ValueError(f"policy_loss: loss_denominator={loss_denominator} must be > 0")
    return loss_denominator


@dataclass(frozen=True)
class ClipSettings:
    """The scalars every registered policy loss reads (algorithm.eps_low / eps_high / clip_ratio_c,
    actor.fused_policy_loss)."""

    eps_low: float
    eps_high: float
    clip_ratio_c: float | None
    fused: bool = False  # the Triton kernel (dapo_kernels.policy_loss); only the token-level losses have one


@dataclass(frozen=True)
class LossTokens:
    """One packed micro-batch's trained positions on this rank, flat [N] (the actor's layout): the
    loss is sum_t weight_t * l_t / loss_denominator. seq_ids: each token's sequence in the micro-batch
    (0..num_sequences-1); every token of a sequence is here (no context parallelism) for the losses
    that read whole sequences (gspo)."""

    logprob: torch.Tensor  # differentiable
    old_logprob: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor  # 1 where the token trains
    weight: torch.Tensor  # the aggregation weight of algo/aggregation.py times the TIS weight
    seq_ids: torch.Tensor
    num_sequences: int
    loss_denominator: float


class PolicyLossFn(Protocol):
    """The signature of every registered policy loss: (sum_t w_t * l_t / D, its stats keyed STAT_KEYS)."""

    def __call__(self, tokens: LossTokens, clip: ClipSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


# algorithm.policy_loss -> the loss (this module registers "dapo" and "grpo", algo/gspo.py "gspo"); mypy
# checks each registered function against PolicyLossFn
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("algorithm.policy_loss")


@POLICY_LOSSES.register("dapo")
def dapo_policy_loss(tokens: LossTokens, clip: ClipSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clip-higher surrogate with dual clip: policy_loss in its token-mean form with mask =
    weight and the global D (the fused kernel's form too; tests/distributed/test_actor_fused.py)."""
    t = tokens
    if clip.fused:
        return fused_policy_loss(
            t.logprob,
            t.old_logprob,
            t.advantages,
            t.weight,
            eps_low=clip.eps_low,
            eps_high=clip.eps_high,
            clip_ratio_c=clip.clip_ratio_c,
            loss_denominator=float(t.loss_denominator),
        )
    return policy_loss(
        t.logprob,
        t.old_logprob,
        t.advantages,
        t.weight,
        eps_low=clip.eps_low,
        eps_high=clip.eps_high,
        clip_ratio_c=clip.clip_ratio_c,
        agg_mode="token-mean",
        loss_denominator=float(t.loss_denominator),
    )


@POLICY_LOSSES.register("grpo")
def grpo_policy_loss(tokens: LossTokens, clip: ClipSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Naive GRPO's PPO surrogate: one symmetric clip range. The arithmetic is dapo's with
    eps_high = eps_low, so the ladder's rung 0 computes what it did before the registry, bit for bit."""
    if clip.eps_high != clip.eps_low:
        raise ValueError(
            f"algorithm.policy_loss='grpo' clips symmetrically: algorithm.eps_high={clip.eps_high} must "
            f"equal algorithm.eps_low={clip.eps_low} (clip-higher is algorithm.policy_loss='dapo')"
        )
    return dapo_policy_loss(tokens, clip)
