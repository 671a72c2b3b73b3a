"""Benchmark results go to a results directory the user names (default ./results where the command
runs), never into the package source; `bench` dispatches every benchmark.

    pytest tests/unit/test_bench_output.py
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

import dapo_megatron
from dapo_megatron.benchmarks import reward as reward_bench
from dapo_megatron.benchmarks import run as bench

PACKAGE = Path(dapo_megatron.__file__).resolve().parent


def _rows(path: Path) -> list[dict]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_reward_bench_appends_to_the_named_results_dir(tmp_path):
    out = tmp_path / "my results"
    for _ in range(2):  # a second run appends a row under the same header
        assert bench.main(["reward", "--num", "12", "--chars", "300", "--repeats", "2", "--results-dir", str(out)]) == 0
    rows = _rows(out / "reward.csv")
    assert len(rows) == 2 and list(rows[0]) == reward_bench.CSV_FIELDS
    row = rows[0]
    assert (row["kernel"], row["metric"], row["unit"], row["x"]) == (
        "reward_math_dapo",
        "seconds_per_12_responses",
        "s",
        "300",
    )
    assert float(row["p20"]) <= float(row["p50"]) <= float(row["p80"])
    assert list(PACKAGE.rglob("*.csv")) == []  # nothing written next to the code


def test_default_results_dir_is_relative_to_where_the_command_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bench.main(["reward", "--num", "6", "--chars", "200", "--repeats", "1"]) == 0
    assert [r["x"] for r in _rows(tmp_path / "results" / "reward.csv")] == ["200"]
    # --csv names one exact file instead
    assert bench.main(["reward", "--num", "6", "--chars", "250", "--repeats", "1", "--csv", "one.csv"]) == 0
    assert [r["x"] for r in _rows(tmp_path / "one.csv")] == ["250"]
    assert [r["x"] for r in _rows(tmp_path / "results" / "reward.csv")] == ["200"]


def test_kernel_results_default_outside_the_package(tmp_path, monkeypatch):
    from dapo_kernels.bench import common

    monkeypatch.chdir(tmp_path)
    writer = common.CsvWriter(None, "policy_loss")
    writer.add("fused", "fwd", "ms", "ms", "T=8", 1.25)
    writer.flush()
    assert [(r["kernel"], r["p50"]) for r in _rows(tmp_path / "results" / "kernels.csv")] == [("policy_loss", "1.25")]


def test_every_bench_subcommand_takes_the_same_output_options(capsys):
    for name in bench.BENCHES:  # its --help: the parser it runs with (benchmarks/parsers.py for the torch ones)
        with pytest.raises(SystemExit) as done:
            bench.main([name, "--help"])
        text = capsys.readouterr().out
        assert done.value.code == 0 and "--results-dir" in text and "--csv" in text, name
    assert bench.main([]) == 2  # usage


def test_slurm_kernel_bench_writes_into_the_run_directory(tmp_path):
    from dapo_megatron.config import load_config
    from dapo_megatron.launch.slurm import submit

    cfg = load_config(None, [f"trainer.output_dir={tmp_path}/run"])
    (job,) = submit.plan_bench_kernels(cfg).jobs
    assert f"BENCH_ARGS=(--results-dir {tmp_path}/run/bench)" in job.script()


def test_rows_under_another_header_are_refused_and_the_file_kept(tmp_path):
    path = tmp_path / "overlap.csv"
    bench.append_rows(path, [{"a": 1, "b": 2}], fields=("a", "b"))
    before = path.read_text()
    try:
        bench.append_rows(path, [{"a": 1, "c": 3, "b": 2}], fields=("a", "c", "b"))
    except ValueError as err:
        assert str(path) in str(err) and "['a', 'b']" in str(err) and "--results-dir" in str(err)
    else:
        raise AssertionError("a row under another header was appended")
    assert path.read_text() == before == "a,b\n1,2\n"


def test_bench_overlap_refuses_a_foreign_csv_before_running_anything(tmp_path):
    from dapo_megatron.benchmarks import overlap

    (tmp_path / "overlap.csv").write_text("date,machine,staleness\n2026-11-23,x,0\n")
    try:  # a run would take minutes; the refusal comes first (no run directory is made)
        overlap.main(["--results-dir", str(tmp_path), "--out", str(tmp_path / "runs")])
    except ValueError as err:
        assert "overlap.csv" in str(err) and "'engine_hidden_fraction'" in str(err)
    else:
        raise AssertionError("bench overlap ran against a CSV with other columns")
    assert not (tmp_path / "runs").exists()


def test_the_command_help_lists_every_benchmark(capsys):
    """`dapo-megatron --help` names each `bench` sub-command (overlap was missing)."""
    from dapo_megatron.benchmarks.run import BENCHES
    from dapo_megatron.cli import main

    assert main(["--help"]) == 0
    (bench_line,) = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("bench ")]
    assert bench_line.split("benchmarks: ")[1].split(" | ") == list(BENCHES)
    assert "overlap" in BENCHES
