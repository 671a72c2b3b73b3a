"""Qwen3 / Qwen3-MoE weights through Megatron: HF -> Megatron (any TP x PP x EP x ETP) -> HF is
bit-identical on every rank, from the public per-expert layout and from transformers' fused
in-memory layout; each EP rank reads only its experts; `convert` round-trips an EP=2 Megatron
checkpoint back to HF with another layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers_tiny import tiny_hf_model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe_rt")
    dense = tiny_hf_model(arch="qwen3", num_layers=4, seed=1)
    dense.save_pretrained(root / "qwen3")
    moe = tiny_hf_model(arch="qwen3_moe", num_layers=4, seed=2)
    moe.save_pretrained(root / "qwen3_moe")  # public layout: mlp.experts.{e}.{gate,up,down}_proj.weight
    fused = root / "qwen3_moe_fused"  # transformers' in-memory layout: mlp.experts.gate_up_proj [E, 2F, H]
    moe.config.save_pretrained(fused)
    save_file(
        {k: v.contiguous() for k, v in moe.state_dict().items()},
        str(fused / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return {"qwen3": root / "qwen3", "qwen3_moe": root / "qwen3_moe", "qwen3_moe_fused": fused}


def _state(hf_dir):
    state = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def roundtrip_on_rank(hf_dir, tp, pp, ep, etp):
    from transformers import AutoConfig

    from dapo_megatron.actor.model import build_model_chunks
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.weights import iter_hf_weights, load_hf_into_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    with model_parallel(tp=tp, pp=pp, ep=ep, etp=etp) as layout:
        chunks = build_model_chunks(hf_config, attention_backend="torch", precision="fp32")
        load_hf_into_model(chunks, hf_dir, layout=layout, hf_config=hf_config)
        return [(name, tensor.clone()) for name, tensor in iter_hf_weights(chunks, hf_config, layout=layout)]


ROUNDTRIPS = [  # (checkpoint, world, tp, pp, ep, etp)
    ("qwen3", 2, 2, 1, 1, None),
    ("qwen3", 2, 1, 2, 1, None),
    ("qwen3_moe", 2, 1, 1, 2, None),
    ("qwen3_moe", 2, 2, 1, 1, None),
    ("qwen3_moe", 4, 1, 2, 2, None),
    ("qwen3_moe", 4, 2, 1, 2, 1),
    ("qwen3_moe", 4, 2, 2, 2, 1),
    ("qwen3_moe_fused", 2, 1, 1, 2, None),
    ("qwen3_moe_fused", 4, 2, 2, 2, 1),
]


@pytest.mark.parametrize("name,world,tp,pp,ep,etp", ROUNDTRIPS, ids=lambda v: str(v))
def test_hf_megatron_hf_is_bit_identical(rank_pool, hf_dirs, name, world, tp, pp, ep, etp):
    # the fused checkpoint comes back in the public layout: compare with the same model's public file
    reference = _state(hf_dirs["qwen3_moe" if name == "qwen3_moe_fused" else name])
    if name.startswith("qwen3_moe"):
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in reference
        assert "model.layers.1.mlp.gate_proj.weight" in reference  # the dense layer (mlp_only_layers)
    per_rank = rank_pool(world).run(roundtrip_on_rank, str(hf_dirs[name]), tp, pp, ep, etp)
    for rank, streamed in enumerate(per_rank):
        names = [n for n, _ in streamed]
        assert len(names) == len(set(names)), f"rank {rank} streamed a tensor twice"
        assert set(names) == set(reference), f"rank {rank}: {set(names) ^ set(reference)}"
        for tensor_name, tensor in streamed:
            assert torch.equal(tensor, reference[tensor_name]), f"rank {rank}: {tensor_name} differs"


def test_fused_layout_holds_the_same_numbers_as_the_public_one(hf_dirs):
    """The fused fixture really is fused, and its slices are the public tensors (gate rows first)."""
    fused, public = _state(hf_dirs["qwen3_moe_fused"]), _state(hf_dirs["qwen3_moe"])
    gate_up = fused["model.layers.2.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (4, 64, 64) and "model.layers.2.mlp.experts.1.up_proj.weight" not in fused
    assert torch.equal(gate_up[1, 32:], public["model.layers.2.mlp.experts.1.up_proj.weight"])


def load_error_on_rank(hf_dir, ep):
    from transformers import AutoConfig

    from dapo_megatron.actor.model import build_model_chunks
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.weights import load_hf_into_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    with model_parallel(ep=ep) as layout:
        chunks = build_model_chunks(hf_config, attention_backend="torch", precision="fp32")
        try:
            load_hf_into_model(chunks, hf_dir, layout=layout, hf_config=hf_config)
        except ValueError as err:
            return str(err)
    return None


def test_each_ep_rank_reads_only_its_experts(rank_pool, hf_dirs, tmp_path):
    """Expert 3 lives on EP rank 1 (experts 2, 3) at EP=2: a checkpoint without it fails there, with
    the tensor named, and loads on rank 0, which never opens it."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(hf_dirs["qwen3_moe"], broken)
    state = load_file(broken / "model.safetensors")
    state.pop("model.layers.2.mlp.experts.3.up_proj.weight")
    save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    errors = rank_pool(2).run(load_error_on_rank, str(broken), 2)
    assert errors[0] is None
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in errors[1] and "missing" in errors[1]


def _convert_on_rank(argv):
    import multiprocessing

    from dapo_megatron.tools.convert import main

    me = multiprocessing.current_process()  # see test_weights_roundtrip._convert_on_rank
    was_daemon = me.daemon
    me.daemon = False
    try:
        return main(argv)
    finally:
        me.daemon = was_daemon


def test_convert_ep2_checkpoint_back_with_another_layout(rank_pool, hf_dirs, tmp_path):
    hf_dir = hf_dirs["qwen3_moe_fused"]  # also: a fused HF checkpoint in, the public layout out
    mcore, back = tmp_path / "mcore", tmp_path / "hf_back"
    pool = rank_pool(2)
    assert pool.run(_convert_on_rank, ["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore), "--ep", "2"]) == [0, 0]
    assert json.loads((mcore / "convert_meta.json").read_text())["layout"]["ep"] == 2
    assert pool.run(
        _convert_on_rank,
        ["mcore-to-hf", "--mcore", str(mcore), "--hf-config", str(hf_dir), "--out", str(back), "--tp", "2"],
    ) == [0, 0]
    reference, result = _state(hf_dirs["qwen3_moe"]), _state(back)
    assert set(result) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(result[name], tensor), name
