"""The trainer-engine mismatch of a step, measured on the responses it trains (docs/algorithm.md 11), and
what the rollout corrections did to them.

With d_t = log pi_old(y_t) - log pi_rollout(y_t) on the trained tokens (samples from pi_rollout),
rho_t = exp(d_t) and S_i = sum_t d_t of response i (n tokens, m responses; exponentials of log ratios
clamped at +-20):

    mismatch/k1            sum_t -d_t / n                        KL(rollout || trainer), k1 estimate
    mismatch/k3            sum_t (rho_t - 1 - d_t) / n           the same KL, k3 (>= 0, lower variance)
    mismatch/log_ppl_diff  sum_i mean_t(-d_t) / m                log-perplexity, trainer minus engine
    mismatch/chi2_token    sum_t rho_t^2 / n - 1                 chi-square divergence, per token
    mismatch/chi2_seq      sum_i exp(S_i)^2 / m - 1              ... per response
    mismatch/ess_token     (sum_t rho_t)^2 / (n sum_t rho_t^2)   effective sample size of the raw ratios, in (0, 1]
    mismatch/ratio_max, ratio_min                               the extreme rho_t
and with a correction active (c_t: its per-token factor, algo/rollout_correction.py):
    correction/weight_mean, ess                                 mean c_t, (sum c)^2 / (n sum c^2)
    correction/weight_max, weight_min                           over the tokens it kept (c_t > 0)
    correction/masked_token_frac, masked_response_frac          c_t = 0 (a response: on all its tokens)
    correction/vetoed_response_frac                             dropped by the veto
    correction/masked_groups, masked_group_frac                 prompt groups none of whose responses trains

Every value is a ratio of SUMS (mismatch_sums), so each data-parallel rank sums over its share of
whole responses, one all-reduce adds the shares (and one MAX the extremes), and mismatch_metrics divides:
the step's value, not a mean of per-rank means.
"""

from __future__ import annotations

import torch

from dapo_megatron.algo.off_policy import clamped_ratio
from dapo_megatron.algo.rollout_correction import MismatchTokens, RolloutCorrection

# mismatch_sums' first tensor, in this order (summed over ranks)
MISMATCH_SUMS = (
    "tokens",
    "neg_log_ratio",
    "k3",
    "responses",
    "log_ppl_diff",
    "ratio",
    "ratio_sq",
    "seq_ratio_sq",
    "weight",
    "weight_sq",
    "masked_tokens",
    "masked_responses",
    "vetoed_responses",
)
# its second tensor (max over ranks; a minimum is carried negated)
MISMATCH_EXTREMES = ("ratio_max", "neg_ratio_min", "weight_max", "neg_weight_min")


def mismatch_sums(tokens: MismatchTokens, correction: RolloutCorrection) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 [len(MISMATCH_SUMS)] sums, float64 [len(MISMATCH_EXTREMES)] extremes, -inf when empty) of
    whole responses."""
    trained = tokens.trained
    d = tokens.log_ratio.double()
    rho = clamped_ratio(d)
    sums = torch.zeros(len(MISMATCH_SUMS), dtype=torch.float64)
    extremes = torch.full((len(MISMATCH_EXTREMES),), -torch.inf, dtype=torch.float64)
    n_seq = tokens.sequence_tokens()
    real = n_seq > 0  # responses with a trained token
    sum_d = tokens.sequence_log_ratio()

    def total(values: torch.Tensor) -> torch.Tensor:
        return torch.where(trained, values, 0.0).sum()

    sums[0] = trained.sum()
    sums[1] = total(-d)
    sums[2] = total(rho - 1.0 - d)
    sums[3] = real.sum()
    sums[4] = (-sum_d[real] / n_seq[real]).sum()
    sums[5] = total(rho)
    sums[6] = total(rho * rho)
    sums[7] = (clamped_ratio(sum_d[real]) ** 2).sum()
    if trained.any():
        extremes[0] = rho[trained].max()
        extremes[1] = -rho[trained].min()
    if correction.active:
        factors = correction.factors(tokens)
        c = torch.ones_like(d)
        for value in factors.values():
            c = c * value.double()
        kept = trained & (c > 0)
        sums[8] = total(c)
        sums[9] = total(c * c)
        sums[10] = (trained & (c == 0)).sum()
        sums[11] = (real & (tokens.per_sequence(kept.double()) == 0)).sum()
        if "veto" in factors:
            sums[12] = (real & (tokens.per_sequence((factors["veto"] == 0).double()) > 0)).sum()
        if kept.any():
            extremes[2] = c[kept].max()
            extremes[3] = -c[kept].min()
    return sums, extremes


def group_counts(
    tokens: MismatchTokens, correction: RolloutCorrection, *, group_index: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """float64 [2, num_groups]: per prompt group (group_index: each response's, 0..num_groups-1), its
    responses with a trained token and how many of them the correction masked on every token. Summed over
    ranks (a group's responses may sit in several data-parallel shares); a group whose two counts are equal
    trains nothing, as if dynamic sampling had dropped it (masked_group_metrics)."""
    out = torch.zeros(2, num_groups, dtype=torch.float64)
    real = tokens.sequence_tokens() > 0
    kept = tokens.trained & (correction.factor(tokens) > 0)
    masked = real & (tokens.per_sequence(kept.double()) == 0)
    index = group_index.to(torch.int64)
    out[0].index_add_(0, index, real.double())
    out[1].index_add_(0, index, masked.double())
    return out


def masked_group_metrics(counts: torch.Tensor) -> dict[str, float]:
    """correction/masked_groups and masked_group_frac from group_counts summed over every rank."""
    present = counts[0] > 0
    masked = present & (counts[1] == counts[0])
    groups = int(present.sum())
    return {
        "correction/masked_groups": float(masked.sum()),
        "correction/masked_group_frac": float(masked.sum()) / groups if groups else 0.0,
    }


def mismatch_metrics(sums: list[float], extremes: list[float], correction: RolloutCorrection) -> dict[str, float]:
    """The step's metrics from mismatch_sums added over every rank (and its extremes' maxima)."""
    s = dict(zip(MISMATCH_SUMS, sums))
    e = dict(zip(MISMATCH_EXTREMES, extremes))
    n, m = s["tokens"], s["responses"]
    if n == 0:
        return {}
    out = {
        "mismatch/k1": s["neg_log_ratio"] / n,
        "mismatch/k3": s["k3"] / n,
        "mismatch/log_ppl_diff": s["log_ppl_diff"] / m,
        "mismatch/chi2_token": s["ratio_sq"] / n - 1.0,
        "mismatch/chi2_seq": s["seq_ratio_sq"] / m - 1.0,
        "mismatch/ess_token": s["ratio"] ** 2 / (n * s["ratio_sq"]),
        "mismatch/ratio_max": e["ratio_max"],
        "mismatch/ratio_min": -e["neg_ratio_min"],
    }
    if correction.active:
        out.update(
            {
                "correction/weight_mean": s["weight"] / n,
                "correction/ess": s["weight"] ** 2 / (n * s["weight_sq"]) if s["weight_sq"] > 0 else 0.0,
                "correction/masked_token_frac": s["masked_tokens"] / n,
                "correction/masked_response_frac": s["masked_responses"] / m,
            }
        )
        if correction.vetoes:
            out["correction/vetoed_response_frac"] = s["vetoed_responses"] / m
        if e["weight_max"] > -torch.inf:
            out["correction/weight_max"] = e["weight_max"]
            out["correction/weight_min"] = -e["neg_weight_min"]
    return out
