"""Mixture-of-experts part of the model provider (Qwen3-MoE): which layers are sparse, how HF's router
maps onto megatron's, and the expert-parallel checks.

HF Qwen3-MoE (transformers 5.23, models/qwen3_moe/modeling_qwen3_moe.py):
  layer i is sparse iff  i not in mlp_only_layers  and  num_experts > 0  and  (i + 1) % decoder_sparse_step == 0
  (the other layers keep a dense SwiGLU MLP of intermediate_size);
  router   logits = h @ W_gate^T;  p = softmax(logits) in fp32;  top-k of p;
           norm_topk_prob: p_topk / sum(p_topk)
  experts  SwiGLU MLPs of moe_intermediate_size; output = sum over the k chosen experts of p * expert(h).
  No shared expert, no expert bias; the load-balancing loss (router_aux_loss_coef) is a pre-training
  term and is left out of the RL objective (moe_aux_loss_coeff 0), as slime and verl do for
  Qwen3-MoE RL.

megatron-core 0.16.1 (transformer/moe/moe_utils.py topk_routing_with_score_function):
  moe_router_pre_softmax=False: top-k of the logits, then softmax over those k logits
      = exp(l_i) / sum_{j in top-k} exp(l_j) = p_i / sum_{top-k} p  -> HF with norm_topk_prob=True
  moe_router_pre_softmax=True:  softmax over all experts, then top-k, not renormalised
      -> HF with norm_topk_prob=False
  (top-k of the logits and top-k of the softmax pick the same experts: softmax is monotonic.)

Expert parallelism (actor.ep): each EP rank holds num_experts / ep experts (global expert
e = ep_rank * num_experts / ep + local index); expert tensor parallelism (actor.etp) splits each
expert's matrices like TP splits the dense MLP. Tokens reach their experts through megatron's
"alltoall" dispatcher.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dapo_megatron.weights.hf_config import MOE_MODEL_TYPES, MoEShape, moe_shape_of  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def moe_layer_pattern(hf_config: PretrainedConfig) -> list[int]:
    """megatron's moe_layer_freq as a list: 1 for every sparse layer (all zeros for a dense model)."""
    shape = moe_shape_of(hf_config)
    if shape is None:
        return [0] * hf_config.num_hidden_layers
    return [int(s) for s in shape.sparse_layers]


def moe_transformer_kwargs(
    hf_config: PretrainedConfig,
    *,
    attention_backend: str,
) -> dict[str, int | bool | str | list[int]]:
    """TransformerConfig keyword arguments for the experts (empty for a dense model).

    Call inside model_parallel(): the expert-parallel sizes come from megatron's parallel state."""
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    check_expert_parallel(hf_config, ep=ep, etp=etp)
    shape = moe_shape_of(hf_config)
    if shape is None:
        return {}
    return dict(
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.topk,
        moe_ffn_hidden_size=shape.ffn,
        moe_layer_freq=moe_layer_pattern(hf_config),
        moe_router_pre_softmax=not shape.norm_topk_prob,  # see the module docstring
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=attention_backend == "te",  # TE's grouped GEMM on GPUs; SequentialMLP on CPU
        # every router gets a RouterReplay (megatron-core 0.16.1 router_replay.py); with no action set
        # it routes normally, so the switch costs nothing until actor/routing_replay.py drives it
        moe_enable_routing_replay=True,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def check_expert_parallel(hf_config: PretrainedConfig, *, ep: int, etp: int) -> None:
    """ValueError naming actor.ep / actor.etp for layouts the checkpoint cannot be split into."""
    shape = moe_shape_of(hf_config)
    if shape is None:
        if ep > 1:
            raise ValueError(
                f"actor.ep={ep}: expert parallelism needs a mixture-of-experts model; "
                f"config.json model_type {getattr(hf_config, 'model_type', None)!r} has no experts"
            )
        return
    if shape.num_experts % ep:
        raise ValueError(f"actor.ep={ep} must divide the number of experts num_experts={shape.num_experts}")
    if shape.ffn % etp:
        raise ValueError(f"actor.etp={etp} must divide each expert's width moe_intermediate_size={shape.ffn}")
