"""FP8 rollout weights (dapo_megatron/quant): modelopt's 128 x 128 block-FP8 export of the tiny Qwen2 in
SGLang's `fp8` layout, the per-sync conversion, block dequantization, the CPU engine serving it (SGLang's
GEMM: dynamic fp8 activations too), and the log-prob mismatch fp8 weights and activations cause.

    python -m pytest -q tests/unit/test_quant_fp8.py
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip(
    "modelopt.torch.quantization", reason="nvidia-modelopt not installed (pip install -e '.[modelopt]')"
)

from dapo_megatron.quant.fp8_export import export_fp8_checkpoint  # noqa: E402
from dapo_megatron.quant.fp8_format import BLOCK, check_sglang_block_shapes, dequantize_block_fp8  # noqa: E402
from dapo_megatron.quant.fp8_sync import Fp8SyncConverter  # noqa: E402

E4M3_MAX = 448.0  # largest finite float8_e4m3fn (1.75 * 2**8)
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


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
    """The tiny Qwen2 (fp32, random init) and its block-FP8 export."""
    from dapo_megatron.data.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fp8")
    model_dir = build_tiny_model(root, seed=3)
    export_dir = export_fp8_checkpoint(model_dir, root / "fp8")
    return model_dir, export_dir, _load_dir(export_dir)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """max|w| of every 128 x 128 block (the last row / column of blocks may be partial)."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32)
    padded[:n, :k] = w.float().abs()
    return padded.reshape(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3))


def test_export_layout_is_what_sglang_fp8_loads(tiny):
    """Names/dtypes/shapes SGLang 0.5.21's Fp8LinearMethod.create_weights registers per Linear (weight fp8
    [out, in], weight_scale_inv fp32 [ceil(out/128), ceil(in/128)]), the config Fp8Config.from_config
    reads, and the scale values: max|w_bf16| of the block / 448, except where modelopt's export gives the
    one-block Linears that read one input a common amax (q/k/v of the tiny model: preprocess_linear_fusion)."""
    model_dir, export_dir, sd = tiny
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict()
    for layer in range(2):
        amax = {}
        for lin in LINEARS:
            m = f"model.layers.{layer}.{lin}"
            w, s = sd[f"{m}.weight"], sd[f"{m}.weight_scale_inv"]
            assert w.dtype == torch.float8_e4m3fn and w.shape == ref[f"{m}.weight"].shape
            assert s.dtype == torch.float32 and tuple(s.shape) == (-(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK))
            assert f"{m}.weight_scale" not in sd and f"{m}.input_scale" not in sd  # weight-only, SGLang's names
            amax[lin] = _blocks(ref[f"{m}.weight"])
        qkv = [f"self_attn.{p}_proj" for p in "qkv"]
        assert all(amax[p].numel() == 1 for p in qkv)  # one block each (128 x 128, 64 x 128)
        shared = max(amax[p].item() for p in qkv) / E4M3_MAX
        for lin in LINEARS:
            m = f"model.layers.{layer}.{lin}"
            want = torch.full_like(amax[lin], shared) if lin in qkv else amax[lin] / E4M3_MAX
            assert torch.equal(sd[f"{m}.weight_scale_inv"], want), m
            # the block(s) owning the scale's max|w| map it onto the largest fp8 code, +-448
            if lin not in qkv or amax[lin].item() == shared * E4M3_MAX:
                assert sd[f"{m}.weight"].float().abs().max().item() == E4M3_MAX
        assert sd[f"model.layers.{layer}.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)  # 256 x 128: 2 blocks
        assert sd[f"model.layers.{layer}.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    # modelopt's disabled list: embeddings, norms, biases and lm_head stay bf16, unscaled
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ):
        assert sd[name].dtype == torch.bfloat16
    assert not any(k.startswith(("lm_head.", "model.embed_tokens.")) and "scale" in k for k in sd)
    qc = json.loads((export_dir / "config.json").read_text())["quantization_config"]
    assert qc == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "ignored_layers": ["lm_head", "model.embed_tokens"],
    }
    assert not (export_dir / "hf_quant_config.json").exists()  # it would describe modelopt's own names


