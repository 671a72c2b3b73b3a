"""The FP8 rollout format: 2-D block FP8 weights, as SGLang 0.5.21's native `quant_method: fp8` loads them.

    # config.json's quantization_config
    cfg = sglang_quant_config(block=128, ignored=["lm_head", "model.embed_tokens"])
    w = dequantize_block_fp8(weight_fp8, weight_scale_inv, block=128)                # what the GEMM multiplies by
    check_sglang_block_shapes(hf_config, block=128, tp_size=2)                         # before an engine starts

Per quantized Linear `<m>` the checkpoint holds
    <m>.weight            float8_e4m3fn [out, in]
    <m>.weight_scale_inv  float32 [ceil(out / block), ceil(in / block)]: block (i, j) of the weight is
                          weight[i*b:(i+1)*b, j*b:(j+1)*b].float() * weight_scale_inv[i, j]
(the DeepSeek-V3 convention SGLang uses: despite the name, the dequantization MULTIPLIER, = the block's
max|w| / 448). Read from sglang 0.5.21: srt/layers/quantization/fp8.py Fp8Config.from_config
(quant_method "fp8", activation_scheme, weight_block_size, ignored_layers / modules_to_not_convert) and
Fp8LinearMethod.create_fp8_weight_ (weight ModelWeightParameter fp8 [out, in]; weight_scale_inv
BlockQuantScaleParameter fp32 of that ceil shape); the dequantization is
srt/layers/quantization/fp8_utils.py block_quant_dequant (repeat each scale over its block, crop, multiply).
modelopt 0.47 decides the values: FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG (fp8_export.py, fp8_sync.py).

Why this format and not modelopt's own FP8 layouts, in SGLang 0.5.21 (docs/fp8.md, "SGLang engines"):
per-tensor modelopt FP8 (ModelOptFp8LinearMethod) replaces its parameters in
process_weights_after_loading, so the engine cannot reload them at a sync; modelopt's block export
(quant_algo "fp8_pb_wo") is not recognised by ModelConfig._parse_modelopt_quant_config, and its
MIXED_PRECISION wrapper is routed to w4afp8 unless some layer is NVFP4. Fp8LinearMethod's block path
(process_weights_after_loading_block_quant) writes back into the same Parameter objects
(`layer.weight.data = ...`), so their weight loaders survive and every sync reloads in place.
"""

from __future__ import annotations

import torch

