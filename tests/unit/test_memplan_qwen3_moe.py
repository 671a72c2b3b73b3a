"""The memory plan on Qwen3 dense and Qwen3-MoE: hand-computed static bytes of the Qwen3-30B-A3B preset
(TP=4 x EP=8, ETP=1, DP=8, expert-DP=4), its verdict (fits, with the peak and its phase), why full
recompute, tiny_cpu_moe's verdict, the layout checks, and SGLang's per-GPU weights of the MoE model.
(The real-Megatron comparisons are in tests/distributed/test_memplan_moe.py.)"""

import warnings
from pathlib import Path

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.memplan.arch import dims_from_hf_config, model_dims_for
from dapo_megatron.memplan.engine import GIB, engine_weight_bytes
from dapo_megatron.memplan.plan import build_plan
from dapo_megatron.memplan.static import Layout, expert_params, static_bytes, total_params

REPO = Path(__file__).resolve().parents[2]
A3B = str(REPO / "configs" / "runs" / "qwen3-30b-a3b_dapo.yaml")
TINY_MOE = str(REPO / "configs" / "runs" / "tiny_cpu_moe.yaml")


def _load(path, overrides=()):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(path, list(overrides))


def test_30b_a3b_dims_and_parameter_count():
    dims = model_dims_for(_load(A3B))
    assert "committed copy Qwen3-30B-A3B-Base.json" in dims.source
    assert (dims.num_experts, dims.topk, dims.moe_ffn, dims.num_sparse_layers, dims.head_dim) == (128, 8, 768, 48, 128)
    # experts: 48 layers x 128 experts x 3 x 768 x 2048 = 28.99B; with attention (q/k norms included), the
    # routers, the embedding and the untied head: 30.53B, the model card's "30.5B"
    assert expert_params(dims) == 48 * 128 * 3 * 768 * 2048 == 28_991_029_248
    assert total_params(dims) == 30_532_122_624


def test_30b_a3b_static_bytes_by_hand():
    """Per GPU at TP=4, EP=8, ETP=1, DP=8 (EDP = 32 / (1*8*1) = 4), bf16, distributed optimizer.
    Dense buffer: embedding and LM head 151936*2048/4 = 77,791,232 each, final norm 2048, per layer
    input norm 2048 + proj 2048*4096/4 + QKV (4096 + 2*512)*2048/4 + q/k norms 2*128 + pre-MLP norm 2048
    + router 128*2048 = 4,985,088 -> 394,868,736 elements (all multiples of 64; total of 128: no padding).
    Expert buffer: 16 experts x 3*768*2048 x 48 layers = 3,623,878,656 (a multiple of 128).
    Distributed Adam: dense / DP 8, experts / EDP 4."""
    dims = model_dims_for(_load(A3B))
    layout = Layout(tp=4, dp=8, ep=8, etp=1, sequence_parallel=True)
    assert layout.expert_dp == 4
    dense = 2 * 77_791_232 + 2048 + 48 * (2048 + 2048 * 4096 // 4 + 5120 * 2048 // 4 + 256 + 2048 + 128 * 2048)
    experts = 48 * 16 * 3 * 768 * 2048
    assert (dense, experts) == (394_868_736, 3_623_878_656)
    owned = dense // 8 + experts // 4
    for r, e in ((0, 0), (7, 3)):
        s = static_bytes(
            dims, layout, precision="bf16", distributed_optimizer=True, pp_rank=0, dp_rank=r, expert_dp_rank=e
        )
        assert (s.weights, s.grads, s.main_params, s.adam) == (
            2 * (dense + experts),
            4 * (dense + experts),
            4 * owned,
            8 * owned,
        )
    plan = build_plan(_load(A3B))
    rows = plan.tables["colocated"][0].rows
    assert rows["actor weights (bf16)"]["train"] == 2 * (dense + experts)  # 7.49 GiB
    assert rows["actor Adam exp_avg + exp_avg_sq (fp32)"]["train"] == 8 * owned  # 7.12 GiB


def test_30b_a3b_preset_fits_with_its_peak_in_the_colocated_rollout():
    """The verdict: colocated on 80 GiB H100s the peak is the rollout phase (the engine's 0.7 x 80 GiB static
    pool + SGLang's 13.25 GiB reserve + the trainer's 2.34 GiB that stay: 71.59 GiB); the actor's train
    phase is 39.17 GiB (30.1 GiB of state, full-recompute activations, the working set, which holds the
    fused head's 0.12 GiB backward workspace: kernels/logprob.blocked_workspace_bytes)."""
    plan = build_plan(_load(A3B))
    assert plan.fits and plan.placement == "colocated"
    table = plan.tables["colocated"][0]
    peak, phase = table.peak()
    assert phase == "rollout" and peak / GIB == pytest.approx(71.59, abs=0.005)
    assert table.total("train") / GIB == pytest.approx(39.17, abs=0.005)
    # the engine: 30.53B bf16 weights over engine TP=2, norms and routers replicated
    dims = model_dims_for(_load(A3B))
    replicated = 97 * 2048 + 96 * 128 + 48 * 128 * 2048
    assert engine_weight_bytes(dims, engine_tp=2) == int(((total_params(dims) - replicated) / 2 + replicated) * 2)
    assert table.rows["engine weights"]["rollout"] == engine_weight_bytes(dims, engine_tp=2)


def test_30b_a3b_selective_recompute_does_not_fit():
    """Why the preset uses full recompute: selective keeps every MoE layer's router and expert activations
    (48 layers of 24576 / 4 tokens x top-8, at the 2x routed-token allowance) and the train phase passes 80 GiB."""
    plan = build_plan(_load(A3B, ["actor.recompute=selective"]))
    assert not plan.fits
    assert any(p.startswith("colocated / train") and "activations saved for backward" in p for p in plan.problems)


def test_tiny_cpu_moe_verdict():
    plan = build_plan(_load(TINY_MOE))
    assert plan.fits
    peak, phase = plan.tables["colocated"][0].peak()
    # 2.21 GiB with the dense [T, T] attention mask the torch backend kept before actor/attention.py
    assert phase == "train" and peak / GIB == pytest.approx(2.15, abs=0.005)
    dims = model_dims_for(_load(TINY_MOE))
    assert dims.is_moe and dims.num_sparse_layers == dims.layers == 2 and dims.qk_norm


def test_qwen3_dense_qk_norm_and_head_dim_from_config():
    """Qwen3 dense: head_dim from config.json (not hidden / heads), two d-wide norms per layer, no QKV bias."""
    config = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "vocab_size": 300,
    }
    dims = dims_from_hf_config(config, name="tiny", source="test")
    assert (dims.head_dim, dims.q_width, dims.qk_norm, dims.qkv_bias, dims.is_moe) == (24, 96, True, False, False)
    per_layer = 64 + 64 * 96 + (96 + 2 * 48) * 64 + 2 * 24 + 64 + 2 * 128 * 64 + 64 * 128
    assert total_params(dims) == 2 * per_layer + 2 * 300 * 64 + 64


