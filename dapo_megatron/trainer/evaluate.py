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
    C(n-c, k)/C(n, k) = prod_{j=0}^{c-1} (n-k-j)/(n-j), and that product is 0 as n - c < k.
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


# --------------------------------------------------------------------------------------------------
# Sampling a policy on the eval set (used by `train` every trainer.eval_every steps and by `eval`)


async def sample_correct(pool, prompt_ids: Sequence[Sequence[int]], records: Sequence, *, n: int, temperature: float,
                         top_p: float, max_new_tokens: int, seed: int, stop_token_ids: Sequence[int] = (),
                         per_sample_seeds: bool = True) -> torch.Tensor:
    """[P, n] float64 table: 1.0 where sample j of problem i is correct under its record's scorer.

    Problem i is one request of n items (n = 1 each, rid f"eval-{seed}-{i}-{j}.", as the sampler's);
    where the engines honour seeds, sample j carries sampling_seed seed * 7919 + i + j, so the same
    policy gives the same table."""
    import asyncio

    from dapo_megatron.reward import scorer_for_data_source

    params = {"n": 1, "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
              "stop_token_ids": list(stop_token_ids)}

    async def one(i: int, ids: Sequence[int], record) -> list[float]:
        first = seed * 7919 + i
        sampling = [{**params, "sampling_seed": first + j} if per_sample_seeds else params for j in range(n)]
        outs = await pool.generate(input_ids=[list(ids)] * n, rid=[f"eval-{seed}-{i}-{j}." for j in range(n)],
                                   sampling_params=sampling)
        scorer = scorer_for_data_source(getattr(record, "data_source", "") or "math_dapo")
        return [float(scorer(o["text"], str(record.ground_truth)).acc) for o in outs]

    rows = await asyncio.gather(*(one(i, ids, r) for i, (ids, r) in enumerate(zip(prompt_ids, records))))
    return torch.tensor(rows, dtype=torch.float64).reshape(len(records), n)


def eval_metrics(correct: torch.Tensor) -> dict[str, float]:
    """The names trainer/train.py logs: avg@k / pass@k with k = samples per problem, and pass@1."""
    n = correct.shape[1]
    summary = summarize(correct, ks=(1, n))
    return {"eval/avg@k": summary[f"avg@{n}"], "eval/pass@k": summary[f"pass@{n}"], "eval/pass@1": summary["pass@1"],
            "eval/k": float(n), "eval/num_prompts": float(correct.shape[0])}


def resolve_checkpoint(checkpoint: str) -> tuple[str, str]:
    """(checkpoint directory, HF model directory) of what `eval --checkpoint` names: a run directory
    (its newest complete checkpoints/step_N), a run checkpoint (step_N with hf/ inside) or a HF
    model directory."""
    from pathlib import Path

    from dapo_megatron.trainer.run_checkpoint import checkpoint_root, latest_checkpoint

    path = Path(checkpoint)
    if checkpoint_root(path).is_dir():  # a run directory
        latest = latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"--checkpoint {checkpoint}: a run directory without a complete checkpoint "
                             f"({checkpoint_root(path)}/step_N with trainer_state.json)")
        path = latest
    for candidate in (path / "hf", path):
        if (candidate / "config.json").is_file():
            return str(path), str(candidate)
    raise ValueError(f"--checkpoint {path}: neither it nor {path / 'hf'} holds a HF model (config.json); "
                     "run checkpoints have hf/ when trainer.save_hf is true")
