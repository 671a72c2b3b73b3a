"""The larger-model presets (Qwen3-8B-Base, Qwen3-32B, Llama-3.1-8B): each loads, resolves its model from
the committed config.json copies (memplan/models/*.json) into the architecture of the published checkpoint
(parameter counts computed by hand from config.json below), and its memory plan fits 80 GiB in both
placements with the numbers its header comment quotes. The Llama copy's RoPE scaling goes through
transformers and actor/model.py's llama3 rules to the factor megatron-core gets.
(Dense Qwen3 and Llama3-RoPE actors against transformers: tests/distributed/test_moe_parity.py and
test_model_parity.py::test_llama3_rope_scaling_matches_transformers.)"""

import json
import warnings
from pathlib import Path

import pytest

from dapo_megatron.config import load_config, validate
from dapo_megatron.memplan.arch import KNOWN_MODELS_DIR, dims_from_hf_config, model_dims_for
from dapo_megatron.memplan.engine import GIB, engine_memory
from dapo_megatron.memplan.plan import build_plan
from dapo_megatron.memplan.static import total_params

RUNS = Path(__file__).resolve().parents[2] / "configs" / "runs"
Q3_8B, Q3_32B, LLAMA = (
    str(RUNS / name) for name in ("qwen3-8b_dapo.yaml", "qwen3-32b_dapo.yaml", "llama3.1-8b_dapo.yaml")
)


def _load(path, overrides=()):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(path, list(overrides))


def _layer(h, q, kv, ffn, qk_norm_dim=0):
    """One decoder layer: input and pre-MLP RMSNorm (h each), Q (q x h), K and V (kv x h each), O (h x q),
    SwiGLU (3 x ffn x h), and Qwen3's q/k RMSNorms (head_dim each). No biases (Qwen3, Llama)."""
    return 2 * h + q * h + 2 * kv * h + h * q + 3 * ffn * h + 2 * qk_norm_dim


# (preset, committed copy, model_type, hidden, ffn, layers, heads, kv heads, head_dim, vocab, qk_norm,
#  parameters by hand, the model card's size)
ARCHS = [
    # Qwen3-8B(-Base): 36 x (2*4096 + 4096*4096 + 2*1024*4096 + 4096*4096 + 3*12288*4096 + 2*128) = 36 x 192,946,432
    # = 6,946,071,552 ("non-embedding 6.95B") + embedding and untied head 2 x 151936*4096 + final norm 4096
    # = 8,190,735,360: "8.2B"
    (
        Q3_8B,
        "Qwen3-8B-Base.json",
        "qwen3",
        4096,
        12288,
        36,
        32,
        8,
        128,
        151936,
        True,
        36 * _layer(4096, 4096, 1024, 12288, 128) + 2 * 151936 * 4096 + 4096,
        8_190_735_360,
    ),
    # Qwen3-32B: 64 x (2*5120 + 8192*5120 + 2*1024*5120 + 5120*8192 + 3*25600*5120 + 2*128) = 64 x 487,598,336
    # = 31,206,293,504 ("non-embedding 31.2B") + 2 x 151936*5120 + 5120 = 32,762,123,264: "32.8B"
    (
        Q3_32B,
        "Qwen3-32B.json",
        "qwen3",
        5120,
        25600,
        64,
        64,
        8,
        128,
        151936,
        True,
        64 * _layer(5120, 8192, 1024, 25600, 128) + 2 * 151936 * 5120 + 5120,
        32_762_123_264,
    ),
    # Llama-3.1-8B: 32 x (2*4096 + 4096*4096 + 2*1024*4096 + 4096*4096 + 3*14336*4096) = 32 x 218,112,000
    # = 6,979,584,000 + 2 x 128256*4096 + 4096 = 8,030,261,248: "8.03B"
    (
        LLAMA,
        "Llama-3.1-8B.json",
        "llama",
        4096,
        14336,
        32,
        32,
        8,
        128,
        128256,
        False,
        32 * _layer(4096, 4096, 1024, 14336) + 2 * 128256 * 4096 + 4096,
        8_030_261_248,
    ),
]


