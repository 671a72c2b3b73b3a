"""trainer.lr_decay_style / min_lr (lr decay after the warm-up) and trainer.keep_best_checkpoint
(rotation keeps the best-eval checkpoint).

    pytest tests/unit/test_lr_decay_and_best_checkpoint.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dapo_megatron.actor.optimizer import build_lr_schedule, set_lr_for_step
from dapo_megatron.config import load_config
from dapo_megatron.trainer.checkpoint import files as ckpt


def _lrs(**kw) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    schedule = build_lr_schedule(optimizer, lr=1e-3, weight_decay=0.0, **kw)
    out = []
    for step in range(10):
        lr = set_lr_for_step(schedule, step=step)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr)  # the optimizer really uses it
        out.append(lr)
    return out


def test_constant_after_warm_up_is_the_default():
    assert _lrs(warmup_steps=2) == pytest.approx([5e-4] + [1e-3] * 9)


def test_cosine_and_linear_decay_reach_min_lr_at_the_last_step():
    # rollout step s counts as num_steps = s + 1; warm-up 2, decay over num_steps 2..10:
    # ratio = (s + 1 - 2) / 8, cosine lr = 1e-4 + 0.5 * (1 + cos(pi * ratio)) * 9e-4
    cosine = _lrs(warmup_steps=2, decay_style="cosine", min_lr=1e-4, total_steps=10)
    expected = [5e-4, 1e-3] + [1e-4 + 0.5 * (1 + math.cos(math.pi * (s - 1) / 8)) * 9e-4 for s in range(2, 10)]
    assert cosine == pytest.approx(expected)
    assert cosine[5] == pytest.approx(5.5e-4) and cosine[-1] == pytest.approx(1e-4)
    linear = _lrs(warmup_steps=0, decay_style="linear", min_lr=0.0, total_steps=10)
    assert linear == pytest.approx([1e-3 * (1 - (s + 1) / 10) for s in range(10)])  # 0.9e-3 ... 0


def test_a_run_within_its_warm_up_never_decays():
    # e.g. `train tiny_cpu.yaml trainer.total_steps=4` with warmup_steps 5: warm-up only, no error
    lrs = _lrs(warmup_steps=20, decay_style="cosine", min_lr=1e-4, total_steps=10)
    assert lrs == pytest.approx([1e-3 * (s + 1) / 20 for s in range(10)])


def test_decay_settings_are_validated():
    with pytest.raises(ValueError, match="trainer.min_lr"):
        load_config(None, ["trainer.lr=1e-4", "trainer.min_lr=2e-4"])
    with pytest.raises(ValueError, match="trainer.lr_decay_style"):
        load_config(None, ["trainer.lr_decay_style=exponential"])
    with pytest.raises(ValueError, match="trainer.keep_best_checkpoint.*save_every \\(4\\) must divide"):
        load_config(None, ["trainer.keep_best_checkpoint=true", "trainer.eval_every=10", "trainer.save_every=4"])
    with pytest.raises(ValueError, match="trainer.keep_best_checkpoint.*save_every \\(0\\) must divide"):
        load_config(None, ["trainer.keep_best_checkpoint=true", "trainer.eval_every=10", "trainer.save_every=0"])
    load_config(None, ["trainer.keep_best_checkpoint=true", "trainer.eval_every=10", "trainer.save_every=5"])
    load_config(None, ["trainer.keep_best_checkpoint=true", "trainer.eval_every=0", "trainer.save_every=0"])  # no eval


def _save(run, step: int, score):
    tmp = ckpt.step_dir(run, step).with_name(f"step_{step:06d}.tmp")
    tmp.mkdir(parents=True)
    ckpt.write_state(tmp, {"step": step, "eval": score})
    ckpt.commit(tmp, ckpt.step_dir(run, step), keep=1, keep_best=True)


def test_rotation_keeps_the_best_eval_checkpoint(tmp_path):
    run = tmp_path / "run"
    for step, score in ((10, 0.70), (20, 0.81), (30, 0.78), (40, 0.81), (50, None)):
        _save(run, step, score)
    # keep=1 keeps the newest (50) and the best: 20 (81%; the later 40 ties and does not replace it)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [20, 50]
    assert json.loads((run / "checkpoints" / "best.json").read_text()) == {"step": 20, "eval": 0.81}
    assert ckpt.best_checkpoint(run) == (20, 0.81, ckpt.step_dir(run, 20))
    _save(run, 60, 0.85)  # a new best takes over; the old best goes with the rotation
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [60]
    assert ckpt.best_checkpoint(run)[:2] == (60, 0.85)


def test_without_keep_best_rotation_is_unchanged(tmp_path):
    run = tmp_path / "run"
    for step, score in ((10, 0.9), (20, 0.5)):
        tmp = ckpt.step_dir(run, step).with_name(f"step_{step:06d}.tmp")
        tmp.mkdir(parents=True)
        ckpt.write_state(tmp, {"step": step, "eval": score})
        ckpt.commit(tmp, ckpt.step_dir(run, step), keep=1)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [20]
    assert ckpt.best_checkpoint(run) is None
