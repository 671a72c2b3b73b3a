"""`dapo-megatron eval --checkpoint X`: X may be a run directory (its newest complete checkpoint), a
run checkpoint (step_N/hf) or a HF model directory.

    pytest tests/unit/test_eval_checkpoint.py
"""

from __future__ import annotations

import pytest

from dapo_megatron.trainer.evaluation.sampling import resolve_checkpoint


def _checkpoint(run, step: int, *, complete: bool = True, hf: bool = True):
    path = run / "checkpoints" / f"step_{step:06d}"
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text(f'{{"step": {step}}}')
    if hf:
        (path / "hf").mkdir()
        (path / "hf" / "config.json").write_text("{}")
    return path


def test_a_run_directory_means_its_newest_complete_checkpoint(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 2)
    newest = _checkpoint(run, 10)
    _checkpoint(run, 12, complete=False)  # no trainer_state.json: a save that never finished
    (run / "checkpoints" / "step_000014.tmp").mkdir()  # being written
    assert resolve_checkpoint(str(run)) == (str(newest), str(newest / "hf"))


def test_a_step_directory_or_a_hf_directory_is_used_as_given(tmp_path):
    step = _checkpoint(tmp_path / "run", 4)
    assert resolve_checkpoint(str(step)) == (str(step), str(step / "hf"))
    assert resolve_checkpoint(str(step / "hf")) == (str(step / "hf"), str(step / "hf"))


def test_a_run_directory_without_a_complete_checkpoint_is_a_clear_error(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 3, complete=False)
    with pytest.raises(ValueError, match="run directory without a complete checkpoint"):
        resolve_checkpoint(str(run))
    _checkpoint(run, 5, hf=False)  # complete, but written with trainer.save_hf=false
    with pytest.raises(ValueError, match="save_hf"):
        resolve_checkpoint(str(run))


def test_eval_of_a_run_directory_in_place_of_the_config_names_checkpoint(tmp_path):
    """`dapo-megatron eval RUN_DIR` (a newcomer's first try): the error says a run directory goes to
    --checkpoint, with the run's saved config when there is one, not just "config file not found"."""
    from dapo_megatron.cli import main

    run = tmp_path / "run"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "config.yaml").write_text("{}")
    with pytest.raises(ValueError, match=r"is a directory.*--checkpoint") as err:
        from dapo_megatron.launch.local.commands import evaluate

        evaluate([str(run)])
    assert f"dapo-megatron eval {run / 'slurm' / 'config.yaml'} --checkpoint {run}" in str(err.value)
    assert main(["eval", str(run)]) == 2  # the command line prints it as one error line
