"""Evaluation maths: avg@k and pass@k over a [P, k] table of correct (1) / wrong (0) samples.

    avg_at_k(correct)            mean over problems of (correct samples / k): DAPO's "avg@32"
    pass_at_k(correct, k=1)      per problem, the unbiased estimator of P(at least one of k correct)
                                 from n >= k samples (Chen et al. 2021, the HumanEval paper):
                                     pass@k = 1 - C(n - c, k) / C(n, k)
                                 e.g. n = 4, c = 1, k = 2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5
    summarize(correct, ks=(1, 8, 32))  -> {"avg@32": .., "pass@1": .., "pass@8": .., "pass@32": ..}

The `dapo-megatron eval` command (sampling a checkpoint on the eval set) builds on these.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

__all__ = ["avg_at_k", "pass_at_k", "summarize"]


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

    1 - C(n-c, k)/C(n, k) computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which avoids huge binomials:
    C(n-c, k)/C(n, k) = prod_{j=0}^{c-1} (n-k-j)/(n-j), and that product is 0 as soon as n - c < k.
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


def summarize(correct: torch.Tensor | Sequence[Sequence[float]], *, ks: Iterable[int] = (1,)) -> dict[str, float]:
    """{"avg@n": .., "pass@k": .. for each k <= n}: the numbers `eval` writes as JSON."""
    table = _as_correct(correct)
    n = table.shape[1]
    result = {f"avg@{n}": avg_at_k(table)}
    for k in sorted(set(ks) | {n}):
        if k <= n:
            result[f"pass@{k}"] = float(pass_at_k(table, k=k).mean())
    return result
