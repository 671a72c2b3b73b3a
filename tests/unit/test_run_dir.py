"""Run-directory policy of `dapo-megatron train` (launch/run_dir.py): two runs never mix in one
directory, --overwrite clears only the run's own files, and --resume on a finished run says so
before any engine or rank starts.

    pytest tests/unit/test_run_dir.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_megatron.launch.run_dir import RUN_FILES, check_run_dir
from dapo_megatron.trainer.checkpoint import files as ckpt

REPO = Path(__file__).resolve().parents[2]


def _finished_run(run_dir: Path, *, steps: tuple[int, ...] = (20, 40)) -> None:
    """What a 40-step run leaves: complete checkpoints, metrics, curves, logs, a cached tiny model."""
    for step in steps:
        path = run_dir / "checkpoints" / f"step_{step:06d}"
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))
        ckpt.write_manifest(path)  # sizes + checksums, as a real save writes them last
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(41)))
    (run_dir / "curves.png").write_bytes(b"png")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "engine_0.log").write_text("serving")
    (run_dir / "tiny_model" / "warm").mkdir(parents=True)
    (run_dir / "tiny_model" / "warm" / "build.json").write_text("{}")


def test_a_fresh_or_model_only_directory_starts_at_step_zero(tmp_path):
    assert check_run_dir(tmp_path / "new", resume=False, overwrite=False, total_steps=40).start_step == 0
    (tmp_path / "cached" / "tiny_model").mkdir(parents=True)  # only a cached model: not a run
    decision = check_run_dir(tmp_path / "cached", resume=False, overwrite=False, total_steps=40)
    assert (decision.start_step, decision.nothing_to_do, decision.message) == (0, False, "")


def test_an_existing_run_is_refused_naming_both_ways_out(tmp_path):
    _finished_run(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError) as err:
        check_run_dir(tmp_path, resume=False, overwrite=False, total_steps=2, command="dapo-megatron train c.yaml")
    text = str(err.value)
    assert f"trainer.output_dir {tmp_path} already holds a run (checkpoints up to step 40)" in text
    assert "dapo-megatron train c.yaml ... --resume" in text and "dapo-megatron train c.yaml ... --overwrite" in text
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing touched


def test_metrics_without_a_checkpoint_are_refused_too_but_resume_is_not_offered(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="no complete checkpoint") as err:
        check_run_dir(tmp_path, resume=False, overwrite=False, total_steps=4)
    assert "--resume" not in str(err.value) and "--overwrite" in str(err.value)


def test_overwrite_clears_the_run_and_keeps_the_cached_model(tmp_path):
    _finished_run(tmp_path)
    decision = check_run_dir(tmp_path, resume=False, overwrite=True, total_steps=40)
    assert decision.start_step == 0 and "removed checkpoints, metrics.jsonl, curves.png, logs" in decision.message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny_model"]
    assert not set(RUN_FILES) & {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="choose one"):
        check_run_dir(tmp_path, resume=True, overwrite=True, total_steps=40)


def test_resume_reports_where_it_continues_or_that_nothing_is_left(tmp_path):
    _finished_run(tmp_path)
    done = check_run_dir(tmp_path, resume=True, overwrite=False, total_steps=40)
    assert done.nothing_to_do and done.start_step == 40
    assert "already at step 40 of 40 (trainer.total_steps): nothing to do" in done.message
    more = check_run_dir(tmp_path, resume=True, overwrite=False, total_steps=60)
    assert (more.nothing_to_do, more.start_step) == (False, 40) and "from step 40 of 60 (step_000040)" in more.message
    # a last checkpoint that no longer verifies is not "finished": the ranks will fall back to step 20
    (tmp_path / "checkpoints" / "step_000040" / "trainer_state.json").write_text('{"step": 41}')
    damaged = check_run_dir(tmp_path, resume=True, overwrite=False, total_steps=40)
    assert not damaged.nothing_to_do and "step_000040 does not verify" in damaged.message
    with pytest.raises(ValueError, match="--resume: no checkpoint in .*run without --resume"):
        check_run_dir(tmp_path / "empty", resume=True, overwrite=False, total_steps=60)


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dapo_megatron.cli", "train", str(REPO / "configs/runs/tiny_cpu.yaml"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_train_command_decides_before_starting_anything(tmp_path):
    """The real command line: a finished run is refused (exit 2) or, with --resume, ends at once with
    exit 0; neither builds the model, starts an engine or launches a rank."""
    run = tmp_path / "run"
    _finished_run(run)
    (run / "logs" / "engine_0.log").unlink()
    (run / "logs").rmdir()
    refused = _train(f"trainer.output_dir={run}", "trainer.total_steps=2")
    assert refused.returncode == 2
    assert "already holds a run (checkpoints up to step 40)" in refused.stderr and "--overwrite" in refused.stderr
    resumed = _train(f"trainer.output_dir={run}", "trainer.total_steps=40", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip() == (
        f"[train] {run} is already at step 40 of 40 (trainer.total_steps): nothing to "
        "do. Raise trainer.total_steps to train further."
    )
    # no engine registry, no engine or rank log, no new model stage: nothing was started; the console's log
    # (logs/train.log) holds the --resume's header and its line (.run.lock: the directory's lock,
    # launch/run_lock.py, emptied when the command ended)
    assert sorted(p.name for p in run.iterdir()) == [
        ".run.lock",
        "checkpoints",
        "curves.png",
        "logs",
        "metrics.jsonl",
        "tiny_model",
    ]
    assert [p.name for p in (run / "logs").iterdir()] == ["train.log"]
    assert "is already at step 40 of 40" in (run / "logs" / "train.log").read_text()
    assert (run / ".run.lock").read_text() == ""
    assert [p.name for p in (run / "tiny_model").iterdir()] == ["warm"]
