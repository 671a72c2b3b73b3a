"""FP8 rollout weights (dapo_megatron/quant): modelopt's export of the tiny Qwen2, the per-sync conversion,
dequantization, and the log-prob mismatch fp8 weights cause.

    python -m pytest -q tests/unit/test_quant_fp8.py
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt not installed (pip install -e '.[modelopt]')")

from dapo_megatron.quant import Fp8SyncConverter, dequantize_fp8, export_fp8_checkpoint  # noqa: E402

E4M3_MAX = 448.0  # largest finite float8_e4m3fn (1.75 * 2**8)
CALIB = ["Q: 12 + 7 = ?", "Q: 3 * 4 = ?", "Q: 40 - 13 = ?"]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _load_dir(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Qwen2 (fp32, random init) and its modelopt FP8 export."""
    from dapo_megatron.tiny import build_tiny_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fp8")
    model_dir = build_tiny_model(root, seed=3)
    export_dir = export_fp8_checkpoint(model_dir, root / "fp8", calib_texts=CALIB)
    return model_dir, export_dir, _load_dir(export_dir)


def test_export_layout_is_what_sglang_modelopt_fp8_loads(tiny):
    """Names/dtypes/shapes that SGLang 0.5.21's ModelOptFp8LinearMethod.create_weights registers per
    Linear (weight fp8 [out, in], weight_scale and input_scale one fp32 per logical shard) and the
    config sections ModelOptFp8Config.from_config reads (srt/layers/quantization/modelopt_quant.py)."""
    model_dir, export_dir, sd = tiny
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict()
    for layer in range(2):
        for lin in LINEARS:
            m = f"model.layers.{layer}.{lin}"
            w = sd[f"{m}.weight"]
            assert w.dtype == torch.float8_e4m3fn and w.shape == ref[f"{m}.weight"].shape
            for scale in ("weight_scale", "input_scale"):
                s = sd[f"{m}.{scale}"]
                assert s.dtype == torch.float32 and s.shape == () and s.item() > 0
            # per-tensor max scaling: max|w_bf16| maps onto 448, and the largest fp8 code is +-448
            assert sd[f"{m}.weight_scale"].item() == pytest.approx(ref[f"{m}.weight"].abs().max().item() / E4M3_MAX, rel=1e-6)
            assert w.float().abs().max().item() == E4M3_MAX
        # q/k/v read the same input (and gate/up): one activation scale, as a fused qkv_proj needs
        qkv = [sd[f"model.layers.{layer}.self_attn.{p}_proj.input_scale"] for p in "qkv"]
        assert qkv[0] == qkv[1] == qkv[2]
        assert sd[f"model.layers.{layer}.mlp.gate_proj.input_scale"] == sd[f"model.layers.{layer}.mlp.up_proj.input_scale"]
    # modelopt's disabled list: embeddings, norms, biases and lm_head stay bf16, unscaled
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.bias"):
        assert sd[name].dtype == torch.bfloat16
    assert not any(k.startswith(("lm_head.", "model.embed_tokens.")) and "scale" in k for k in sd)
    nested = json.loads((export_dir / "hf_quant_config.json").read_text())["quantization"]
    assert nested["quant_algo"] == "FP8" and set(nested["exclude_modules"]) == {"lm_head", "model.embed_tokens"}
    flat = json.loads((export_dir / "config.json").read_text())["quantization_config"]
    assert flat["quant_method"] == "modelopt" and flat["quant_algo"] == "FP8"
    assert set(flat["ignore"]) == {"lm_head", "model.embed_tokens"}


def test_sglang_modelopt_config_reads_export(tiny):
    """SGLang's own ModelOptFp8Config parses both config forms and excludes lm_head/embeddings."""
    mq = pytest.importorskip("sglang.srt.layers.quantization.modelopt_quant",
                             reason="sglang 0.5.21 not importable here (GPU-cluster dependency; CPU venvs lack its deps)")
    _, export_dir, _ = tiny
    for raw in (json.loads((export_dir / "hf_quant_config.json").read_text()),
                json.loads((export_dir / "config.json").read_text())["quantization_config"]):
        cfg = mq.ModelOptFp8Config.from_config(raw)
        assert cfg.is_checkpoint_fp8_serialized
        assert cfg.is_layer_excluded("lm_head") and not cfg.is_layer_excluded("model.layers.0.self_attn.qkv_proj")


