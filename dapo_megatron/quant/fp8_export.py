"""Quantize a HF causal LM with modelopt's FP8 recipe and export the checkpoint SGLang's modelopt loader reads.

    path = export_fp8_checkpoint("out/tiny_model/warm", "out/tiny_model/fp8", calib_texts=prompts)

Everything is modelopt 0.47's own code, run on CPU:
- `mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)` (modelopt/torch/quantization/config.py:
  FP8_DEFAULT_CFG = configs/ptq/presets/model/fp8: per-tensor E4M3 (num_bits=(4, 3), axis=None) weight
  and input quantizers on every Linear, "max" calibration, and _default_disabled_quantizer_cfg which
  disables lm_head, routers, nn.Embedding, ...). On CPU this is fake quantization; calibration runs
  the forward on the given texts and records max|x| per input quantizer.
- `export_hf_checkpoint(model, export_dir)` (modelopt/torch/export/unified_export_hf.py), whose
  `_export_quantized_weight` writes per quantized Linear:
      <module>.weight        float8_e4m3fn  = to_quantized_weight(w.to(dtype), weight_scale, "fp8")
      <module>.weight_scale  float32 scalar = weight amax / 448
      <module>.input_scale   float32 scalar = calibrated activation amax / 448 (q/k/v, and gate/up,
                                              share one: requantize_resmooth_fused_llm_layers)
  everything else (embeddings, norms, biases, lm_head) in the model dtype, plus hf_quant_config.json
  {"quantization": {"quant_algo": "FP8", "exclude_modules": [...]}} and config.json's
  quantization_config {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": [...]}.
SGLang 0.5.21 reads exactly that: srt/layers/quantization/modelopt_quant.py ModelOptFp8Config.from_config
(flat config.json form or the nested hf_quant_config.json form; quant_algo must be "FP8"),
ModelOptFp8LinearMethod.create_weights (parameters weight [fp8], weight_scale and input_scale, one per
logical shard so that q/k/v and gate/up load into fused layers) and process_weights_after_loading
(requantize_with_max_scale: fused shards re-quantized to their max scale).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import torch


def _calibration_loop(tokenizer, texts: Sequence[str]):
    def forward_loop(model) -> None:
        # One text at a time: no padding tokens enter the activation amax.
        with torch.no_grad():
            for text in texts:
                ids = tokenizer(text, return_tensors="pt")
                model(input_ids=ids["input_ids"])

    return forward_loop


def export_fp8_checkpoint(model_dir: str | Path, out_dir: str | Path, *, calib_texts: Sequence[str],
                          dtype: torch.dtype = torch.bfloat16) -> Path:
    """modelopt FP8 (FP8_DEFAULT_CFG) of the HF model at `model_dir`, exported to `out_dir` (with its tokenizer).

    `dtype` is the engine's unquantized dtype (embeddings, norms, lm_head) and the dtype the weights
    pass through before the fp8 cast, as modelopt's export does (weight.to(dtype)).
    """
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not calib_texts:
        raise ValueError("export_fp8_checkpoint: calib_texts is empty; FP8 input scales need calibration text")
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop=_calibration_loop(tokenizer, calib_texts))
    export_hf_checkpoint(model, dtype=dtype, export_dir=str(tmp))
    tokenizer.save_pretrained(tmp)
    # Nothing half written: the directory appears complete or not at all.
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def read_quant_config(checkpoint_dir: str | Path) -> dict:
    """The checkpoint's quantization section as SGLang's ModelOptFp8Config.from_config reads it (nested form)."""
    path = Path(checkpoint_dir) / "hf_quant_config.json"
    if not path.is_file():
        raise ValueError(f"{checkpoint_dir}: no hf_quant_config.json; not a modelopt-exported checkpoint")
    section = json.loads(path.read_text()).get("quantization") or {}
    if section.get("quant_algo") != "FP8":
        raise ValueError(f"{path}: quantization.quant_algo={section.get('quant_algo')!r}; only 'FP8' is supported")
    return section
