"""Each layer's settings from the whole Config: the Config stops here (and at the command line);
the layers below receive their sections or small settings objects.

    actor = Actor(actor_settings(cfg), cfg.model.path, layout)
"""

from __future__ import annotations

from dapo_megatron.actor.settings import ActorSettings, OptimizerSettings
from dapo_megatron.config import Config
from dapo_megatron.quant.engine_checkpoint import fp8_rollout_dir


def actor_settings(cfg: Config) -> ActorSettings:
    """The actor's: its section, the loss, the optimizer keys, the engines' temperature and (for the
    quantization-aware forward) where the engines' FP8 checkpoint is."""
    fp8 = str(fp8_rollout_dir(cfg.trainer.output_dir)) if cfg.actor.quantization_aware else None
    return ActorSettings(
        actor=cfg.actor,
        algorithm=cfg.algorithm,
        optimizer=OptimizerSettings.from_trainer(cfg.trainer),
        temperature=cfg.rollout.temperature,
        fp8_checkpoint=fp8,
    )
