"""What `train` does with an existing run directory (trainer.output_dir), decided before any engine
or rank starts: two runs never mix in one directory.

    decision = check_run_dir(run_dir, resume=False, overwrite=False, total_steps=40)
    # a fresh directory, or only a cached tiny model in it: go
    # a directory holding a run (checkpoints or metrics): ValueError naming both ways out,
    #   --resume (continue it) or --overwrite (clear it first), or another trainer.output_dir
    # --resume on a run already at total_steps: decision.nothing_to_do, with the message to print
    # --resume with no checkpoint at all: ValueError (never a silent start from nothing)

Only the run's own files are cleared by --overwrite (RUN_FILES); a cached tiny model
(<run_dir>/tiny_model, keyed by its build arguments) is kept: it is rebuilt when they differ.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from dapo_megatron.trainer.checkpoint import files as ckpt

# what one run writes into its directory (README, "run directory"); --overwrite removes exactly these
RUN_FILES = ("checkpoints", "metrics.jsonl", "curves.png", "wandb", "logs", "engines", "eval")


@dataclass
class RunDirDecision:
    start_step: int  # the step training starts from (0 fresh, N after --resume from step_N)
    nothing_to_do: bool = False
    message: str = ""  # what to print before anything starts ("" = nothing)
    checkpoint: Path | None = None  # --resume: the newest checkpoint (the ranks take it if it verifies)


def _has_metrics(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and path.stat().st_size > 0


def clear_run(run_dir: Path) -> list[str]:
    """Delete the run's own files (RUN_FILES) from run_dir; returns the names removed."""
    removed = []
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def check_run_dir(
    run_dir: str | Path,
    *,
    resume: bool,
    overwrite: bool,
    total_steps: int,
    command: str = "dapo-megatron train CONFIG",
    prefix: str = "[train]",
) -> RunDirDecision:
    """Refuse to mix two runs; clear with `overwrite`; say when `resume` has nothing left to do.
    command: how the ways out are spelled (`slurm submit` passes its own); prefix: of the printed lines."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise ValueError("--resume continues the run in trainer.output_dir and --overwrite deletes it: choose one")
    checkpoints = ckpt.list_checkpoints(run_dir)
    latest_step = checkpoints[-1][0] if checkpoints else None
    if overwrite:
        removed = clear_run(run_dir) if run_dir.is_dir() else []
        message = f"{prefix} --overwrite: removed {', '.join(removed)} from {run_dir}" if removed else ""
        return RunDirDecision(start_step=0, message=message)
    if resume:
        return _resume_decision(run_dir, checkpoints, total_steps=total_steps, prefix=prefix)
    if latest_step is not None or _has_metrics(run_dir):
        _refuse_mixing(run_dir, latest_step, command=command)
    return RunDirDecision(start_step=0)


def _resume_decision(
    run_dir: Path, checkpoints: list[tuple[int, Path]], *, total_steps: int, prefix: str
) -> RunDirDecision:
    """--resume: from the newest checkpoint, nothing to do when it is at total_steps and verifies, an
    earlier one when it does not; no checkpoint at all is an error."""
    latest_step = checkpoints[-1][0] if checkpoints else None
    if latest_step is None:  # as the ranks would (checkpointing.newest_valid_checkpoint), but before they start
        raise ValueError(
            f"--resume: no checkpoint in {ckpt.checkpoint_root(run_dir)} (a complete step_<N>/ "
            f"with {ckpt.STATE_FILE}); run without --resume to start this run from the beginning"
        )
    # a finished run is only finished if its last checkpoint is intact (its manifest verifies);
    # otherwise the ranks set it aside and resume from an earlier one (trainer/checkpoint/files.py)
    problems = ckpt.verify_checkpoint(checkpoints[-1][1]) if latest_step >= total_steps else []
    if problems:
        return RunDirDecision(
            start_step=latest_step,
            message=(
                f"{prefix} {checkpoints[-1][1].name} does not verify ({problems[0]}): resuming from an earlier "
                "checkpoint"
            ),
        )
    if latest_step >= total_steps:
        return RunDirDecision(
            start_step=latest_step,
            nothing_to_do=True,
            message=(
                f"{prefix} {run_dir} is already at step {latest_step} of {total_steps} "
                f"(trainer.total_steps): nothing to do. Raise trainer.total_steps to train further."
            ),
        )
    return RunDirDecision(
        start_step=latest_step,
        message=(f"{prefix} resuming {run_dir} from step {latest_step} of {total_steps} ({checkpoints[-1][1].name})"),
        checkpoint=checkpoints[-1][1],
    )


def _refuse_mixing(run_dir: Path, latest_step: int | None, *, command: str) -> None:
    """A new run into a directory holding one: a ValueError naming what is there and the ways out."""
    held = (
        f"checkpoints up to step {latest_step}"
        if latest_step is not None
        else "metrics.jsonl of an earlier run (no complete checkpoint)"
    )
    ways = [f"continue it: {command} ... --resume"] if latest_step is not None else []
    ways.append(f"start over: {command} ... --overwrite (deletes {', '.join(RUN_FILES)} there)")
    ways.append("or write elsewhere: trainer.output_dir=NEW_DIR")
    raise ValueError(
        f"trainer.output_dir {run_dir} already holds a run ({held}); a new run there would mix "
        "with it. " + "; ".join(ways)
    )
