"""A step's scored responses as flat tensors: built once on the driver, split per data-parallel rank.

    batch = RolloutBatch.from_groups(groups)          # driver, after rewards and advantages
    part = batch.select(torch.tensor([4, 0, 7]))       # sequences 4, 0, 7 (a DP share), copies
    view = batch.narrow(2, 5)                          # sequences 2..6, views (a mini-batch)

Layout (N sequences, T tokens, R response tokens; sequence i has P_i prompt and R_i response tokens):

    tokens            int32 [T]   prompt then response ids of sequence 0, then of sequence 1, ...
    seq_lengths       int32 [N]   P_i + R_i
    prompt_lengths    int32 [N]   P_i
    group_index       int32 [N]   the GRPO group (responses of one prompt)
    rewards           fp32  [N]   final reward (score + overlong shaping)
    advantages        fp32  [N]   broadcast to every response token by the packing
    truncated         bool  [N]   generation hit the cap (overlong filtering masks these)
    loss_mask         uint8 [R] | None      None: every response token trains
    rollout_logprobs  fp32  [R] | None      the engine's log-probs of the response tokens
    old_logprobs      fp32  [R] | None      pi_old, filled on the ranks that compute it (Actor.logprobs)
    ref_logprobs      fp32  [R] | None      the KL reference's, likewise
    token_fields      {name: [T, ...]}      optional per-token extras, cut and sent along with `tokens`;
                                            "routed_experts": int16 [T, layers x top-k], the engine's
                                            experts of the token at each position (MoE routing replay),
                                            -1 where the engine reported none (the last token of each
                                            sequence: SGLang reports prompt + output - 1 rows)

Response tokens of sequence i are tokens[o_i + P_i : o_i + P_i + R_i] (o = seq_offsets) and
response-token fields[r_i : r_i + R_i] (r = response_offsets). Once a batch is built no per-token
Python object exists: every operation here is a tensor op. fp32 log-probs lose nothing: SGLang and
the CPU engine compute them in fp32, and the actor packed them into fp32 tensors anyway. Token ids
are int32 (vocabularies are < 2^31; half the bytes of int64 on the wire).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from dapo_megatron.dataplane.sample import validate_samples

SEQUENCE_FIELDS = ("seq_lengths", "prompt_lengths", "group_index", "rewards", "advantages", "truncated")
RESPONSE_FIELDS = ("loss_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs")


def exclusive_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    """[n] -> [n + 1] int64 offsets: [3, 2] -> [0, 3, 5]."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(lengths.to(torch.int64), 0)
    return out


