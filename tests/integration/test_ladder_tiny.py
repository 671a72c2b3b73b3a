"""`dapo-megatron ladder` end to end on a short ladder: the first 2 rungs of configs/ablations_tiny/, 1 seed,
2 steps (the real launcher, CPU engine, Megatron rank; a 30-step warm start, 16 eval problems x 4).
Checks the files it writes, the summary's numbers recomputed here from the runs' per-problem records
and metrics.jsonl, the skip of finished runs on a rerun, and the refusal of another ladder's directory.
The full experiment (6 rungs x 3 seeds x 80 steps) is in docs/benchmarks.md, not in CI.

    pytest tests/integration/test_ladder_tiny.py
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "trainer.total_steps=2",
    "trainer.eval_every=60",  # > total_steps, as the ladder help's example: the run's last step is evaluated anyway
    "trainer.save_every=2",
    "tiny.warm_start_steps=30",
    "data.synthetic.num_eval=16",
    "trainer.eval_n=4",
]
RUNGS = ["0_naive_grpo", "1_overlong_filtering"]


def _ladder(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dapo_megatron.cli", "ladder", "configs/ablations_tiny", "--rungs", "2"]
    return subprocess.run(
        [*cmd, "--seeds", "1", "--out", str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    out = tmp_path_factory.mktemp("ladder") / "out"
    done = _ladder(out, *SHORT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def _problems(run_dir: Path) -> list[dict]:
    report = json.loads((run_dir / "evals" / "step_000002.json").read_text())
    assert report["step"] == 2 and report["k"] == 4 and len(report["problems"]) == 16
    return report["problems"]


def _scores(run_dir: Path) -> list[float]:
    return [p["correct"] / p["n"] for p in _problems(run_dir)]


def test_the_ladder_writes_its_runs_summary_and_plot(ladder):
    out, stdout = ladder
    for rung in RUNGS:
        run_dir = out / "runs" / rung / "seed_1"
        assert json.loads((run_dir / "ladder_done.json").read_text())["seed"] == 1
        assert (out / "runs" / rung / "seed_1.log").is_file()
    assert (out / "tiny_model_seed_1" / "tiny_model" / "warm" / "config.json").is_file()  # one model for both
    assert (out / "ablation_summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "ablation_summary.md").read_text()
    assert "PARTIAL" not in md and md.count("\n| ") == 2  # 2 rung rows below the header and separator
    assert "2 rungs x 1 seeds" in stdout


def test_the_summary_numbers_are_the_runs_per_problem_records(ladder):
    out, _ = ladder
    rows = list(csv.DictReader((out / "ablation_summary.csv").open()))
    assert [r["rung"] for r in rows] == RUNGS
    # the score of every rung is its step-2 eval (the last step), not the warm start's step 0, and says so
    assert [(r["step"], r.get("note", "")) for r in rows] == [("2", "")] * 2
    before, after = (_scores(out / "runs" / rung / "seed_1") for rung in RUNGS)
    for row, scores in zip(rows, (before, after)):
        mean = sum(scores) / 16
        assert float(row["avg@k"]) == pytest.approx(mean, abs=1e-12)
        assert float(row["avg@k_seed1"]) == pytest.approx(mean, abs=1e-12)
        # the bootstrap interval of a mean of values in [min, max] lies in [min, max] and holds the mean
        # up to resampling noise; with 16 problems it is never a point unless every problem scores alike
        low, high = float(row["avg@k_ci95_low"]), float(row["avg@k_ci95_high"])
        assert min(scores) <= low <= high <= max(scores)
        assert (low < high) == (min(scores) < max(scores))
        assert (row["seeds"], row["step"], row["k"], row["num_prompts"]) == ("1", "2", "4", "16")
    diff = sum(b - a for a, b in zip(before, after)) / 16
    second = rows[1]
    assert float(second["diff_vs_prev"]) == pytest.approx(diff, abs=1e-12)
    low, high = float(second["diff_ci95_low"]), float(second["diff_ci95_high"])
    deltas = [b - a for a, b in zip(before, after)]
    assert min(deltas) <= low <= high <= max(deltas)
    assert second["beats_prev"] == ("yes" if low > 0 else "no: worse" if high < 0 else "unclear")
    assert rows[0]["diff_vs_prev"] == "" and second["paired_seeds"] == "1"
    assert float(second["diff_seed1"]) == pytest.approx(diff, abs=1e-12)  # one seed: its own difference
    for row, rung in zip(rows, RUNGS):  # 16 problems x 4 responses
        problems = _problems(out / "runs" / rung / "seed_1")
        assert float(row["eval_truncated_frac"]) == pytest.approx(sum(p["truncated"] for p in problems) / 64)
        tokens = sum(p["mean_response_tokens"] for p in problems) / 16
        assert float(row["eval_response_tokens"]) == pytest.approx(tokens, rel=1e-12)


def test_the_mechanism_columns_average_the_logged_metrics(ladder):
    out, _ = ladder
    rows = {r["rung"]: r for r in csv.DictReader((out / "ablation_summary.csv").open())}
    for rung in RUNGS:
        lines = (out / "runs" / rung / "seed_1" / "metrics.jsonl").read_text().splitlines()
        steps = [r for r in map(json.loads, lines) if "actor/entropy" in r]
        assert [r["step"] for r in steps] == [1, 2]
        for column, key in (
            ("entropy", "actor/entropy"),
            ("response_length", "response_length/mean"),
            ("truncated_frac", "response_length/clip_ratio"),
            ("gen_rounds", "sampler/rounds"),
            ("rollout_acc", "sampler/acc_all"),
        ):
            assert float(rows[rung][column]) == pytest.approx((steps[0][key] + steps[1][key]) / 2, rel=1e-12)
        seen = sum(r["sampler/groups_seen"] for r in steps)
        for column, key in (
            ("kept_group_frac", "sampler/groups_kept"),
            ("all_correct_group_frac", "sampler/groups_all_correct"),
            ("all_wrong_group_frac", "sampler/groups_all_wrong"),
        ):
            assert float(rows[rung][column]) == pytest.approx(sum(r[key] for r in steps) / seen, rel=1e-12)
        # no dynamic sampling on rungs 0-1: every generated group trains, uninformative ones included
        assert float(rows[rung]["kept_group_frac"]) == 1.0


def test_a_rerun_skips_finished_runs_and_another_ladder_is_refused(ladder):
    out, _ = ladder
    before = (out / "runs" / RUNGS[0] / "seed_1" / "metrics.jsonl").read_text()
    again = _ladder(out, *SHORT)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.count("done before, skipped") == 2
    assert (out / "runs" / RUNGS[0] / "seed_1" / "metrics.jsonl").read_text() == before
    other = _ladder(out, *SHORT[1:], "trainer.total_steps=3")
    assert other.returncode == 2
    assert "holds the runs of another ladder" in other.stderr and "overrides" in other.stderr
