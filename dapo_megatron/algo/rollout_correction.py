"""Rollout correction: what the trainer does about the engine sampling from a slightly different policy
than the one it trains (bf16 vs FP8 engines, MoE routing, engine kernels; docs/algorithm.md 11).

With d_t = log pi_old(y_t) - log pi_rollout(y_t) on a response's trained tokens (pi_old: the trainer's
recomputed log-probs, pi_rollout: the engine's), each correction is a per-token factor c_t >= 0 that
multiplies the token's policy-gradient weight (algo/objective.py). A factor is a constant (computed from
log-probs that carry no gradient); a factor 0 masks the token out of the loss's numerator, and the
loss's D still counts it (D is what loss_agg_mode says of the loss mask, before any correction: a
rejected token or response lowers the step's signal instead of scaling the survivors up).

    "token_is"          c_t = min(exp(d_t), U)                              algorithm.tis_cap
    "sequence_is"       c_t = min(exp(S_i), U),      S_i = sum_t d_t        algorithm.seq_is_cap
    "token_reject"      c_t = [L <= exp(d_t) <= U]                          algorithm.rejection=token
    "sequence_reject"   c_t = [L <= exp(S_i) <= U]                          algorithm.rejection=sequence
    "geometric_reject"  c_t = [L <= exp(S_i / n_i) <= U]                    algorithm.rejection=geometric
    "icepop"            c_t = exp(d_t) * [L <= exp(d_t) <= U]               algorithm.rejection=icepop
    "veto"              c_t = [min_t exp(d_t) >= L]  (the whole response)   algorithm.veto_threshold

(i: t's response, n_i its trained tokens, U / L the upper / lower bound; the rejections' L defaults to
1 / U.) Several corrections multiply (RolloutCorrection.factor). Ratios are exponentiated from log
ratios clamped at +-20 (exp(20) = 4.9e8: no overflow, and a sequence sum that large is rejected or
truncated anyway); comparisons are made in log space, exactly.

A sequence-level or geometric quantity is the WHOLE response's: the functions here read flat tokens
that hold whole responses (seq_ids, -1 on padding). The actor calls them on a micro-batch before its
context-parallel split (a micro-batch always holds whole sequences: actor/packing.py), the step's
metrics on a data-parallel rank's share; sums are taken in float64. With algorithm.bypass_old_logprobs
pi_old is the engine's own, and objective() passes the current policy (no gradient) as pi_old here
(only the masks are allowed then: config.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from dapo_megatron.algo.off_policy import LOG_RATIO_CLAMP, clamped_ratio
from dapo_megatron.algo.registry import Registry


@dataclass(frozen=True)
class MismatchTokens:
    """Flat [N] tokens of whole responses: d_t, the tokens that train, each token's response."""

    log_ratio: torch.Tensor  # d_t = log pi_old - log pi_rollout (any float dtype; sums are float64)
    mask: torch.Tensor  # nonzero where the token trains; padding and prompt positions 0
    seq_ids: torch.Tensor  # 0..num_sequences-1, -1 on padding
    num_sequences: int

    @classmethod
    def of(
        cls,
        *,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        seq_ids: torch.Tensor,
        num_sequences: int,
    ) -> MismatchTokens:
        return cls(
            log_ratio=(old_logprobs.detach() - rollout_logprobs.detach()),
            mask=mask,
            seq_ids=seq_ids,
            num_sequences=num_sequences,
        )

    @property
    def trained(self) -> torch.Tensor:
        return self.mask != 0

    def per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """[num_sequences] float64 sums of `values` over each response's trained tokens."""
        out = torch.zeros(self.num_sequences + 1, dtype=torch.float64, device=values.device)
        index = (self.seq_ids.to(torch.int64) + 1).to(values.device)  # slot 0 collects the padding
        out.index_add_(0, index, torch.where(self.trained, values.double(), 0.0))
        return out[1:]

    def sequence_log_ratio(self) -> torch.Tensor:
        """[num_sequences] S_i = sum_t d_t (float64)."""
        return self.per_sequence(self.log_ratio)

    def sequence_tokens(self) -> torch.Tensor:
        """[num_sequences] n_i, trained tokens of each response (float64)."""
        return self.per_sequence(torch.ones_like(self.log_ratio))

    def broadcast(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """[N] each token's value of its response (padding: the value 1, it never trains)."""
        out = torch.ones(self.log_ratio.shape[0], dtype=per_sequence.dtype, device=per_sequence.device)
        real = self.seq_ids >= 0
        out[real] = per_sequence[self.seq_ids[real].to(torch.int64)]
        return out


@dataclass(frozen=True)
class CorrectionBounds:
    """U and L of one correction (the truncations read only `upper`, the veto only `lower`)."""

    upper: float = math.inf
    lower: float = 0.0

    def inside(self, log_ratio: torch.Tensor) -> torch.Tensor:
        """[L <= exp(x) <= U], compared in log space (exact: no exponential, no clamp)."""
        low = math.log(self.lower) if self.lower > 0 else -math.inf
        return (log_ratio >= low) & (log_ratio <= math.log(self.upper))


class RolloutCorrectionFn(Protocol):
    """The signature of every registered correction: [N] per-token factors >= 0 in log_ratio's dtype."""

    def __call__(self, tokens: MismatchTokens, bounds: CorrectionBounds) -> torch.Tensor: ...


ROLLOUT_CORRECTIONS: Registry[RolloutCorrectionFn] = Registry("algorithm.rejection")


@ROLLOUT_CORRECTIONS.register("token_is")
def token_is(tokens: MismatchTokens, bounds: CorrectionBounds) -> torch.Tensor:
    """Truncated token-level importance weight min(pi_old / pi_rollout, U) (TIS)."""
    return torch.clamp(clamped_ratio(tokens.log_ratio), max=bounds.upper)


@ROLLOUT_CORRECTIONS.register("sequence_is")
def sequence_is(tokens: MismatchTokens, bounds: CorrectionBounds) -> torch.Tensor:
    """Truncated sequence-level weight min(prod_t pi_old / pi_rollout, U) on every token of the response."""
    weight = torch.clamp(clamped_ratio(tokens.sequence_log_ratio()), max=bounds.upper)
    return tokens.broadcast(weight).to(tokens.log_ratio.dtype)


@ROLLOUT_CORRECTIONS.register("token_reject")
def token_reject(tokens: MismatchTokens, bounds: CorrectionBounds) -> torch.Tensor:
    """A token whose ratio leaves [L, U] is masked."""
    return bounds.inside(tokens.log_ratio).to(tokens.log_ratio.dtype)


@ROLLOUT_CORRECTIONS.register("sequence_reject")
def sequence_reject(tokens: MismatchTokens, bounds: CorrectionBounds) -> torch.Tensor:
    """A response whose sequence ratio prod_t pi_old / pi_rollout leaves [L, U] is masked whole."""
    keep = bounds.inside(tokens.sequence_log_ratio()).double()
    return tokens.broadcast(keep).to(tokens.log_ratio.dtype)


@ROLLOUT_CORRECTIONS.register("geometric_reject")
def geometric_reject(tokens: MismatchTokens, bounds: CorrectionBounds) -> torch.Tensor:
    """A response whose geometric-mean ratio exp(mean_t d_t) leaves [L, U] is masked whole: unlike the
    sequence ratio it does not grow with the length, so one bound serves short and long responses."""
    mean = tokens.sequence_log_ratio() / tokens.sequence_tokens().clamp(min=1.0)
    return tokens.broadcast(bounds.inside(mean).double()).to(tokens.log_ratio.dtype)


@ROLLOUT_CORRECTIONS.register("icepop")
def icepop(tokens: MismatchTokens, bounds: CorrectionBounds) -> torch.Tensor:
    """IcePop's two-sided token masking: the untruncated ratio inside [L, U], 0 outside."""
    inside = bounds.inside(tokens.log_ratio)
    return torch.where(inside, clamped_ratio(tokens.log_ratio), 0.0).to(tokens.log_ratio.dtype)


@ROLLOUT_CORRECTIONS.register("veto")
def veto(tokens: MismatchTokens, bounds: CorrectionBounds) -> torch.Tensor:
    """A response holding a trained token with pi_old / pi_rollout < L is dropped whole (a token the
    trainer finds catastrophically unlikely: the engine sampled what the trained policy would not)."""
    catastrophic = tokens.trained & (tokens.log_ratio < math.log(bounds.lower))
    vetoed = tokens.per_sequence(catastrophic.double()) > 0
    return tokens.broadcast((~vetoed).double()).to(tokens.log_ratio.dtype)


@dataclass(frozen=True)
class RolloutCorrection:
    """The active corrections, (registered name, bounds) in the order they multiply; () = none."""

    steps: tuple[tuple[str, CorrectionBounds], ...] = ()

    def __post_init__(self) -> None:
        for name, _ in self.steps:
            ROLLOUT_CORRECTIONS.get(name)

    @classmethod
    def from_keys(
        cls,
        *,
        tis_cap: float | None = None,
        seq_is_cap: float | None = None,
        rejection: str | None = None,
        rejection_upper: float | None = None,
        rejection_lower: float | None = None,
        veto_threshold: float | None = None,
    ) -> RolloutCorrection:
        """From the algorithm section's keys (config.py checks their combinations; algo/ never reads it)."""
        steps: list[tuple[str, CorrectionBounds]] = []
        if tis_cap is not None:
            steps.append(("token_is", CorrectionBounds(upper=tis_cap)))
        if seq_is_cap is not None:
            steps.append(("sequence_is", CorrectionBounds(upper=seq_is_cap)))
        if rejection is not None:
            if rejection_upper is None:
                raise ValueError(f"algorithm.rejection={rejection!r} needs algorithm.rejection_upper")
            lower = 1.0 / rejection_upper if rejection_lower is None else rejection_lower
            name = "icepop" if rejection == "icepop" else f"{rejection}_reject"
            steps.append((name, CorrectionBounds(upper=rejection_upper, lower=lower)))
        if veto_threshold is not None:
            steps.append(("veto", CorrectionBounds(lower=veto_threshold)))
        return cls(tuple(steps))

    @property
    def active(self) -> bool:
        return bool(self.steps)

    @property
    def vetoes(self) -> bool:
        return any(name == "veto" for name, _ in self.steps)

    def factors(self, tokens: MismatchTokens) -> dict[str, torch.Tensor]:
        """Each active correction's [N] factors, by name."""
        return {name: ROLLOUT_CORRECTIONS.get(name)(tokens, bounds) for name, bounds in self.steps}

    def factor(self, tokens: MismatchTokens) -> torch.Tensor:
        """[N] the product of the active corrections' factors (1 where none is active)."""
        out = torch.ones_like(tokens.log_ratio)
        for value in self.factors(tokens).values():
            out = out * value
        return out


__all__ = [
    "LOG_RATIO_CLAMP",
    "ROLLOUT_CORRECTIONS",
    "CorrectionBounds",
    "MismatchTokens",
    "RolloutCorrection",
    "RolloutCorrectionFn",
]
