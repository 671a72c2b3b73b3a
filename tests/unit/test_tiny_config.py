"""configs/runs/tiny_cpu.yaml and tiny_cpu_grpo.yaml load, and the tiny section is validated."""

from pathlib import Path

import pytest

from dapo_megatron.config import load_config

RUNS = Path(__file__).resolve().parents[2] / "configs" / "runs"


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_tiny_cpu_is_the_prototyped_setup():
    cfg = load_config(RUNS / "tiny_cpu.yaml")
    assert cfg.tiny.enabled and cfg.tiny.label_smoothing == 0.1 and cfg.tiny.warm_start_steps == 1000
    assert (cfg.rollout.engine, cfg.actor.attention_backend, cfg.actor.precision) == ("cpu", "torch", "fp32")
    assert (cfg.actor.world_size, cfg.actor.tp, cfg.actor.pp) == (2, 1, 1)
    assert (cfg.data.synthetic.difficulty, cfg.data.synthetic.style) == (2, "compact")
    assert (cfg.rollout.n, cfg.trainer.train_batch_size, cfg.trainer.mini_batch_size) == (8, 16, 8)
    assert (cfg.trainer.lr, cfg.trainer.total_steps, cfg.trainer.eval_top_p) == (5e-4, 60, 1.0)
    # ends at its best (docs/LOG.md, 2026-11-23): cosine decay to 0.1 x lr, the best eval's checkpoint kept
    assert (cfg.trainer.lr_decay_style, cfg.trainer.min_lr, cfg.trainer.warmup_steps) == ("cosine", 5e-5, 5)
    assert (cfg.trainer.eval_every, cfg.trainer.save_every, cfg.trainer.keep_best_checkpoint) == (10, 10, True)
    # the longest correct response ("Answer: 198" + EOS, 12 tokens) is not punished by overlong shaping
    assert cfg.rollout.max_response_length - cfg.algorithm.overlong_buffer_length == 12


def test_tiny_grpo_changes_only_the_algorithm():
    dapo = _flat(load_config(RUNS / "tiny_cpu.yaml").to_dict())
    grpo = _flat(load_config(RUNS / "tiny_cpu_grpo.yaml").to_dict())
    changed = {k: (dapo[k], grpo[k]) for k in dapo if dapo[k] != grpo[k]}
    assert changed == {
        "rollout.gen_batch_size": (32, 16),
        "algorithm.policy_loss": ("dapo", "grpo"),
        "algorithm.eps_high": (0.28, 0.2),
        "algorithm.loss_agg_mode": ("token-mean", "seq-mean-token-mean"),
        "algorithm.dynamic_sampling": (True, False),
        "algorithm.overlong_shaping": (True, False),
        "algorithm.use_kl": (False, True),
        "trainer.output_dir": ("outputs/tiny_cpu", "outputs/tiny_cpu_grpo"),
    }


@pytest.mark.parametrize(
    "override, match",
    [
        ("actor.tp=4", "tiny.num_kv_heads.*multiple of actor.tp"),
        ("tiny.label_smoothing=1.0", "tiny.label_smoothing"),
        ("data.train_path=/x.parquet", "data.train_path"),
        ("tiny.warm_start_lr=0", "tiny.warm_start_lr"),
    ],
)
def test_tiny_validation_names_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(RUNS / "tiny_cpu.yaml", [override, "actor.world_size=4"])
