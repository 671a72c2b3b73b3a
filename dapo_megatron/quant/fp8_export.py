"""Quantize a HF causal LM with modelopt's 2-D block FP8 recipe and write the checkpoint SGLang's `fp8` loader reads.

    path = export_fp8_checkpoint("out/tiny_model/warm", "out/run/rollout_fp8")

modelopt 0.47 decides every value, on CPU:
- `mtq.quantize(model, mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)` (modelopt/torch/quantization/config.py,
  preset configs/ptq/presets/model/fp8_2d_blockwise_weight_only): E4M3 weight quantizers with
  block_sizes {-1: 128, -2: 128} on every Linear, no activation quantizers (weight-only: nothing to
  calibrate on text, so no calibration data), "max" calibration of the weights, and the default
  disabled list (lm_head, routers, nn.Embedding, ...);
- `export_hf_checkpoint(model, dtype, export_dir)` (modelopt/torch/export/unified_export_hf.py), whose
  `_export_quantized_weight` (format QUANTIZATION_FP8_PB_WO) writes per quantized Linear
      <m>.weight        float8_e4m3fn [out, in] = FP8QTensor.quantize(w.to(dtype), scale, block_sizes)
      <m>.weight_scale  float32, the block amaxes / 448, shaped [nb_out, 1, nb_in, 1] (0-dim for one block)
  plus hf_quant_config.json {"quantization": {"quant_algo": "fp8_pb_wo", ...}}.
SGLang 0.5.21 does not load that as written (quant_algo "fp8_pb_wo" is unknown to its ModelConfig;
fp8_format.py says why this format). `_to_sglang_layout` then changes names and shapes only, no value:
`<m>.weight_scale` -> `<m>.weight_scale_inv` reshaped to [ceil(out/128), ceil(in/128)] (the same
elements in the same row-major order: FP8QTensor.quantize reshapes the scale exactly so), config.json's
quantization_config -> {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size":
[128, 128], "ignored_layers": modelopt's exclude list}, and hf_quant_config.json removed (it would
describe tensor names the checkpoint no longer has). Everything else (embeddings, norms, biases,
lm_head) stays in `dtype`. Written to a temporary directory and renamed: nothing half written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from dapo_megatron.quant.fp8_format import BLOCK, block_scale_shape, sglang_quant_config


def modelopt_block_cfg() -> dict:
    """modelopt's 2-D block FP8 weight-only recipe; refuses a modelopt whose preset changed block size."""
    import modelopt.torch.quantization as mtq

    cfg = mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer" and "cfg" in entry:
            blocks = {int(k): v for k, v in entry["cfg"].get("block_sizes", {}).items()}
            if blocks != {-1: BLOCK, -2: BLOCK} or tuple(entry["cfg"].get("num_bits", ())) != (4, 3):
                raise RuntimeError(
                    f"modelopt FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG weight quantizer is {entry['cfg']}; "
                    f"expected E4M3 with block_sizes {{-1: {BLOCK}, -2: {BLOCK}}} (modelopt 0.47)"
                )
            return cfg
    raise RuntimeError("modelopt FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG has no '*weight_quantizer' entry; modelopt changed?")


def sglang_scale(weight_fp8: torch.Tensor, modelopt_scale: torch.Tensor) -> torch.Tensor:
    """modelopt's block scale ([nb_out, 1, nb_in, 1] or 0-dim) as SGLang's weight_scale_inv [nb_out, nb_in]."""
    shape = block_scale_shape(weight_fp8.shape)
    if modelopt_scale.numel() != shape[0] * shape[1]:
        raise ValueError(
            f"modelopt block scale has {modelopt_scale.numel()} elements, weight {tuple(weight_fp8.shape)} "
            f"needs {shape[0]} x {shape[1]}"
        )
    return modelopt_scale.to(torch.float32).reshape(shape).contiguous()


def _to_sglang_layout(export_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    quant = json.loads((export_dir / "hf_quant_config.json").read_text())["quantization"]
    if str(quant.get("quant_algo", "")).lower() != "fp8_pb_wo":
        raise RuntimeError(f"{export_dir}: modelopt wrote quant_algo={quant.get('quant_algo')!r}, expected 'fp8_pb_wo'")
    for path in sorted(export_dir.glob("*.safetensors")):
        state = load_file(str(path))
        out = {}
        for name, t in state.items():
            if name.endswith(".weight_scale"):
                module = name.removesuffix(".weight_scale")
                weight = state.get(f"{module}.weight")
                if weight is None:  # modelopt writes a module's weight and scale into one shard
                    raise RuntimeError(f"{path.name}: '{name}' without '{module}.weight' in the same file")
                out[f"{module}.weight_scale_inv"] = sglang_scale(weight, t)
            else:
                out[name] = t
        save_file(out, str(path), metadata={"format": "pt"})
    index = export_dir / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        idx["weight_map"] = {
            (k.removesuffix(".weight_scale") + ".weight_scale_inv" if k.endswith(".weight_scale") else k): v
            for k, v in idx["weight_map"].items()
        }
        index.write_text(json.dumps(idx, indent=2))
    config_path = export_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = sglang_quant_config(ignored=list(quant.get("exclude_modules") or []))
    config_path.write_text(json.dumps(config, indent=2))
    (export_dir / "hf_quant_config.json").unlink()


def export_fp8_checkpoint(model_dir: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """modelopt 2-D block FP8 of the HF model at `model_dir`, in SGLang's fp8 layout, at `out_dir` (with its tokenizer).

    `dtype` is the engine's unquantized dtype (embeddings, norms, lm_head) and the dtype the weights pass
    through before the fp8 cast, as modelopt's export does (weight.to(dtype)).
    """
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    mtq.quantize(model, modelopt_block_cfg(), forward_loop=None)  # weight-only: max over the weights themselves
    export_hf_checkpoint(model, dtype=dtype, export_dir=str(tmp))
    _to_sglang_layout(tmp)
    try:
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)
    except (OSError, ValueError):
        pass  # a weights-only directory: the engines take input_ids
    # Nothing half written: the directory appears complete or not at all.
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def read_quant_config(checkpoint_dir: str | Path) -> dict:
    """config.json's quantization_config as SGLang's Fp8Config.from_config reads it; ValueError unless it
    is serialized block FP8 (quant_method "fp8", dynamic activations, square weight_block_size)."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{checkpoint_dir}: no config.json; not an FP8 rollout checkpoint")
    qc = json.loads(path.read_text()).get("quantization_config") or {}
    block = qc.get("weight_block_size")
    if qc.get("quant_method") != "fp8" or not (isinstance(block, list) and len(block) == 2 and block[0] == block[1]):
        raise ValueError(
            f"{path}: quantization_config={qc!r} is not block FP8 ({{'quant_method': 'fp8', "
            f"'weight_block_size': [{BLOCK}, {BLOCK}], ...}}); export it with "
            "dapo_megatron.quant.fp8_export.export_fp8_checkpoint"
        )
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{path}: activation_scheme={qc['activation_scheme']!r}; block FP8 takes 'dynamic' only")
    return qc
