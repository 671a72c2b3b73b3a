"""What --resume may change, checked before anything starts (trainer/checkpoint/resume_check.py): a
checkpoint's actor_state.json against the config's layout and the model directory's config.json."""

from __future__ import annotations

import json

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.trainer.checkpoint.resume_check import check_resume_layout, check_resume_model

MODEL = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
MODEL.update(num_key_value_heads=2, intermediate_size=128, vocab_size=301, tie_word_embeddings=False)


def _checkpoint(tmp_path, *, layout, optimizer_format="fully_reshardable", precision="fp32", model=None):
    """A run checkpoint's step dir whose actor/actor_state.json says what Actor.save writes."""
    actor = tmp_path / "step_000072" / "actor"
    actor.mkdir(parents=True)
    meta = {"last_step": 71, "num_updates": 72, "layout": layout, "precision": precision}
    meta["distributed_optimizer"] = False  # tiny_cpu.yaml's
    if optimizer_format is not None:
        meta["optimizer_format"] = optimizer_format
    if model is not None:
        meta["model"] = {**model, "head_dim": model["hidden_size"] // model["num_attention_heads"]}
    (actor / "actor_state.json").write_text(json.dumps(meta))
    (actor.parent / "trainer_state.json").write_text(json.dumps({"step": 72}))  # the run's step (1-based)
    return actor.parent


def _cfg(*overrides):
    return load_config("configs/runs/tiny_cpu.yaml", list(overrides))


TP1_DP2 = {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "vpp": 1, "ep": 1, "etp": 1, "world": 2}


def test_a_layout_change_is_said_in_one_line(tmp_path):
    ckpt = _checkpoint(tmp_path, layout=TP1_DP2)
    assert check_resume_layout(_cfg(), ckpt) == ""  # tiny_cpu.yaml: TP=1 x DP=2, as saved
    assert check_resume_layout(_cfg("actor.tp=2"), ckpt) == (
        "[train] resuming step 72 saved at TP=1 PP=1 CP=1 DP=2 under TP=2 PP=1 CP=1 DP=1: resharding (model "
        "and optimizer through megatron's global-shape checkpoint, RNG states re-derived from trainer.seed)"
    )
    # DP alone: the RNG states map (they are per TP x PP x EP position)
    assert check_resume_layout(_cfg("actor.world_size=1"), ckpt).endswith("global-shape checkpoint)")


def test_a_checkpoint_in_the_earlier_optimizer_format_keeps_its_tp_and_pp(tmp_path):
    ckpt = _checkpoint(tmp_path, layout={"tp": 1, "pp": 1, "cp": 1, "dp": 2, "vpp": None}, optimizer_format=None)
    assert check_resume_layout(_cfg("actor.world_size=1"), ckpt).startswith("[train] resuming step 72")  # DP: fine
    with pytest.raises(ValueError, match=r"dp_reshardable optimizer format .* resume with actor.tp=1, then"):
        check_resume_layout(_cfg("actor.tp=2"), ckpt)


@pytest.mark.parametrize(
    ("key", "value", "saved"), [("precision", "bf16", "'fp32'"), ("use_distributed_optimizer", "true", "False")]
)
def test_what_the_optimizer_state_depends_on_cannot_change(tmp_path, key, value, saved):
    ckpt = _checkpoint(tmp_path, layout=TP1_DP2)
    shown = f"'{value}'" if key == "precision" else "True"
    with pytest.raises(ValueError, match=rf"actor.{key}={shown} but checkpoint .* saved with actor.{key}={saved}"):
        check_resume_layout(_cfg(f"actor.{key}={value}"), ckpt)


def test_the_architecture_cannot_change(tmp_path):
    ckpt = _checkpoint(tmp_path, layout=TP1_DP2, model=MODEL)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL))
    check_resume_model(ckpt, model_dir=model)  # the same model: nothing to say
    (model / "config.json").write_text(json.dumps({**MODEL, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match=r"has num_hidden_layers=4 but checkpoint .* saved with num_hidden_layers=2"):
        check_resume_model(ckpt, model_dir=model)
    check_resume_model(ckpt, model_dir=tmp_path / "elsewhere")  # not on this machine: the ranks' load decides
