"""Load one layer of our FP8 sync into SGLang 0.5.21's own ModelOptFp8LinearMethod parameters, on CPU.

    python tests/conformance/sglang_fp8_layout.py SYNC.safetensors OUT.json --layer 0

SYNC.safetensors holds what Fp8SyncConverter.convert yields (HF names: <m>.weight fp8, <m>.weight_scale,
<m>.input_scale). For each fused Linear of SGLang's Qwen2 (srt/models/qwen2.py, load_weights:
stacked_params_mapping q/k/v -> qkv_proj, gate/up -> gate_up_proj; o_proj and down_proj alone), this
runs SGLang's code: ModelOptFp8Config.from_config, ModelOptFp8LinearMethod.create_weights (the
parameters an FP8 engine allocates, with output_partition_sizes from our shapes) and the parameters'
own loaders (ModelWeightParameter.load_qkv_weight / load_merged_column_weight /
load_row_parallel_weight, PerTensorScaleParameter's shard loaders, srt/layers/parameter.py), with the
shard offsets QKVParallelLinear / MergedColumnParallelLinear pass at TP=1. Written to OUT.json: per
fused layer, the registered parameters (dtype, shape) and whether each loaded parameter's bytes equal
ours. process_weights_after_loading is not run: it needs sgl_kernel's GPU quantization kernel.

Own process: importing sglang needs the oracle's torchvision stub (sglang_oracle.install_stubs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sync")
    ap.add_argument("out")
    ap.add_argument("--layer", type=int, default=0)
    args = ap.parse_args()

    from sglang_oracle import install_stubs

    install_stubs()
    import torch
    from safetensors.torch import load_file
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp8Config, ModelOptFp8LinearMethod

    sent = load_file(args.sync)
    method = ModelOptFp8LinearMethod(ModelOptFp8Config.from_config(
        {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    prefix = f"model.layers.{args.layer}"
    fused = {  # SGLang module -> [(our module, shard id)] (qwen2.py stacked_params_mapping)
        "self_attn.qkv_proj": [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")],
        "mlp.gate_up_proj": [("mlp.gate_proj", 0), ("mlp.up_proj", 1)],
        "self_attn.o_proj": [("self_attn.o_proj", None)],
        "mlp.down_proj": [("mlp.down_proj", None)],
    }
    report = {}
    for sg_name, shards in fused.items():
        weights = [sent[f"{prefix}.{m}.weight"] for m, _ in shards]
        sizes = [int(w.shape[0]) for w in weights]
        in_size = int(weights[0].shape[1])
        layer = torch.nn.Module()
        method.create_weights(layer, input_size_per_partition=in_size, output_partition_sizes=sizes,
                              input_size=in_size, output_size=sum(sizes), params_dtype=torch.bfloat16,
                              weight_loader=lambda *a, **k: None)
        params = {n: {"dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape),
                      "class": type(p).__name__} for n, p in layer.named_parameters()}
        offset = 0
        for (module, shard_id), w, size in zip(shards, weights, sizes):
            scale = sent[f"{prefix}.{module}.weight_scale"]
            inp = sent[f"{prefix}.{module}.input_scale"]
            if shard_id is None:  # RowParallelLinear.weight_loader_v2 at TP=1 (o_proj, down_proj): the
                # whole tensor; a 0-dim scale is reshaped to (1,) first, as that loader does
                layer.weight.load_row_parallel_weight(w, tp_rank=0)
                layer.weight_scale.load_row_parallel_weight(scale.reshape(1), tp_rank=0)
                layer.input_scale.load_row_parallel_weight(inp.reshape(1), tp_rank=0)
            elif isinstance(shard_id, str):  # QKVParallelLinear.weight_loader_v2 at TP=1
                layer.weight.load_qkv_weight(w, tp_rank=0, shard_id=shard_id, shard_offset=offset, shard_size=size,
                                             num_heads=1)
                layer.weight_scale.load_qkv_weight(scale, shard_id=shard_id)
                layer.input_scale.load_qkv_weight(inp, shard_id=shard_id)
            else:  # MergedColumnParallelLinear.weight_loader_v2 at TP=1
                layer.weight.load_merged_column_weight(w, tp_rank=0, shard_offset=offset, shard_size=size)
                layer.weight_scale.load_merged_column_weight(scale, shard_id=shard_id)
                layer.input_scale.load_merged_column_weight(inp, shard_id=shard_id)
            offset += size
        held_w = layer.weight.data
        cat = torch.cat(weights, 0)
        scales = torch.stack([sent[f"{prefix}.{m}.weight_scale"] for m, _ in shards])
        inputs = torch.stack([sent[f"{prefix}.{m}.input_scale"] for m, _ in shards])
        report[sg_name] = {
            "params": params,
            "weight_bytes_equal": bool(torch.equal(held_w.view(torch.uint8), cat.view(torch.uint8))),
            "weight_scale_equal": bool(torch.equal(layer.weight_scale.data.reshape(-1), scales.reshape(-1))),
            "input_scale_equal": bool(torch.equal(layer.input_scale.data.reshape(-1), inputs.reshape(-1))),
        }
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