def test_dequantize_block_hand_checked():
    """E4M3 has 3 mantissa bits: 0.3 = 1.2 * 2**-2 lies between codes 0.28125 and 0.3125 (step 2**-5) and
    rounds to 0.3125; 1, 2, 3 and 448 are exact. Block 2: a 2 x 3 weight has scales [1, 2] (columns 0-1,
    then the partial column 2), each multiplying its own block."""
    w = torch.tensor([[0.3, 1.0, 448.0], [-0.3, 2.0, 3.0]]).to(torch.float8_e4m3fn)
    out = dequantize_block_fp8(w, torch.tensor([[0.5, 2.0]]), block=2)
    assert out.tolist() == [[0.15625, 0.5, 896.0], [-0.15625, 1.0, 6.0]]
    with pytest.raises(ValueError, match=r"needs a scale of shape \(1, 2\), got \(1, 1\)"):
        dequantize_block_fp8(w, torch.tensor([[1.0]]), block=2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_block_fp8(torch.ones(2, 2), torch.ones(1, 1), block=2)


def test_dequantized_weights_within_fp8_error(tiny):
    """Error bound from the format, with s the element's block scale. modelopt's to_quantized_weight
    divides w_bf16 by the scale (in bf16 when the scale is 0-dim, i.e. a one-block weight: a second
    rounding, <= 2**-9 relative; in fp32 otherwise) and casts to E4M3 (3 mantissa bits: half a step,
    <= 2**-4 relative for normals; below the smallest normal 2**-6 the step is the subnormal 2**-9, half
    of it 2**-10 absolute). Times s:
        |dequant - w| <= max(|w| (2**-4 + 2**-9 + 2**-13), s 2**-10 + |w| 2**-9)   (+ fp32 dequant: 2**-22 |w|)."""
    model_dir, _, sd = tiny
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict()
    worst = 0.0
    for name, w in sd.items():
        if w.dtype != torch.float8_e4m3fn:
            continue
        scale = sd[name.removesuffix(".weight") + ".weight_scale_inv"]
        n, k = w.shape
        s_full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
        orig = ref[name].float()
        err = (dequantize_block_fp8(w, scale) - orig).abs()
        a = orig.abs()
        bound = torch.maximum(a * (2**-4 + 2**-9 + 2**-13), s_full * 2**-10 + a * 2**-9) + a * 2**-22
        assert bool((err <= bound).all()), name
        worst = max(worst, (err / bound).max().item())
    assert 0.5 < worst <= 1.0  # the bound is tight: some element errs by more than half of it


def _stepped(model_dir, out_dir, *, seed: int):
    """The model at model_dir after a 'training step' (every weight moved), saved to out_dir."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.abs().mean() * 0.3)
    model.save_pretrained(out_dir)
    return model


def _assert_conversion_equals_export(conv, model, expected) -> int:
    got = dict(conv.convert(model.state_dict().items()))
    assert set(got) == set(expected)
    for name, t in got.items():
        assert t.dtype == expected[name].dtype and torch.equal(_bits(t), _bits(expected[name])), name
    return sum(t.dtype == torch.float8_e4m3fn for t in got.values())


def test_sync_conversion_equals_modelopt_export_bit_for_bit(tiny, tmp_path):
    """After a 'training step' (weights moved), converting the actor's fp32 weights gives the same fp8
    bytes and block scales as quantizing + exporting that model with modelopt, one-block q/k/v with
    their shared amax included."""
    model_dir, export_dir, base_sd = tiny
    model = _stepped(model_dir, tmp_path / "stepped", seed=0)
    expected = _load_dir(export_fp8_checkpoint(tmp_path / "stepped", tmp_path / "stepped_fp8"))
    conv = Fp8SyncConverter.from_checkpoint(export_dir)
    assert _assert_conversion_equals_export(conv, model, expected) == 2 * len(LINEARS)
    # the step really changed the quantized bytes (the test would pass vacuously otherwise)
    assert not torch.equal(
        _bits(expected["model.layers.0.mlp.up_proj.weight"]), _bits(base_sd["model.layers.0.mlp.up_proj.weight"])
    )
    # q/k/v arrive in any order and apart (a bucket boundary): the converter waits for the whole group
    named = list(model.state_dict().items())
    q = next(i for i, (n, _) in enumerate(named) if n == "model.layers.1.self_attn.q_proj.weight")
    reordered = [named[q]] + named[:q] + named[q + 1 :][::-1]
    got = dict(conv.convert(reordered))
    for name in ("model.layers.1.self_attn.q_proj.weight_scale_inv", "model.layers.1.self_attn.v_proj.weight"):
        assert torch.equal(_bits(got[name]), _bits(expected[name]))


def test_sync_conversion_with_dims_not_divisible_by_the_block(tmp_path):
    """hidden 160 (1.25 blocks), intermediate 200 (1.56), 2 KV heads of 40: partial blocks in both
    dimensions, several blocks per weight. Still bit-identical to modelopt's export, and every scale
    has the ceil shape SGLang allocates."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(5)
    cfg = Qwen2Config(
        hidden_size=160,
        intermediate_size=200,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=64,
        architectures=["Qwen2ForCausalLM"],
    )
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "base")
    conv = Fp8SyncConverter.from_checkpoint(export_fp8_checkpoint(tmp_path / "base", tmp_path / "base_fp8"))
    model = _stepped(tmp_path / "base", tmp_path / "stepped", seed=1)
    expected = _load_dir(export_fp8_checkpoint(tmp_path / "stepped", tmp_path / "stepped_fp8"))
    assert _assert_conversion_equals_export(conv, model, expected) == len(LINEARS)
    shapes = {lin: tuple(expected[f"model.layers.0.{lin}.weight_scale_inv"].shape) for lin in LINEARS}
    assert shapes == {
        "self_attn.q_proj": (2, 2),
        "self_attn.k_proj": (1, 2),
        "self_attn.v_proj": (1, 2),
        "self_attn.o_proj": (2, 2),
        "mlp.gate_proj": (2, 2),
        "mlp.up_proj": (2, 2),
        "mlp.down_proj": (2, 2),
    }
    # each partial block's scale is that block's own max: the last column block of down_proj (72 columns)
    w = model.state_dict()["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16)
    assert (
        expected["model.layers.0.mlp.down_proj.weight_scale_inv"][1, 1] == w[128:, 128:].float().abs().max() / E4M3_MAX
    )
    # no engine serves it: SGLang's GEMM asserts K % 128 == 0 at the first forward, the CPU engine at load
    from dapo_megatron.cpu_engine.fp8 import load_fp8_model

    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.mlp.down_proj' takes 200 input features, not a multiple "
        r"of the FP8 block 128",
    ):
        load_fp8_model(tmp_path / "stepped_fp8", dtype=torch.float32)


