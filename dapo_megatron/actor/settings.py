"""What the actor reads of a run's configuration, and nothing more: the actor receives its settings,
never the whole Config (that stops at trainer/ and the command line; trainer/settings.py builds these).

    settings = ActorSettings(actor=cfg.actor, algorithm=cfg.algorithm,
                             optimizer=OptimizerSettings.from_trainer(cfg.trainer),
                             temperature=cfg.rollout.temperature, fp8_checkpoint=None)
    actor = Actor(settings, hf_dir, layout)
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.algo.objective import ObjectiveSettings
from dapo_megatron.algo.policy_loss import ClipSettings
from dapo_megatron.config import ActorConfig, AlgorithmConfig, LrDecayStyle, TrainerConfig


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer's keys of the trainer section (trainer.lr, ...): Adam, its clip and the lr schedule."""

    lr: float
    warmup_steps: int
    lr_decay_style: LrDecayStyle
    min_lr: float
    total_steps: int  # the schedule's length (linear / cosine decay reach min_lr there)
    weight_decay: float
    grad_clip: float
    adam_beta1: float
    adam_beta2: float

    @classmethod
    def from_trainer(cls, trainer: TrainerConfig) -> OptimizerSettings:
        return cls(
            lr=trainer.lr,
            warmup_steps=trainer.warmup_steps,
            lr_decay_style=trainer.lr_decay_style,
            min_lr=trainer.min_lr,
            total_steps=trainer.total_steps,
            weight_decay=trainer.weight_decay,
            grad_clip=trainer.grad_clip,
            adam_beta1=trainer.adam_beta1,
            adam_beta2=trainer.adam_beta2,
        )


@dataclass(frozen=True)
class ActorSettings:
    actor: ActorConfig  # the config's actor section: parallel layout, precision, micro-batches, kernels, offload
    algorithm: AlgorithmConfig  # the loss: clip ranges, aggregation mode, truncated importance sampling, KL
    optimizer: OptimizerSettings  # lr and its schedule, weight decay, betas, grad_clip (from the trainer section)
    temperature: float  # rollout.temperature: log-probs under the engines' sampling temperature
    fp8_checkpoint: str | None = None  # actor.quantization_aware: the engines' FP8 checkpoint (its layout)

    def objective(self) -> ObjectiveSettings:
        """The loss keys of the algorithm section as algo/objective.py's scalars."""
        al = self.algorithm
        return ObjectiveSettings(
            policy_loss=al.policy_loss,
            loss_agg_mode=al.loss_agg_mode,
            clip=ClipSettings(
                eps_low=al.eps_low,
                eps_high=al.eps_high,
                clip_ratio_c=al.clip_ratio_c,
                fused=self.actor.fused_policy_loss,
            ),
            tis_cap=al.tis_cap,
            seq_is_cap=al.seq_is_cap,
            rejection=al.rejection,
            rejection_upper=al.rejection_upper,
            rejection_lower=al.rejection_lower,
            veto_threshold=al.veto_threshold,
            bypass=al.bypass_old_logprobs,
            use_kl=al.use_kl,
            kl_coef=al.kl_coef,
            kl_kind=al.kl_kind,
        )
