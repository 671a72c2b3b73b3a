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

from dapo_megatron.algo.mismatch import MISMATCH_EXTREMES, MISMATCH_SUMS, mismatch_metrics, mismatch_sums
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
    largest = torch.zeros(1 + len(MISMATCH_EXTREMES), dtype=torch.float64, device=device)
    largest[1:] = -torch.inf
    if reports and logprobs is not None and logprobs.numel():
        assert entropies is not None, "the actor returns entropies with its log-probs"
        sums[0] = entropies.double().sum()
        sums[1] = entropies.numel()
        if batch.rollout_logprobs is not None:
            diff = (logprobs.double() - batch.rollout_logprobs.double()).abs()
            sums[2], sums[3] = diff.sum(), diff.numel()
            largest[0] = diff.max()
            tokens = MismatchTokens.of(
                old_logprobs=logprobs.double(),
                rollout_logprobs=batch.rollout_logprobs.double(),
                mask=batch.loss_mask if batch.loss_mask is not None else torch.ones(logprobs.numel()),
                seq_ids=batch.response_sequence_index(),
                num_sequences=batch.num_sequences,
            )
            more, extremes = mismatch_sums(tokens, correction)
            sums[4:], largest[1:] = more.to(device), extremes.to(device)
    coll.all_reduce(sums)
    coll.all_reduce(largest, op=dist.ReduceOp.MAX)
    entropy_sum, tokens, diff_sum, compared = sums[:4].tolist()
    out = {"actor/entropy_old": entropy_sum / tokens if tokens else 0.0}
    if compared:
        out.update({"mismatch/mean": diff_sum / compared, "mismatch/max": float(largest[0])})
        out.update(mismatch_metrics(sums[4:].tolist(), largest[1:].tolist(), correction))
    return out


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
