"""The objective the actor minimizes, on one packed micro-batch (docs/algorithm.md 5): the registered
policy loss (algorithm.policy_loss) with the aggregation weights, the truncated importance weight and
the KL term around it, and the metric sums of the step.

    loss = sum_t w_t * (c_t * l_t + kl_coef * kl_t) / D        (kl only with algorithm.use_kl)

w_t is the aggregation weight of algo/aggregation.py (m_t, or m_t / n_seq(t) for seq-mean-token-mean),
l_t the policy loss's per-token term (GSPO's: its sequence's), tis_t = min(pi_old / pi_rollout, cap)
(algo/off_policy.py), or more generally c_t the product of the rollout corrections
(algo/rollout_correction.py: truncated weights, rejection masks, the veto; 1 when none is set; a masked
token keeps its place in D), kl_t the k1/k2/k3 estimate to the reference (algo/kl.py) and D the GLOBAL count
of the mini-batch, so that micro-batches, context-parallel shards and data-parallel ranks add up to the
loss of one big batch. The actor sums `values` over micro-batches and ranks (METRIC_SUMS, plus the max
of ratio_max) and objective_metrics turns the sums into the step's means.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dapo_megatron.algo.aggregation import check_agg_mode
from dapo_megatron.algo.kl import kl_penalty
from dapo_megatron.algo.policy_loss import POLICY_LOSSES, ClipSettings, LossTokens
from dapo_megatron.algo.rollout_correction import MismatchTokens, RolloutCorrection

# what objective() returns to be summed over micro-batches and ranks, in this order (ratio_max: a max)
METRIC_SUMS = (
    "loss",
    "pg_loss",
    "kl_loss",
    "clipfrac_low",
    "clipfrac_high",
    "dualclip_frac",
    "approx_kl",
    "ratio_mean",
    "entropy",
    "kl",
    "tis_weight",
    "masked_tokens",
    "num_tokens",
    "num_weight",
)
_WEIGHTED_STATS = ("clipfrac_low", "clipfrac_high", "dualclip_frac", "approx_kl", "ratio_mean")


@dataclass(frozen=True)
class ObjectiveSettings:
    """The algorithm section's loss keys as scalars (algo/ never reads the config)."""

    policy_loss: str = "dapo"
    loss_agg_mode: str = "token-mean"
    clip: ClipSettings = ClipSettings(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0)
    tis_cap: float | None = None  # the token-level truncated weight ("token_is")
    # the other rollout corrections (algo/rollout_correction.py; config.py checks their combinations)
    seq_is_cap: float | None = None
    rejection: str | None = None  # "token", "sequence", "geometric", "icepop"
    rejection_upper: float | None = None
    rejection_lower: float | None = None  # None: 1 / rejection_upper
    veto_threshold: float | None = None
    # algorithm.bypass_old_logprobs: old_logprob IS the engine's; the masks compare the current policy with it
    bypass: bool = False
    use_kl: bool = False
    kl_coef: float = 0.001
    kl_kind: str = "k3"

    def __post_init__(self) -> None:
        POLICY_LOSSES.get(self.policy_loss)  # an unknown name fails here, naming the registered ones
        check_agg_mode(self.loss_agg_mode)
        _ = self.rollout_correction  # an unknown rejection, or one without its bound, fails here

    @property
    def rollout_correction(self) -> RolloutCorrection:
        return RolloutCorrection.from_keys(
            tis_cap=self.tis_cap,
            seq_is_cap=self.seq_is_cap,
            rejection=self.rejection,
            rejection_upper=self.rejection_upper,
            rejection_lower=self.rejection_lower,
            veto_threshold=self.veto_threshold,
        )

    # which optional inputs objective() reads (the caller gathers and moves only those)
    @property
    def reads_sequence_tokens(self) -> bool:
        return self.loss_agg_mode == "seq-mean-token-mean"

    @property
    def reads_rollout_logprobs(self) -> bool:
        return self.rollout_correction.active and not self.bypass

    @property
    def reads_ref_logprobs(self) -> bool:
        return self.use_kl

    def correction_factor(
        self,
        *,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor | None,
        loss_mask: torch.Tensor,
        seq_ids: torch.Tensor,
        num_sequences: int,
    ) -> torch.Tensor:
        """c_t of the rollout corrections on flat tokens that hold whole responses (the actor's
        micro-batch before its context-parallel split), for PackedTokens.correction."""
        if rollout_logprobs is None:
            raise ValueError("the rollout correction (algorithm.tis_cap, ...) reads the engine's rollout_logprobs")
        tokens = MismatchTokens.of(
            old_logprobs=old_logprobs,
            rollout_logprobs=rollout_logprobs,
            mask=loss_mask,
            seq_ids=seq_ids,
            num_sequences=num_sequences,
        )
        return self.rollout_correction.factor(tokens)


@dataclass(frozen=True)
class PackedTokens:
    """One packed micro-batch's response tokens on this rank, flat [N], in the actor's local order."""

    logprob: torch.Tensor  # pi_theta, differentiable
    entropy: torch.Tensor
    old_logprob: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # 1 where the token trains
    seq_ids: torch.Tensor  # each token's sequence in the micro-batch
    num_sequences: int
    sequence_tokens: torch.Tensor | None = None  # n_seq(t): trained tokens of t's whole sequence (all CP shards)
    rollout_logprobs: torch.Tensor | None = None  # the engine's (with a rollout correction)
    # c_t of the rollout corrections, computed by the caller over whole responses (before a
    # context-parallel split); None: objective() computes it from the tokens here (whole responses)
    correction: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None  # the reference policy's (with use_kl)