def ranges_index(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(s, s + n) for each (s, n), as one int64 tensor (no Python loop)."""
    lengths = lengths.to(torch.int64)
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    offsets = exclusive_cumsum(lengths)[:-1]
    within = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(offsets, lengths)
    return torch.repeat_interleave(starts.to(torch.int64), lengths) + within


@dataclass
class RolloutBatch:
    tokens: torch.Tensor
    seq_lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    group_index: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    truncated: torch.Tensor
    loss_mask: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    token_fields: dict[str, torch.Tensor] = field(default_factory=dict)

    # --- sizes ---------------------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return int(self.seq_lengths.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def response_lengths(self) -> torch.Tensor:
        return (self.seq_lengths - self.prompt_lengths).to(torch.int64)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_lengths.sum())

    @property
    def seq_offsets(self) -> torch.Tensor:
        return exclusive_cumsum(self.seq_lengths)

    @property
    def response_offsets(self) -> torch.Tensor:
        return exclusive_cumsum(self.response_lengths)

    def response_token_index(self) -> torch.Tensor:
        """[R] positions in `tokens` of every response token, in response-field order."""
        return ranges_index(self.seq_offsets[:-1] + self.prompt_lengths, self.response_lengths)

    def response_sequence_index(self) -> torch.Tensor:
        """[R] the sequence each response token belongs to."""
        return torch.repeat_interleave(torch.arange(self.num_sequences), self.response_lengths)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the batch holds, by name (token fields as `token_fields.<name>`)."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "token_fields" and getattr(self, f.name) is not None
        }
        out.update({f"token_fields.{k}": v for k, v in self.token_fields.items()})
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    # --- building ------------------------------------------------------------------------------------
    @classmethod
    def from_groups(cls, groups: Sequence[Sequence]) -> RolloutBatch:
        """From the sampler's groups of Samples (group index = position of the group)."""
        samples = [s for g in groups for s in g]
        index = [gi for gi, g in enumerate(groups) for _ in g]
        return cls.from_samples(samples, group_index=index)

    @classmethod
    def from_samples(cls, samples: Sequence, *, group_index: Sequence[int] | None = None) -> RolloutBatch:
        """Tensors from Samples (dapo_megatron.dataplane.sample.Sample): the one place per-token Python lists
        are read. ValueError names the sample and the field of a record the actor cannot train on."""
        validate_samples(samples)
        ids = [torch.tensor(s.prompt_ids, dtype=torch.int32) for s in samples]
        ids += [torch.tensor(s.response_ids, dtype=torch.int32) for s in samples]
        n = len(samples)
        prompts, responses = ids[:n], ids[n:]
        pieces = [t for pair in zip(prompts, responses) for t in pair]
        tokens = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int32)
        batch = cls(
            tokens=tokens,
            seq_lengths=torch.tensor([s.num_tokens for s in samples], dtype=torch.int32),
            prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.int32),
            group_index=torch.tensor(
                list(group_index) if group_index is not None else [s.group_index for s in samples], dtype=torch.int32
            ),
            rewards=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
            advantages=torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32),
            truncated=torch.tensor([bool(s.truncated) for s in samples], dtype=torch.bool),
        )
        if any(s.loss_mask is not None for s in samples):
            batch.loss_mask = torch.cat([torch.tensor(s.response_mask(), dtype=torch.uint8) for s in samples])
        for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs"):
            setattr(batch, name, _response_field(samples, name))
        experts = _routed_experts_field(samples)
        if experts is not None:
            batch.token_fields["routed_experts"] = experts
        return batch

    # --- cutting -------------------------------------------------------------------------------------
    def select(self, indices: torch.Tensor) -> RolloutBatch:
        """The sequences at `indices` (int64 [k], any order), as a new batch (copies)."""
        indices = indices.to(torch.int64)
        token_index = ranges_index(self.seq_offsets[indices], self.seq_lengths[indices])
        response_index = ranges_index(self.response_offsets[indices], self.response_lengths[indices])
        return self._take(lambda t: t[indices], lambda t: t[token_index], lambda t: t[response_index])

    def narrow(self, start: int, length: int) -> RolloutBatch:
        """Sequences start .. start + length - 1 (views, no copy)."""
        so, ro = self.seq_offsets, self.response_offsets
        t0, t1 = int(so[start]), int(so[start + length])
        r0, r1 = int(ro[start]), int(ro[start + length])
        return self._take(lambda t: t[start : start + length], lambda t: t[t0:t1], lambda t: t[r0:r1])

    def _take(self, per_sequence, per_token, per_response) -> RolloutBatch:
        values = {name: per_sequence(getattr(self, name)) for name in SEQUENCE_FIELDS}
        values.update(
            {
                name: None if getattr(self, name) is None else per_response(getattr(self, name))
                for name in RESPONSE_FIELDS
            }
        )
        return replace(
            self,
            tokens=per_token(self.tokens),
            token_fields={k: per_token(v) for k, v in self.token_fields.items()},
            **values,
        )


def _response_field(samples: Sequence, name: str) -> torch.Tensor | None:
    """fp32 [R] of a per-response-token field when every sample has it, None when none has it."""
    have = [getattr(s, name) is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        missing = have.index(False)
        raise ValueError(
            f"sample {missing}: {name} is None while other samples of the batch have it "
            f"(a batch holds a per-token field for every response or for none)"
        )
    return torch.cat([torch.tensor(getattr(s, name), dtype=torch.float32) for s in samples])


# expert ids < 2^15 (256 experts in the largest MoE models); half the bytes of int32 on the wire
ROUTED_EXPERTS_DTYPE = torch.int16


def _routed_experts_field(samples: Sequence) -> torch.Tensor | None:
    """int16 [T, width] of the samples' routed experts ([num_tokens - 1, width] each), aligned with
    `tokens`, -1 in rows the engine did not report; None when no sample has them. ValueError names
    the sample whose rows do not fit its tokens or the others' width."""
    have = [i for i, s in enumerate(samples) if getattr(s, "routed_experts", None) is not None]
    if not have:
        return None
    width = int(samples[have[0]].routed_experts.shape[-1])
    out = torch.full((sum(s.num_tokens for s in samples), width), -1, dtype=ROUTED_EXPERTS_DTYPE)
    offset = 0
    for index, s in enumerate(samples):
        rows = s.routed_experts
        if rows is not None:
            rows = torch.as_tensor(rows)
            if tuple(rows.shape) != (s.num_tokens - 1, width):
                raise ValueError(
                    f"sample {index}: routed_experts has shape {tuple(rows.shape)}, expected "
                    f"{(s.num_tokens - 1, width)} (prompt + response - 1 tokens, "
                    "the batch's layers x top-k)"
                )
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) > torch.iinfo(ROUTED_EXPERTS_DTYPE).max):
                raise ValueError(f"sample {index}: routed_experts holds expert ids outside 0..32767")
            out[offset : offset + rows.shape[0]] = rows.to(ROUTED_EXPERTS_DTYPE)
        offset += s.num_tokens
    return out
