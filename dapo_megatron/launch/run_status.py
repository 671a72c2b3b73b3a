"""`dapo-megatron status RUN_DIR`: where a run stands, local or Slurm, live or finished.

    dapo-megatron status outputs/tiny_cpu
    run outputs/tiny_cpu: live (local: pid 4121 on node7, since 2026-11-28 19:02:11 UTC)
      step:        23 of 60
      speed:       4.1 s per step (median of the last 10); rollout 3.5K tok/s, train 11.2K tok/s
      time left:   2 min 32 s (37 steps)
      last eval:   avg@8 71.3% [65.0%, 77.1%] (95% CI) at step 20
      engines:     http://127.0.0.1:41233 (up), http://127.0.0.1:41877 (up)
      log:         outputs/tiny_cpu/logs/train.log
      last error:  (none in the log)

Live: the run directory's lock is held (launch/run_lock.py: the local launcher, or a Slurm job's batch
shell), or its Slurm training job (slurm/jobs.json) is pending or running. The progress lines are
trainer/run_status.py's (the run directory's files). `slurm status RUN_DIR` lists every job of a
submission with its Slurm state.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dapo_megatron.launch import run_lock
from dapo_megatron.launch.slurm import status
from dapo_megatron.trainer.run_status import read_progress

_LIVE_SLURM = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")


def state_line(run_dir: Path, *, step: int | None, total_steps: int | None, run: status.Runner = status._run) -> str:
    """live / finished / stopped, and who runs it: the Slurm training job when there is one, else the lock."""
    jobs = [job for job in _slurm_jobs(run_dir) if job.get("role") == "train"]
    if jobs:
        rows = status.job_rows(str(jobs[-1]["job_id"]), run)
        state = rows[-1]["state"] if rows else "gone"
        live = state.split()[0].rstrip("+") in _LIVE_SLURM
        return f"{'live' if live else _ended(step, total_steps)} (Slurm job {jobs[-1]['job_id']}: {state})"
    holder, _ = run_lock.holder(run_dir)
    if holder:
        who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
        started = holder.get("started")
        since = (
            time.strftime(", since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, float) else ""
        )
        return f"live (local: {who}{since})"
    return _ended(step, total_steps)


def _ended(step: int | None, total_steps: int | None) -> str:
    if step is not None and total_steps is not None and step >= total_steps:
        return "finished"
    return "not running" + (f" (stopped at step {step})" if step is not None else "")


def _slurm_jobs(run_dir: Path) -> list[dict]:
    try:
        return status.read_jobs(run_dir)
    except (ValueError, OSError):
        return []


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dapo-megatron status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's trainer.output_dir (local or Slurm)")
    run_dir = Path(parser.parse_args(argv).run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    progress = read_progress(run_dir)
    print(f"run {run_dir}: {state_line(run_dir, step=progress.step, total_steps=progress.total_steps)}")
    print("\n".join(progress.lines()))
    return 0
