"""Qwen3 / Qwen3-MoE without ranks: which layers are sparse, the expert names and shard maths of the
mapping, the two HF expert layouts, the names a non-owner PP stage expects from an EP gather, and
the config checks for actor.ep / actor.etp / actor.routing_replay."""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.actor.moe import check_expert_parallel, moe_layer_pattern, moe_shape_of
from dapo_megatron.weights.export import _names_owned_with
from dapo_megatron.weights.hf_layout import fused_source, public_expert_views, read_fused_rows
from dapo_megatron.weights.mapping import Dims, expected_hf_shapes, map_param, merge_shards, read_shard, shard_for_rank


def _moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    values = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    values.update(overrides)
    return Qwen3MoeConfig(**values)


def test_sparse_layers_follow_transformers_rule():
    from transformers import AutoModelForCausalLM

    cfg = _moe_config(decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6)
    # (i + 1) % 2 == 0 -> 1, 3, 5; minus mlp_only_layers [3] -> 1, 5
    assert moe_layer_pattern(cfg) == [0, 1, 0, 0, 0, 1]
    model = AutoModelForCausalLM.from_config(cfg)
    assert [
        int(hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")) for layer in model.model.layers
    ] == moe_layer_pattern(cfg)
    shape = moe_shape_of(cfg)
    assert (shape.num_experts, shape.topk, shape.ffn, shape.norm_topk_prob) == (8, 2, 32, True)


def test_dense_models_have_no_moe_shape_and_refuse_expert_parallel():
    from transformers import Qwen3Config

    dense = Qwen3Config(num_hidden_layers=2)
    assert moe_shape_of(dense) is None and moe_layer_pattern(dense) == [0, 0]
    with pytest.raises(ValueError, match="actor.ep=2: expert parallelism needs a mixture-of-experts model"):
        check_expert_parallel(dense, ep=2, etp=1)


def test_expert_parallel_sizes_must_divide_the_experts():
    cfg = _moe_config()
    check_expert_parallel(cfg, ep=8, etp=4)
    with pytest.raises(ValueError, match=r"actor.ep=3 must divide the number of experts num_experts=8"):
        check_expert_parallel(cfg, ep=3, etp=1)
    with pytest.raises(ValueError, match=r"actor.etp=3 must divide each expert's width moe_intermediate_size=32"):
        check_expert_parallel(cfg, ep=1, etp=3)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        moe_shape_of(_moe_config(shared_expert_intermediate_size=64))


def test_expert_names_local_and_te_specs_map_to_global_experts():
    dims = Dims.from_hf(_moe_config())
    # EP rank 1 of 2 holds experts 4..7: local expert 2 of layer 1 in a chunk starting at layer 1
    local = map_param(
        "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight", layer_offset=1, dims=dims, expert_offset=4
    )
    assert local.hf_names == (
        "model.layers.1.mlp.experts.6.gate_proj.weight",
        "model.layers.1.mlp.experts.6.up_proj.weight",
    )
    assert (local.kind, local.local_expert, local.global_layer) == ("expert_fc1", 2, 1)
    te = map_param("decoder.layers.0.mlp.experts.linear_fc2.weight3", layer_offset=1, dims=dims, expert_offset=4)
    assert te.hf_names == ("model.layers.1.mlp.experts.7.down_proj.weight",) and te.kind == "expert_row"
    router = map_param("decoder.layers.2.mlp.router.weight", layer_offset=0, dims=dims)
    assert router.hf_names == ("model.layers.2.mlp.gate.weight",) and router.kind == "replicated"
    q_norm = map_param("decoder.layers.0.self_attention.q_layernorm.weight", layer_offset=0, dims=dims)
    assert q_norm.hf_names == ("model.layers.0.self_attn.q_norm.weight",)


def test_expected_shapes_of_a_mixed_dense_and_sparse_checkpoint():
    from transformers import AutoModelForCausalLM

    cfg = _moe_config(num_hidden_layers=3, mlp_only_layers=[1], num_experts=4)
    shapes = expected_hf_shapes(Dims.from_hf(cfg))
    model = AutoModelForCausalLM.from_config(cfg)
    import tempfile

    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with safe_open(f"{tmp}/model.safetensors", "pt") as handle:
            saved = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}  # noqa: SIM118 (safe_open has keys(), no __iter__)
    assert shapes == saved  # exactly what save_pretrained writes, names and shapes
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (24,)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (96, 64)  # 4 heads x head_dim 24 != hidden