def test_expert_layout_errors_name_the_key():
    dims = model_dims_for(_load(A3B))
    with pytest.raises(ValueError, match=r"actor.ep=3 must divide .*num_experts=128"):
        static_bytes(dims, Layout(dp=3, ep=3), precision="bf16", distributed_optimizer=True, pp_rank=0)
    with pytest.raises(ValueError, match=r"actor.etp=5 must divide .*moe_intermediate_size=768"):
        static_bytes(dims, Layout(dp=5, etp=5), precision="bf16", distributed_optimizer=True, pp_rank=0)
    dense = model_dims_for(_load(str(REPO / "configs" / "runs" / "qwen2.5-7b_dapo.yaml")))
    with pytest.raises(ValueError, match=r"actor.ep=2: expert parallelism needs a mixture-of-experts model"):
        static_bytes(dense, Layout(dp=2, ep=2), precision="bf16", distributed_optimizer=True, pp_rank=0)


def test_235b_a22b_fp8_engine_weights_by_hand():
    """Qwen3-235B-A22B served in block FP8 at engine TP=8 (runs/qwen3-235b-a22b_dapo.yaml).
    Linears per layer: QKV (8192 + 2*512) x 4096 + O 8192 x 4096 = 71,303,168, experts 128 x 3 x 1536 x 4096
    = 2,415,919,104 -> x 94 layers = 233,798,893,568 FP8 weights, + fp32 scales per 128x128 block
    (x 4 / 16384). Replicated on every rank (bf16): 2*94+1 norms of 4096, q/k norms 2*94*128, routers
    94 x 128 x 4096. Split over TP (bf16): embedding + head 2 x 151936 x 4096."""
    dims = model_dims_for(_load(str(A3B).replace("qwen3-30b-a3b", "qwen3-235b-a22b")))
    linear = 94 * (71_303_168 + 2_415_919_104)
    assert linear == 233_798_893_568
    replicated = (2 * 94 + 1) * 4096 + 2 * 94 * 128 + 94 * 128 * 4096
    split = (linear + linear * 4 // 16384) + 2 * (2 * 151936 * 4096)
    assert engine_weight_bytes(dims, engine_tp=8, fp8=True) == int(split / 8 + 2 * replicated)  # 27.61 GiB
