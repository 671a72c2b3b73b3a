"""What one data-parallel rank trains on in a step: its token-balanced share of every mini-batch.

    settings = PackSettings.from_actor_config(cfg.actor)
    plans = plan_shares(batch.seq_lengths, sequences_per_mini_batch=512, settings=settings, dp_size=8)
    share = BatchShare.from_plan(batch, plans[r], step_sequences=batch.num_sequences)  # rank r's share
    for mini in share.mini_batches():                 # one optimizer update each
        for a, b, length in mini.micro_batch_spans(): ...

The step's sequences are cut into mini-batches of consecutive groups (trainer.mini_batch_size
prompts each); each mini-batch is split over the DP ranks exactly as the actor always did
(packing.plan_micro_batches: longest-first token balancing, then the same number of token-budget
micro-batches on every DP rank). A share stores its sequences in packing order, so a micro-batch is
a contiguous range of them and the plan is three small integer tensors. The old-log-prob pass runs
over the same micro-batches as the updates, so the first update of a step recomputes pi_old bit for
bit (ratio exactly 1 on-policy).

Tests and tools may pass the same list of Samples to every rank: `share_of_samples` plans it as one
mini-batch and keeps this rank's part, deterministically and without communication.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dapo_megatron.dataplane.batch import RolloutBatch
from dapo_megatron.dataplane.micro_batches import plan_micro_batches, round_up


@dataclass(frozen=True)
class PackSettings:
    """How the actor packs sequences; derived from the actor's layout so that the driver can plan
    for every DP rank exactly what the ranks' own packing would do."""

    micro_batch_tokens: int
    seq_pad_multiple: int = 1  # each sequence: a multiple of 2*cp under context parallelism
    pad_multiple: int = 1  # each micro-batch: a multiple of tp (sequence parallel) x seq_pad_multiple
    uniform_length: bool = False  # pipeline parallelism: one padded length for a whole mini-batch
    micro_batch_multiple: int = 1  # interleaved pipeline schedule: micro-batches in whole groups of pp

    @classmethod
    def for_layout(
        cls, *, micro_batch_tokens: int, tp: int, pp: int, cp: int, vpp: int | None, sequence_parallel: bool
    ) -> PackSettings:
        seq_pad = 2 * cp if cp > 1 else 1
        return cls(
            micro_batch_tokens=micro_batch_tokens,
            seq_pad_multiple=seq_pad,
            pad_multiple=(tp if sequence_parallel else 1) * seq_pad,
            uniform_length=pp > 1,
            micro_batch_multiple=pp if vpp else 1,
        )

    @classmethod
    def from_actor_config(cls, actor_cfg) -> PackSettings:
        a = actor_cfg
        return cls.for_layout(
            micro_batch_tokens=a.micro_batch_tokens,
            tp=a.tp,
            pp=a.pp,
            cp=a.cp,
            vpp=a.vpp,
            sequence_parallel=a.sequence_parallel,
        )


@dataclass
class SharePlan:
    """One DP rank's part of a step, before any data moves (int64 tensors)."""

    indices: torch.Tensor  # [n] positions in the step batch, in packing order
    micro_batch_sizes: torch.Tensor  # [micro-batches of the step] sequences in each (0: padding only)
    micro_batches_per_mini: torch.Tensor  # [mini-batches] equal on every DP rank
    mini_batch_lengths: torch.Tensor  # [mini-batches] padded length shared by the mini-batch's micro-batches, 0 = own