# SGLang models whose loader keeps the name weight_scale_inv (qwen2.py, qwen3.py load_weights); llama.py
# renames it to weight_scale before the lookup, so block scales would not load (docs/fp8.md)
SGLANG_FP8_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
BLOCK = 128  # SGLang's and DeepGEMM's block (weight_block_size [128, 128]); modelopt's FP8_2D_BLOCKWISE default
E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def block_scale_shape(shape: tuple[int, ...] | torch.Size, block: int = BLOCK) -> tuple[int, int]:
    """[ceil(out / block), ceil(in / block)]: Fp8LinearMethod.create_fp8_weight_'s weight_scale_inv shape."""
    out_f, in_f = int(shape[0]), int(shape[1])
    return (out_f + block - 1) // block, (in_f + block - 1) // block


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, *, block: int = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """float8 weight times its per-block scale, the weight a block-FP8 GEMM multiplies by.

    SGLang's block_quant_dequant (fp8_utils.py): each scale repeated over its block x block tile, cropped
    to the weight's shape (the last row/column of blocks may be partial), product in fp32, then `dtype`.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_block_fp8: weight dtype {weight.dtype}, expected torch.float8_e4m3fn")
    if weight.dim() != 2:
        raise ValueError(f"dequantize_block_fp8: a 2-D weight expected, got shape {tuple(weight.shape)}")
    want = block_scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"dequantize_block_fp8: weight {tuple(weight.shape)} with block {block} needs a scale of "
            f"shape {want}, got {tuple(scale_inv.shape)}"
        )
    n, k = weight.shape
    full = scale_inv.float().repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)[:n, :k]
    return (weight.float() * full).to(dtype)


def sglang_quant_config(*, block: int = BLOCK, ignored: list[str] | None = None) -> dict:
    """config.json's quantization_config for SGLang's Fp8Config.from_config: serialized fp8 weights
    ("fp8" in quant_method), block size, dynamic activations (the only scheme block FP8 takes)."""
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "ignored_layers": list(ignored or []),
    }


def check_sglang_block_shapes(hf_config: dict, *, block: int = BLOCK, tp_size: int = 1) -> None:
    """ValueError naming the projection whose per-rank size SGLang 0.5.21 refuses for block FP8.

    Fp8LinearMethod.validate_block_quant_shapes (fp8.py), at engine start: every output shard of a fused
    layer (q/k/v of qkv_proj, gate/up of gate_up_proj) and of a column-parallel layer split over TP ranks
    must be a multiple of block_n, and the per-rank input of a row-parallel layer (o_proj, down_proj)
    at TP > 1 a multiple of block_k. Those inputs are q_proj's and gate_proj's per-rank outputs, so the
    checks below cover them. And the GEMM (Fp8LinearMethod.apply -> the w8a8 block linear) quantizes the
    activations per token and block_k channels: every Hopper path reaches per_token_group_quant_fp8 /
    sglang_per_token_group_quant_fp8, which assert `x.shape[-1] % group_size == 0` (DeepGEMM and FlashInfer's
    SM90 DeepGEMM fall back to Triton when K % 128 != 0; CUTLASS is refused on SM90), so the input of
    q/k/v/gate/up_proj on every rank, hidden_size, must be a multiple of block too: SGLang would load such a
    model and fail at its first forward. Dense Qwen2 / Qwen3 layouts (config.json keys); other architectures
    are refused (SGLANG_FP8_ARCHITECTURES).
    """
    archs = list(hf_config.get("architectures") or [])
    if not set(archs) & set(SGLANG_FP8_ARCHITECTURES):
        raise ValueError(
            f"rollout.quantization=fp8 on SGLang: architectures {archs} not supported; block-FP8 "
            f"reloads are verified for {', '.join(SGLANG_FP8_ARCHITECTURES)} (Llama's SGLang loader "
            "renames weight_scale_inv, so its block scales would not load; docs/fp8.md)"
        )
    hidden = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hidden // heads)
    inter = int(hf_config["intermediate_size"])
    kv_per_rank = max(1, kv_heads // tp_size) * head_dim  # fewer KV heads than ranks: replicated, one per rank
    outs = {
        "q_proj": heads * head_dim // tp_size,
        "k_proj": kv_per_rank,
        "v_proj": kv_per_rank,
        "gate_proj": inter // tp_size,
        "up_proj": inter // tp_size,
    }
    if hidden % block:
        raise ValueError(
            f"rollout.quantization=fp8 on SGLang: hidden_size {hidden} (the input of q/k/v/gate/up_proj on "
            f"every engine TP rank, rollout.engine_tp={tp_size}) is not a multiple of the FP8 block {block}; "
            f"SGLang's block-FP8 GEMM quantizes activations per {block} channels and asserts it at the "
            "first forward (per_token_group_quant_fp8: x.shape[-1] % group_size == 0)"
        )
    # the row-parallel inputs are these outputs: o_proj reads q_proj's, down_proj gate_proj's (intermediate_size
    # per rank), so their K % block rule is the one below too
    also = {"q_proj": "; also o_proj's input", "gate_proj": f"; intermediate_size {inter} per rank, down_proj's input"}
    for name, size in outs.items():
        if size % block:
            raise ValueError(
                f"rollout.quantization=fp8 on SGLang: {name} has {size} output features per engine TP "
                f"rank (rollout.engine_tp={tp_size}{also.get(name, '')}), not a multiple of the FP8 block "
                f"{block}; SGLang's Fp8LinearMethod.validate_block_quant_shapes refuses it at start-up"
            )
