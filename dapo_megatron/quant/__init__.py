"""FP8 rollout weights: modelopt 2-D block FP8 in the layout SGLang's `fp8` engines load (docs/fp8.md).

    export_fp8_checkpoint(model_dir, out_dir)                    # the engines' start checkpoint
    conv = Fp8SyncConverter.from_checkpoint(out_dir)             # once per run
    for name, tensor in conv.convert(iter_hf_weights(...)): ...  # every sync: fp8 weights + block scales
    w = dequantize_block_fp8(weight_fp8, weight_scale_inv)       # what a block-FP8 GEMM multiplies by
"""

from dapo_megatron.quant.fp8_export import export_fp8_checkpoint, read_quant_config
from dapo_megatron.quant.fp8_format import BLOCK, check_sglang_block_shapes, dequantize_block_fp8
from dapo_megatron.quant.fp8_sync import Fp8SyncConverter

__all__ = ["BLOCK", "export_fp8_checkpoint", "read_quant_config", "Fp8SyncConverter", "dequantize_block_fp8",
           "check_sglang_block_shapes"]