def test_expert_shards_split_the_expert_width_over_etp():
    dims = Dims.from_hf(_moe_config())  # expert width 32, dense 128
    gate, up = torch.arange(32 * 2.0).reshape(32, 2), -torch.arange(32 * 2.0).reshape(32, 2)
    shard = shard_for_rank("expert_fc1", [gate, up], tp_rank=1, tp_size=2, dims=dims)
    assert torch.equal(shard, torch.cat([gate[16:], up[16:]]))
    down = torch.arange(2 * 32.0).reshape(2, 32)

    def read_rows(name, start, stop, dim):
        full = {"g": gate, "u": up, "d": down}[name]
        return full[start:stop] if dim == 0 else full[:, start:stop]

    assert torch.equal(read_shard("expert_fc1", ["g", "u"], read_rows, tp_rank=1, tp_size=2, dims=dims), shard)
    assert torch.equal(read_shard("expert_row", ["d"], read_rows, tp_rank=0, tp_size=2, dims=dims), down[:, :16])
    shards = [shard_for_rank("expert_fc1", [gate, up], tp_rank=r, tp_size=4, dims=dims) for r in range(4)]
    merged = merge_shards("expert_fc1", shards, dims=dims)
    assert torch.equal(merged[0], gate) and torch.equal(merged[1], up)


def test_fused_and_public_expert_layouts(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    fused_gate_up = torch.arange(3 * 8 * 2.0).reshape(3, 8, 2)  # 3 experts, width 4: gate rows 0..3, up rows 4..7
    fused_down = torch.arange(3 * 2 * 4.0).reshape(3, 2, 4)
    assert fused_source("model.layers.5.mlp.experts.2.up_proj.weight") == (
        "model.layers.5.mlp.experts.gate_up_proj",
        2,
        "up_proj",
    )
    assert fused_source("model.layers.5.mlp.gate.weight") is None
    save_file(
        {"a.mlp.experts.gate_up_proj": fused_gate_up, "a.mlp.experts.down_proj": fused_down}, str(tmp_path / "f.st")
    )
    with safe_open(str(tmp_path / "f.st"), "pt") as handle:
        up_rows = read_fused_rows(handle.get_slice, (3, 8, 2), "a.mlp.experts.gate_up_proj", 2, "up_proj", 1, 3, 0)
        down_cols = read_fused_rows(handle.get_slice, (3, 2, 4), "a.mlp.experts.down_proj", 1, "down_proj", 2, 4, 1)
    assert torch.equal(up_rows, fused_gate_up[2, 5:7])
    assert torch.equal(down_cols, fused_down[1, :, 2:4])
    params = {"a.mlp.experts.gate_up_proj": fused_gate_up.clone(), "a.mlp.gate.weight": torch.zeros(3, 2)}
    views = public_expert_views(params)
    assert set(views) == {"a.mlp.gate.weight"} | {
        f"a.mlp.experts.{e}.{p}.weight" for e in range(3) for p in ("gate_proj", "up_proj")
    }
    views["a.mlp.experts.1.up_proj.weight"].copy_(torch.full((4, 2), -1.0))  # writes the fused tensor
    assert (params["a.mlp.experts.gate_up_proj"][1, 4:] == -1).all()
    assert torch.equal(params["a.mlp.experts.gate_up_proj"][1, :4], fused_gate_up[1, :4])


def test_a_non_owner_stage_expects_the_owners_ep_gathered_names_in_order():
    dims = Dims.from_hf(_moe_config())  # 8 experts: EP=2 -> 4 per rank; local expert 1 is global 1 and 5
    assert _names_owned_with("model.layers.3.mlp.experts.1.gate_proj.weight", dims, ep=2) == (
        "model.layers.3.mlp.experts.1.gate_proj.weight",
        "model.layers.3.mlp.experts.1.up_proj.weight",
        "model.layers.3.mlp.experts.5.gate_proj.weight",
        "model.layers.3.mlp.experts.5.up_proj.weight",
    )
    assert _names_owned_with("model.layers.3.mlp.gate.weight", dims, ep=2) == ("model.layers.3.mlp.gate.weight",)


@pytest.mark.parametrize(
    "overrides,key,message",
    [
        (["actor.ep=0"], "actor.ep", "must be >= 1"),
        (["actor.etp=0"], "actor.etp", "null"),
        (["actor.world_size=4", "actor.ep=8"], "actor.world_size", "etp*ep*pp = 1*8*1"),
        (
            ["actor.world_size=4", "actor.tp=2", "actor.ep=4", "actor.sequence_parallel=true"],
            "actor.world_size",
            "etp*ep*pp = 2*4*1",
        ),
        (["actor.routing_replay=true"], "actor.routing_replay", "rollout.return_routed_experts=true"),
        (
            [
                "actor.routing_replay=true",
                "rollout.return_routed_experts=true",
                "actor.recompute=full",
                "actor.pp=2",
                "actor.world_size=2",
            ],
            "actor.routing_replay",
            "actor.pp=1",
        ),
    ],
)
def test_config_errors_name_the_key(overrides, key, message):
    from dapo_megatron.config import load_config

    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    assert f"'{key}'" in str(err.value) and message in str(err.value)


def test_valid_expert_layouts_pass():
    from dapo_megatron.config import load_config

    cfg = load_config(
        None,
        [
            "actor.world_size=8",
            "actor.tp=2",
            "actor.ep=4",
            "actor.etp=1",
            "actor.sequence_parallel=true",
            "actor.routing_replay=true",
            "rollout.return_routed_experts=true",
        ],
    )
    assert (cfg.actor.ep, cfg.actor.etp, cfg.actor.routing_replay) == (4, 1, True)


def test_tiny_moe_variant_builds_a_qwen3_moe_that_keeps_the_tokenizer(tmp_path):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_megatron.data.tiny_model import TinyModelSpec, build_tiny_model, build_tiny_tokenizer, prompt_ids

    spec = TinyModelSpec(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        arch="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    path = build_tiny_model(tmp_path / "moe", seed=0, spec=spec)
    cfg = AutoModelForCausalLM.from_pretrained(path).config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "qwen3_moe",
        4,
        2,
        16,
    )
    assert cfg.head_dim == 16 and cfg.norm_topk_prob and moe_layer_pattern(cfg) == [1, 1]
    reloaded = AutoTokenizer.from_pretrained(path)
    assert prompt_ids(reloaded, "27+58=") == prompt_ids(build_tiny_tokenizer(), "27+58=")
    # the dense default's cache record is what it was before the MoE variant existed
    dense = build_tiny_model(
        tmp_path / "dense",
        seed=0,
        spec=TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64),
    )
    assert "arch" not in json.loads((dense / "build.json").read_text())["spec"]


