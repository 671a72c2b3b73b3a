"""FP8 rollout weights: modelopt 2-D block FP8 in the layout SGLang's `fp8` engines load (docs/fp8.md).

    export_fp8_checkpoint(model_dir, out_dir)                    # the engines' start checkpoint
    conv = Fp8SyncConverter.from_checkpoint(out_dir)             # once per run
    for name, tensor in conv.convert(iter_hf_weights(...)): ...  # every sync: fp8 weights + block scales
    w = dequantize_block_fp8(weight_fp8, weight_scale_inv)       # what a block-FP8 GEMM multiplies by

from fp8_export.py, fp8_sync.py and fp8_format.py. The package itself imports nothing, so that the
launcher's light module (engine_checkpoint.py) does not pull torch in with it.
"""
