"""The tiny ablation ladder (configs/ablations_tiny/) is the 32B ladder (configs/ablations/) in miniature:
rung by rung the same keys change, rung 5 is runs/tiny_chain.yaml; and `dapo-megatron ladder`'s
guards on its output directory and rung files.

    pytest tests/unit/test_ablations_tiny.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.launch.experiments.ladder import MANIFEST, claim_out_dir, rung_files

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
BIG, TINY = CONFIGS / "ablations", CONFIGS / "ablations_tiny"


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _changed(a, b) -> dict[str, tuple]:
    """key -> (before, after) of every key whose value differs, trainer.output_dir aside."""
    fa, fb = _flat(a.to_dict()), _flat(b.to_dict())
    return {k: (fa[k], fb[k]) for k in fa if fa[k] != fb[k] and k != "trainer.output_dir"}


def test_both_ladders_have_the_same_six_rung_names():
    assert [p.name for p in rung_files(TINY)] == [p.name for p in rung_files(BIG)]
    assert len(rung_files(TINY)) == 6


@pytest.mark.parametrize("rung", range(1, 6))
def test_each_tiny_rung_changes_the_same_keys_to_the_same_values_as_the_32b_rung(rung):
    big, tiny = rung_files(BIG), rung_files(TINY)
    big_change = _changed(load_config(big[rung - 1]), load_config(big[rung]))
    tiny_change = _changed(load_config(tiny[rung - 1]), load_config(tiny[rung]))
    assert tiny_change == big_change
    assert tiny_change  # every rung adds something


def test_rung_0_turns_the_same_dapo_switches_off_as_the_32b_rung_0():
    big = _changed(load_config(CONFIGS / "runs" / "qwen2.5-32b_dapo.yaml"), load_config(rung_files(BIG)[0]))
    tiny = _changed(load_config(CONFIGS / "runs" / "tiny_chain.yaml"), load_config(rung_files(TINY)[0]))
    assert tiny == big
    assert tiny["algorithm.eps_high"] == (0.28, 0.2) and tiny["algorithm.use_kl"] == (False, True)


def test_tiny_rung_5_is_the_tiny_chain_run_and_every_rung_writes_its_own_directory():
    assert _changed(load_config(rung_files(TINY)[-1]), load_config(CONFIGS / "runs" / "tiny_chain.yaml")) == {}
    outputs = {load_config(p).trainer.output_dir for p in rung_files(TINY)}
    assert len(outputs) == 6


def test_the_tiny_budget_is_below_the_longest_worked_response():
    """The ladder's premise: the 20-token budget truncates the longest worked sums (up to 23 tokens)."""
    from dapo_megatron.data.chain_task import response_tokens, worked_response

    cfg = load_config(CONFIGS / "runs" / "tiny_chain.yaml")
    assert cfg.data.synthetic.difficulty == 6
    # "18 27 36 45 Answer: 54" + EOS: 4 x 3 + 10 + 1
    assert response_tokens(worked_response("9+9+9+9+9+9=")) == 23 > cfg.rollout.max_response_length == 20
    assert cfg.rollout.max_response_length - cfg.algorithm.overlong_buffer_length == 16


def test_claim_out_dir_accepts_the_same_ladder_and_refuses_another(tmp_path):
    manifest = {"rungs": {"0_a": "x: 1\n"}, "overrides": ["trainer.total_steps=3"]}
    out = tmp_path / "ladder"
    claim_out_dir(out, manifest)
    assert json.loads((out / MANIFEST).read_text()) == manifest
    claim_out_dir(out, manifest)  # a rerun of the same ladder: accepted
    with pytest.raises(ValueError, match="holds the runs of another ladder .*overrides"):
        claim_out_dir(out, {**manifest, "overrides": ["trainer.total_steps=4"]})
    with pytest.raises(ValueError, match="holds the runs of another ladder .*rungs"):
        claim_out_dir(out, {**manifest, "rungs": {"0_a": "x: 2\n"}})


def test_claim_out_dir_refuses_a_directory_that_is_not_a_ladder(tmp_path):
    (tmp_path / "something.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds no ladder"):
        claim_out_dir(tmp_path, {"rungs": {}, "overrides": []})


def test_rung_files_orders_by_number_and_refuses_an_empty_or_ambiguous_directory(tmp_path):
    for name in ("10_last.yaml", "2_mid.yaml", "0_first.yaml", "notes.yaml"):
        (tmp_path / name).write_text("")
    assert [p.name for p in rung_files(tmp_path)] == ["0_first.yaml", "2_mid.yaml", "10_last.yaml"]
    (tmp_path / "2_other.yaml").write_text("")
    with pytest.raises(ValueError, match="share a number"):
        rung_files(tmp_path)
    with pytest.raises(ValueError, match="not a directory of rung configs"):
        rung_files(tmp_path / "notes.yaml")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no rung configs"):
        rung_files(tmp_path / "empty")


def test_a_run_lock_held_elsewhere_is_refused_and_freed_with_its_holder(tmp_path):
    """Two ladder processes on one OUT: the second skips the run the first holds (flock, dropped by the
    kernel when the holder's file closes or its process dies)."""
    from dapo_megatron.launch.experiments.ladder import _flock

    lock = tmp_path / "seed_1.lock"
    with _flock(lock, wait=False) as first:
        assert first
        with _flock(lock, wait=False) as second:  # another open file description: as another process would
            assert not second
    with _flock(lock, wait=False) as again:
        assert again


def test_a_bad_override_stops_the_ladder_before_it_makes_anything(tmp_path):
    from dapo_megatron.launch.experiments.ladder import main

    out = tmp_path / "ladder"
    with pytest.raises(ValueError, match="unknown config key 'trainer.total_stepz'"):
        main([str(TINY), "trainer.total_stepz=3", "--out", str(out)])
    with pytest.raises(ValueError, match="the ladder sets|other than trainer.output_dir"):
        main([str(TINY), "trainer.seed=3", "--out", str(out)])
    assert not out.exists()