@pytest.mark.parametrize("row", ARCHS, ids=lambda r: Path(r[0]).stem)
def test_preset_resolves_its_model_from_the_committed_copy(row):
    path, copy, model_type, hidden, ffn, layers, heads, kv_heads, head_dim, vocab, qk_norm, by_hand, published = row
    cfg = _load(path)
    validate(cfg)
    assert cfg.model.arch == model_type
    dims = model_dims_for(cfg)
    assert f"committed copy {copy}" in dims.source and "is not on this machine" in dims.source
    assert (
        dims.model_type,
        dims.hidden,
        dims.ffn,
        dims.layers,
        dims.heads,
        dims.kv_heads,
        dims.head_dim,
        dims.vocab,
    ) == (model_type, hidden, ffn, layers, heads, kv_heads, head_dim, vocab)
    assert (dims.tied, dims.qkv_bias, dims.qk_norm, dims.is_moe, dims.dtype_bytes) == (False, False, qk_norm, False, 2)
    assert total_params(dims) == by_hand == published


def test_qwen3_8b_post_trained_copy_has_the_base_models_shapes():
    """model.path=/shared/models/Qwen3-8B (the hybrid-thinking model) plans like the base model: of the fields
    copied, the two config.json files differ only in max_position_embeddings (40960 / 32768)."""
    base = json.loads((KNOWN_MODELS_DIR / "Qwen3-8B-Base.json").read_text())
    post = json.loads((KNOWN_MODELS_DIR / "Qwen3-8B.json").read_text())
    assert {k for k in base if base[k] != post.get(k)} == {"_source", "max_position_embeddings"}
    dims = model_dims_for(_load(Q3_8B, ["model.path=/shared/models/Qwen3-8B"]))
    assert "committed copy Qwen3-8B.json" in dims.source and total_params(dims) == 8_190_735_360


# (preset, colocated peak and its phase, colocated train phase, disaggregated trainer peak, engine GPU peak,
#  engine KV tokens): the numbers each preset's header quotes
PLANS = [
    (Q3_8B, 71.59, 49.12, 48.62, 70.41, 704_460),
    (Q3_32B, 72.34, 20.00, 21.00, 71.45, 667_533),
    (LLAMA, 71.59, 45.77, 45.27, 70.23, 794_967),
]


@pytest.mark.parametrize("path,peak,train,trainer,engine_gpu,kv_tokens", PLANS, ids=[Path(p[0]).stem for p in PLANS])
def test_preset_plan_fits_80_gib_in_both_placements(path, peak, train, trainer, engine_gpu, kv_tokens):
    """The colocated peak is the rollout (0.7 x 80 GiB static pool + SGLang's reserve + the trainer's 2.34 GiB
    that stay); disaggregated, the trainer and engine GPUs each fit too."""
    cfg = _load(path)
    plan = build_plan(cfg)
    assert plan.fits and plan.placement == "colocated" and not plan.problems
    (colocated,) = plan.tables["colocated"]
    top, phase = colocated.peak()
    assert phase == "rollout" and top / GIB == pytest.approx(peak, abs=0.005)
    assert colocated.total("train") / GIB == pytest.approx(train, abs=0.005)
    trainer_gpus, engine_gpus = plan.tables["disaggregated"]
    assert trainer_gpus.peak()[0] / GIB == pytest.approx(trainer, abs=0.005)
    assert engine_gpus.peak()[0] / GIB == pytest.approx(engine_gpu, abs=0.005)
    assert max(t.peak()[0] for tables in plan.tables.values() for t in tables) <= 80 * GIB
    engine = engine_memory(
        model_dims_for(cfg),
        engine_tp=cfg.rollout.engine_tp,
        mem_fraction_static=cfg.rollout.mem_fraction_static,
        gpu_bytes=80 * GIB,
    )
    # KV per token per GPU: layers x (K, V) x KV heads per engine TP rank x 128 x 2 B
    per_token = {Q3_8B: 36 * 2 * 4 * 128 * 2, Q3_32B: 64 * 2 * 2 * 128 * 2, LLAMA: 32 * 2 * 4 * 128 * 2}[path]
    assert engine.kv_bytes_per_token == per_token
    assert engine.kv_tokens == kv_tokens == (int(0.7 * 80 * GIB) - engine.weights) // per_token


