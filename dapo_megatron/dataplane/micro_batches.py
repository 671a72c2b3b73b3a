"""How a step's sequences form micro-batches: longest-first token balancing over the data-parallel ranks,
then the same number of token-budget micro-batches on every rank. Lengths in, index lists out (the
actor packs the tensors: actor/packing.py; the scatter plans each rank's share: dataplane/share.py).
"""

from __future__ import annotations

import math


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# --------------------------------------------------------------------------------------------
# Planning: which samples go to which DP rank and micro-batch (pure, deterministic)


def plan_micro_batches(
    lengths: list[int], *, micro_batch_tokens: int, dp_size: int, micro_batch_multiple: int = 1
) -> list[list[list[int]]]:
    """Split sample indices into `plan[dp_rank][micro_batch] -> [sample indices]`.

    1. DP shares: longest-first greedy (LPT): each sample, longest first (ties: lower index), goes to
       the rank holding the fewest tokens so far (ties: fewer samples, then lower rank). The token
       imbalance is at most one sequence.
    2. The number of micro-batches M is the smallest count, starting from the lower bound
       max_rank ceil(tokens_rank / budget), for which every rank's share fits into M micro-batches
       of at most `micro_batch_tokens` tokens: first by LPT into the least-filled micro-batch
       (balanced lengths, which matters when PP pads them all to the longest), else by
       first-fit-decreasing. M grows by one until both fail on no rank; M = the largest share always
       fits (one sample per micro-batch).
    Inside a micro-batch, samples keep their mini-batch order. M is a multiple of
    `micro_batch_multiple`: megatron's interleaved pipeline schedule (virtual pipeline stages) takes
    the micro-batches in groups of pp per model chunk and refuses a last group smaller than pp
    (schedules.forward_backward_pipelining_with_interleaving), so the actor asks for multiples of pp;
    a micro-batch may then be empty (all padding, no trained token) when a rank has fewer sequences.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if micro_batch_multiple < 1:
        raise ValueError(f"micro_batch_multiple must be >= 1, got {micro_batch_multiple}")
    if micro_batch_tokens < 1:
        raise ValueError(f"actor.micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    for index, length in enumerate(lengths):
        if length > micro_batch_tokens:
            raise ValueError(
                f"sample {index} has {length} tokens (prompt + response, after padding), more than "
                f"actor.micro_batch_tokens={micro_batch_tokens}: raise the budget or cap the lengths"
            )
        if length < 1:
            raise ValueError(f"sample {index} has {length} tokens; a sequence needs at least one")

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for i in order:
        rank = min(range(dp_size), key=lambda r: (load[r], len(shares[r]), r))
        shares[rank].append(i)  # stays sorted longest-first
        load[rank] += lengths[i]

    lower = max(1, max(math.ceil(tokens / micro_batch_tokens) for tokens in load))
    num_micro = round_up(lower, micro_batch_multiple)
    while True:
        plan = []
        for share in shares:
            bins = _fill_balanced(share, lengths, num_micro, micro_batch_tokens)
            if bins is None:
                bins = _fill_first_fit(share, lengths, num_micro, micro_batch_tokens)
            if bins is None:
                break
            plan.append([sorted(b) for b in bins])
        if len(plan) == dp_size:
            return plan
        num_micro += micro_batch_multiple


def _fill_balanced(items: list[int], lengths: list[int], num_bins: int, budget: int) -> list[list[int]] | None:
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    fill = [0] * num_bins
    for i in items:
        fits = [b for b in range(num_bins) if fill[b] + lengths[i] <= budget]
        if not fits:
            return None
        b = min(fits, key=lambda k: (fill[k], k))
        bins[b].append(i)
        fill[b] += lengths[i]
    return bins


def _fill_first_fit(items: list[int], lengths: list[int], num_bins: int, budget: int) -> list[list[int]] | None:
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    fill = [0] * num_bins
    for i in items:
        b = next((k for k in range(num_bins) if fill[k] + lengths[i] <= budget), None)
        if b is None:
            return None
        bins[b].append(i)
        fill[b] += lengths[i]
    return bins


# --------------------------------------------------------------------------------------------
# Building the tensors
