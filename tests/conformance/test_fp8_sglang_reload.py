"""Our FP8 rollout format against SGLang 0.5.21's own code: the export loads at start-up and two syncs
reload in place, at engine TP 1 and TP 2 (sglang_fp8_reload.py runs SGLang's code in its own process).

The model has the projection shapes SGLang's block FP8 accepts (every fused shard a multiple of 128 per
TP rank: Fp8LinearMethod.validate_block_quant_shapes; the hidden size a multiple of 128 too, since the
GEMM quantizes activations per 128 channels and asserts it at the first forward: check_sglang_block_shapes).
Under those rules no weight of a dense Qwen2 / Qwen3 has a partial block (every in/out dim is a hidden,
q/k/v or gate/up size), so none is tested here; partial blocks are the converter's and the CPU engine's
concern (tests/unit/test_quant_fp8.py, tests/conformance/test_fp8_gemm_sglang.py). The sync tensors are our
converter's output after the weights moved. For each
engine TP rank and each phase (start-up load, sync 1 over update_weights_from_distributed with a
flattened bucket, sync 2 over update_weights_from_tensor), every byte of every fp8 weight and every
block scale must be where SGLang reads it (the TP rank's slice of the fused parameter), the parameters
must stay the same objects with their weight loaders (what makes the next reload possible), and SGLang's
block_quant_dequant of what it holds must equal our CPU engine's dequantization of what we sent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "modelopt.torch.quantization", reason="nvidia-modelopt not installed (pip install -e '.[modelopt]')"
)

SCRIPT = Path(__file__).with_name("sglang_fp8_reload.py")
BLOCK = 128
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 256, 4, 2, 128, 512  # 2 blocks of hidden; q 4 blocks, k/v 2, gate/up 4
# SGLang module -> (our shards, row-parallel?); qwen2.py stacked_params_mapping
FUSED = {
    "self_attn.qkv_proj": (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], False),
    "mlp.gate_up_proj": (["mlp.gate_proj", "mlp.up_proj"], False),
    "self_attn.o_proj": (["self_attn.o_proj"], True),
    "mlp.down_proj": (["mlp.down_proj"], True),
}


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rank_part(sent: dict, layer: int, module: str, tp: int, rank: int, *, row_parallel: bool):
    """(weight, weight_scale_inv) of TP rank `rank` of one of our modules: a column-parallel shard gives its
    rank's rows (and block rows), a row-parallel module its rank's columns (and block columns)."""
    w, s = sent[f"model.layers.{layer}.{module}.weight"], sent[f"model.layers.{layer}.{module}.weight_scale_inv"]
    dim = 1 if row_parallel else 0
    n, nb = w.shape[dim] // tp, s.shape[dim] // tp
    return w.narrow(dim, rank * n, n), s.narrow(dim, rank * nb, nb)


def _expected(sent: dict, layer: int, fused: str, tp: int, rank: int):
    """What TP rank `rank` must hold in SGLang module `fused`: its shards' parts stacked in shard order,
    each as (weight, weight_scale_inv)."""
    shards, row_parallel = FUSED[fused]
    return [_rank_part(sent, layer, m, tp, rank, row_parallel=row_parallel) for m in shards]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A small Qwen2, its FP8 export, and two syncs of moved weights through Fp8SyncConverter."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_megatron.quant.fp8_export import export_fp8_checkpoint
    from dapo_megatron.quant.fp8_sync import Fp8SyncConverter

    torch.set_num_threads(1)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("fp8_sglang")
    cfg = Qwen2Config(
        hidden_size=HIDDEN,
        head_dim=HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTER,
        num_hidden_layers=2,
        vocab_size=300,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(root / "base")
    export = export_fp8_checkpoint(root / "base", root / "fp8")
    conv = Fp8SyncConverter.from_checkpoint(export)
    syncs = []
    for i in (1, 2):
        gen = torch.Generator().manual_seed(i)
        moved = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in model.state_dict().items()}
        sent = {n: t.contiguous() for n, t in conv.convert(moved.items())}
        save_file(sent, str(root / f"sync{i}.safetensors"))
        syncs.append(sent)
    from safetensors.torch import load_file

    return root, load_file(str(export / "model.safetensors")), syncs


@pytest.mark.parametrize("tp", [1, 2])
def test_sglang_loads_the_export_and_reloads_every_sync_in_place(sglang_installed, checkpoints, tp):
    from safetensors.torch import load_file

    from dapo_megatron.quant.fp8_format import dequantize_block_fp8

    root, start, (sync1, sync2) = checkpoints
    from dapo_megatron.quant.fp8_format import check_sglang_block_shapes

    # the shapes are ones our start-up check lets through (and SGLang's validate_block_quant_shapes below)
    check_sglang_block_shapes(json.loads((root / "fp8" / "config.json").read_text()), tp_size=tp)
    out = root / f"out_tp{tp}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(root / "fp8"),
            str(root / "sync1.safetensors"),
            str(root / "sync2.safetensors"),
            str(out),
            "--tp-size",
            str(tp),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert sorted(report) == [str(r) for r in range(tp)]
    for rank in range(tp):
        info = report[str(rank)]["info"]
        # --quantization fp8 agrees with the checkpoint (ModelConfig._verify_quantization); Fp8Config block
        # quant serves every Linear; the NVIDIA branch of process_weights_after_loading_block_quant ran
        assert info["quantization"] == "fp8" and info["quant_config"] == "Fp8Config"
        assert info["weight_block_size"] == [BLOCK, BLOCK] and "Fp8LinearMethod" in info["linear_methods"]
        assert "ModelOptFp8LinearMethod" not in info["linear_methods"]
        assert info["branch"] == {
            "cpu_amx": False,
            "fnuz": False,
            "marlin": False,
            "mxfp8": False,
            "block_fp8_as_mxfp8": False,
            "block_quant": True,
            "gemm": "triton_w8a8_block_fp8_linear",
            "ue8m0_requant": False,
        }
        phases = report[str(rank)]["phases"]
        for phase in ("sync1", "sync2"):
            assert phases[phase]["result"]["begin"] and phases[phase]["result"]["end"]
            assert phases[phase]["result"]["update"], phases[phase]["result"]["message"]
        # same Parameter objects, still with their weight loaders, after every process_weights_after_loading
        assert phases["start"]["params"] == phases["sync1"]["params"] == phases["sync2"]["params"]
        for name, p in phases["start"]["params"].items():
            assert p["has_weight_loader"], name
            assert p["class"] == ("ModelWeightParameter" if name.endswith(".weight") else "BlockQuantScaleParameter")
        for phase, sent in (("start", start), ("sync1", sync1), ("sync2", sync2)):
            held = load_file(str(out / f"rank{rank}_{phase}.safetensors"))
            for layer in range(2):
                for fused in FUSED:
                    prefix = f"model.layers.{layer}.{fused}"
                    parts = _expected(sent, layer, fused, tp, rank)
                    want_w, want_s = torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts])
                    assert phases[phase]["params"][f"{prefix}.weight"]["dtype"] == "float8_e4m3fn"
                    assert torch.equal(held[f"{prefix}.weight"], _u8(want_w)), (phase, rank, prefix)
                    assert torch.equal(held[f"{prefix}.weight_scale_inv"], want_s), (phase, rank, prefix)
                    # SGLang's dequantization of what it holds == ours of what we sent (parts are whole blocks)
                    ours = torch.cat([dequantize_block_fp8(w, s) for w, s in parts])
                    assert torch.equal(held[f"{prefix}.dequant"], ours), (phase, rank, prefix)
    # the syncs really changed what the engine holds (the test would pass vacuously otherwise)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(_u8(sync1[q]), _u8(start[q])) and not torch.equal(_u8(sync2[q]), _u8(sync1[q]))