def test_dequantize_hand_checked():
    """E4M3 has 3 mantissa bits: 0.3 = 1.2 * 2**-2 lies between codes 0.28125 and 0.3125 (step 2**-5)
    and rounds to 0.3125; 1.0 and 448 are exact; times the scale."""
    w = torch.tensor([0.3, 1.0, 448.0, -0.3]).to(torch.float8_e4m3fn)
    out = dequantize_fp8(w, torch.tensor(0.5))
    assert out.tolist() == [0.15625, 0.5, 224.0, -0.15625]
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(torch.ones(2), torch.tensor(1.0))


def test_dequantized_weights_within_fp8_error(tiny):
    """Error bound from the format. modelopt's to_quantized_weight computes (w_bf16 / scale) in bf16
    (a 0-dim fp32 scale does not promote a bf16 tensor) and then casts to E4M3, so two roundings:
    bf16 (8 mantissa bits) errs by <= 2**-9 relative, then E4M3 (3 mantissa bits) by half a step,
    <= 2**-4 relative for normals; below the smallest normal (2**-6) the E4M3 step is the subnormal
    2**-9, half of it 2**-10 absolute. Times the per-tensor scale:
        |dequant - w| <= max(|w| (2**-4 + 2**-9 + 2**-13), scale 2**-10 + |w| 2**-9)   (+ fp32 dequant: 2**-22 |w|)."""
    model_dir, _, sd = tiny
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict()
    worst = 0.0
    for name, w in sd.items():
        if w.dtype != torch.float8_e4m3fn:
            continue
        module = name.removesuffix(".weight")
        scale = sd[f"{module}.weight_scale"]
        orig = ref[name].float()
        err = (dequantize_fp8(w, scale) - orig).abs()
        a = orig.abs()
        bound = torch.maximum(a * (2**-4 + 2**-9 + 2**-13), scale * 2**-10 + a * 2**-9) + a * 2**-22
        assert bool((err <= bound).all()), name
        worst = max(worst, (err / bound).max().item())
    assert 0.5 < worst <= 1.0  # the bound is tight: some element errs by more than half of it


def test_sync_conversion_equals_modelopt_export_bit_for_bit(tiny, tmp_path):
    """After a 'training step' (weights moved), converting the actor's fp32 weights gives the same fp8
    bytes and weight scales as quantizing + exporting that model with modelopt; input scales stay the
    engine checkpoint's (a sync has no activations to calibrate)."""
    model_dir, export_dir, base_sd = tiny
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.abs().mean() * 0.3)
    model.save_pretrained(tmp_path / "stepped")
    from dapo_megatron.tiny import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(tmp_path / "stepped")
    expected = _load_dir(export_fp8_checkpoint(tmp_path / "stepped", tmp_path / "stepped_fp8", calib_texts=CALIB))

    conv = Fp8SyncConverter.from_checkpoint(export_dir)
    got = dict(conv.convert(model.state_dict().items()))
    assert set(got) == set(expected)
    n_fp8 = 0
    for name, t in got.items():
        ref = base_sd[name] if name.endswith(".input_scale") else expected[name]
        assert t.dtype == ref.dtype and torch.equal(_bits(t), _bits(ref)), name
        n_fp8 += t.dtype == torch.float8_e4m3fn
    assert n_fp8 == 2 * len(LINEARS)
    # the step really changed the quantized bytes (the test would pass vacuously otherwise)
    assert not torch.equal(_bits(got["model.layers.0.mlp.up_proj.weight"]), _bits(base_sd["model.layers.0.mlp.up_proj.weight"]))


def _token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_fp8_weight_logprob_mismatch_nonzero_and_bounded(tiny):
    """Per-token log-prob |fp8-weight model - fp32 model| on the tiny model's own samples: fp8 weights
    (dequantized per tensor, activations kept fp32, as the CPU engine will) change every log-prob a
    little and none by much. Measured 2026-11-23: see docs/benchmarks.md."""
    model_dir, _, sd = tiny
    from transformers import AutoModelForCausalLM

    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    fp8 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = fp8.state_dict()
    with torch.no_grad():
        for name, w in sd.items():
            if w.dtype == torch.float8_e4m3fn:
                state[name].copy_(dequantize_fp8(w, sd[name.removesuffix(".weight") + ".weight_scale"]))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 261, (8, 48), generator=gen)
    with torch.no_grad():
        diff = (_token_logprobs(fp8, ids) - _token_logprobs(fp32, ids)).abs()
    print(f"fp8-weight log-prob mismatch: mean {diff.mean().item():.3e} max {diff.max().item():.3e}")
    assert diff.mean().item() > 1e-5  # the quantization really happened
    assert diff.max().item() < 0.05  # and stays small


