"""Pure tensor maths of DAPO: no config objects, no torch.distributed (docs/architecture.md, "Layout")."""

from dapo_megatron.algo.advantages import group_advantages
from dapo_megatron.algo.dynamic_sampling import DynamicSampler, SamplerStats, group_accuracies, keep_group
from dapo_megatron.algo.kl import KL_KINDS, kl_penalty
from dapo_megatron.algo.overlong import overlong_filter_mask, overlong_penalty
from dapo_megatron.algo.aggregation import AGG_MODES, count_loss_units
from dapo_megatron.algo.policy_loss import STAT_KEYS, policy_loss

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "STAT_KEYS",
    "DynamicSampler",
    "SamplerStats",
    "count_loss_units",
    "group_accuracies",
    "group_advantages",
    "keep_group",
    "kl_penalty",
    "overlong_filter_mask",
    "overlong_penalty",
    "policy_loss",
]
