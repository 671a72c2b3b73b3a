"""The real `dapo-megatron train` on the tiny CPU config (launcher, CPU rollout engine, 2 gloo actor
ranks under torchrun) with its only engine SIGKILLed mid-run.

The session's tiny model (warm-start cache) is shared by:
  A  the uninterrupted 4-step run (conftest.py: tiny_run_a, test_train_tiny.py's run)
  K  the same run whose engine is SIGKILLed once step 1 is logged: the launcher restarts it, the
     driver waits for it, re-syncs the current weights and redoes what the step lost
  Z  a 2-step run with the same kill and rollout.engine_restarts=0: the run stops with the engine
     named and the checkpoint of step 1 on disk
K's per-step data (the keys test_train_tiny.py calls exact) must equal A's: the redone rollout asks
for the same samples (same prompts, rids and per-sample seeds) from the same weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_tiny import EXACT_KEYS

from dapo_megatron.rollout.registry import read_engine_events

ROOT = Path(__file__).resolve().parents[2]


def _cmd(out: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dapo_megatron.cli", "train", str(ROOT / "configs/runs/tiny_cpu.yaml"),
            f"trainer.output_dir={out}", f"tiny.cache_dir={cache}", "tiny.warm_start_steps=300",
            "trainer.total_steps=4", "trainer.eval_every=4", "trainer.save_every=2", "trainer.keep_checkpoints=2",
            "trainer.wandb_mode=disabled", "rollout.engine_wait_s=120", *extra]  # tiny_run_a's settings


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if r["step"] > 0]  # step 0: the starting eval


def _engine_pid(out: Path) -> int:
    records = [json.loads(p.read_text()) for p in (out / "engines").glob("*.json")]
    assert len(records) == 1, records
    return int(records[0]["pid"])


def _train_killing_engine(out: Path, cache: Path, *extra: str, after_step: int = 1) -> tuple[int, str, dict]:
    """Run train; SIGKILL its engine once step `after_step` is in metrics.jsonl. Returns (exit code,
    console text, the killed engine's registration)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    log = out.parent / f"{out.name}.console.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(_cmd(out, cache, *extra), cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while not any(r["step"] == after_step for r in _rows(out)):
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, "no step logged within 600 s"
                time.sleep(0.05)
            record = json.loads(next((out / "engines").glob("*.json")).read_text())
            os.kill(int(record["pid"]), signal.SIGKILL)
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    return rc, log.read_text(), record


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_run_a):
    root = tmp_path_factory.mktemp("faults")
    cache = tiny_run_a["cache"]
    killed = _train_killing_engine(root / "k", cache)
    no_budget = _train_killing_engine(root / "z", cache, "rollout.engine_restarts=0", "rollout.engine_wait_s=60",
                                      "trainer.total_steps=2", "trainer.eval_every=0", "trainer.save_every=0")
    return {"root": root, "a": [r for r in tiny_run_a["a"] if r["step"] > 0], "k": killed, "z": no_budget}


def test_only_engine_killed_restarts_and_trains_every_step_as_if_uninterrupted(runs):
    rc, console, record = runs["k"]
    assert rc == 0, console[-6000:]
    a, k = runs["a"], _rows(runs["root"] / "k")
    assert [r["step"] for r in k] == [1, 2, 3, 4]
    for ra, rk in zip(a, k):
        for key in EXACT_KEYS:
            assert ra[key] == rk[key], (ra["step"], key, ra[key], rk[key])
    # the launcher's console line, and the driver's counters from step 2 on
    assert f"[engines] engine_0 ({record['url']}, pid {record['pid']}) exited with code -9 (SIGKILL); restarting it" \
        in console, console[-4000:]
    assert "(restart 1 of rollout.engine_restarts=3)" in console
    assert [r["engines/restarted_total"] for r in k] == [0.0, 1.0, 1.0, 1.0]
    assert [r["engines/live"] for r in k] == [1.0, 1.0, 1.0, 1.0]
    assert k[1]["engines/dropped_total"] >= 1.0
    events = read_engine_events(runs["root"] / "k" / "logs" / "engine_restarts.jsonl")
    assert [(e["engine"], e["action"], e["returncode"], e["pid"]) for e in events] == \
        [("engine_0", "restarted", -9, record["pid"])]


def test_only_engine_killed_without_restart_budget_checkpoints_and_names_the_engine(runs):
    rc, console, record = runs["z"]
    assert rc != 0
    assert "not restarted: the restart budget is spent (0 of rollout.engine_restarts=0)" in console
    assert f"no rollout engine left at step 2: {record['url']} dropped" in console, console[-6000:]
    assert "the launcher's engine_0 exited with code -9 and was not restarted" in console
    out = runs["root"] / "z"
    assert f"checkpoint of step 1 written ({out / 'checkpoints' / 'step_000001'})" in console
    from dapo_megatron.trainer.run_checkpoint import newest_valid_checkpoint, read_state

    latest = newest_valid_checkpoint(out)  # complete: its manifest verifies
    assert latest == out / "checkpoints" / "step_000001"
    assert read_state(latest)["step"] == 1
    assert [r["step"] for r in _rows(out)] == [1]
