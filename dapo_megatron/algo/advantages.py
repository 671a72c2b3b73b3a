"""Group-relative advantages (GRPO, docs/algorithm.md section 4), registered in ADVANTAGES (a
Registry[AdvantageFn]; algorithm.advantage selects one; each takes rewards [N], group ids [N] and eps):

    "grpo"    A_i = (R_i - mean_g R) / (std_g R + eps)   unbiased (n - 1) std; a group of one: mean 0, std 1
              (DAPO, naive GRPO and GSPO all use it)
    "drgrpo"  A_i = R_i - mean_g R                       Dr. GRPO (Liu et al. 2025, "Understanding
              R1-Zero-Like Training"): no division by the group's std, which favours groups whose
              rewards barely differ; a group of one: 0

Example, rewards [1, -1, -1, 1, -2] in groups [7, 7, 7, 3, 3]:
  group 7: mean -1/3, std sqrt(((4/3)^2 + 2 (2/3)^2) / 2) = sqrt(4/3) = 1.1547 -> A = [1.1547, -0.5774, -0.5774]
  group 3: mean -0.5, std sqrt((1.5^2 + 1.5^2) / 1) = 2.1213              -> A = [0.7071, -0.7071]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from dapo_megatron.algo.registry import Registry

__all__ = ["ADVANTAGES", "AdvantageFn", "group_advantages", "group_mean_advantages"]


class AdvantageFn(Protocol):
    """The signature of every registered advantage estimator: rewards [N], group ids [N] -> advantages [N]."""

    def __call__(
        self, rewards: torch.Tensor | Sequence[float], group_index: torch.Tensor | Sequence[int], *, eps: float
    ) -> torch.Tensor: ...


# algorithm.advantage -> the estimator; mypy checks each registered function against AdvantageFn
ADVANTAGES: Registry[AdvantageFn] = Registry("algorithm.advantage")


@ADVANTAGES.register("grpo")
def group_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_index: torch.Tensor | Sequence[int],
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-response advantages normalized within each group (any integer ids, any order).

    rewards: [N] final rewards (correctness + overlong shaping); group_index: [N] group id of each
    response. Returns [N] in the dtype of `rewards` (float32 if rewards are not floating point);
    the statistics are computed in float64.
    """
    r, group, count, mean, var, out_dtype = _group_moments(rewards, group_index)
    if r is None:
        return torch.zeros(0, dtype=out_dtype)
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(var), var.sqrt())
    adv = (r - mean[group]) / (std[group] + eps)
    return adv.to(out_dtype)


@ADVANTAGES.register("drgrpo")
def group_mean_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_index: torch.Tensor | Sequence[int],
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """R_i - mean_g R (Dr. GRPO): group_advantages without the std; eps is unused (the registry's
    signature). A group of one gets 0 (its own mean)."""
    r, group, _, mean, _, out_dtype = _group_moments(rewards, group_index)
    if r is None:
        return torch.zeros(0, dtype=out_dtype)
    return (r - mean[group]).to(out_dtype)


def _group_moments(rewards, group_index):
    """(rewards float64, dense group of each, count, mean and unbiased variance per group, output dtype);
    r is None for no rewards."""
    rewards_t = torch.as_tensor(rewards)
    index_t = torch.as_tensor(group_index)
    if rewards_t.dim() != 1 or index_t.shape != rewards_t.shape:
        raise ValueError(
            f"group_advantages: rewards {tuple(rewards_t.shape)} and group_index {tuple(index_t.shape)} "
            "must be 1-D of the same length"
        )
    if index_t.is_floating_point() or index_t.dtype == torch.bool:
        raise ValueError(f"group_advantages: group_index must hold integer ids, got {index_t.dtype}")
    out_dtype = rewards_t.dtype if rewards_t.is_floating_point() else torch.float32
    if rewards_t.numel() == 0:
        return None, None, None, None, None, out_dtype

    r = rewards_t.to(torch.float64)
    _, group = torch.unique(index_t, return_inverse=True)  # ids -> 0..G-1
    num_groups = int(group.max()) + 1
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, group, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, group, r)
    mean = total / count
    dev = r - mean[group]
    sum_sq = torch.zeros_like(count).index_add_(0, group, dev * dev)
    # unbiased variance; a group of one has no spread: the spec fixes its mean 0 and std 1
    var = sum_sq / (count - 1).clamp(min=1)
    return r, group, count, mean, var, out_dtype
