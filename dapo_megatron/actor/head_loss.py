"""actor.head_loss: how the train step's last pipeline stage turns hidden states into the loss.

    "separate" (default)  Policy._head: the LM head's log-prob + entropy (actor/lm_head.py, actor.fused_logprob),
                          then algo/objective.py's objective (the registered policy loss, actor.fused_policy_loss)
    "one_pass"            one_pass_objective below: dapo_kernels.linear_dapo_loss (kernels/head_loss.py) takes
                          the hidden states at the response positions and the LM-head weight shard and returns
                          the loss, log-prob, entropy and the policy loss's statistics, with dL/dhidden and
                          dL/dweight computed in its forward (the loss's gradient is taken while the logits
                          are on chip: three N x H x V GEMMs instead of four, no [N, V] logits)

Why it can: the objective is loss = sum_t w_t c_t l_t / D (algo/objective.py) and everything but log p_t is
known before the pass: w_t (the mask, or mask / n_seq(t) for seq-mean-token-mean: algo.objective
aggregation_weight), c_t (the rollout corrections, computed by the actor over whole responses before the
context-parallel split), the old log-prob, the advantage, the clip bounds and the global D. So the op's
per-token loss weight is w_t c_t and its stats (weighted by it) are the objective's, and metric_values
(the function objective() uses) turns them into the same logged keys: the same sums over micro-batches,
context-parallel shards and data-parallel ranks, the same one-big-batch gradient.

What it cannot compute is refused at config time (config.py one_pass_conflicts, checked again here for
settings built without Config.validate): gspo (a sequence-level ratio), algorithm.use_kl (a KL gradient),
a rollout correction under algorithm.bypass_old_logprobs (its factor reads the current policy). An explicit
one_pass never silently runs as separate. actor.fused_policy_loss does not apply to one_pass (the loss is
inside the op); actor.fused_logprob still picks the old-log-prob pass's head (Actor.logprobs).
"""

from __future__ import annotations

from typing import Any

import torch

from dapo_kernels import linear_dapo_loss
from dapo_megatron.actor.lm_head import require_fused_kernels
from dapo_megatron.actor.settings import ActorSettings
from dapo_megatron.algo.objective import ObjectiveSettings, aggregation_weight, metric_values
from dapo_megatron.config import one_pass_conflicts

HEAD_LOSSES = ("separate", "one_pass")


def uses_one_pass(settings: ActorSettings, *, device_type: str) -> bool:
    """True when the train step computes head + loss in one pass (actor.head_loss=one_pass); a ValueError
    naming actor.head_loss when the objective or this process cannot run it (at Actor construction)."""
    mode = settings.actor.head_loss
    if mode not in HEAD_LOSSES:
        raise ValueError(f"config key 'actor.head_loss': {mode!r} is not allowed; one of {HEAD_LOSSES}")
    if mode != "one_pass":
        return False
    for why in one_pass_conflicts(settings.algorithm):
        raise ValueError(f"config key 'actor.head_loss': 'one_pass' is not allowed; 'separate' with {why}")
    require_fused_kernels("actor.head_loss", device_type=device_type, value="one_pass", instead="separate")
    return True


def one_pass_objective(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    fields: dict[str, Any],
    settings: ObjectiveSettings,
    *,
    loss_denominator: float,
    temperature: float,
    tp_group,
    vocab_size: int | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """objective()'s (loss, values) for one micro-batch's response tokens on this rank, computed by
    linear_dapo_loss from the hidden states [N, H] and this TP rank's LM-head weight [V_local, H].
    fields: the PackedTokens fields other than logprob / entropy (Actor._token_fields)."""
    s = settings
    mask = fields["loss_mask"]
    pg_weight = aggregation_weight(mask, fields["sequence_tokens"], agg_mode=s.loss_agg_mode)
    tis = torch.ones_like(mask)
    if s.rollout_correction.active:  # bypass + a correction is refused: the actor computed c_t beforehand
        assert fields["correction"] is not None, "the one-pass head reads the rollout correction c_t precomputed"
        tis = fields["correction"]
        pg_weight = pg_weight * tis
    clip = s.clip
    loss, logprob, entropy, stats = linear_dapo_loss(
        hidden.to(weight.dtype),  # a Float16Module wrapper would hand the output back as fp32 (lm_head.py)
        weight,
        targets,
        fields["old_logprob"],
        fields["advantages"],
        pg_weight,
        eps_low=clip.eps_low,
        eps_high=clip.eps_high,
        clip_ratio_c=clip.clip_ratio_c,
        loss_denominator=loss_denominator,
        temperature=temperature,
        tp_group=tp_group,
        vocab_size=vocab_size,
    )
    zero = torch.zeros((), dtype=torch.float32, device=logprob.device)
    values = metric_values(
        loss=loss,
        pg_loss=loss,
        kl_loss=zero,
        stats=stats,
        entropy=entropy,
        kl=torch.zeros_like(logprob),
        tis=tis,
        mask=mask,
    )
    return loss, values