@pytest.mark.parametrize("path,over", [(Q3_8B, 92.15), (LLAMA, 85.51)], ids=["qwen3-8b", "llama3.1-8b"])
def test_8b_presets_need_tp4(path, over):
    """Why TP=4: at TP=2 (DP=16) the train phase (weights, grads and selective-recompute activations per GPU
    all double) passes 80 GiB."""
    plan = build_plan(_load(path, ["actor.tp=2"]))
    assert not plan.fits
    assert plan.tables["colocated"][0].total("train") / GIB == pytest.approx(over, abs=0.005)
    assert any(p.startswith("colocated / train") for p in plan.problems)


def test_qwen3_32b_selective_recompute_would_fit():
    """The header's alternative: selective recompute keeps 49.18 GiB of activations on stage 0 (2 micro-batches
    in flight x 32 layers) and the train phase is 67.28 GiB, still under 80."""
    plan = build_plan(_load(Q3_32B, ["actor.recompute=selective"]))
    table = plan.tables["colocated"][0]
    assert plan.fits
    assert table.rows["activations saved for backward"]["train"] / GIB == pytest.approx(49.18, abs=0.005)
    assert table.total("train") / GIB == pytest.approx(67.28, abs=0.005)


def test_llama_copy_rope_scaling_reaches_megatron_as_factor_8(tmp_path):
    """The committed Llama-3.1-8B config.json (rope_scaling as on the Hub) read by transformers passes
    actor/model.py's llama3 rules (megatron-core hard-codes low 1, high 4, original 8192) and gives the actor
    rotary base 500000 with scaling factor 8; the weight mapping reads it as a bias-free llama."""
    from transformers import AutoConfig

    from dapo_megatron.actor.model import _MEGATRON_LLAMA3_ROPE, rope_settings_of
    from dapo_megatron.weights.hf_config import has_qk_norm, has_qkv_bias, model_type_of

    config = json.loads((KNOWN_MODELS_DIR / "Llama-3.1-8B.json").read_text())
    scaling = config["rope_scaling"]
    assert {k: scaling[k] for k in _MEGATRON_LLAMA3_ROPE} == _MEGATRON_LLAMA3_ROPE
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "_source"}))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert rope_settings_of(hf) == (500000.0, 8.0)
    assert model_type_of(hf) == "llama" and not has_qkv_bias(hf) and not has_qk_norm(hf)
    for name in ("Qwen3-8B-Base", "Qwen3-32B"):
        qwen = {k: v for k, v in json.loads((KNOWN_MODELS_DIR / f"{name}.json").read_text()).items() if k != "_source"}
        (tmp_path / "config.json").write_text(json.dumps(qwen))
        hf = AutoConfig.from_pretrained(tmp_path)
        assert rope_settings_of(hf) == (1000000.0, None)
        assert model_type_of(hf) == "qwen3" and has_qk_norm(hf) and not has_qkv_bias(hf)


def test_every_committed_copy_is_read_into_a_modelled_architecture():
    """Each memplan/models/*.json names its source and is a model the plan (and the actor) builds."""
    for path in sorted(KNOWN_MODELS_DIR.glob("*.json")):
        config = json.loads(path.read_text())
        assert config["_source"].startswith("https://huggingface.co/") and "/blob/main/config.json" in config["_source"]
        assert path.stem in config["_source"], path.name
        dims = dims_from_hf_config(config, name=path.stem, source=str(path))
        assert total_params(dims) > 1e9
