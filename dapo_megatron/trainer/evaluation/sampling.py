"""Sampling a policy on an eval set, for `train` (every trainer.eval_every steps) and `eval`.

    samples = await sample_eval(pool, prompt_ids, records, n=32, ...)   # EvalSamples: [P, n] correct,
                                                                         # answers, tokens, truncated
    report  = eval_report(samples, records, step=120)                   # trainer/evaluation/report.py

The maths (avg@k, unbiased pass@k, maj@k, bootstrap intervals) is dapo_megatron/algo/eval_stats.py;
avg_at_k / pass_at_k / summarize are re-exported here for the callers that knew them here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dapo_megatron.algo.eval_stats import avg_at_k, pass_at_k, summarize
from dapo_megatron.reward import scorer_for_data_source
from dapo_megatron.trainer.checkpoint.files import checkpoint_root, latest_checkpoint

__all__ = ["EvalSamples", "avg_at_k", "pass_at_k", "sample_eval", "summarize"]


@dataclass
class EvalSamples:
    """What n samples per problem of one eval set gave, problem by problem (row i = records[i])."""

    correct: torch.Tensor  # [P, n] float64, 1.0 where the scorer accepts sample j of problem i
    answers: list[list[str]]  # [P][n] the scorer's extracted, normalized answer ("[INVALID]": none found)
    response_tokens: torch.Tensor  # [P, n] int64 generated tokens
    truncated: torch.Tensor  # [P, n] bool: stopped by the max_new_tokens cap (finish_reason "length")


# --------------------------------------------------------------------------------------------------
# Sampling a policy on the eval set (used by `train` every trainer.eval_every steps and by `eval`)


async def sample_eval(
    pool,
    prompt_ids: Sequence[Sequence[int]],
    records: Sequence,
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    stop_token_ids: Sequence[int] = (),
    per_sample_seeds: bool = True,
    on_problem: Callable[[int], None] | None = None,
) -> EvalSamples:
    """n samples of every problem, scored by its record's scorer (reward/: the same one training uses);
    on_problem(k): k problems done so far (a progress line: trainer/progress_line.py).

    Problem i is one request of n items (n = 1 each, rid f"eval-{seed}-{i}-{j}.", as the sampler's);
    where the engines honour seeds, sample j carries sampling_seed seed * 7919 + i + j, so the same
    policy gives the same samples."""
    import asyncio

    params = {
        "n": 1,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": list(stop_token_ids),
    }

    async def one(i: int, ids: Sequence[int], record) -> list[tuple[float, str, int, bool]]:
        first = seed * 7919 + i
        sampling = [{**params, "sampling_seed": first + j} if per_sample_seeds else params for j in range(n)]
        outs = await pool.generate(
            input_ids=[list(ids)] * n, rid=[f"eval-{seed}-{i}-{j}." for j in range(n)], sampling_params=sampling
        )
        rows = _scored(outs, record)
        done.append(i)
        if on_problem is not None:
            on_problem(len(done))
        return rows

    done: list[int] = []

    rows = await asyncio.gather(*(one(i, ids, r) for i, (ids, r) in enumerate(zip(prompt_ids, records))))
    return EvalSamples(
        correct=torch.tensor([[s[0] for s in row] for row in rows], dtype=torch.float64).reshape(len(records), n),
        answers=[[s[1] for s in row] for row in rows],
        response_tokens=torch.tensor([[s[2] for s in row] for row in rows], dtype=torch.int64).reshape(len(records), n),
        truncated=torch.tensor([[s[3] for s in row] for row in rows], dtype=torch.bool).reshape(len(records), n),
    )


def _scored(outs: list[dict], record) -> list[tuple[float, str, int, bool]]:
    """(correct, extracted answer, response tokens, truncated) of each engine output of one problem."""
    scorer = scorer_for_data_source(getattr(record, "data_source", "") or "math_dapo")
    rows = []
    for o in outs:
        result = scorer(o["text"], str(record.ground_truth))
        pred = getattr(result, "pred", None)
        rows.append(
            (
                float(result.acc),
                "" if pred is None else str(pred),
                len(o["output_ids"]),
                o["meta_info"]["finish_reason"]["type"] == "length",
            )
        )
    return rows


def resolve_checkpoint(checkpoint: str) -> tuple[str, str]:
    """(checkpoint directory, HF model directory) of what `eval --checkpoint` names: a run directory
    (its newest complete checkpoints/step_N), a run checkpoint (step_N with hf/ inside) or a HF
    model directory."""
    from pathlib import Path

    path = Path(checkpoint)
    if checkpoint_root(path).is_dir():  # a run directory
        latest = latest_checkpoint(path)
        if latest is None:
            raise ValueError(
                f"--checkpoint {checkpoint}: a run directory without a complete checkpoint "
                f"({checkpoint_root(path)}/step_N with trainer_state.json)"
            )
        path = latest
    for candidate in (path / "hf", path):
        if (candidate / "config.json").is_file():
            return str(path), str(candidate)
    raise ValueError(
        f"--checkpoint {path}: neither it nor {path / 'hf'} holds a HF model (config.json); "
        "run checkpoints have hf/ when trainer.save_hf is true"
    )
