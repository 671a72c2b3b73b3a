"""The real `dapo-megatron train` on the tiny CPU config (launcher, CPU rollout engine, 2 gloo actor
ranks under torchrun) with its only engine SIGKILLed mid-run.

The session's tiny model (warm-start cache) is shared by:
  A  the uninterrupted 4-step run (conftest.py: tiny_run_a, test_train_tiny.py's run)
  K  the same run whose engine is SIGKILLed once step 1 is logged: the launcher restarts it, the
     driver waits for it, re-syncs the current weights and redoes what the step lost; and the restarted
     engine SIGKILLed again as soon as it holds step 4's weights, i.e. during step 4's eval: the eval
     is retried once it is back, with the same prompts and seeds
  Z  a 2-step run (eval every step) with the only engine SIGKILLed as soon as it holds step 1's weights
     (during step 1's eval) and rollout.engine_restarts=0: the eval is recorded as missed, step 1 is
     logged, and the next rollout stops the run with the engine named and the checkpoint of step 1 on disk
K's per-step data (the keys test_train_tiny.py calls exact) and its step-4 eval must equal A's: the
redone rollout and the retried eval ask for the same samples (same prompts, rids and per-sample
seeds) from the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_megatron.rollout.registry import read_engine_events
from helpers_train import EXACT_KEYS, holds_weights, step_logged, step_rows, train_killing_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_run_a):
    root = tmp_path_factory.mktemp("faults")
    cache = tiny_run_a["cache"]
    killed = train_killing_engine(root / "k", cache, kills=(step_logged(1), holds_weights("step_4")))
    no_budget = train_killing_engine(
        root / "z",
        cache,
        "rollout.engine_restarts=0",
        "rollout.engine_wait_s=60",
        "trainer.total_steps=2",
        "trainer.eval_every=1",
        "trainer.save_every=0",
        "trainer.keep_best_checkpoint=false",
        kills=(holds_weights("step_1"),),
    )
    return {"root": root, "a": [r for r in tiny_run_a["a"] if r["step"] > 0], "k": killed, "z": no_budget}


def test_only_engine_killed_restarts_and_trains_every_step_as_if_uninterrupted(runs):
    rc, console, (record, second) = runs["k"]
    assert rc == 0, console[-6000:]
    a, k = runs["a"], step_rows(runs["root"] / "k")
    assert [r["step"] for r in k] == [1, 2, 3, 4]
    for ra, rk in zip(a, k):
        for key in EXACT_KEYS:
            assert ra[key] == rk[key], (ra["step"], key, ra[key], rk[key])
    # step 4's eval lost its engine, was retried once it was back: the same avg@k as the uninterrupted run
    assert "[engines] no engine left during the eval of step 4" in console, console[-6000:]
    assert "re-syncing the weights of step 4, then the eval starts over with the same prompts and seeds" in console
    assert (k[3]["eval/retried"], k[3]["eval/avg@k"], k[3]["eval/pass@k"]) == (
        1.0,
        a[3]["eval/avg@k"],
        a[3]["eval/pass@k"],
    )
    # the launcher's console line, and the driver's counters from step 2 on
    assert (
        f"[engines] engine_0 ({record['url']}, pid {record['pid']}) exited with code -9 (SIGKILL); restarting it"
        in console
    ), console[-4000:]
    assert "(restart 1 of rollout.engine_restarts=3)" in console
    assert [r["engines/restarted_total"] for r in k] == [0.0, 1.0, 1.0, 1.0]
    assert [r["engines/live"] for r in k] == [1.0, 1.0, 1.0, 1.0]
    assert k[1]["engines/dropped_total"] >= 1.0
    events = read_engine_events(runs["root"] / "k" / "logs" / "engine_restarts.jsonl")
    assert [(e["engine"], e["action"], e["returncode"], e["pid"]) for e in events] == [
        ("engine_0", "restarted", -9, record["pid"]),
        ("engine_0", "restarted", -9, second["pid"]),
    ]


def test_only_engine_killed_without_restart_budget_checkpoints_and_names_the_engine(runs):
    rc, console, (record,) = runs["z"]
    assert rc != 0
    # it died during step 1's eval: the eval is missed, step 1 is logged and kept
    assert "[eval] the eval of step 1 is missed (recorded as eval/missed=1): no rollout engine left" in console, (
        console[-6000:]
    )
    assert "Training goes on from step 1, which is complete" in console
    assert step_rows(runs["root"] / "z")[0]["eval/missed"] == 1.0
    assert "not restarted: the restart budget is spent (0 of rollout.engine_restarts=0)" in console
    assert f"no rollout engine left at step 2: {record['url']} dropped" in console, console[-6000:]
    assert "the launcher's engine_0 exited with code -9 and was not restarted" in console
    out = runs["root"] / "z"
    assert f"checkpoint of step 1 written ({out / 'checkpoints' / 'step_000001'})" in console
    from dapo_megatron.trainer.checkpoint.files import newest_valid_checkpoint, read_state

    latest = newest_valid_checkpoint(out)  # complete: its manifest verifies
    assert latest == out / "checkpoints" / "step_000001"
    assert read_state(latest)["step"] == 1
    assert [r["step"] for r in step_rows(out)] == [1]


@pytest.fixture(scope="module")
def colocated_killed(tmp_path_factory, tiny_run_a):
    """C: tiny_cpu_colocated.yaml (the engine shares the ranks' memory, weights by shared memory), its
    only engine SIGKILLed once step 1 is logged."""
    root = tmp_path_factory.mktemp("colocated_faults")
    return root, train_killing_engine(root / "c", tiny_run_a["cache"], config="tiny_cpu_colocated.yaml")


def test_colocated_engine_killed_restarts_and_trains_every_step_as_if_uninterrupted(colocated_killed, tiny_run_a):
    root, (rc, console, (record,)) = colocated_killed
    assert rc == 0, console[-6000:]
    assert (
        f"[engines] engine_0 ({record['url']}, pid {record['pid']}) exited with code -9 (SIGKILL); restarting it"
        in console
    ), console[-4000:]
    assert "re-syncing the weights of step 1, then step 2's rollout starts over" in console
    a, c = [r for r in tiny_run_a["a"] if r["step"] > 0], step_rows(root / "c")
    assert [r["step"] for r in c] == [1, 2, 3, 4]
    # the colocated run equals the disaggregated one to the bit (test_train_colocated.py), interrupted or not
    for ra, rc_ in zip(a, c):
        for key in EXACT_KEYS + ("eval/avg@k",):
            assert ra.get(key) == rc_.get(key), (ra["step"], key, ra.get(key), rc_.get(key))
    assert [r["engines/restarted_total"] for r in c] == [0.0, 1.0, 1.0, 1.0]