def test_sglang_engines_are_started_with_routed_experts_capture_when_asked():
    from dapo_megatron.config import load_config
    from dapo_megatron.launch.slurm.colocated import engine_commands
    from dapo_megatron.launch.slurm.render import render_rollout_array

    on = load_config(None, ["rollout.engine=sglang", "rollout.return_routed_experts=true", "trainer.output_dir=/r"])
    off = load_config(None, ["rollout.engine=sglang", "trainer.output_dir=/r"])
    assert "SGLANG_ARGS=(--enable-return-routed-experts)" in render_rollout_array(on, register_dir="/r/engines")
    assert "SGLANG_ARGS=()" in render_rollout_array(off, register_dir="/r/engines")
    assert all(cmd[-1] == "--enable-return-routed-experts" for cmd in engine_commands(on, host="h"))
    assert not any("--enable-return-routed-experts" in cmd for cmd in engine_commands(off, host="h"))


def test_qwen3_30b_a3b_layout_fits_its_arithmetic():
    """configs/runs/qwen3-30b-a3b_dapo.yaml: the checkpoint splits into that layout, and the per-GPU
    parameter counts its comment derives the memory from are the checkpoint's."""
    from dapo_megatron.actor.model import padded_vocab_size
    from dapo_megatron.config import load_config

    cfg = load_config("configs/runs/qwen3-30b-a3b_dapo.yaml")
    ac = cfg.actor
    hf = _moe_config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        tie_word_embeddings=False,
    )
    check_expert_parallel(hf, ep=ac.ep, etp=ac.etp)
    assert hf.num_key_value_heads % ac.tp == 0 and padded_vocab_size(hf.vocab_size, tp=ac.tp, divisible_by=1) == 151936
    shapes = expected_hf_shapes(Dims.from_hf(hf))
    numel = lambda names: sum(int(torch.tensor(shapes[n]).prod()) for n in names)  # noqa: E731
    experts = numel([n for n in shapes if ".experts." in n])
    dense = numel([n for n in shapes if ".experts." not in n])
    assert round((experts + dense) / 1e9, 2) == 30.53 and round(experts / 1e9, 2) == 28.99
    assert round(dense / 1e9, 2) == 1.54
    per_gpu = experts / ac.ep + dense / ac.tp  # ETP=1: whole experts; the norms are replicated (negligible)
    assert round(per_gpu / 1e9, 2) == 4.01
    edp, dp = ac.world_size // (ac.etp * ac.ep * ac.pp), ac.world_size // (ac.tp * ac.pp)
    assert (edp, dp) == (4, 8)
    static_gb = per_gpu * (2 + 4) / 1e9 + experts / ac.ep * 12 / edp / 1e9 + dense / ac.tp * 12 / dp / 1e9
    assert 35 < static_gb < 36  # weights + fp32 grads + distributed Adam, as the comment says
