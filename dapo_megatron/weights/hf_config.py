"""What a checkpoint's config.json says about its shapes: the model type, head size, q/k/v bias, QK-norm,
the padded vocabulary, and a MoE model's experts. Read by the weight mapping (weights/mapping.py) and by
the actor's model provider (actor/model.py, actor/moe.py), which re-export these names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe")
VOCAB_DIVISIBLE_BY = 128  # megatron's make_vocab_size_divisible_by default


def model_type_of(hf_config: PretrainedConfig) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model.arch: config.json model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return model_type


def head_dim_of(hf_config: PretrainedConfig) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def has_qkv_bias(hf_config: PretrainedConfig) -> bool:
    """Qwen2/2.5 always carry q/k/v biases; Llama and Qwen3 only with attention_bias=True."""
    if model_type_of(hf_config) == "qwen2":
        return True
    return bool(getattr(hf_config, "attention_bias", False))


def has_qk_norm(hf_config: PretrainedConfig) -> bool:
    """Qwen3 (dense and MoE) normalises each query and key head (q_norm / k_norm) before RoPE."""
    return model_type_of(hf_config) in ("qwen3", "qwen3_moe")


def padded_vocab_size(vocab_size: int, *, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron pads the vocabulary to a multiple of divisible_by * tp so every TP rank holds an
    equal slice: 300 tokens at tp=2 -> multiple of 256 -> 512 rows (256 per rank)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


MOE_MODEL_TYPES = ("qwen3_moe",)


@dataclass(frozen=True)
class MoEShape:
    """The sizes of a MoE checkpoint the provider and the weight mapping need."""

    num_experts: int
    topk: int
    ffn: int  # moe_intermediate_size: each expert's SwiGLU width
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: MoE (True) or dense MLP (False)


def moe_shape_of(hf_config: PretrainedConfig) -> MoEShape | None:
    """MoEShape of a Qwen3-MoE config, None for a dense model. ValueError for what we cannot build."""
    if getattr(hf_config, "model_type", None) not in MOE_MODEL_TYPES:
        return None
    num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
    if num_experts <= 0:
        return None
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        raise ValueError(
            "config.json shared_expert_intermediate_size: shared experts are not supported (Qwen3-MoE has none)"
        )
    topk = int(hf_config.num_experts_per_tok)
    if not 1 <= topk <= num_experts:
        raise ValueError(f"config.json num_experts_per_tok={topk} must be in [1, num_experts={num_experts}]")
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    sparse = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers))
    return MoEShape(
        num_experts=num_experts,
        topk=topk,
        ffn=int(hf_config.moe_intermediate_size),
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        sparse_layers=sparse,
    )
