"""Tiny random Hugging Face checkpoints for tests (no hub download: built from a config).

    from helpers_tiny import save_tiny_hf
    hf_dir = save_tiny_hf(tmp_path / "qwen", arch="qwen2", tied=False, num_layers=2)

Shapes: hidden 64, 4 heads of 16, 2 KV heads (GQA 2:1), FFN 128, vocab 300 (NOT a multiple of
128 * tp, so Megatron's vocab padding is exercised), fp32 safetensors. Qwen2 has q/k/v biases.
`shape=` overrides any of them (e.g. an odd vocabulary, MHA or GQA 4:1): see TINY_SHAPE.
Qwen3 has QK-norm and heads of 24 (head_dim from the config: 4 x 24 = 96 != hidden 64).
Qwen3-MoE: heads of 24, 4 experts of width 32, top-2, layer 1 dense (mlp_only_layers), the others
sparse; norm_topk_prob as asked.
The random init is rescaled (std 0.2 for matrices, non-zero biases and norm weights) so every
parameter visibly shapes the log-probs: a mapping bug cannot hide behind near-zero weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 300
TINY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB_SIZE
)


def tiny_hf_config(
    *,
    arch: str = "qwen2",
    tied: bool = False,
    num_layers: int = 2,
    shape: dict | None = None,
    norm_topk_prob: bool = True,
):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    unknown = set(shape or {}) - set(TINY_SHAPE)
    if unknown:
        raise ValueError(f"tiny shape keys {sorted(unknown)} unknown; allowed {sorted(TINY_SHAPE)}")
    common = dict(
        **{**TINY_SHAPE, **(shape or {})},
        num_hidden_layers=num_layers,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=10000.0)
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=500000.0)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=24, rope_theta=1000000.0)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=24,
            rope_theta=1000000.0,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    if arch == "llama3":  # Llama 3.1-style RoPE scaling (theta 1e4 so the scaled bands matter at 12 tokens)
        common["max_position_embeddings"] = 16384
        return LlamaConfig(
            **common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    raise ValueError(f"unknown tiny arch {arch!r}")


def tiny_hf_model(
    *,
    arch: str = "qwen2",
    tied: bool = False,
    num_layers: int = 2,
    seed: int = 0,
    shape: dict | None = None,
    norm_topk_prob: bool = True,
):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_hf_config(arch=arch, tied=tied, num_layers=num_layers, shape=shape, norm_topk_prob=norm_topk_prob)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    return model.eval()


def save_tiny_hf(
    out_dir,
    *,
    arch: str = "qwen2",
    tied: bool = False,
    num_layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shape: dict | None = None,
    norm_topk_prob: bool = True,
) -> Path:
    """Build, randomize and save_pretrained a tiny model into out_dir (in `dtype`); returns the directory.
    MoE models are written in the public per-expert layout (what save_pretrained writes)."""
    out_dir = Path(out_dir)
    model = tiny_hf_model(
        arch=arch, tied=tied, num_layers=num_layers, seed=seed, shape=shape, norm_topk_prob=norm_topk_prob
    ).to(dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
