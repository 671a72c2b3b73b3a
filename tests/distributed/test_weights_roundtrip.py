"""HF -> Megatron (any TP x PP x VPP layout) -> HF is bit-identical, on every rank; bad checkpoints
raise ValueError naming the tensor; `dapo-megatron convert` round-trips through a Megatron
distributed checkpoint with a different layout on the way back."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers_tiny import save_tiny_hf


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf_rt")
    return {
        "qwen2": save_tiny_hf(root / "qwen2", arch="qwen2", tied=False, num_layers=4),
        "qwen2_tied": save_tiny_hf(root / "qwen2_tied", arch="qwen2", tied=True, num_layers=4, seed=1),
        "llama": save_tiny_hf(root / "llama", arch="llama", tied=False, num_layers=4, seed=2),
        "qwen2_bf16": save_tiny_hf(
            root / "qwen2_bf16", arch="qwen2", tied=True, num_layers=4, seed=3, dtype=torch.bfloat16
        ),
    }


def _hf_state(hf_dir):
    state = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def _roundtrip_on_rank(hf_dir, tp, pp, vpp):
    from transformers import AutoConfig

    from dapo_megatron.actor.model import build_model_chunks
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.weights import iter_hf_weights, load_hf_into_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    precision = "bf16" if hf_config.dtype == torch.bfloat16 else "fp32"
    with model_parallel(tp=tp, pp=pp, vpp=vpp) as layout:
        chunks = build_model_chunks(hf_config, attention_backend="torch", precision=precision)
        load_hf_into_model(chunks, hf_dir, layout=layout, hf_config=hf_config)
        return [(name, tensor.clone()) for name, tensor in iter_hf_weights(chunks, hf_config, layout=layout)]


ROUNDTRIPS = [  # (checkpoint, world, tp, pp, vpp)
    ("qwen2", 2, 1, 1, None),
    ("qwen2", 2, 2, 1, None),
    ("qwen2", 2, 1, 2, None),
    ("qwen2", 4, 2, 2, None),
    ("qwen2", 4, 1, 2, 2),
    ("qwen2", 4, 2, 1, None),
    ("qwen2_tied", 2, 2, 1, None),
    ("qwen2_tied", 2, 1, 2, None),
    ("qwen2_tied", 4, 2, 2, None),
    ("llama", 4, 2, 2, None),
    ("qwen2_bf16", 4, 2, 2, None),  # bf16 parameters (what runs on GPUs), streamed as bf16
]


@pytest.mark.parametrize("name,world,tp,pp,vpp", ROUNDTRIPS, ids=lambda v: str(v))
def test_hf_megatron_hf_is_bit_identical_on_every_rank(rank_pool, hf_dirs, name, world, tp, pp, vpp):
    reference = _hf_state(hf_dirs[name])
    per_rank = rank_pool(world).run(_roundtrip_on_rank, str(hf_dirs[name]), tp, pp, vpp)
    for rank, streamed in enumerate(per_rank):
        names = [n for n, _ in streamed]
        assert len(names) == len(set(names)), f"rank {rank} streamed a tensor twice"
        assert set(names) == set(reference), f"rank {rank}: {set(names) ^ set(reference)}"
        assert names[0] == "model.embed_tokens.weight" and names[-1] in ("lm_head.weight", "model.norm.weight")
        for tensor_name, tensor in streamed:
            assert tensor.dtype == reference[tensor_name].dtype
            assert torch.equal(tensor, reference[tensor_name]), f"rank {rank}: {tensor_name} differs"


def _load_expecting_error(hf_dir, tp):
    from transformers import AutoConfig

    from dapo_megatron.actor.model import build_model_chunks
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.weights import load_hf_into_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    with model_parallel(tp=tp) as layout:
        chunks = build_model_chunks(hf_config, attention_backend="torch", precision="fp32")
        try:
            load_hf_into_model(chunks, hf_dir, layout=layout, hf_config=hf_config)
        except ValueError as err:
            return str(err)
    return None


def _broken_copy(src, dst, edit):
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})
    return dst


def test_missing_tensor_raises_value_error_naming_it(rank_pool, hf_dirs, tmp_path):
    broken = _broken_copy(
        hf_dirs["qwen2"], tmp_path / "missing", lambda s: s.pop("model.layers.2.self_attn.k_proj.bias")
    )
    errors = rank_pool(2).run(_load_expecting_error, str(broken), 2)
    for err in errors:
        assert err is not None and "model.layers.2.self_attn.k_proj.bias" in err and "missing" in err


def test_wrong_shape_raises_value_error_naming_it(rank_pool, hf_dirs, tmp_path):
    def shrink(state):
        state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:-1].clone()

    broken = _broken_copy(hf_dirs["qwen2"], tmp_path / "shape", shrink)
    errors = rank_pool(2).run(_load_expecting_error, str(broken), 1)
    for err in errors:
        assert err is not None and "model.layers.1.mlp.up_proj.weight" in err
        assert "(127, 64)" in err and "(128, 64)" in err


def _convert_on_rank(argv):
    import multiprocessing

    from dapo_megatron.tools.convert import main

    # The pool's ranks are daemonic processes and Megatron's checkpoint writer forks writer
    # processes, which daemonic processes may not do: lift the flag for this call (under torchrun,
    # where users run convert, ranks are ordinary processes).
    me = multiprocessing.current_process()
    was_daemon = me.daemon
    me.daemon = False
    try:
        return main(argv)
    finally:
        me.daemon = was_daemon


def test_convert_hf_to_mcore_and_back_with_another_layout(rank_pool, hf_dirs, tmp_path):
    hf_dir = hf_dirs["qwen2_tied"]
    mcore, back = tmp_path / "mcore", tmp_path / "hf_back"
    pool = rank_pool(2)
    assert pool.run(_convert_on_rank, ["hf-to-mcore", "--hf", str(hf_dir), "--out", str(mcore), "--tp", "2"]) == [0, 0]
    assert json.loads((mcore / "convert_meta.json").read_text())["layout"] == {
        "tp": 2,
        "pp": 1,
        "vpp": None,
        "ep": 1,
        "etp": None,
    }
    # reshard on the way back: TP=2 checkpoint read as PP=2
    assert pool.run(
        _convert_on_rank,
        ["mcore-to-hf", "--mcore", str(mcore), "--hf-config", str(hf_dir), "--out", str(back), "--pp", "2"],
    ) == [0, 0]
    reference, result = _hf_state(hf_dir), _hf_state(back)
    assert set(result) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(result[name], tensor), name


def _actor_checkpoint_to_hf_on_rank(hf_dir, batch, ckpt_dir, out_dir):
    import multiprocessing

    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.tools.convert import main
    from dapo_megatron.trainer.settings import actor_settings
    from helpers_actor import make_cfg

    me = multiprocessing.current_process()  # see _convert_on_rank
    was_daemon = me.daemon
    me.daemon = False
    try:
        with model_parallel(tp=2) as layout:
            actor = Actor(actor_settings(make_cfg(tp=2, lr=1e-2, warmup_steps=1)), hf_dir, layout)
            actor.train(batch, step=0)  # move the weights away from the HF checkpoint
            actor.save(ckpt_dir)  # model + optimizer + RNG, in the actor's (unpadded-vocab) layout
            streamed = {name: tensor.clone() for name, tensor in actor.iter_hf_weights()}
            del actor
        # exported with another layout (TP=1 x PP=2)
        rc = main(["mcore-to-hf", "--mcore", ckpt_dir, "--hf-config", hf_dir, "--out", out_dir, "--pp", "2"])
        return rc, streamed
    finally:
        me.daemon = was_daemon


def test_trained_actor_checkpoint_exports_to_hf(rank_pool, hf_dirs, tmp_path):
    from helpers_actor import fill_rl_fields, hf_logprobs, make_samples

    hf_dir = str(hf_dirs["qwen2"])
    samples = make_samples(6, seed=3)
    batch = fill_rl_fields(samples, hf_logprobs(hf_dir, samples)[0], seed=3)
    out = tmp_path / "exported"
    results = rank_pool(2).run(_actor_checkpoint_to_hf_on_rank, hf_dir, batch, str(tmp_path / "actor_ckpt"), str(out))
    original, exported = _hf_state(hf_dirs["qwen2"]), _hf_state(out)
    assert set(exported) == set(original)
    for rc, streamed in results:
        assert rc == 0
        for name, tensor in streamed.items():
            assert torch.equal(exported[name], tensor), name  # the checkpoint holds what the actor held
    assert sum(not torch.equal(exported[n], original[n]) for n in original) > len(original) // 2  # it trained
