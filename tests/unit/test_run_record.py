"""trainer/run_record.py: one wandb run per training run (its id in <run_dir>/run.json, kept by every resume),
and the one line a resume that changes the lr schedule prints (the lr it computes is actor/optimizer.py's)."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

from dapo_megatron.actor.optimizer import build_lr_schedule, set_lr_for_step
from dapo_megatron.trainer.metrics_log import MetricsLogger
from dapo_megatron.trainer.run_record import RUN_FILE, RunRecord, lr_at


def _config(total_steps: int, **trainer) -> dict:
    schedule = {"lr": 1e-4, "warmup_steps": 10, "lr_decay_style": "cosine", "min_lr": 1e-5, "total_steps": total_steps}
    return {"trainer": {**schedule, **trainer}}


def test_two_resumes_continue_one_wandb_run(tmp_path):
    """A fresh start, then two resumes (by hand or a requeued job: both pass --resume): one run id, in
    run.json and in every offline wandb run directory; a fresh run in the same directory gets a new one."""
    ids = []
    for resume_step in (None, 2, 4):
        logger = MetricsLogger(
            tmp_path,
            wandb_mode="offline",
            wandb_project="test",
            config=_config(60),
            console=None,
            resume_step=resume_step,
        )
        logger.log(1 if resume_step is None else resume_step + 1, {"reward/mean": 0.5})
        ids.append(logger._wandb.id)
        logger.close(plot=False)
    assert len(set(ids)) == 1
    assert json.loads((tmp_path / RUN_FILE).read_text())["wandb_id"] == ids[0]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 3 and all(f"-{ids[0]}" in run.name for run in runs)  # `wandb sync` joins them
    fresh = MetricsLogger(tmp_path, wandb_mode="disabled", config=_config(60), console=None)
    assert fresh.record.wandb_id != ids[0]
    fresh.close(plot=False)


def _megatron_lrs(total_steps: int, style: str, warmup: int = 10) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    schedule = build_lr_schedule(
        optimizer,
        lr=1e-4,
        weight_decay=0.0,
        warmup_steps=warmup,
        decay_style=style,
        min_lr=1e-5,
        total_steps=total_steps,
    )
    return [set_lr_for_step(schedule, step=step) for step in range(total_steps + 5)]


@pytest.mark.parametrize(("total_steps", "style", "warmup"), [(60, "cosine", 10), (73, "linear", 0), (8, "cosine", 10)])
def test_lr_at_is_the_optimizers_schedule(total_steps, style, warmup):
    ours = [
        lr_at(step, lr=1e-4, warmup_steps=warmup, lr_decay_style=style, min_lr=1e-5, total_steps=total_steps)
        for step in range(total_steps + 5)
    ]
    assert ours == pytest.approx(_megatron_lrs(total_steps, style, warmup), rel=1e-12, abs=1e-20)


def test_a_resume_that_changes_total_steps_says_what_the_lr_does(tmp_path):
    RunRecord.open(tmp_path, resume=False, config=_config(60))
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, wandb_mode="disabled", config=_config(73), console=out, resume_step=50)
    logger.close(plot=False)
    # cosine from step 10: at rollout step 50 (num_steps 51) ratio 41/50 over 60 steps, 41/63 over 73
    old = 1e-5 + 0.5 * (1 + math.cos(math.pi * 41 / 50)) * 9e-5
    new = 1e-5 + 0.5 * (1 + math.cos(math.pi * 41 / 63)) * 9e-5
    assert out.getvalue().splitlines()[0] == (
        f"[train] lr schedule: cosine over 60 -> 73 steps, resumed at step 50: lr {old:.2e} -> {new:.2e} "
        "(the schedule is this config's from here on)"
    )
    assert (f"{old:.2e}", f"{new:.2e}") == ("1.70e-05", "3.45e-05")
    assert json.loads((tmp_path / RUN_FILE).read_text())["lr_schedule"]["total_steps"] == 73
    quiet = io.StringIO()  # the same schedule again: nothing to say
    MetricsLogger(tmp_path, wandb_mode="disabled", config=_config(73), console=quiet, resume_step=60).close(plot=False)
    assert quiet.getvalue() == ""
    other = io.StringIO()
    MetricsLogger(tmp_path, wandb_mode="disabled", config=_config(73, lr=2e-4), console=other, resume_step=60).close(
        plot=False
    )
    assert other.getvalue().startswith("[train] lr schedule: trainer.lr 0.0001 -> 0.0002, resumed at step 60: lr ")