def plan_shares(
    seq_lengths: torch.Tensor, *, sequences_per_mini_batch: int, settings: PackSettings, dp_size: int
) -> list[SharePlan]:
    """Every DP rank's SharePlan; mini-batches are consecutive runs of sequences_per_mini_batch."""
    if sequences_per_mini_batch < 1:
        raise ValueError(f"sequences per mini-batch must be >= 1, got {sequences_per_mini_batch}")
    s = settings
    lengths = [round_up(n, s.seq_pad_multiple) for n in seq_lengths.tolist()]  # one int per sequence
    order: list[list[int]] = [[] for _ in range(dp_size)]
    sizes: list[list[int]] = [[] for _ in range(dp_size)]
    per_mini: list[int] = []
    mini_lengths: list[int] = []
    for first in range(0, len(lengths), sequences_per_mini_batch):
        part = lengths[first : first + sequences_per_mini_batch]
        plan = plan_micro_batches(
            part, micro_batch_tokens=s.micro_batch_tokens, dp_size=dp_size, micro_batch_multiple=s.micro_batch_multiple
        )
        fills = [sum(part[i] for i in micro) for share in plan for micro in share]
        mini_lengths.append(round_up(max(max(fills), 1), s.pad_multiple) if s.uniform_length else 0)
        per_mini.append(len(plan[0]))
        for rank, share in enumerate(plan):
            for micro in share:
                order[rank].extend(first + i for i in micro)
                sizes[rank].append(len(micro))
    return [
        SharePlan(
            indices=torch.tensor(order[r], dtype=torch.int64),
            micro_batch_sizes=torch.tensor(sizes[r], dtype=torch.int64),
            micro_batches_per_mini=torch.tensor(per_mini, dtype=torch.int64),
            mini_batch_lengths=torch.tensor(mini_lengths, dtype=torch.int64),
        )
        for r in range(dp_size)
    ]


@dataclass
class BatchShare:
    """This DP rank's sequences (packing order) and how they form micro- and mini-batches."""

    batch: RolloutBatch
    micro_batch_sizes: torch.Tensor
    micro_batches_per_mini: torch.Tensor
    mini_batch_lengths: torch.Tensor
    step_sequences: int  # sequences of the whole step over every DP rank (0: nothing to train on)
    source_indices: torch.Tensor | None = None  # positions in the step batch (None on a received share)

    @classmethod
    def from_plan(cls, batch: RolloutBatch, plan: SharePlan, *, step_sequences: int) -> BatchShare:
        return cls(
            batch=batch.select(plan.indices),
            micro_batch_sizes=plan.micro_batch_sizes,
            micro_batches_per_mini=plan.micro_batches_per_mini,
            mini_batch_lengths=plan.mini_batch_lengths,
            step_sequences=step_sequences,
            source_indices=plan.indices,
        )

    @property
    def num_mini_batches(self) -> int:
        return int(self.micro_batches_per_mini.numel())

    def mini_batches(self) -> Iterator[BatchShare]:
        """One share per optimizer update (views of this one)."""
        micro_start = seq_start = 0
        for j, count in enumerate(self.micro_batches_per_mini.tolist()):
            sizes = self.micro_batch_sizes[micro_start : micro_start + count]
            num = int(sizes.sum())
            yield BatchShare(
                batch=self.batch.narrow(seq_start, num),
                micro_batch_sizes=sizes,
                micro_batches_per_mini=self.micro_batches_per_mini[j : j + 1],
                mini_batch_lengths=self.mini_batch_lengths[j : j + 1],
                step_sequences=self.step_sequences,
                source_indices=None
                if self.source_indices is None
                else self.source_indices[seq_start : seq_start + num],
            )
            micro_start += count
            seq_start += num

    def micro_batch_spans(self, settings: PackSettings) -> list[tuple[int, int, int]]:
        """(first sequence, end, padded length) of each micro-batch of a one-mini-batch share."""
        if self.num_mini_batches != 1:
            raise ValueError(
                f"micro_batch_spans: the share holds {self.num_mini_batches} mini-batches; "
                "iterate share.mini_batches() first"
            )
        shared = int(self.mini_batch_lengths[0])
        padded = -(-self.batch.seq_lengths.to(torch.int64) // settings.seq_pad_multiple) * settings.seq_pad_multiple
        spans, start = [], 0
        for size in self.micro_batch_sizes.tolist():
            fill = int(padded[start : start + size].sum())
            spans.append((start, start + size, shared or round_up(max(fill, 1), settings.pad_multiple)))
            start += size
        return spans


def share_of_samples(samples: Sequence, *, settings: PackSettings, dp_size: int, dp_rank: int) -> BatchShare:
    """This DP rank's share of a list of Samples that every rank holds, as one mini-batch (no
    communication: every rank plans the same list identically)."""
    batch = RolloutBatch.from_samples(samples)
    plans = plan_shares(
        batch.seq_lengths, sequences_per_mini_batch=max(batch.num_sequences, 1), settings=settings, dp_size=dp_size
    )
    return BatchShare.from_plan(batch, plans[dp_rank], step_sequences=batch.num_sequences)
