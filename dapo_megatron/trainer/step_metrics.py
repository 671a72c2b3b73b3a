"""A step's metrics: per-token statistics as tensor maths on each rank's share, reduced over DP;
the mini-batch updates summarised; phase times.

    metrics = old_logprob_metrics(share.batch, old.logprobs, old.entropies, reports=roles.reports)  # collective
    metrics = reduce_updates([actor.train(mini, step=s) for mini in share.mini_batches()])

Each DP replica's reporting rank (last pipeline stage, TP and CP rank 0: it holds its share's
log-probs) sums over its own tokens (whole responses: a share never splits one); one all-reduce
of float64 sums (and one of maxima) over the world adds the replicas (every other rank contributes
zeros), so every rank, the driver included, gets the step's values without any per-token list or
per-token loop.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dapo_megatron.algo.mismatch import (
    MISMATCH_EXTREMES,
    MISMATCH_SUMS,
    group_counts,
    masked_group_metrics,
    mismatch_metrics,
    mismatch_sums,
)
from dapo_megatron.algo.rollout_correction import MismatchTokens, RolloutCorrection
from dapo_megatron.dataplane.batch import RolloutBatch
from dapo_megatron.distributed import collectives as coll


def old_logprob_metrics(
    batch: RolloutBatch,
    logprobs: torch.Tensor | None,
    entropies: torch.Tensor | None,
    *,
    reports: bool,
    correction: RolloutCorrection | None = None,
) -> dict[str, float]:
    """actor/entropy_old: mean entropy of pi_old over the step's response tokens; mismatch/mean and
    mismatch/max: |log pi_trainer - log pi_engine| on the sampled tokens (kernels, precision and
    attention differences between trainer and engine show up here before they show up as
    instability), when the engines returned log-probs, with the KLs, chi-square, effective sample size
    and what the rollout correction (algorithm.tis_cap, rejection, ...) masked (algo/mismatch.py)."""
    correction = correction or RolloutCorrection()
    device = coll.backend_device()  # filled from the actor's tensors, then reduced: no extra copies
    # entropy sum, tokens, |diff| sum, compared tokens, then MISMATCH_SUMS
    sums = torch.zeros(4 + len(MISMATCH_SUMS), dtype=torch.float64, device=device)
    # max |diff|, MISMATCH_EXTREMES, then the step's number of prompt groups
    largest = torch.zeros(2 + len(MISMATCH_EXTREMES), dtype=torch.float64, device=device)
    largest[1:-1] = -torch.inf
    mismatch_tokens = None
    if reports and logprobs is not None and logprobs.numel():
        assert entropies is not None, "the actor returns entropies with its log-probs"
        sums[0] = entropies.double().sum()
        sums[1] = entropies.numel()
        if batch.rollout_logprobs is not None:
            diff = (logprobs.double() - batch.rollout_logprobs.double()).abs()
            sums[2], sums[3] = diff.sum(), diff.numel()
            largest[0] = diff.max()
            mismatch_tokens = _mismatch_tokens(batch, logprobs)
            more, extremes = mismatch_sums(mismatch_tokens, correction)
            sums[4:], largest[1:-1] = more.to(device), extremes.to(device)
            largest[-1] = int(batch.group_index.max()) + 1
    coll.all_reduce(sums)
    coll.all_reduce(largest, op=dist.ReduceOp.MAX)
    entropy_sum, num_tokens, diff_sum, compared = sums[:4].tolist()
    out = {"actor/entropy_old": entropy_sum / num_tokens if num_tokens else 0.0}
    if compared:
        out.update({"mismatch/mean": diff_sum / compared, "mismatch/max": float(largest[0])})
        out.update(mismatch_metrics(sums[4:].tolist(), largest[1:-1].tolist(), correction))
    num_groups = int(largest[-1])
    if correction.active and num_groups:  # the same decision on every rank: a config and a reduced count
        counts = torch.zeros(2, num_groups, dtype=torch.float64)
        if mismatch_tokens is not None:
            counts = group_counts(mismatch_tokens, correction, group_index=batch.group_index, num_groups=num_groups)
        counts = counts.to(device)
        coll.all_reduce(counts)  # a group's responses may sit in several shares
        out.update(masked_group_metrics(counts.cpu()))
    return out


def _mismatch_tokens(batch: RolloutBatch, logprobs: torch.Tensor) -> MismatchTokens:
    """The share's response tokens (whole responses) for algo/mismatch.py, in float64."""
    assert batch.rollout_logprobs is not None
    return MismatchTokens.of(
        old_logprobs=logprobs.double(),
        rollout_logprobs=batch.rollout_logprobs.double(),
        mask=batch.loss_mask if batch.loss_mask is not None else torch.ones(logprobs.numel()),
        seq_ids=batch.response_sequence_index(),
        num_sequences=batch.num_sequences,
    )


class Clock:
    """Seconds of each phase of a step (time/<phase>_s) and of the whole step."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase], self.last = now - self.last, now

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self.laps.items()}
        out["time/step_s"] = self.last - self.start
        return out


def reduce_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """Per-step view of the mini-batch updates: means, except counts (sum) and maxima (max)."""
    if not updates:
        return {"actor/num_updates": 0.0}
    out = {}
    for key in updates[0]:
        values = [u[key] for u in updates]
        if key in ("num_tokens", "nonfinite", "update_skipped"):
            out[f"actor/{key}"] = float(sum(values))
        elif key in ("ratio_max",):
            out[f"actor/{key}"] = float(max(values))
        else:
            out[f"actor/{key}"] = float(sum(values) / len(values))
    out["actor/grad_norm_max"] = float(max(u["grad_norm"] for u in updates))
    out["actor/num_updates"] = float(len(updates))
    return out
