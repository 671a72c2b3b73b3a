"""A block-FP8 rollout checkpoint served for real on CPU: each quantized Linear holds its weight in
float8_e4m3fn with one fp32 scale per 128 x 128 block, and multiplies as SGLang's GEMM does (docs/fp8.md).

    model = load_fp8_model("out/run/rollout_fp8", dtype=torch.float32)   # what CpuEngine loads
    is_fp8_checkpoint("out/run/rollout_fp8")                             # config.json quant_method "fp8"

The format is the one SGLang's engines load (fp8_format.py), and every forward computes what SGLang's
block-FP8 GEMM computes (Fp8LinearMethod.apply -> triton_w8a8_block_fp8_linear, srt/layers/quantization/
fp8_utils.py; fp8_gemm.py): the activations are quantized to fp8 dynamically, per token and 128 input
channels (fp8_activation.py), multiplied by the fp8 weight with its block scales, accumulated in fp32,
cast to the engine dtype, bias added. So the engine's mismatch carries the weight error and the
activation error a GPU engine has. Like SGLang's GEMM (which asserts it at the first forward), a
quantized Linear whose input dimension is not a multiple of the block is refused, at load. Which
Linears are fp8 is read from the checkpoint (a module is fp8 iff it holds `<module>.weight_scale_inv`),
as Fp8SyncConverter does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dapo_megatron.cpu_engine.fp8_gemm import block_fp8_linear
from dapo_megatron.quant.fp8_export import read_quant_config
from dapo_megatron.quant.fp8_format import block_scale_shape


def is_fp8_checkpoint(model_dir: str | Path) -> bool:
    """An FP8 rollout checkpoint: config.json's quantization_config says quant_method "fp8" (SGLang's
    reading, ModelConfig._parse_quant_hf_config), or a modelopt export that was not converted (refused
    by load_fp8_model with the reason)."""
    path = Path(model_dir)
    if (path / "hf_quant_config.json").is_file():
        return True
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    qc = json.loads(cfg.read_text()).get("quantization_config") or {}
    return qc.get("quant_method") in ("fp8", "modelopt")


class Fp8Linear(nn.Module):
    """nn.Linear with a float8_e4m3fn weight and fp32 per-block scales, under the checkpoint's names
    <m>.weight [out, in] and <m>.weight_scale_inv [ceil(out/block), in/block]; the input is quantized to
    fp8 per token and block channels at every forward (fp8_gemm.block_fp8_linear)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype, block: int):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        self.weight_scale_inv = nn.Parameter(
            torch.ones(block_scale_shape((out_features, in_features), block), dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # SGLang's GEMM numerics from the fp8 bytes and block scales; nothing dequantized is kept
        return block_fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, block=self.block)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fp8_e4m3fn {self.block}x{self.block} blocks, dynamic fp8 activations per token x {self.block}"
        )


def _quantized_modules(state: dict[str, torch.Tensor]) -> set[str]:
    return {k.removesuffix(".weight_scale_inv") for k in state if k.endswith(".weight_scale_inv")}


def _swap_in_fp8_linears(
    model: nn.Module, state: dict[str, torch.Tensor], *, block: int, dtype: torch.dtype, where: Path
) -> None:
    """Every nn.Linear the checkpoint quantized (it holds `<m>.weight_scale_inv`) replaced by an Fp8Linear."""
    for name in sorted(_quantized_modules(state)):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, leaf, None)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{where}: '{name}.weight_scale_inv' names {type(linear).__name__}, not an nn.Linear")
        if linear.in_features % block:
            raise ValueError(
                f"{where}: '{name}' takes {linear.in_features} input features, not a multiple of "
                f"the FP8 block {block}: SGLang's block-FP8 GEMM quantizes activations per {block} "
                "channels and asserts it (per_token_group_quant_fp8); so does this engine"
            )
        if state[f"{name}.weight"].dtype != torch.float8_e4m3fn:
            raise ValueError(f"{where}: '{name}.weight' is {state[f'{name}.weight'].dtype}, expected float8_e4m3fn")
        setattr(
            parent,
            leaf,
            Fp8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, dtype=dtype, block=block),
        )


def _copy_checkpoint_tensors(model: nn.Module, state: dict[str, torch.Tensor], *, tied: bool, where: Path) -> None:
    """The checkpoint's tensors copied into the model: each must have a place of its shape there, and every
    model tensor must come from the checkpoint (a tied lm_head aside)."""
    ours = model.state_dict()
    unknown = sorted(set(state) - set(ours))
    if unknown:
        raise ValueError(
            f"{where}: checkpoint tensor '{unknown[0]}' has no place in the model ({len(unknown)} such tensors)"
        )
    with torch.no_grad():
        for name, tensor in state.items():
            if list(ours[name].shape) != list(tensor.shape):
                raise ValueError(
                    f"{where}: '{name}' has shape {list(tensor.shape)}, the model {list(ours[name].shape)}"
                )
            ours[name].copy_(tensor.to(ours[name].dtype))
    missing = sorted(set(ours) - set(state))
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing:
        raise ValueError(f"{where}: model tensor '{missing[0]}' is not in the checkpoint ({len(missing)} missing)")


def load_fp8_model(model_dir: str | Path, *, dtype: torch.dtype):
    """The HF causal LM of a block-FP8 export with its quantized Linears as Fp8Linear, the other tensors
    (embeddings, norms, biases, lm_head: bf16 in the export) in `dtype`. Every tensor of the checkpoint
    must land in the model and every model tensor must come from the checkpoint (tied aliases aside):
    ValueError naming the first that does not."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model_dir = Path(model_dir)
    if (model_dir / "hf_quant_config.json").is_file():
        raise ValueError(
            f"{model_dir}: a modelopt export not converted to the block-FP8 rollout layout "
            "(hf_quant_config.json present); export it with dapo_megatron.quant.fp8_export.export_fp8_checkpoint"
        )
    block = int(read_quant_config(model_dir)["weight_block_size"][0])  # ValueError unless block FP8
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    config = AutoConfig.from_pretrained(str(model_dir))
    # transformers would hand quantization_config to its own quantizer integration; this module is
    # the CPU engine's FP8 implementation, so the model is built plain and the Linears swapped below
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _swap_in_fp8_linears(model, state, block=block, dtype=dtype, where=model_dir)
    tied = config.tie_word_embeddings if hasattr(config, "tie_word_embeddings") else False
    _copy_checkpoint_tensors(model, state, tied=tied, where=model_dir)
    if tied:
        model.tie_weights()
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(model_dir))
    except OSError:
        pass  # no generation_config.json: the model config's eos stands
    return model.eval()
