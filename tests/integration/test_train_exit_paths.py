"""Every way a run ends on an error finishes what it started (trainer/train.py: train_rank's `finish`;
launch/local/ranks.py: the one line). The real `dapo-megatron train` on the tiny CPU config (launcher, CPU
engine, 2 gloo ranks under torchrun, wandb offline), stopped three ways:

  N  a non-finite stop: trainer.lr=1e38 makes step 1's second update NaN, and
     trainer.max_nonfinite_in_row=1 stops the run once step 1 is logged (NonFiniteGuard)
  L  EnginesLost: the only engine SIGKILLed once step 1 is logged, with rollout.engine_restarts=0:
     step 2's rollout finds no engine, step 1 is checkpointed, the run stops naming the engine
  X  an exception nobody expects in a step: trainer.lr=1e38 with the guard at 3 lets step 1's
     huge weights reach the engine, whose sampling then fails (HTTP 500, "probability tensor contains
     either inf, nan or element < 0") in step 2's rollout: an EngineError that is not an engine loss

Each leaves curves.png and the timeline (jsonl + PNG), metrics.jsonl with every completed step's line,
its wandb run finished with exit code 1 (wandb's own log), no process of the run, exactly one line naming the cause and
no traceback on the console, and exit code 1 (README, "Exit codes").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers_train import run_processes, step_logged, step_rows, train_failing, wandb_exit_code

PNG = b"\x89PNG\r\n\x1a\n"


# each run is its own fixture, so that one test's time limit covers one run (the first also pays for
# the session's warm-start cache, conftest.py: tiny_cache)
pytestmark = pytest.mark.timeout(1200)  # generous: the machine may be shared and loaded
SHORT = ("trainer.total_steps=3", "trainer.eval_every=0", "trainer.save_every=0")


def _stopped(tmp_path_factory, cache: Path, name: str, *extra: str, kills=()) -> tuple[Path, int, str]:
    out = tmp_path_factory.mktemp("exits") / name
    return (out, *train_failing(out, cache, *SHORT, *extra, kills=kills))


@pytest.fixture(scope="module")
def non_finite(tmp_path_factory, tiny_cache):
    return _stopped(tmp_path_factory, tiny_cache, "n", "trainer.lr=1e38", "trainer.max_nonfinite_in_row=1")


@pytest.fixture(scope="module")
def engines_lost(tmp_path_factory, tiny_cache):
    return _stopped(
        tmp_path_factory,
        tiny_cache,
        "l",
        "rollout.engine_restarts=0",
        "rollout.engine_wait_s=60",
        kills=(step_logged(1),),
    )


@pytest.fixture(scope="module")
def exception_in_a_step(tmp_path_factory, tiny_cache):
    return _stopped(tmp_path_factory, tiny_cache, "x", "trainer.lr=1e38", "trainer.max_nonfinite_in_row=3")


def _finished_what_it_started(out: Path, rc: int, console: str, *, cause: str, steps: list[int]) -> None:
    assert rc == 1, console[-6000:]
    assert (out / "curves.png").read_bytes()[:8] == PNG
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    assert {"generate", "train", "sync"} <= {t["phase"] for t in timeline} and min(t["start"] for t in timeline) == 0.0
    assert (out / "timeline.png").read_bytes()[:8] == PNG
    assert [r["step"] for r in step_rows(out)] == steps  # every completed step's line, no other
    assert wandb_exit_code(out) == 1  # finished, as failed
    assert run_processes(out) == []  # launcher, torchrun, ranks, engine: all gone
    named = [line for line in console.splitlines() if cause in line]
    assert len(named) == 1, named
    assert named[0].startswith("[train] the run failed on rank "), named
    assert "Traceback" not in console, console[-6000:]
    assert f"(traceback: {out / 'logs' / 'ranks_error.txt'})" in named[0]
    assert "Traceback (most recent call last):" in (out / "logs" / "ranks_error.txt").read_text()


def test_a_non_finite_stop_finishes_what_it_started(non_finite):
    out, rc, console = non_finite
    _finished_what_it_started(
        out, rc, console, cause="RuntimeError: 1 updates in a row had a NaN/inf loss or grad norm", steps=[1]
    )
    assert step_rows(out)[0]["actor/nonfinite"] > 0


def test_engines_lost_finishes_what_it_started(engines_lost):
    out, rc, console = engines_lost
    _finished_what_it_started(out, rc, console, cause="EnginesLost: no rollout engine left at step 2", steps=[1])
    assert f"checkpoint of step 1 written ({out / 'checkpoints' / 'step_000001'})" in console


def test_an_exception_in_a_step_finishes_what_it_started(exception_in_a_step):
    out, rc, console = exception_in_a_step
    _finished_what_it_started(out, rc, console, cause="EngineError: ", steps=[1])
    assert "probability tensor contains either `inf`, `nan` or element < 0" in console
