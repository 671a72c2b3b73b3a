"""Sub-commands take flags and key=value overrides in any order (issue 35 item 7): an override after a
flag reaches the config (its bad value is named), where argparse used to refuse it with "unrecognized
arguments"."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_megatron import cli

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "runs" / "tiny_cpu.yaml")


@pytest.mark.parametrize(
    "argv",
    [
        ["train", TINY, "--resume", "algorithm.eps_low=5"],
        ["train", TINY, "trainer.total_steps=3", "--skip-plan", "algorithm.eps_low=5", "--overwrite"],
        ["eval", TINY, "--checkpoint", "no/such/dir", "algorithm.eps_low=5"],
        ["plan", TINY, "algorithm.eps_low=5"],
    ],
    ids=["train-flag-first", "train-mixed", "eval-flag-first", "plan"],
)
def test_an_override_after_a_flag_reaches_the_config(argv, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # the local launcher's path, which fails at the config
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err
    assert "config key 'algorithm.eps_low': 5.0 is not allowed" in err, err
