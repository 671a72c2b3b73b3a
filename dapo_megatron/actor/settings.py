"""What the actor reads of a run's configuration, and nothing more: the actor receives its settings,
never the whole Config (that stops at trainer/ and the command line; trainer/settings.py builds these).

    settings = ActorSettings(actor=cfg.actor, algorithm=cfg.algorithm, optimizer=cfg.trainer,
                             temperature=cfg.rollout.temperature, fp8_checkpoint=None)
    actor = Actor(settings, hf_dir)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dapo_megatron.algo.objective import ObjectiveSettings
from dapo_megatron.algo.policy_loss import ClipSettings


@dataclass(frozen=True)
class ActorSettings:
    actor: Any  # the config's actor section: parallel layout, precision, micro-batches, kernels, offload
    algorithm: Any  # the loss: clip ranges, aggregation mode, truncated importance sampling, KL
    optimizer: Any  # the trainer section's optimizer keys: lr and its schedule, weight decay, betas, grad_clip
    temperature: float  # rollout.temperature: log-probs under the engines' sampling temperature
    fp8_checkpoint: str | None = None  # actor.quantization_aware: the engines' FP8 checkpoint (its layout)

    def objective(self) -> ObjectiveSettings:
        """The loss keys of the algorithm section as algo/objective.py's scalars."""
        al = self.algorithm
        return ObjectiveSettings(policy_loss=al.policy_loss, loss_agg_mode=al.loss_agg_mode,
                                 clip=ClipSettings(eps_low=al.eps_low, eps_high=al.eps_high, clip_ratio_c=al.clip_ratio_c,
                                                   fused=self.actor.fused_policy_loss),
                                 tis_cap=al.tis_cap, use_kl=al.use_kl, kl_coef=al.kl_coef, kl_kind=al.kl_kind)
