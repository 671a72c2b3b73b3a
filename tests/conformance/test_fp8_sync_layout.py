"""Our FP8 weight sync (Fp8SyncConverter) against SGLang 0.5.21's own FP8 parameters and loaders.

One layer of the converter's output (after a 'training step': the weights moved) is loaded, in a
process of its own (sglang_fp8_layout.py), into the parameters SGLang's ModelOptFp8LinearMethod
.create_weights registers for the fused Linears of its Qwen2 (qkv_proj, gate_up_proj, o_proj,
down_proj), through those parameters' own shard loaders: the dtypes and shapes must be the ones
SGLang allocates, and every byte of our fp8 weights and every scale must arrive where SGLang reads
them. What this does not cover, and why rollout.engine=sglang with fp8 is refused: the reload after
process_weights_after_loading (docs/fp8.md, "SGLang GPU engines").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt not installed (pip install -e '.[modelopt]')")

SCRIPT = Path(__file__).with_name("sglang_fp8_layout.py")
CALIB = ["What is 12 + 7? Answer: 19", "What is 3 + 4? Answer: 7"]


def test_fp8_sync_loads_into_sglang_modelopt_fp8_parameters_bit_for_bit(sglang_installed, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from dapo_megatron.quant import Fp8SyncConverter, export_fp8_checkpoint
    from dapo_megatron.tiny import build_tiny_model

    torch.set_num_threads(1)
    model_dir = build_tiny_model(tmp_path, seed=3)
    conv = Fp8SyncConverter.from_checkpoint(export_fp8_checkpoint(model_dir, tmp_path / "fp8", calib_texts=CALIB))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    moved = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in model.state_dict().items()}
    sent = {n: t.contiguous() for n, t in conv.convert(moved.items())}
    save_file(sent, str(tmp_path / "sync.safetensors"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "sync.safetensors"), str(tmp_path / "out.json"),
                           "--layer", "1"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "out.json").read_text())

    shards = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
              "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
              "self_attn.o_proj": ["self_attn.o_proj"], "mlp.down_proj": ["mlp.down_proj"]}
    assert set(report) == set(shards)
    for fused, modules in shards.items():
        ours = [sent[f"model.layers.1.{m}.weight"] for m in modules]
        params = report[fused]["params"]
        # what SGLang allocates: one fp8 [sum of shard outs, in] weight, one fp32 scale per logical shard
        assert params["weight"] == {"dtype": "float8_e4m3fn", "class": "ModelWeightParameter",
                                    "shape": [sum(int(w.shape[0]) for w in ours), int(ours[0].shape[1])]}
        for scale in ("weight_scale", "input_scale"):
            assert params[scale] == {"dtype": "float32", "shape": [len(modules)], "class": "PerTensorScaleParameter"}
            for m in modules:
                assert sent[f"model.layers.1.{m}.{scale}"].dtype == torch.float32
                assert sent[f"model.layers.1.{m}.{scale}"].shape == torch.Size([])
        assert all(w.dtype == torch.float8_e4m3fn for w in ours)
        # SGLang's loaders put every byte and every scale where its FP8 GEMM reads them
        assert report[fused]["weight_bytes_equal"] and report[fused]["weight_scale_equal"]
        assert report[fused]["input_scale_equal"]