def objective(
    tokens: PackedTokens, settings: ObjectiveSettings, *, loss_denominator: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss to backpropagate, values): values holds METRIC_SUMS (detached, to be summed) and ratio_max."""
    t, s, denom = tokens, settings, loss_denominator
    mask = t.loss_mask
    weight = aggregation_weight(mask, t.sequence_tokens, agg_mode=s.loss_agg_mode)
    pg_weight = weight
    tis = torch.ones_like(mask)
    if s.rollout_correction.active:
        tis = _correction_of(t, s)
        pg_weight = weight * tis
    pg_loss, stats = POLICY_LOSSES.get(s.policy_loss)(
        LossTokens(
            logprob=t.logprob,
            old_logprob=t.old_logprob,
            advantages=t.advantages,
            mask=mask,
            weight=pg_weight,
            seq_ids=t.seq_ids,
            num_sequences=t.num_sequences,
            loss_denominator=denom,
        ),
        s.clip,
    )
    kl = torch.zeros_like(t.logprob)
    kl_loss = torch.zeros((), dtype=torch.float32, device=t.logprob.device)
    if s.use_kl:
        assert t.ref_logprobs is not None, "use_kl reads ref_logprobs"
        kl = kl_penalty(t.logprob, t.ref_logprobs, s.kl_kind)
        kl_loss = (kl * weight).sum() / denom
    loss = pg_loss + s.kl_coef * kl_loss if s.use_kl else pg_loss
    values = metric_values(
        loss=loss, pg_loss=pg_loss, kl_loss=kl_loss, stats=stats, entropy=t.entropy, kl=kl, tis=tis, mask=mask
    )
    return loss, values


def aggregation_weight(loss_mask: torch.Tensor, sequence_tokens: torch.Tensor | None, *, agg_mode: str) -> torch.Tensor:
    """w_t of algo/aggregation.py: the mask, or mask / n_seq(t) for seq-mean-token-mean (sequence_tokens:
    n_seq(t), the trained tokens of t's whole sequence). Known before the forward: the one-pass head's
    loss weight is this times c_t (actor/head_loss.py)."""
    if agg_mode == "seq-mean-token-mean":
        assert sequence_tokens is not None, "seq-mean-token-mean reads sequence_tokens"
        return loss_mask / sequence_tokens.clamp(min=1.0)
    return loss_mask


def metric_values(
    *,
    loss: torch.Tensor,
    pg_loss: torch.Tensor,
    kl_loss: torch.Tensor,
    stats: dict[str, torch.Tensor],
    entropy: torch.Tensor,
    kl: torch.Tensor,
    tis: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """objective()'s values (METRIC_SUMS + ratio_max, detached) from the loss terms, the policy loss's
    stats (means weighted by pg_weight), the per-token entropy, KL estimate and correction factor c_t:
    one function, so that every path that computes the objective logs the same keys the same way."""
    trained = (mask != 0).float()
    num_weight = stats["num_tokens"].float()  # the stats are means over pg_weight: sums are mean * weight
    return {
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "kl_loss": kl_loss.detach(),
        **{k: stats[k].float() * num_weight for k in _WEIGHTED_STATS},
        "entropy": (entropy.detach() * trained).sum(),
        "kl": (kl.detach() * trained).sum(),
        "tis_weight": (tis * trained).sum(),
        "masked_tokens": ((tis == 0).float() * trained).sum(),
        "num_tokens": trained.sum(),
        "num_weight": num_weight,
        "ratio_max": stats["ratio_max"].float(),
    }


def _correction_of(t: PackedTokens, s: ObjectiveSettings) -> torch.Tensor:
    """c_t: the caller's (whole responses, before a CP split), else from the call's own tokens (right when
    they hold whole responses). In bypass old_logprob is the engine's, and the masks read pi_theta / pi_rollout
    with pi_theta taken without gradient (verl's bypass; at a step's first update pi_theta is the trainer's
    pi_old, so they decide as without the bypass)."""
    if t.correction is not None:
        return t.correction
    if s.bypass:
        return s.correction_factor(
            old_logprobs=t.logprob.detach(),
            rollout_logprobs=t.old_logprob,
            loss_mask=t.loss_mask,
            seq_ids=t.seq_ids,
            num_sequences=t.num_sequences,
        )
    return s.correction_factor(
        old_logprobs=t.old_logprob,
        rollout_logprobs=t.rollout_logprobs,
        loss_mask=t.loss_mask,
        seq_ids=t.seq_ids,
        num_sequences=t.num_sequences,
    )


def objective_metrics(sums: dict[str, float], ratio_max: float) -> dict[str, float]:
    """The step's metrics from METRIC_SUMS summed over every micro-batch and rank: the loss terms as
    they are (each already divided by the global D), the clip stats as pg-weight means, entropy, KL and
    the correction's factor c_t (tis_weight) as means over trained tokens, and the fraction of trained
    tokens the corrections masked (c_t = 0)."""
    weight = max(sums["num_weight"], 1e-30)
    tokens = max(sums["num_tokens"], 1.0)
    return {
        "loss": sums["loss"],
        "pg_loss": sums["pg_loss"],
        "kl_loss": sums["kl_loss"],
        **{k: sums[k] / weight for k in _WEIGHTED_STATS},
        "ratio_max": float(ratio_max),
        "entropy": sums["entropy"] / tokens,
        "kl": sums["kl"] / tokens,
        "tis_weight": sums["tis_weight"] / tokens,
        "correction_masked_frac": sums["masked_tokens"] / tokens,
        "num_tokens": sums["num_tokens"],
    }
