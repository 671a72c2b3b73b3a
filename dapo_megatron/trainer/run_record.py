"""What a run keeps about itself across resumes, in <run_dir>/run.json: its wandb run id (one wandb run per
training run, however often it is resumed or requeued) and its lr schedule (so a --resume that changes
the schedule's length says what the lr does, in one line, instead of silently reshaping it).

    record = RunRecord.open(run_dir, resume=resume_step is not None, config=cfg.to_dict())
    record.wandb_id                   # the run's id: kept from the first start, new for a fresh run
    record.schedule_change(step=71)   # "lr schedule: cosine over 60 -> 73 steps, resumed at step 71: ..." or ""

The lr of a step is computed here as actor/optimizer.py has megatron compute it (warm-up over rollout steps,
then constant / linear / cosine decay to min_lr at trainer.total_steps; tests/unit/test_run_record.py
checks the two agree). The decision on a changed trainer.total_steps: the schedule is the new config's
(the lr of every later step follows it, from the resumed step on); the line says so, with the lr the
resumed step gets under the old and the new length.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

RUN_FILE = "run.json"
SCHEDULE_KEYS = ("lr", "warmup_steps", "lr_decay_style", "min_lr", "total_steps")


def lr_at(step: int, *, lr: float, warmup_steps: int, lr_decay_style: str, min_lr: float, total_steps: int) -> float:
    """The lr of rollout step `step` (0-based), as actor/optimizer.py's set_lr_for_step sets it."""
    num_steps = step + 1
    style = "constant" if total_steps <= warmup_steps else lr_decay_style
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return lr * num_steps / warmup_steps
    if style == "constant":
        return lr
    if num_steps > total_steps:
        return min_lr
    ratio = (num_steps - warmup_steps) / (total_steps - warmup_steps)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (lr - min_lr)


def schedule_of(config: Mapping[str, object]) -> dict[str, float | int | str]:
    """The trainer section's lr schedule keys."""
    trainer = config.get("trainer", {})
    assert isinstance(trainer, Mapping)
    return {key: trainer[key] for key in SCHEDULE_KEYS if key in trainer}


@dataclass
class RunRecord:
    run_dir: Path
    wandb_id: str
    schedule: dict[str, float | int | str]  # this start's
    previous_schedule: dict[str, float | int | str] | None  # the run's previous start's (resumed), if recorded

    @classmethod
    def open(cls, run_dir: str | Path, *, resume: bool, config: Mapping[str, object]) -> RunRecord:
        """The run's record: the previous start's, when resumed; written back with this start's schedule."""
        run_dir = Path(run_dir)
        before = _read(run_dir / RUN_FILE) if resume else {}
        wandb_id = str(before.get("wandb_id") or secrets.token_hex(4))  # 8 hex digits, as wandb's own ids
        previous = before.get("lr_schedule")
        record = cls(
            run_dir=run_dir,
            wandb_id=wandb_id,
            schedule=schedule_of(config),
            previous_schedule=dict(previous) if isinstance(previous, Mapping) else None,
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f"{RUN_FILE}.tmp"
        tmp.write_text(json.dumps({"wandb_id": record.wandb_id, "lr_schedule": record.schedule}, indent=1) + "\n")
        tmp.replace(run_dir / RUN_FILE)
        return record

    def schedule_change(self, *, step: int) -> str:
        """One line when the resumed run's lr schedule differs from its previous start's; '' when it does not."""
        old, new = self.previous_schedule, self.schedule
        if old is None or set(old) != set(SCHEDULE_KEYS) or set(new) != set(SCHEDULE_KEYS) or old == new:
            return ""
        lr_old, lr_new = (lr_at(step, **_typed(s)) for s in (old, new))
        style = str(new["lr_decay_style"])
        if old["total_steps"] != new["total_steps"] and all(
            old[k] == new[k] for k in SCHEDULE_KEYS if k != "total_steps"
        ):
            what = f"{style} over {old['total_steps']} -> {new['total_steps']} steps"
        else:
            changed = [k for k in SCHEDULE_KEYS if old[k] != new[k]]
            what = ", ".join(f"trainer.{k} {old[k]} -> {new[k]}" for k in changed)
        return (
            f"[train] lr schedule: {what}, resumed at step {step}: lr {lr_old:.2e} -> {lr_new:.2e} "
            "(the schedule is this config's from here on)"
        )


def _typed(schedule: Mapping[str, float | int | str]) -> dict:
    return {
        "lr": float(schedule["lr"]),
        "warmup_steps": int(schedule["warmup_steps"]),
        "lr_decay_style": str(schedule["lr_decay_style"]),
        "min_lr": float(schedule["min_lr"]),
        "total_steps": int(schedule["total_steps"]),
    }


def _read(path: Path) -> dict[str, object]:
    """run.json; {} when it is missing or unreadable (a run from before this file: a new wandb id)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
