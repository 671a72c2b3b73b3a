"""Pack sequences into token-budget micro-batches, balanced across data-parallel ranks.

`plan_micro_batches` decides, deterministically, which sequences of a mini-batch each DP rank
trains on and how they are grouped into micro-batches: the driver plans the whole step with it
(dataplane/share.py: plan_shares) and sends every DP rank only its share; tests may instead pass
the same list of Samples to every rank, which then plans and keeps its share without talking.
`pack_batch_micro_batch` builds one micro-batch from a tensor RolloutBatch with tensor ops only
(no per-token Python object); `pack_micro_batch` packs Samples through it (tests and tools). Megatron's
schedules need the same number of micro-batches on every DP rank, so the plan gives every rank exactly
`num_micro_batches` of them (a rank with fewer samples than that
gets empty micro-batches: padding only, loss mask 0).

Layout of one packed micro-batch (two samples, prompt p / response r, then a padding tail):

    tokens        [p0 p1 p2 r0 r1 | q0 q1 s0 s1 s2 | PAD PAD]
    position_ids  [0  1  2  3  4  | 0  1  2  3  4  | 0   1  ]   restart at every sequence
    seq_ids       [0  0  0  0  0  | 1  1  1  1  1  | -1  -1 ]   -1 = padding tail
    targets       [p1 p2 r0 r1 0  | q1 s0 s1 s2 0  | 0   0  ]   next token; 0 after a sequence end
    response_mask [0  0  1  1  0  | 0  1  1  1  0  | 0   0  ]   position t predicts response token

Position t predicts targets[t]: response token j of a sample whose prompt has P tokens and which
starts at offset o is scored at position o + P - 1 + j. Every per-token array (loss mask, advantage,
old / rollout / ref log-probs) is aligned to those prediction positions, so the log-prob computed
at position t is directly comparable with old_logprobs[t].

Padding: each sequence may be rounded up to `seq_pad_multiple` tokens (context parallelism needs
a multiple of 2*cp: context_parallel.py), and the whole micro-batch to `pad_multiple` (sequence
parallelism needs a multiple of tp). With pipeline parallelism every micro-batch of a step must have
the same shape (Megatron's p2p send/recv buffers are allocated from one `seq_length`), so
`uniform_length=True` pads all micro-batches of all DP ranks to the longest one, rounded up to
`pad_multiple`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dapo_megatron.dataplane.batch import RolloutBatch, exclusive_cumsum, ranges_index
from dapo_megatron.dataplane.micro_batches import plan_micro_batches, round_up  # noqa: F401 (re-exported)
from dapo_megatron.dataplane.sample import Sample, validate_samples  # noqa: F401 (re-exported)


@dataclass
class MicroBatch:
    """One packed micro-batch: flat [T] tensors (T = padded length) plus its bookkeeping."""

    sample_indices: list[int]  # positions in the mini-batch list, in packing order
    seq_lengths: list[int]  # real tokens of each sequence (prompt + response)
    seq_lengths_padded: list[int]  # each rounded up to seq_pad_multiple
    tokens: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64
    seq_ids: torch.Tensor  # [T] int64, -1 on the padding tail
    targets: torch.Tensor  # [T] int64
    response_mask: torch.Tensor  # [T] bool: position predicts a response token
    loss_mask: torch.Tensor  # [T] float32: response_mask & sample.loss_mask (& not truncated)
    advantages: torch.Tensor  # [T] float32
    old_logprobs: torch.Tensor | None  # [T] float32 (None when a sample has none)
    rollout_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_sequences(self) -> int:
        return len(self.sample_indices)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """[num_seq + 1] int32 offsets of the real tokens of each sequence (THD `cu_seqlens_q`)."""
        return _cumsum(self.seq_lengths)

    @property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """[num_seq + 2] int32 offsets of the padded sequences, with the padding tail as the last
        segment (so the last entry is T): THD `cu_seqlens_q_padded` and the CP split use it."""
        tail = self.length - sum(self.seq_lengths_padded)
        return _cumsum(self.seq_lengths_padded + ([tail] if tail else []))


def _cumsum(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0).to(torch.int32)
    return out


def padded_lengths(samples: list[Sample], seq_pad_multiple: int) -> list[int]:
    return [round_up(s.num_tokens, seq_pad_multiple) for s in samples]


def pack_micro_batch(
    samples: list[Sample],
    indices: list[int],
    *,
    length: int,
    seq_pad_multiple: int = 1,
    pad_token_id: int = 0,
    mask_truncated: bool = False,
) -> MicroBatch:
    """Pack samples[indices] into flat tensors of `length` tokens (layout in the module docstring), in
    that order: pack_batch_micro_batch on their RolloutBatch (the one builder of a MicroBatch), with
    sample_indices naming positions in `samples`.

    mask_truncated: loss mask 0 on samples that hit the generation cap (DAPO's "overlong filtering").
    """
    chosen = RolloutBatch.from_samples([samples[i] for i in indices])
    mb = pack_batch_micro_batch(
        chosen,
        0,
        len(indices),
        length=length,
        seq_pad_multiple=seq_pad_multiple,
        pad_token_id=pad_token_id,
        mask_truncated=mask_truncated,
    )
    mb.sample_indices = list(indices)
    return mb


def pack_batch_micro_batch(
    batch: RolloutBatch,
    start: int,
    stop: int,
    *,
    length: int,
    seq_pad_multiple: int = 1,
    pad_token_id: int = 0,
    mask_truncated: bool = False,
) -> MicroBatch:
    """The micro-batch of sequences start..stop-1 of a RolloutBatch (dataplane/batch.py), `length` tokens
    (layout in the module docstring), with tensor ops only. An empty range gives a padding-only
    micro-batch."""
    part = batch.narrow(start, stop - start)
    n = part.num_sequences
    lens = part.seq_lengths.to(torch.int64)
    padded = -(-lens // seq_pad_multiple) * seq_pad_multiple
    fill = int(padded.sum())
    if fill > length:
        raise ValueError(f"micro-batch of {fill} tokens does not fit the packed length {length}")
    starts = exclusive_cumsum(padded)[:-1]  # where each padded sequence begins
    seq_of = torch.repeat_interleave(torch.arange(n), lens)  # per real token
    dst = ranges_index(starts, lens)  # packed position of every real token
    src = part.tokens.to(torch.int64)

    tokens = torch.full((length,), pad_token_id, dtype=torch.int64)
    tokens[dst] = src
    targets = torch.zeros(length, dtype=torch.int64)
    has_next = (dst - starts[seq_of]) < lens[seq_of] - 1  # not the last token of its sequence
    targets[dst[has_next]] = src[1:][has_next[:-1]] if src.numel() else src
    seq_ids = torch.full((length,), -1, dtype=torch.int64)
    seq_ids[:fill] = torch.repeat_interleave(torch.arange(n), padded)
    # padding inside a padded sequence continues its positions; the tail restarts at 0
    position_ids = torch.zeros(length, dtype=torch.int64)
    position_ids[:fill] = ranges_index(torch.zeros(n, dtype=torch.int64), padded)
    position_ids[fill:] = torch.arange(length - fill)

    response_mask, loss_mask, advantages, per_token = _response_tensors(
        part, starts, length=length, mask_truncated=mask_truncated
    )
    return MicroBatch(
        sample_indices=list(range(start, stop)),
        seq_lengths=lens.tolist(),
        seq_lengths_padded=padded.tolist(),
        tokens=tokens,
        position_ids=position_ids,
        seq_ids=seq_ids,
        targets=targets,
        response_mask=response_mask,
        loss_mask=loss_mask,
        advantages=advantages,
        old_logprobs=per_token["old_logprobs"],
        rollout_logprobs=per_token["rollout_logprobs"],
        ref_logprobs=per_token["ref_logprobs"],
    )


def _response_tensors(
    part: RolloutBatch, starts: torch.Tensor, *, length: int, mask_truncated: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    """(response_mask, loss_mask, advantages, {log-prob field: values or None}) of a micro-batch, each
    [length], at the prediction positions o + P - 1 + j of the sequences that begin at `starts`."""
    response_lengths = part.response_lengths
    response_dst = ranges_index(starts + part.prompt_lengths.to(torch.int64) - 1, response_lengths)

    def scattered(values: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = torch.zeros(length, dtype=dtype)
        out[response_dst] = values
        return out

    mask = part.loss_mask.to(torch.float32) if part.loss_mask is not None else torch.ones(response_dst.numel())
    if mask_truncated:
        mask = mask.masked_fill(torch.repeat_interleave(part.truncated, response_lengths), 0.0)
    per_token: dict[str, torch.Tensor | None] = {}
    for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
        values = getattr(part, name)
        per_token[name] = None if values is None or part.num_sequences == 0 else scattered(values)
    return (
        scattered(torch.ones(response_dst.numel(), dtype=torch.bool), torch.bool),
        scattered(mask),
        scattered(torch.repeat_interleave(part.advantages, response_lengths)),
        per_token,
    )


@dataclass
class PackedShare:
    """What one DP rank trains on: its micro-batches plus mini-batch-wide counts."""

    micro_batches: list[MicroBatch]
    num_micro_batches: int  # the same on every DP rank
    length: int | None  # the shared padded length when uniform_length, else None


def pack_for_rank(
    samples: list[Sample],
    *,
    micro_batch_tokens: int,
    dp_size: int,
    dp_rank: int,
    pad_multiple: int = 1,
    seq_pad_multiple: int = 1,
    uniform_length: bool = False,
    micro_batch_multiple: int = 1,
    pad_token_id: int = 0,
    mask_truncated: bool = False,
) -> PackedShare:
    """Plan the whole mini-batch (identically on every rank) and build this DP rank's micro-batches."""
    validate_samples(samples)
    lengths = padded_lengths(samples, seq_pad_multiple)
    plan = plan_micro_batches(
        lengths, micro_batch_tokens=micro_batch_tokens, dp_size=dp_size, micro_batch_multiple=micro_batch_multiple
    )
    fills = [sum(lengths[i] for i in mb) for share in plan for mb in share]
    shared = round_up(max(max(fills), 1), pad_multiple) if uniform_length else None
    micro_batches = []
    for indices in plan[dp_rank]:
        own = round_up(max(sum(lengths[i] for i in indices), 1), pad_multiple)
        micro_batches.append(
            pack_micro_batch(
                samples,
                indices,
                length=shared or own,
                seq_pad_multiple=seq_pad_multiple,
                pad_token_id=pad_token_id,
                mask_truncated=mask_truncated,
            )
        )
    return PackedShare(micro_batches=micro_batches, num_micro_batches=len(plan[dp_rank]), length=shared)


# --------------------------------------------------------------------------------------------
# The inverse: per-position outputs back to per-sample response lists


def unpack_response_values(values: torch.Tensor, mb: MicroBatch, samples: list[Sample]) -> dict[int, torch.Tensor]:
    """values[T] (a per-position output, e.g. log-probs) -> {sample index: values of its response
    tokens}, read at the prediction positions o + P - 1 + j (module docstring)."""
    out = {}
    offset = 0
    for index, n_pad in zip(mb.sample_indices, mb.seq_lengths_padded):
        s = samples[index]
        first = offset + len(s.prompt_ids) - 1
        out[index] = values[first : first + len(s.response_ids)]
        offset += n_pad
    return out
