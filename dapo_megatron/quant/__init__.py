"""FP8 rollout weights with nvidia-modelopt (issue 14, part A; docs/fp8.md).

    export_fp8_checkpoint(model_dir, out_dir, calib_texts=...)   # the engine's start checkpoint
    conv = Fp8SyncConverter.from_checkpoint(out_dir)             # once per run
    for name, tensor in conv.convert(iter_hf_weights(...)): ...  # every sync: fp8 weights + scales
    w = dequantize_fp8(weight_fp8, weight_scale)                 # what an FP8 GEMM multiplies by
"""

from dapo_megatron.quant.fp8_export import export_fp8_checkpoint, read_quant_config
from dapo_megatron.quant.fp8_sync import Fp8SyncConverter, dequantize_fp8

__all__ = ["export_fp8_checkpoint", "read_quant_config", "Fp8SyncConverter", "dequantize_fp8"]
