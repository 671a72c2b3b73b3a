"""Evaluation statistics (docs/algorithm.md, "Evaluation"): lists/tensors and scalars in, numbers out.

    avg_at_k(correct_PN)                  mean over problems of c_i / n (DAPO's "avg@32")
    pass_at_k(correct_PN, k=j)            [P] unbiased pass@j per problem (Chen et al. 2021):
                                              1 - C(n - c, j) / C(n, j)
                                          e.g. n = 4, c = 1, j = 2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5
    pass_ks(n)                            the j reported: 1, 2, 4, ... below n, then n  (n = 8: 1, 2, 4, 8)
    majority_correct(answers, correct)    maj@k of one problem: the most frequent answer's correctness;
                                          a tie scores the fraction of the tied answers that are correct
    bootstrap_mean_ci(values_P)           95% percentile-bootstrap interval of the mean over problems
    paired_bootstrap_diff(a_P, b_P)       mean(b - a) and its 95% interval, the same problems resampled for both

Bootstrap method (the one rule both intervals follow, so that anyone can reproduce a number):
  idx[B, P] = torch.randint(0, P, (B, P), generator=torch.Generator().manual_seed(seed))   # B >= 2000
  means[b]  = mean_p values[idx[b, p]]                 (float64)
  sorted    = sort(means)
  interval  = [sorted[floor(B * a)], sorted[ceil(B * (1 - a)) - 1]]  with a = (1 - level) / 2
With B = 2000 and level 0.95: [sorted[50], sorted[1949]]. Only problems are resampled: each problem's
accuracy c_i / n is held at its observed value (its sampling noise is inside that value).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "avg_at_k",
    "pass_at_k",
    "pass_ks",
    "summarize",
    "majority_correct",
    "bootstrap_means",
    "bootstrap_mean_ci",
    "paired_bootstrap_diff",
    "BOOTSTRAP_RESAMPLES",
    "BOOTSTRAP_SEED",
    "CI_LEVEL",
]

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0  # fixed: an interval is a function of the eval's results only
CI_LEVEL = 0.95


def _as_correct(correct: torch.Tensor | Sequence[Sequence[float]]) -> torch.Tensor:
    table = torch.as_tensor(correct, dtype=torch.float64)
    if table.dim() != 2 or table.shape[0] == 0 or table.shape[1] == 0:
        raise ValueError(f"correct must be a non-empty [problems, samples] table, got shape {tuple(table.shape)}")
    if not bool(((table == 0) | (table == 1)).all()):
        raise ValueError("correct must hold only 0/1 (or False/True) per sample")
    return table


def avg_at_k(correct: torch.Tensor | Sequence[Sequence[float]]) -> float:
    """Mean accuracy over all problems and all k samples each (every problem weighs the same)."""
    return float(_as_correct(correct).mean(dim=1).mean())


def pass_at_k(correct: torch.Tensor | Sequence[Sequence[float]], *, k: int) -> torch.Tensor:
    """[P] float64 unbiased pass@k per problem, from each problem's n samples (k <= n).

    1 - C(n-c, k)/C(n, k) as a product, never as binomials (C(32, 16) is 6e8; at n in the thousands
    they overflow a float): C(n-c, k)/C(n, k) = prod_{j=0}^{c-1} (n-k-j)/(n-j), which is 0 as soon as
    n - c < k (some factor is then 0: every size-k subset holds a correct sample).
    """
    table = _as_correct(correct)
    n = table.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, number of samples per problem = {n}]")
    out = torch.empty(table.shape[0], dtype=torch.float64)
    for i, c in enumerate(table.sum(dim=1).round().long().tolist()):
        if n - c < k:
            out[i] = 1.0
            continue
        miss = 1.0  # probability that k samples drawn without replacement are all wrong
        for j in range(c):
            miss *= (n - k - j) / (n - j)
        out[i] = 1.0 - miss
    return out


def pass_ks(n: int) -> list[int]:
    """The j of pass@j an eval reports: the powers of two below n, then n itself (n = 32: 1, 2, 4, 8, 16, 32)."""
    if n < 1:
        raise ValueError(f"pass_ks: n={n} must be >= 1")
    return [2**e for e in range(max(0, math.ceil(math.log2(n)))) if 2**e < n] + [n]


def summarize(correct: torch.Tensor | Sequence[Sequence[float]], *, ks: Iterable[int] = (1,)) -> dict[str, float]:
    """{"avg@n": .., "pass@k": .. for each k <= n and k = n}."""
    table = _as_correct(correct)
    n = table.shape[1]
    result = {f"avg@{n}": avg_at_k(table)}
    for k in sorted(set(ks) | {n}):
        if k <= n:
            result[f"pass@{k}"] = float(pass_at_k(table, k=k).mean())
    return result


def majority_correct(answers: Sequence[str], correct: Sequence[float], *, abstain: str | None = None) -> float:
    """maj@k of one problem: 1.0 if the most frequent answer is correct, 0.0 if not.

    Tie rule: when several answers share the highest count, the score is the fraction of those tied
    answers that are correct (the expected score of breaking the tie uniformly at random), so it does
    not depend on the order of the samples: votes {"7": 2, "9": 2} with "7" correct -> 0.5.
    Samples whose answer is `abstain` (the scorer's "no answer found") do not vote; with no vote at
    all the score is 0. An answer's correctness is the mean over its samples (the scorer gives the
    same answer the same verdict, so this is 0 or 1)."""
    if len(answers) != len(correct):
        raise ValueError(f"majority_correct: {len(answers)} answers but {len(correct)} correct flags")
    votes: Counter[str] = Counter()
    right: dict[str, float] = {}
    for answer, ok in zip(answers, correct):
        if abstain is not None and answer == abstain:
            continue
        votes[answer] += 1
        right[answer] = right.get(answer, 0.0) + float(ok)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, count in votes.items() if count == top]
    return sum(right[a] / votes[a] for a in tied) / len(tied)


def bootstrap_means(
    values: torch.Tensor | Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> torch.Tensor:
    """[resamples] float64 means of `values` over problems drawn with replacement (the module's rule)."""
    v = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    if v.numel() == 0:
        raise ValueError("bootstrap: no problems to resample")
    if resamples < 1:
        raise ValueError(f"bootstrap: resamples={resamples} must be >= 1")
    idx = torch.randint(0, v.numel(), (resamples, v.numel()), generator=torch.Generator().manual_seed(seed))
    return v[idx].mean(dim=1)


def _percentile_interval(means: torch.Tensor, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"bootstrap: level={level} must be in (0, 1)")
    ordered = torch.sort(means).values
    b, tail = ordered.numel(), (1 - level) / 2
    low = min(int(math.floor(b * tail + 1e-9)), b - 1)
    high = max(int(math.ceil(b * (1 - tail) - 1e-9)) - 1, 0)
    return float(ordered[low]), float(ordered[high])


def bootstrap_mean_ci(
    values: torch.Tensor | Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = CI_LEVEL,
) -> tuple[float, float]:
    """[low, high]: the percentile-bootstrap interval of the mean of per-problem values (e.g. c_i / n)."""
    return _percentile_interval(bootstrap_means(values, resamples=resamples, seed=seed), level)


def paired_bootstrap_diff(
    a: torch.Tensor | Sequence[float],
    b: torch.Tensor | Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = CI_LEVEL,
) -> dict[str, float | str]:
    """mean(b) - mean(a) over the same problems (a[i] and b[i] are problem i's scores under A and B)
    and its paired-bootstrap interval: every resample draws problems once and uses them for both, so
    the spread of problem difficulty (shared by A and B) cancels. "verdict" is "B better" when the
    whole interval is above 0, "B worse" when below, else "no clear difference"."""
    va, vb = (torch.as_tensor(x, dtype=torch.float64).reshape(-1) for x in (a, b))
    if va.numel() != vb.numel():
        raise ValueError(f"paired bootstrap: {va.numel()} problems in A but {vb.numel()} in B")
    diff = vb - va
    low, high = _percentile_interval(bootstrap_means(diff, resamples=resamples, seed=seed), level)
    verdict = "B better" if low > 0 else "B worse" if high < 0 else "no clear difference"
    return {"diff": float(diff.mean()), "low": low, "high": high, "verdict": verdict}