def _token_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _weight_only_model(model_dir, sd):
    """fp32 model whose quantized Linears hold dequantize_block_fp8(weight, scale): the fp8 weight error alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, w in sd.items():
            if w.dtype == torch.float8_e4m3fn:
                state[name].copy_(dequantize_block_fp8(w, sd[name.removesuffix(".weight") + ".weight_scale_inv"]))
    return model


def test_fp8_logprob_mismatch_nonzero_and_bounded(tiny):
    """Per-token log-prob |fp8 model - fp32 model| on random token sequences, for fp8 weights alone
    (dequantized per block, activations fp32) and for what the CPU engine computes (SGLang's GEMM: fp8
    weights and dynamic fp8 activations per token x 128). Both change every log-prob a little and none by
    much. Measured 2026-11-25 (2-core dev machine): weights only mean 7.8e-3, max 5.1e-2; weights +
    activations mean 1.05e-2, max 5.2e-2. (2026-11-24: per-tensor FP8 weights, the earlier format, 7.9e-3 / 3.5e-2.)"""
    model_dir, export_dir, sd = tiny
    from transformers import AutoModelForCausalLM

    from dapo_megatron.cpu_engine.fp8 import load_fp8_model

    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights_only = _weight_only_model(model_dir, sd)
    engine_model = load_fp8_model(export_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 261, (8, 48), generator=gen)
    with torch.no_grad():
        ref = _token_logprobs(fp32, ids)
        w_diff = (_token_logprobs(weights_only, ids) - ref).abs()
        wa_diff = (_token_logprobs(engine_model, ids) - ref).abs()
    print(
        f"fp8 log-prob mismatch: weights only mean {w_diff.mean().item():.3e} max {w_diff.max().item():.3e}; "
        f"weights + activations mean {wa_diff.mean().item():.3e} max {wa_diff.max().item():.3e}"
    )
    assert w_diff.mean().item() > 1e-5 and wa_diff.mean().item() > w_diff.mean().item()  # both really quantize
    # and stay small: the measured values with ~20% headroom for other machines' fp32 rounding
    assert w_diff.mean().item() < 0.0095 and w_diff.max().item() < 0.062
    assert wa_diff.mean().item() < 0.0126 and wa_diff.max().item() < 0.063


def test_rollout_quantization_key_is_validated():
    from dapo_megatron.config import config_from_dict

    assert config_from_dict({"rollout": {"quantization": "fp8", "engine": "cpu"}}).rollout.quantization == "fp8"
    assert config_from_dict({"rollout": {"quantization": "fp8", "engine": "sglang"}}).rollout.engine == "sglang"
    assert config_from_dict({}).rollout.quantization == "none"
    with pytest.raises(ValueError, match=r"rollout\.quantization.*'int3'.*none, fp8"):
        config_from_dict({"rollout": {"quantization": "int3"}})


def test_sglang_block_shape_rule():
    """Fp8LinearMethod.validate_block_quant_shapes' rule per engine TP rank, on Qwen2.5-7B's shapes
    (hidden 3584 = 28 x 128, 4 KV heads of 128, intermediate 18944 = 148 x 128)."""
    q7b = {
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "architectures": ["Qwen2ForCausalLM"],
    }
    for tp in (1, 2, 4):
        check_sglang_block_shapes(q7b, tp_size=tp)
    with pytest.raises(
        ValueError,
        match=r"q_proj has 448 output features per engine TP rank \(rollout.engine_tp=8; "
        r"also o_proj's input\)",
    ):
        check_sglang_block_shapes(q7b, tp_size=8)  # 3584 / 8 = 448 = 3.5 blocks
    tiny = {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "architectures": ["Qwen2ForCausalLM"],
    }
    with pytest.raises(ValueError, match=r"k_proj has 64 output features"):
        check_sglang_block_shapes(tiny)  # the tiny model runs on CPU engines only
    with pytest.raises(ValueError, match=r"gate_proj has 320 output features"):
        check_sglang_block_shapes(
            {
                "hidden_size": 512,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 128,
                "intermediate_size": 640,
                "architectures": ["Qwen3ForCausalLM"],
            },
            tp_size=2,
        )
    with pytest.raises(
        ValueError,
        match=r"gate_proj has 192 output features .*engine_tp=4; intermediate_size 768 per "
        r"rank, down_proj's input",
    ):
        check_sglang_block_shapes({**q7b, "intermediate_size": 768}, tp_size=4)
    # the GEMM quantizes activations per 128 input channels (asserted at SGLang's first forward): hidden 320
    # (2.5 blocks) is refused even though every output shard is whole blocks
    with pytest.raises(
        ValueError,
        match=r"hidden_size 320 \(the input of q/k/v/gate/up_proj on every engine TP rank, "
        r"rollout.engine_tp=2\) is not a multiple of the FP8 block 128",
    ):
        check_sglang_block_shapes(
            {
                "hidden_size": 320,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 128,
                "intermediate_size": 512,
                "architectures": ["Qwen2ForCausalLM"],
            },
            tp_size=2,
        )
    with pytest.raises(ValueError, match=r"architectures \['LlamaForCausalLM'\] not supported"):
        check_sglang_block_shapes({**q7b, "architectures": ["LlamaForCausalLM"]})


def test_converter_refuses_a_checkpoint_without_block_fp8_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        Fp8SyncConverter.from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}})
    )
    with pytest.raises(ValueError, match=r"config.json: quantization_config=.*is not block FP8"):
        Fp8SyncConverter.from_checkpoint(tmp_path)


def test_sglang_launcher_fp8_starts_from_the_export_only(tiny):
    from dapo_megatron.rollout.sglang_launcher import SGLangSettings, sglang_command

    model_dir, export_dir, _ = tiny
    cmd = sglang_command(SGLangSettings(model_path=str(export_dir), quantization="fp8", python="p"))
    assert cmd[cmd.index("--model-path") + 1] == str(export_dir) and cmd[cmd.index("--quantization") + 1] == "fp8"
    assert "--quantization" not in sglang_command(SGLangSettings(model_path=str(model_dir), python="p"))
    # the base model with --quantization fp8 would be quantized online by SGLang (no reload): refused
    with pytest.raises(ValueError, match=r"config.json: quantization_config=\{\} is not block FP8"):
        sglang_command(SGLangSettings(model_path=str(model_dir), quantization="fp8"))


class _SglangLinearRef(torch.nn.Module):
    """SGLang's triton_w8a8_block_fp8_linear written out again, loop by loop (not fp8_gemm.py's code): per
    token and 128-column group g, s = max(absmax, 1e-10) / 448 and q = clamp(x * (1 / s)) in fp8; per block
    of rows, the tile's exact dot rounded to fp32, times s, times the block scale, added into an fp32
    output; cast to x's dtype; + bias."""

    def __init__(self, weight, scale, bias):
        super().__init__()
        self.weight, self.scale, self.bias = weight, scale, bias

    def forward(self, x):
        n, k = self.weight.shape
        x2 = x.reshape(-1, k).float()
        out = torch.zeros(x2.shape[0], n, dtype=torch.float32)
        for g in range(k // BLOCK):
            cols = slice(g * BLOCK, (g + 1) * BLOCK)
            sx = x2[:, cols].abs().amax(1).clamp_min(1e-10) / E4M3_MAX
            qx = (x2[:, cols] * (1 / sx)[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
            for nb in range(-(-n // BLOCK)):
                rows = slice(nb * BLOCK, min(n, (nb + 1) * BLOCK))
                dot = (qx.double() @ self.weight[rows, cols].double().T).float()
                out[:, rows] += dot * sx[:, None] * self.scale[nb, g]
        out = out.to(x.dtype)
        return (out + self.bias if self.bias is not None else out).reshape(*x.shape[:-1], n)


def test_cpu_engine_serves_the_fp8_export_with_sglangs_gemm(tiny):
    """The CPU engine started from the export holds float8 weights + fp32 block scales (1 byte per fp8
    element, 4 per scale), and its logits equal, bit for bit, those of an fp32 model whose quantized
    Linears compute SGLang's block-FP8 linear (_SglangLinearRef: dynamic fp8 activations, the export's fp8
    weights and scales) and whose other tensors are the export's bf16 values; they differ from a model of
    the dequantized weights with fp32 activations (the activation error is there too)."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.cpu_engine.engine import CpuEngine, WeightError

    model_dir, export_dir, sd = tiny
    engine = CpuEngine(str(export_dir), dtype="float32")
    specs = engine.parameter_specs()
    fp8 = [n for n, t in sd.items() if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 14 and all(specs[n]["dtype"] == "float8_e4m3fn" for n in fp8)
    for n in fp8:
        scale = n.removesuffix(".weight") + ".weight_scale_inv"
        assert specs[scale] == {"dtype": "float32", "shape": list(sd[scale].shape)}
    assert set(specs) == set(sd)  # the checkpoint's names, nothing more or less
    expected_bytes = sum(t.numel() * (1 if t.dtype == torch.float8_e4m3fn else 4) for t in sd.values())
    assert engine.resident_weight_bytes() == expected_bytes
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = ref.state_dict()
    with torch.no_grad():
        for name, t in sd.items():
            if name in state and name not in fp8:
                state[name].copy_(t.float())
    for name in fp8:
        module = name.removesuffix(".weight")
        parent, _, leaf = module.rpartition(".")
        bias = sd.get(f"{module}.bias")
        setattr(
            ref.get_submodule(parent),
            leaf,
            _SglangLinearRef(sd[name], sd[f"{module}.weight_scale_inv"], None if bias is None else bias.float()),
        )
    ids = torch.tensor([[1, 17, 42, 99, 7, 250, 3, 4]])
    with torch.no_grad():
        want = ref(ids).logits
        assert torch.equal(engine.model(ids).logits, want)
        assert not torch.allclose(_weight_only_model(model_dir, sd)(ids).logits, want, rtol=0, atol=1e-4)
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
    with pytest.raises(WeightError, match=r"shape mismatch for 'model.layers.0.mlp.up_proj.weight_scale_inv'"):
        engine.load_weights([("model.layers.0.mlp.up_proj.weight_scale_inv", torch.ones(1, 1))])


def test_slurm_runs_start_fp8_engines_from_the_export(tmp_path):
    """Engine arrays start from <output_dir>/rollout_fp8 (SGLang with --quantization fp8) after an
    fp8_export job wrote it (afterok); colocated engines start from it too (the trainer job exports it
    first, slurm/_trainer_launch.sh); every script is valid bash."""
    import subprocess
    from pathlib import Path

    from dapo_megatron.config import load_config
    from dapo_megatron.launch.slurm import colocated, render, submit

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(
        repo / "configs/runs/qwen2.5-7b_dapo.yaml",
        ["rollout.quantization=fp8", f"trainer.output_dir={tmp_path / 'run'}"],
    )
    plan = submit.plan_train(cfg, engines=2)
    assert [(j.role, j.dependency) for j in plan.jobs] == [
        ("fp8_export", None),
        ("engines", ("afterok", "fp8_export")),
        ("train", ("after", "engines")),
    ]
    export, array, train = (j.script({"engines": "12"}) for j in plan.jobs)
    assert f"MODEL={tmp_path / 'run' / 'rollout_fp8'}\n" in array and "QUANTIZATION=fp8\n" in array
    assert '-m dapo_megatron.launch.slurm.fp8_export "$CONFIG"' in export and "--gpus-per-node" not in export
    assert 'dapo_megatron.launch.slurm.fp8_export "$CONFIG" "${MODEL_ARGS[@]}" --colocated-only' in train
    for text in (export, array, train):
        assert subprocess.run(["bash", "-n"], input=text.encode()).returncode == 0
    plain = render.render_rollout_array(load_config(repo / "configs/runs/qwen2.5-7b_dapo.yaml"), register_dir="/r")
    assert "QUANTIZATION=''" in plain and "rollout_fp8" not in plain
    coloc = load_config(
        repo / "configs/runs/qwen2.5-7b_dapo.yaml", ["rollout.quantization=fp8", "rollout.placement=colocated"]
    )
    cmd = colocated.engine_commands(coloc, host="h")[0]
    assert cmd[cmd.index("--model") + 1].endswith("/rollout_fp8") and cmd[cmd.index("--quantization") + 1] == "fp8"
