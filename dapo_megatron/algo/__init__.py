"""Pure tensor maths of DAPO: no config objects, no torch.distributed (docs/architecture.md, "Layout").

The objective's variants are registered by name (algo/registry.py's Registry, typed by their Protocol):
POLICY_LOSSES ("dapo", "grpo", "gspo"; algorithm.policy_loss; PolicyLossFn), ADVANTAGES ("grpo",
"drgrpo"; algorithm.advantage; AdvantageFn) and ROLLOUT_CORRECTIONS (token_is, sequence_is, token_reject,
sequence_reject, geometric_reject, icepop, veto; algorithm.tis_cap, seq_is_cap, rejection, veto_threshold;
RolloutCorrectionFn). Importing this package registers all of them.
"""

from dapo_megatron.algo import gspo as _gspo  # noqa: F401  (registers "gspo")
from dapo_megatron.algo.advantages import ADVANTAGES, AdvantageFn, group_advantages, group_mean_advantages
from dapo_megatron.algo.aggregation import AGG_MODES, count_loss_units
from dapo_megatron.algo.dynamic_sampling import DynamicSampler, SamplerStats, group_accuracies, keep_group
from dapo_megatron.algo.kl import KL_KINDS, kl_penalty
from dapo_megatron.algo.objective import METRIC_SUMS, ObjectiveSettings, PackedTokens, objective, objective_metrics
from dapo_megatron.algo.overlong import overlong_filter_mask, overlong_penalty
from dapo_megatron.algo.policy_loss import POLICY_LOSSES, STAT_KEYS, ClipSettings, LossTokens, PolicyLossFn, policy_loss
from dapo_megatron.algo.registry import Registry
from dapo_megatron.algo.rollout_correction import ROLLOUT_CORRECTIONS, RolloutCorrection, RolloutCorrectionFn

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "AdvantageFn",
    "KL_KINDS",
    "METRIC_SUMS",
    "POLICY_LOSSES",
    "ROLLOUT_CORRECTIONS",
    "STAT_KEYS",
    "ClipSettings",
    "DynamicSampler",
    "LossTokens",
    "ObjectiveSettings",
    "PackedTokens",
    "PolicyLossFn",
    "Registry",
    "RolloutCorrection",
    "RolloutCorrectionFn",
    "SamplerStats",
    "count_loss_units",
    "group_accuracies",
    "group_advantages",
    "group_mean_advantages",
    "keep_group",
    "kl_penalty",
    "objective",
    "objective_metrics",
    "overlong_filter_mask",
    "overlong_penalty",
    "policy_loss",
]
