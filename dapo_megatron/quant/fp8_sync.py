"""Per-sync FP8 conversion: the actor's HF-named weights -> the fp8 weights + scales an FP8 engine loads.

    conv = Fp8SyncConverter.from_checkpoint("out/tiny_model/fp8")   # the engine's modelopt export
    for name, tensor in conv.convert(iter_hf_weights(chunks, hf_config)):
        ...   # "<m>.weight" fp8, "<m>.weight_scale" fp32, "<m>.input_scale" fp32, other tensors in dtype

Which tensors are quantized is read from the engine's checkpoint, not decided here: a module is FP8
iff modelopt's export wrote `<module>.weight_scale` for it (FP8_DEFAULT_CFG with its disabled list
decided that: embeddings, norms, lm_head stay in dtype). For each such weight the scale and the fp8
values come from modelopt's own code, the same path export_hf_checkpoint takes:
  1. a TensorQuantizer built from FP8_DEFAULT_CFG's "*weight_quantizer" entry calibrates max|w| with
     its max calibrator (what mtq.quantize does to weight quantizers: model_calib.max_calibrate);
  2. modelopt/torch/export/unified_export_hf.py `_export_quantized_weight` turns it into the fp8
     weight and weight_scale = amax / 448 (to_quantized_weight, quant_utils.py).
So a sync is bit-identical to exporting the same weights with modelopt (tests/unit/test_quant_fp8.py).
Input scales are activation statistics: they stay the ones calibrated for the engine's checkpoint
(a sync has no activations to calibrate on); re-calibrating them is a separate, explicit export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch import nn

from dapo_megatron.quant.fp8_export import read_quant_config


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8 * per-tensor scale, the weight an FP8 GEMM effectively multiplies by.

    Same formula as SGLang's per_tensor_dequantize (srt/layers/quantization/utils.py) and modelopt's
    from_quantized_weight for "fp8" (quant_utils.py): weight.to(dtype) * scale.
    """
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"dequantize_fp8: weight dtype {weight.dtype}, expected torch.float8_e4m3fn")
    if scale.numel() != 1:
        raise ValueError(f"dequantize_fp8: per-tensor scale expected, got shape {tuple(scale.shape)}")
    return weight.to(dtype) * scale.to(dtype)


def _fp8_weight_quantizer_cfg() -> dict:
    """FP8_DEFAULT_CFG's weight-quantizer attributes ({'num_bits': (4, 3), 'axis': None} in 0.47)."""
    import modelopt.torch.quantization as mtq

    for entry in mtq.FP8_DEFAULT_CFG["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer" and "cfg" in entry:
            return dict(entry["cfg"])
    raise RuntimeError("modelopt FP8_DEFAULT_CFG has no '*weight_quantizer' entry; modelopt version changed?")


def _modelopt_fp8_export(weight: torch.Tensor, *, dtype: torch.dtype, quantizer_cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, weight_scale) for one Linear weight, computed by modelopt's calibrator and export."""
    from modelopt.torch.export.unified_export_hf import _export_quantized_weight
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    holder = nn.Module()
    # The export casts weight.to(dtype); a model loaded in dtype (what export_fp8_checkpoint does)
    # also calibrates on the dtype-cast weight, so the amax is taken after the same cast.
    holder.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
    quantizer = TensorQuantizer(QuantizerAttributeConfig(**quantizer_cfg))
    quantizer.disable_quant()
    quantizer.enable_calib()
    with torch.no_grad():
        quantizer(holder.weight)
    quantizer.load_calib_amax()
    quantizer.enable_quant()
    quantizer.disable_calib()
    holder.weight_quantizer = quantizer
    _export_quantized_weight(holder, dtype)
    return holder.weight.data, holder.weight_scale


class Fp8SyncConverter:
    """Turns a stream of (hf_name, tensor) into the engine's FP8 layout (see the module docstring)."""

    def __init__(self, *, quantized_modules: set[str], input_scales: dict[str, torch.Tensor], dtype: torch.dtype,
                 exclude_modules: list[str]):
        self.quantized_modules = quantized_modules
        self.input_scales = input_scales
        self.dtype = dtype
        self.exclude_modules = exclude_modules
        self._quantizer_cfg = _fp8_weight_quantizer_cfg()

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "Fp8SyncConverter":
        """Read the engine's modelopt export: which modules are fp8, their input scales, the dtype."""
        import json

        from safetensors import safe_open

        section = read_quant_config(checkpoint_dir)
        files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
        if not files:
            raise ValueError(f"{checkpoint_dir}: no *.safetensors files")
        quantized, input_scales = set(), {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key.endswith(".weight_scale"):
                        quantized.add(key.removesuffix(".weight_scale"))
                    elif key.endswith(".input_scale"):
                        input_scales[key.removesuffix(".input_scale")] = f.get_tensor(key)
        config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "bfloat16")
        return cls(quantized_modules=quantized, input_scales=input_scales, dtype=dtype,
                   exclude_modules=list(section.get("exclude_modules") or []))

    def convert(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each quantized `<m>.weight` becomes fp8 `<m>.weight`, `<m>.weight_scale` (+ `<m>.input_scale`); others are cast to dtype."""
        for name, tensor in named_tensors:
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module in self.quantized_modules:
                fp8, scale = _modelopt_fp8_export(tensor, dtype=self.dtype, quantizer_cfg=self._quantizer_cfg)
                yield name, fp8
                yield f"{module}.weight_scale", scale
                if module in self.input_scales:
                    # on the weight's device: on GPUs the actor's tensors are CUDA, the checkpoint's scales CPU
                    yield f"{module}.input_scale", self.input_scales[module].to(fp8.device)
            else:
                yield name, tensor.detach().to(self.dtype)