def test_rollout_quantization_key_is_validated():
    from dapo_megatron.config import config_from_dict

    assert config_from_dict({"rollout": {"quantization": "fp8", "engine": "cpu"}}).rollout.quantization == "fp8"
    assert config_from_dict({}).rollout.quantization == "none"
    with pytest.raises(ValueError, match=r"rollout\.quantization.*'int3'.*none, fp8"):
        config_from_dict({"rollout": {"quantization": "int3"}})
    # SGLang 0.5.21 cannot hot-reload modelopt FP8 (docs/fp8.md): refused before anything starts
    with pytest.raises(ValueError, match=r"rollout\.quantization.*'fp8'.*rollout\.engine=cpu only.*restore_weights"):
        config_from_dict({"rollout": {"quantization": "fp8", "engine": "sglang"}})


def test_converter_refuses_a_checkpoint_without_modelopt_config(tmp_path):
    with pytest.raises(ValueError, match="hf_quant_config.json"):
        Fp8SyncConverter.from_checkpoint(tmp_path)


def test_cpu_engine_serves_the_fp8_export_dequantized_per_matmul(tiny):
    """The CPU engine started from the export holds float8 weights + fp32 scales (1 byte per fp8
    element), and its logits equal, bit for bit, those of an fp32 model whose quantized Linears hold
    dequantize_fp8(weight, scale) and whose other tensors are the export's bf16 values: the weight
    error is exactly modelopt's."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.rollout.cpu_engine import CpuEngine, WeightError

    model_dir, export_dir, sd = tiny
    engine = CpuEngine(str(export_dir), dtype="float32")
    specs = engine.parameter_specs()
    fp8 = [n for n, t in sd.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 14 and all(specs[n]["dtype"] == "float8_e4m3fn" for n in fp8)
    assert all(specs[n.removesuffix(".weight") + ".weight_scale"]["dtype"] == "float32" for n in fp8)
    assert set(specs) == set(sd)  # the checkpoint's names, nothing more or less
    expected_bytes = sum(t.numel() * (1 if t.dtype == torch.float8_e4m3fn else 4) for t in sd.values())
    assert engine.resident_weight_bytes() == expected_bytes
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = ref.state_dict()
    with torch.no_grad():
        for name, t in sd.items():
            if name in state:
                scale = sd.get(name.removesuffix(".weight") + ".weight_scale")
                src = dequantize_fp8(t, scale) if name in fp8 else t.float()
                state[name].copy_(src)
    ids = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 4]])
    with torch.no_grad():
        want = ref(ids).logits
        assert torch.equal(engine.model(ids).logits, want)
    # release / resume (the colocated placement's cycle) frees the fp8 storage too; a sync of the
    # export's own tensors (what the converter sends for the base weights) restores the same logits
    engine.release(["weights"])
    assert engine.resident_weight_bytes() == 0
    engine.resume(["weights"])
    engine.load_weights(list(sd.items()))
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, want)
    # a float value into a float8 parameter would skip the scale; a float8 one into a plain one too
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(WeightError, match=r"dtype mismatch for 'model.layers.0.self_attn.q_proj.weight'.*float32"):
        engine.load_weights([(q, torch.zeros(specs[q]["shape"]))])
    with pytest.raises(WeightError, match=r"dtype mismatch for 'lm_head.weight'.*float8_e4m3fn"):
        engine.load_weights([("lm_head.weight", torch.zeros(specs["lm_head.weight"]["shape"]).to(torch.float8_e4m3fn))])



def test_slurm_engine_array_refuses_fp8():
    """Slurm's engine array would start engines from the base model: an fp8 run is refused at render."""
    from pathlib import Path

    from dapo_megatron.config import load_config
    from dapo_megatron.launch.render import render_rollout_array

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "runs" / "tiny_cpu_fp8.yaml")
    with pytest.raises(ValueError, match=r"rollout\.quantization.*fp8.*dapo-megatron train.*not through Slurm"):
        render_rollout_array(cfg, register_dir="/tmp/engines")
