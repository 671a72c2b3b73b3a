"""logs/train.log (trainer/console_log.py: the console's lines, appended across starts, a progress bar's
redraws reduced to their last state) and `dapo-megatron status RUN_DIR` (trainer/run_status.py reading
the run directory, launch/run_status.py deciding live / finished from the run lock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from dapo_megatron.launch import run_status
from dapo_megatron.launch.run_lock import RunLock
from dapo_megatron.trainer.console_log import log_path
from dapo_megatron.trainer.run_record import RUN_FILE
from dapo_megatron.trainer.run_status import read_progress

_START = textwrap.dedent(
    """
    import sys
    from dapo_megatron.trainer import console_log
    print("before the start: not in the file")
    console_log.start(sys.argv[1], header=sys.argv[2])
    print("[train] resuming from step 2")
    sys.stderr.write("gen 10%\\rgen 60%\\rgen 100%\\n")          # a bar redrawn, left at its end
    sys.stderr.write("\\rtrain 3/8\\r\\x1b[K\\r")                 # a bar that erased itself
    print("  3/4 +0.250")
    console_log.start(sys.argv[1], header="again")                # a second start: nothing more
    print("RuntimeError: the engines are gone")
    """
)


def _start(run_dir: Path, header: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _START, str(run_dir), header], capture_output=True, check=True)


def test_the_log_holds_the_consoles_lines_appended_across_starts(tmp_path):
    first = _start(tmp_path, "dapo-megatron train c.yaml")
    _start(tmp_path, "dapo-megatron train c.yaml --resume")
    assert b"gen 10%\rgen 60%\rgen 100%" in first.stderr  # the terminal gets every redraw
    lines = log_path(tmp_path).read_text().splitlines()
    body = ["[train] resuming from step 2", "gen 100%", "  3/4 +0.250", "RuntimeError: the engines are gone"]
    assert [line.split(" UTC ", 1)[1].rsplit(" (pid", 1)[0] for line in (lines[0], lines[5])] == [
        "dapo-megatron train c.yaml",
        "dapo-megatron train c.yaml --resume",
    ]
    assert lines[0].startswith("===== ") and lines[1:5] == body and lines[6:] == body


def _run_dir(tmp_path: Path, *, steps: int, total: int) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    records = [{"step": 0, "eval/avg@k": 0.25, "eval/k": 8.0}]
    for step in range(1, steps + 1):
        records.append(
            {
                "step": step,
                "time/step_s": float(step),  # 1, 2, ..., steps: the median of the last 10 is hand-computable
                "throughput/rollout_tok_s": 3512.0,
                "throughput/train_tok_s": 11234.0,
            }
        )
    records[4].update({"eval/avg@k": 0.5, "eval/k": 8.0, "eval/avg@k_ci95_low": 0.375, "eval/avg@k_ci95_high": 0.625})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / RUN_FILE).write_text(json.dumps({"wandb_id": "ab12cd34", "lr_schedule": {"total_steps": total}}))
    (tmp_path / "engines").mkdir()
    url = "http://127.0.0.1:5"
    (tmp_path / "engines" / "e.json").write_text(json.dumps({"url": url, "host": "127.0.0.1", "pid": os.getpid()}))
    (tmp_path / "logs").mkdir()
    log_path(tmp_path).write_text(
        "===== 2026-11-28 10:00:00 UTC dapo-megatron train c.yaml (pid 1) =====\nValueError: an old start's\n"
        "===== 2026-11-28 11:00:00 UTC dapo-megatron train c.yaml --resume (pid 2) =====\n"
        "[eval] the eval of step 4 failed: engine timeout\n  5/60 ...\n"
    )
    return tmp_path


def test_progress_of_a_run_directory(tmp_path):
    run_dir = _run_dir(tmp_path, steps=14, total=60)
    progress = read_progress(run_dir)
    # the last 10 steps took 5..14 s: median 9.5 s; 46 steps left: 437 s
    assert (progress.step, progress.total_steps, progress.step_s, progress.eta_s) == (14, 60, 9.5, 437.0)
    assert progress.lines() == [
        "  step:        14 of 60",
        "  speed:       9.5 s per step (median of the last 10); rollout 3.5K tok/s, train 11.2K tok/s",
        "  time left:   7 min 17 s (46 steps)",
        "  last eval:   avg@8 50.0% [37.5%, 62.5%] (95% CI) at step 4",
        "  engines:     http://127.0.0.1:5 (up)",
        f"  log:         {run_dir / 'logs' / 'train.log'}",
        "  last error:  [eval] the eval of step 4 failed: engine timeout",  # this start's, not the first's
    ]


def test_status_says_live_while_the_lock_is_held_and_finished_at_the_last_step(tmp_path, capsys):
    run_dir = _run_dir(tmp_path, steps=14, total=60)
    with RunLock(run_dir, command="dapo-megatron train c.yaml"):
        assert run_status.main([str(run_dir)]) == 0
        first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"run {run_dir}: live (local: pid {os.getpid()} on ")
    run_status.main([str(run_dir)])
    assert capsys.readouterr().out.splitlines()[0] == f"run {run_dir}: not running (stopped at step 14)"
    done = _run_dir(tmp_path / "done", steps=14, total=14)
    run_status.main([str(done)])
    assert capsys.readouterr().out.splitlines()[:2] == [f"run {done}: finished", "  step:        14 of 14"]


def test_status_of_a_slurm_run_asks_slurm_for_its_training_job(tmp_path):
    run_dir = _run_dir(tmp_path, steps=5, total=60)
    (run_dir / "slurm").mkdir()
    (run_dir / "slurm" / "jobs.json").write_text(json.dumps({"jobs": [{"role": "train", "job_id": "812"}]}))
    squeue = {"squeue": "812|RUNNING|5:01|None\n"}

    def run(argv: list[str]) -> str | None:
        return squeue.get(argv[0])

    assert run_status.state_line(run_dir, step=5, total_steps=60, run=run) == "live (Slurm job 812: RUNNING)"
    squeue.clear()  # gone from squeue and scontrol: ended
    assert run_status.state_line(run_dir, step=5, total_steps=60, run=run) == (
        "not running (stopped at step 5) (Slurm job 812: gone)"
    )
