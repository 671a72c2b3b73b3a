"""The one record that flows sampler -> advantages -> actor: a prompt and one sampled response.

The sampler fills ids, text, reward, acc, truncation, the engine's log-probs (and, for MoE models,
the engine's routed experts); `advantages` fills
`advantage`; the actor fills `old_logprobs` (pi_old computed by the trainer, not the engine).
Token lists stay plain Python lists until the actor packs them into micro-batches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    group_index: int  # samples of one prompt share it (the GRPO group)
    response_text: str = ""
    ground_truth: str = ""
    reward: float = 0.0  # final reward: correctness score + overlong shaping
    acc: float = 0.0  # 1.0 if the answer is correct, else 0.0 (dynamic sampling filters on this)
    truncated: bool = False  # generation hit max_response_length (finish_reason "length")
    advantage: float = 0.0  # broadcast to every response token
    rollout_logprobs: list[float] | None = None  # the engine's log-probs of response_ids
    old_logprobs: list[float] | None = None  # the trainer's pi_old of response_ids
    ref_logprobs: list[float] | None = None  # reference policy (KL baseline only)
    loss_mask: list[int] | None = None  # per response token; None = all ones
    # MoE: the engine's experts of every processed token, [prompt + response - 1, layers * topk] uint8 /
    # int16 (rollout/routing.py); row t = position t. The actor replays them (actor.routing_replay).
    routed_experts: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def response_mask(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.response_ids)


def validate_samples(samples: Iterable[Sample]) -> None:
    """ValueError naming the sample and the field for records the actor cannot train on."""
    for index, s in enumerate(samples):
        if not s.prompt_ids:
            raise ValueError(f"sample {index}: prompt_ids is empty (the first response token needs a context)")
        if not s.response_ids:
            raise ValueError(f"sample {index}: response_ids is empty")
        num = len(s.response_ids)
        for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs", "loss_mask"):
            values = getattr(s, name)
            if values is not None and len(values) != num:
                raise ValueError(f"sample {index}: {name} has {len(values)} entries, response_ids has {num}")
