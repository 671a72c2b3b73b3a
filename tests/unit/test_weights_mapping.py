"""Shard maths of weights/mapping.py on hand-built tensors, the bucketizer's byte bound, and the
atomic HF checkpoint writer (reloaded by transformers)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dapo_megatron.weights.export import bucketize
from dapo_megatron.weights.mapping import Dims, expected_hf_shapes, map_param, merge_shards, read_shard, shard_for_rank

# 4 query heads, 2 KV groups, head_dim 1, hidden 3, ffn 4, vocab 5: small enough to write out by hand
DIMS = Dims(hidden=3, num_heads=4, num_groups=2, head_dim=1, ffn=4, vocab=5, num_layers=2, qkv_bias=True, tied=False)


def _rows(*values):
    return torch.tensor(values, dtype=torch.float32)[:, None].expand(-1, DIMS.hidden).clone()


def test_qkv_interleaves_per_query_group_and_splits_groups_over_tp():
    q, k, v = _rows(10, 11, 12, 13), _rows(20, 21), _rows(30, 31)
    # group 0 = [q heads 0,1 ; k0 ; v0], group 1 = [q heads 2,3 ; k1 ; v1]
    full = shard_for_rank("qkv", [q, k, v], tp_rank=0, tp_size=1, dims=DIMS)
    assert full[:, 0].tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    rank1 = shard_for_rank("qkv", [q, k, v], tp_rank=1, tp_size=2, dims=DIMS)
    assert rank1[:, 0].tolist() == [12, 13, 21, 31]
    bias = shard_for_rank(
        "qkv",
        [torch.tensor([10.0, 11, 12, 13]), torch.tensor([20.0, 21]), torch.tensor([30.0, 31])],
        tp_rank=0,
        tp_size=2,
        dims=DIMS,
    )
    assert bias.tolist() == [10, 11, 20, 30]


def test_fc1_shard_is_gate_shard_then_up_shard():
    gate, up = _rows(1, 2, 3, 4), _rows(5, 6, 7, 8)
    assert shard_for_rank("fc1", [gate, up], tp_rank=0, tp_size=2, dims=DIMS)[:, 0].tolist() == [1, 2, 5, 6]
    assert shard_for_rank("fc1", [gate, up], tp_rank=1, tp_size=2, dims=DIMS)[:, 0].tolist() == [3, 4, 7, 8]


def test_vocab_rows_are_padded_with_zeros_and_split():
    emb = _rows(1, 2, 3, 4, 5)
    shards = [shard_for_rank("vocab", [emb], tp_rank=r, tp_size=2, dims=DIMS) for r in range(2)]
    assert [s.shape[0] for s in shards] == [128, 128]  # 5 rows padded to 2 * 128
    assert shards[0][:5, 0].tolist() == [1, 2, 3, 4, 5]
    assert shards[0][5:].abs().sum() == 0 and shards[1].abs().sum() == 0


def test_row_parallel_splits_columns():
    down = torch.arange(12.0).reshape(3, 4)
    assert shard_for_rank("row", [down], tp_rank=1, tp_size=2, dims=DIMS).tolist() == [[2, 3], [6, 7], [10, 11]]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["replicated", "vocab", "row", "qkv", "fc1"])
def test_merge_inverts_shard_bit_for_bit(kind, tp):
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "replicated": [(3,)],
        "vocab": [(5, 3)],
        "row": [(3, 4)],
        "fc1": [(4, 3), (4, 3)],
        "qkv": [(4, 3), (2, 3), (2, 3)],
    }[kind]
    full = [torch.randn(s, generator=gen) for s in shapes]
    shards = [shard_for_rank(kind, full, tp_rank=r, tp_size=tp, dims=DIMS) for r in range(tp)]
    merged = merge_shards(kind, shards, dims=DIMS)
    assert len(merged) == len(full)
    for a, b in zip(merged, full):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kind,names,tps",
    [
        ("replicated", ["norm"], [1, 2]),
        ("vocab", ["embed"], [1, 2, 4]),
        ("row", ["o_proj"], [1, 2]),
        ("row", ["down_proj"], [1, 2, 4]),
        ("fc1", ["gate", "up"], [1, 2, 4]),
        ("qkv", ["q", "k", "v"], [1, 2]),
        ("qkv", ["q_bias", "k_bias", "v_bias"], [1, 2]),
    ],
)
def test_sliced_read_equals_full_read_then_shard(kind, names, tps):
    gen = torch.Generator().manual_seed(1)
    shapes = {
        "norm": (3,),
        "embed": (5, 3),
        "o_proj": (3, 4),
        "down_proj": (3, 4),
        "gate": (4, 3),
        "up": (4, 3),
        "q": (4, 3),
        "k": (2, 3),
        "v": (2, 3),
        "q_bias": (4,),
        "k_bias": (2,),
        "v_bias": (2,),
    }
    store = {n: torch.randn(shapes[n], generator=gen) for n in names}
    reads = []

    def read_rows(name, start, stop, dim):
        reads.append((name, start, stop, dim))
        return store[name][start:stop] if dim == 0 else store[name][:, start:stop]

    for tp in tps:
        for vocab_rows in [None, 8] if kind == "vocab" else [None]:
            for rank in range(tp):
                expected = shard_for_rank(
                    kind, [store[n] for n in names], tp_rank=rank, tp_size=tp, dims=DIMS, vocab_rows=vocab_rows
                )
                got = read_shard(kind, names, read_rows, tp_rank=rank, tp_size=tp, dims=DIMS, vocab_rows=vocab_rows)
                assert torch.equal(got, expected), (tp, rank, vocab_rows)
    if kind != "replicated" and max(tps) > 1:  # at tp > 1 a rank never reads a whole split tensor
        assert any(start not in (None, 0) for _, start, _, _ in reads)


def test_map_param_names_layers_with_the_stage_offset_and_both_specs():
    local = map_param("decoder.layers.1.self_attention.linear_qkv.weight", layer_offset=2, dims=DIMS)
    assert local.hf_names == (
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
    )
    te = map_param("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", layer_offset=0, dims=DIMS)
    assert te.hf_names == ("model.layers.0.post_attention_layernorm.weight",) and te.kind == "replicated"
    tied = Dims(**{**DIMS.__dict__, "tied": True})
    assert map_param("output_layer.weight", layer_offset=0, dims=tied).hf_names == ("model.embed_tokens.weight",)
    with pytest.raises(ValueError, match="decoder.layers.0.self_attention.mystery.weight"):
        map_param("decoder.layers.0.self_attention.mystery.weight", layer_offset=0, dims=DIMS)


def test_expected_shapes_follow_the_config():
    shapes = expected_hf_shapes(DIMS)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (2, 3)
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (4,)
    assert shapes["lm_head.weight"] == (5, 3)
    assert "lm_head.weight" not in expected_hf_shapes(Dims(**{**DIMS.__dict__, "tied": True}))


def test_bucketize_respects_the_byte_bound_and_keeps_order():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 100, 1, 1])]
    buckets = list(bucketize(tensors, max_bytes=160))  # 40 bytes per 10 floats
    # 40+40 | +120 would be 200 > 160 -> new; 120+20=140 | 400 alone (over the bound) | 4+4
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2", "t3"], ["t4"], ["t5", "t6"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 160 or len(bucket) == 1
    with pytest.raises(ValueError, match="positive"):
        list(bucketize(tensors, max_bytes=0))


def test_save_hf_checkpoint_shards_index_and_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    from dapo_megatron.weights.save import save_hf_checkpoint
    from helpers_tiny import tiny_hf_model

    model = tiny_hf_model(arch="qwen2", tied=False, num_layers=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = tmp_path / "hf_out"
    save_hf_checkpoint(state.items(), model.config, out, max_shard_bytes=60_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, tensor in state.items():
        assert torch.equal(reloaded[name], tensor), name
    # overwrite: replaced atomically, no temporary directories left next to it
    save_hf_checkpoint(state.items(), model.config, out)
    assert sorted(os.listdir(tmp_path)) == ["hf_out"]


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path):
    from dapo_megatron.weights.save import save_hf_checkpoint
    from helpers_tiny import tiny_hf_model

    model = tiny_hf_model(arch="qwen2", tied=True, num_layers=2)
    out = tmp_path / "ckpt"
    save_hf_checkpoint(model.state_dict().items(), model.config, out)
    before = sorted(os.listdir(out))

    def dying():
        yield from list(model.state_dict().items())[:3]
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError, match="killed"):
        save_hf_checkpoint(dying(), model.config, out, max_shard_bytes=1000)
    assert sorted(os.listdir(out)) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
