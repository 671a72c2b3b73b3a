"""The outer loop's components (trainer/train.py train_rank): each decides its own timing.

TrainerState keeps trainer_state.json as every checkpoint so far wrote it (the dict of main at 736cec1,
written here by hand); the Checkpointer saves every save_every steps, at the last step and on a stop
request; the Evaluator at step 0 and every eval_every steps; the NonFiniteGuard stops after
max_nonfinite_in_row NaN/inf updates in a row, with the message the loop always printed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dapo_megatron.trainer.checkpoint import files as ckpt
from dapo_megatron.trainer.checkpoint.checkpointer import Checkpointer
from dapo_megatron.trainer.checkpoint.files import TrainerState
from dapo_megatron.trainer.evaluation.evaluator import Evaluator
from dapo_megatron.trainer.nonfinite import NonFiniteGuard

DRIVER_STATE = {"prompts": {"epoch": 1, "index": 7, "seed": 3}, "num_requests": 96}


def _as_written_before(tmp_path, state: dict):
    """trainer_state.json exactly as run_checkpoint.save_step wrote it before TrainerState existed:
    write_state(tmp, {"step": step, "driver": driver.state_dict(), **extra})."""
    path = tmp_path / "step_000004"
    path.mkdir()
    (path / ckpt.STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
    return path


def test_a_checkpoint_written_before_reads_into_the_typed_state_and_writes_back_byte_identical(tmp_path):
    old = {"step": 4, "driver": DRIVER_STATE, "nonfinite_in_row": 1, "eval": 0.3125}
    path = _as_written_before(tmp_path, old)
    state = ckpt.read_trainer_state(path)
    assert state == TrainerState(step=4, nonfinite_in_row=1, eval=0.3125, driver=DRIVER_STATE)
    again = tmp_path / "again"
    again.mkdir()
    ckpt.write_state(again, state.to_json())
    assert (again / ckpt.STATE_FILE).read_bytes() == (path / ckpt.STATE_FILE).read_bytes()


def test_the_engines_lost_checkpoint_without_eval_and_an_older_state_without_the_guard_count(tmp_path):
    path = _as_written_before(tmp_path, {"step": 2, "driver": DRIVER_STATE, "nonfinite_in_row": 0, "eval": None})
    assert ckpt.read_trainer_state(path) == TrainerState(step=2, driver=DRIVER_STATE)
    (path / ckpt.STATE_FILE).write_text(json.dumps({"step": 3, "driver": DRIVER_STATE}))
    assert ckpt.read_trainer_state(path) == TrainerState(step=3, nonfinite_in_row=0, eval=None, driver=DRIVER_STATE)


def test_a_state_without_its_step_names_the_file(tmp_path):
    path = _as_written_before(tmp_path, {"driver": DRIVER_STATE})
    with pytest.raises(ValueError, match=r"step_000004/trainer_state.json: not a trainer state \(KeyError: 'step'\)"):
        ckpt.read_trainer_state(path)


def _checkpointer(tmp_path, save_every: int) -> Checkpointer:
    cfg = SimpleNamespace(trainer=SimpleNamespace(output_dir=str(tmp_path), save_every=save_every))
    return Checkpointer(cfg, actor=None, driver=None, roles=SimpleNamespace(driver=True), placement=None)


def test_the_checkpointer_saves_every_save_every_steps_the_last_step_and_on_a_stop_request(tmp_path):
    every3 = _checkpointer(tmp_path, 3)
    assert [s for s in range(1, 11) if every3.should_save(s, last_step=s == 10, stop=False)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if every3.should_save(s, last_step=False, stop=s == 4)] == [3, 4, 6, 9]
    never = _checkpointer(tmp_path, 0)  # save_every=0: only the last step and a stop
    assert [s for s in range(1, 6) if never.should_save(s, last_step=s == 5, stop=s == 2)] == [2, 5]
    assert every3.step_dir(12) == tmp_path / "checkpoints" / "step_000012"


def test_the_evaluator_evaluates_at_step_zero_and_every_eval_every_steps():
    assert [u for u in range(11) if Evaluator(None, eval_every=4).should_evaluate(u)] == [0, 4, 8]
    assert not any(Evaluator(None, eval_every=0).should_evaluate(u) for u in range(11))


def test_the_evaluator_evaluates_the_last_step_whatever_eval_every_unless_evals_are_off():
    # the ladder help's example: 40 steps of a config with eval_every 60 (its summary was the warm start's)
    assert [u for u in range(41) if Evaluator(None, eval_every=60).should_evaluate(u, last=u == 40)] == [0, 40]
    assert [u for u in range(11) if Evaluator(None, eval_every=4).should_evaluate(u, last=u == 10)] == [0, 4, 8, 10]
    assert [u for u in range(9) if Evaluator(None, eval_every=4).should_evaluate(u, last=u == 8)] == [0, 4, 8]
    assert not Evaluator(None, eval_every=0).should_evaluate(10, last=True)


def test_the_guard_counts_nonfinite_updates_in_a_row_and_stops_with_the_same_message(tmp_path):
    guard = NonFiniteGuard(max_in_row=3, in_row=1, last_good=lambda: tmp_path / "step_000002")  # resumed with 1
    counts = []
    for nonfinite in (1.0, 0.0, 1.0, 1.0):
        log = {"actor/nonfinite": nonfinite}
        guard.observe(log)
        guard.stop_if_exceeded()
        counts.append(log["nonfinite_in_row"])
    assert counts == [2.0, 0.0, 1.0, 2.0]
    guard.observe({"actor/nonfinite": 1.0})
    with pytest.raises(RuntimeError) as err:
        guard.stop_if_exceeded()
    assert str(err.value) == (
        "3 updates in a row had a NaN/inf loss or grad norm (trainer.max_nonfinite_in_row=3); "
        f"stopping. Last good checkpoint: {tmp_path / 'step_000002'}"
    )
