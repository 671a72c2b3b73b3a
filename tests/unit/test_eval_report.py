"""One eval's JSON (trainer/evaluation/report.py): the summary and per-problem records from hand-made samples,
the metrics logged from it, several eval sets (config, data, names), the paired comparison and its
refusal, the gathered tables (each row vs the one before, the ablation ladder) and the curves' band."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dapo_megatron.config import load_config
from dapo_megatron.data.datasets import train_and_eval_sets
from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.launch.experiments import gather
from dapo_megatron.launch.local.commands import compare
from dapo_megatron.trainer.evaluation.report import (
    compare_evals,
    eval_file_path,
    eval_report,
    headline_avg,
    load_eval_sets,
    metric_prefix,
    read_eval_file,
    report_metrics,
    write_eval_file,
)
from dapo_megatron.trainer.evaluation.sampling import EvalSamples

REPO = Path(__file__).resolve().parents[2]
RECORDS = [PromptRecord(prompt="2+5=", ground_truth="7"), PromptRecord(prompt="4+5=", ground_truth="9")]


def _samples(rows: list[list[str]], truths=("7", "9"), tokens=None, truncated=None) -> EvalSamples:
    correct = torch.tensor([[float(a == t) for a in row] for row, t in zip(rows, truths)], dtype=torch.float64)
    n = len(rows[0])
    return EvalSamples(
        correct=correct,
        answers=rows,
        response_tokens=torch.tensor(tokens or [[10] * n] * len(rows)),
        truncated=torch.tensor(truncated or [[False] * n] * len(rows)),
    )


def test_report_by_hand():
    # problem 0: 2 of 4 right, a 2-2 tie between 7 (right) and 8 -> maj 1/2; problem 1: 1 of 4, 3 x "[INVALID]"
    # (no vote) and "9" -> maj 1
    samples = _samples(
        [["7", "8", "7", "8"], ["[INVALID]", "9", "[INVALID]", "[INVALID]"]],
        tokens=[[10, 12, 10, 12], [16, 8, 16, 16]],
        truncated=[[False] * 4, [True, False, True, True]],
    )
    report = eval_report(samples, RECORDS, step=3)
    assert report["avg@k"] == 0.375  # (2/4 + 1/4) / 2
    assert report["maj@k"] == 0.75  # (1/2 + 1) / 2
    assert report["pass@1"] == 0.375
    assert report["pass@2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6)) / 2)  # C(2,2)/C(4,2), C(3,2)/C(4,2)
    assert report["pass@4"] == report["pass@k"] == 1.0
    # two problems scored 1/2 and 1/4: resampled means 1/4, 3/8, 1/2 -> [0.25, 0.5]
    assert report["avg@k_ci95"] == [0.25, 0.5]
    assert (report["step"], report["set"], report["k"], report["num_prompts"]) == (3, "eval", 4, 2)
    assert report["problems"][1] == {
        "index": 1,
        "data_source": "math_dapo",
        "prompt_hash": report["problems"][1]["prompt_hash"],
        "ground_truth": "9",
        "n": 4,
        "correct": 1,
        "answers": {"[INVALID]": 3, "9": 1},
        "mean_response_tokens": 14.0,
        "truncated": 3,
    }
    assert report["problems"][0]["answers"] == {"7": 2, "8": 2}
    metrics = report_metrics(report)
    assert metrics == {
        "eval/k": 4.0,
        "eval/num_prompts": 2.0,
        "eval/avg@k": 0.375,
        "eval/avg@k_ci95_low": 0.25,
        "eval/avg@k_ci95_high": 0.5,
        "eval/maj@k": 0.75,
        "eval/pass@1": 0.375,
        "eval/pass@2": report["pass@2"],
        "eval/pass@4": 1.0,
        "eval/pass@k": 1.0,
    }
    assert set(report_metrics(report, prefix="eval/aime24/")) == {k.replace("eval/", "eval/aime24/") for k in metrics}


def test_metric_names_one_set_and_several():
    assert metric_prefix("eval", num_sets=1) == "eval/"  # today's names
    assert metric_prefix("aime24", num_sets=2) == "eval/aime24/"
    assert headline_avg({"eval/avg@k": 0.5}) == 0.5
    assert headline_avg({"eval/math500/avg@k": 0.7, "eval/aime24/avg@k": 0.3}, ["aime24", "math500"]) == 0.3
    assert headline_avg({"reward/mean": 1.0}, ["aime24"]) is None


def test_files_round_trip_and_compare(tmp_path, capsys):
    before = eval_report(_samples([["7", "8", "8", "8"], ["1", "2", "3", "4"]]), RECORDS, step=0)
    after = eval_report(_samples([["7", "7", "7", "8"], ["9", "2", "9", "4"]]), RECORDS, step=10)
    write_eval_file(eval_file_path(tmp_path / "run", 0), {"eval": before})
    write_eval_file(eval_file_path(tmp_path / "run", 10), {"eval": after})
    path, sets = load_eval_sets(tmp_path / "run")  # a run directory: its newest eval
    assert path.name == "step_000010.json" and sets == {"eval": after}
    # per-problem accuracy 1/4 -> 3/4 and 0 -> 1/2: B - A = 1/2 on both problems, so on every resample
    (row,) = compare_evals({"eval": before}, sets)
    assert (row["avg_a"], row["avg_b"], row["diff"], row["diff_ci95"], row["verdict"]) == (
        0.125,
        0.625,
        0.5,
        [0.5, 0.5],
        "B better",
    )
    assert compare(["--compare", str(eval_file_path(tmp_path / "run", 0)), str(tmp_path / "run")]) == 0
    assert (
        "eval: avg@k A 12.5%  B 62.5%  B-A +50.0% [+50.0%, +50.0%] (95% paired bootstrap, 2 problems): B better"
        in capsys.readouterr().out
    )
    # several sets: {"step", "sets": {...}}; read back by name
    write_eval_file(tmp_path / "two.json", {"aime24": before, "math500": after})
    data = json.loads((tmp_path / "two.json").read_text())
    assert data["step"] == 0 and list(data["sets"]) == ["aime24", "math500"]
    assert read_eval_file(tmp_path / "two.json")["math500"] == after


def test_compare_refuses_different_problems(tmp_path):
    a = eval_report(_samples([["7"], ["9"]]), RECORDS, step=0)
    other = [RECORDS[0], PromptRecord(prompt="4+6=", ground_truth="10")]
    b = eval_report(_samples([["7"], ["10"]], truths=("7", "10")), other, step=0)
    with pytest.raises(
        ValueError,
        match=r"eval set 'eval': A and B were not evaluated on the same problems "
        r"\(problem 1 differs \(prompt_hash \w+ vs \w+\)\)",
    ):
        compare_evals({"eval": a}, {"eval": b})
    c = eval_report(_samples([["7"]], truths=("7",)), RECORDS[:1], step=0)
    with pytest.raises(ValueError, match=r"2 problems in A, 1 in B"):
        compare_evals({"eval": a}, {"eval": c})
    with pytest.raises(ValueError, match="none in common"):
        compare_evals({"aime24": a}, {"math500": a})
    old = tmp_path / "old.json"  # written before evals kept per-problem records
    old.write_text(json.dumps({"avg@k": 0.5, "pass@k": 0.9}))
    with pytest.raises(ValueError, match="has no per-problem records"):
        load_eval_sets(old)


def _dapo_rows(path: Path, problems: list[tuple[str, str]]) -> str:
    path.write_text(
        "".join(
            json.dumps({"data_source": "math_dapo", "prompt": p, "reward_model": {"ground_truth": t}}) + "\n"
            for p, t in problems
        )
    )
    return str(path)


def test_eval_sets_config_and_data(tmp_path):
    a = _dapo_rows(tmp_path / "a.jsonl", [("1+1=", "2"), ("2+2=", "4")])
    b = _dapo_rows(tmp_path / "b.jsonl", [("3+3=", "6")])
    cfg = load_config(REPO / "configs/runs/tiny_cpu.yaml", [f"data.eval_sets={{aime24: {a}, math500: {b}}}"])
    _, sets = train_and_eval_sets(cfg.data)
    assert list(sets) == ["aime24", "math500"] and [r.prompt for r in sets["aime24"]] == ["1+1=", "2+2="]
    _, default = train_and_eval_sets(load_config(REPO / "configs/runs/tiny_cpu.yaml").data)
    assert list(default) == ["eval"] and len(default["eval"]) == 100  # the synthetic held-out split
    missing = load_config(REPO / "configs/runs/tiny_cpu.yaml", [f"data.eval_sets={{aime25: {tmp_path / 'no.jsonl'}}}"])
    with pytest.raises(ValueError, match=f"data.eval_sets.aime25: prompt file not found: {tmp_path / 'no.jsonl'}"):
        train_and_eval_sets(missing.data)
    with pytest.raises(ValueError, match=r"config key 'data.eval_sets.aime/24': .* set names are letters, digits"):
        load_config(REPO / "configs/runs/tiny_cpu.yaml", [f"data.eval_sets={{aime/24: {a}}}"])
    with pytest.raises(ValueError, match=r"config key 'data.eval_path': .* empty when data.eval_sets is set"):
        load_config(REPO / "configs/runs/tiny_cpu.yaml", [f"data.eval_sets={{x: {a}}}", f"data.eval_path={b}"])
    with pytest.raises(ValueError, match=r"config key 'data.eval_sets': expected a mapping"):
        load_config(REPO / "configs/runs/tiny_cpu.yaml", [f"data.eval_sets=[{a}]"])


def test_gathered_table_says_whether_each_row_beats_the_previous(tmp_path):
    results = tmp_path / "eval"
    reports = [
        eval_report(_samples(rows), RECORDS, step=step)
        for step, rows in (
            (5, [["8", "8"], ["1", "2"]]),
            (10, [["7", "7"], ["9", "9"]]),
            (20, [["7", "8"], ["9", "1"]]),
        )
    ]
    for report in reports:
        write_eval_file(results / f"step_{report['step']}.json", {"eval": report}, extra={"checkpoint": "/x"})
    md, csv_path = gather.gather(results)
    rows = {r["checkpoint"]: r for r in gather.load_rows(results)}
    assert "diff_vs_prev" not in rows["step_5"]
    assert (rows["step_10"]["diff_vs_prev"], rows["step_10"]["diff_vs_prev_ci95"], rows["step_10"]["beats_prev"]) == (
        1.0,
        "[1.0000, 1.0000]",
        "yes",
    )
    # per-problem 1 -> 1/2 on both: worse on every resample
    assert (rows["step_20"]["diff_vs_prev"], rows["step_20"]["beats_prev"]) == (-0.5, "no: worse")
    assert rows["step_10"]["avg@k_ci95"] == "[1.0000, 1.0000]" and "interval.method" not in rows["step_10"]
    header = md.read_text().splitlines()[0]
    assert "| diff_vs_prev | diff_vs_prev_ci95 | beats_prev |" in header and "problems" not in header


def test_ablation_ladder_summary(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "slurm").mkdir(parents=True)
    runs = []
    for rung, rows in (
        ("0_naive_grpo", [["8", "8"], ["1", "9"]]),
        ("1_overlong_filtering", [["7", "7"], ["9", "9"]]),
        ("2_clip_higher", [["7", "7"], ["9", "9"]]),
    ):
        write_eval_file(eval_file_path(tmp_path / rung, 40), {"eval": eval_report(_samples(rows), RECORDS, step=40)})
        runs.append(f"{rung}\t{tmp_path / rung}")
    (sweep / "slurm" / "sweep_runs.tsv").write_text("\n".join(runs) + "\n")
    md, _ = gather.gather(sweep, ladder=True)
    assert md.name == "ablation_summary.md"
    rows = gather.ladder_rows(sweep)
    assert [(r["rung"], r["avg@k"], r.get("beats_prev")) for r in rows] == [
        ("0_naive_grpo", 0.25, None),
        ("1_overlong_filtering", 1.0, "yes"),
        ("2_clip_higher", 1.0, "unclear"),
    ]
    # rung 1 vs 0: per-problem differences 1 and 1/2 -> mean 3/4, interval [1/2, 1]: above 0
    assert rows[1]["diff_vs_prev"] == 0.75 and rows[1]["diff_vs_prev_ci95"] == "[0.5000, 1.0000]"


def test_a_summary_row_whose_score_is_not_the_trained_policys_says_so(tmp_path):
    """gather --ladder and `ladder`'s summary: a run whose newest eval is the warm start's (step 0) or older
    than its last trained step (metrics.jsonl) gets a note; a run evaluated at its last step gets none."""
    from dapo_megatron.launch.experiments.ladder_summary import ladder_summary, write_summary

    sweep = tmp_path / "sweep"
    (sweep / "slurm").mkdir(parents=True)
    trained = {"0_warm": (0, 2), "1_older": (40, 60), "2_last": (60, 60)}  # rung -> (eval step, last trained step)
    for rung, (eval_step, last) in trained.items():
        write_eval_file(
            eval_file_path(tmp_path / rung, eval_step),
            {"eval": eval_report(_samples([["7"], ["9"]]), RECORDS, step=eval_step)},
        )
        steps = [{"step": s, "time/step_s": 1.0} for s in range(1, last + 1)]
        (tmp_path / rung / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (sweep / "slurm" / "sweep_runs.tsv").write_text("".join(f"{r}\t{tmp_path / r}\n" for r in trained))
    notes = [(r["rung"], r["step"], r.get("note")) for r in gather.ladder_rows(sweep)]
    assert notes == [
        ("0_warm", 0, "warm start (step 0): not the trained policy"),
        ("1_older", 40, "step 40, not the last trained step 60"),
        ("2_last", 60, None),
    ]
    rows = ladder_summary([(rung, {1: tmp_path / rung}) for rung in trained])
    assert [(r["rung"], r["step"], r.get("note")) for r in rows] == [
        ("0_warm", 0, "seed 1: warm start (step 0): not the trained policy"),
        ("1_older", 40, "seed 1: step 40, not the last trained step 60"),
        ("2_last", 60, None),
    ]
    md = write_summary(tmp_path, rows[:1], [], note="")[0].read_text()
    assert md.startswith("NOT THE TRAINED POLICY: the score of 0_warm is not from its run's last step")
    assert md.splitlines()[2].startswith("| rung | seeds | step | note |")


def test_curves_draw_the_interval_as_a_band(tmp_path):
    from dapo_megatron.trainer.metrics_log import build_figure

    records = [
        {"step": 0, "eval/avg@k": 0.25, "eval/avg@k_ci95_low": 0.2, "eval/avg@k_ci95_high": 0.3},
        {"step": 1, "acc/mean": 0.5},
        {
            "step": 2,
            "eval/avg@k": 0.5,
            "eval/avg@k_ci95_low": 0.4,
            "eval/avg@k_ci95_high": 0.6,
            "eval/aime24/avg@k": 0.1,
        },
    ]
    panels = {ax.get_title(): ax for ax in build_figure(records).axes}
    acc = panels["accuracy"]
    (band,) = [c for c in acc.collections if c.get_label() == "eval avg@k 95% CI"]
    ys = sorted({round(float(y), 6) for y in band.get_paths()[0].vertices[:, 1]})
    assert ys == [0.2, 0.3, 0.4, 0.6]
    assert [ln.get_label() for ln in acc.get_lines()] == ["train acc (kept groups)", "eval avg@k", "eval aime24 avg@k"]


def test_the_worked_example_of_docs_algorithm_md():
    """docs/algorithm.md section 10, every number computed there by hand."""
    records = [PromptRecord(prompt=f"p{i}", ground_truth=t) for i, t in enumerate(("7", "12", "5"))]
    truths = ("7", "12", "5")
    a = eval_report(
        _samples([["7", "7", "8", "7"], ["12", "15", "12", "15"], ["[INVALID]", "4", "[INVALID]", "6"]], truths=truths),
        records,
        step=0,
    )
    b = eval_report(
        _samples([["7"] * 4, ["12", "12", "15", "15"], ["5", "4", "[INVALID]", "6"]], truths=truths), records, step=1
    )
    assert a["avg@k"] == pytest.approx(5 / 12) and a["pass@1"] == pytest.approx(5 / 12)
    assert a["pass@2"] == pytest.approx(11 / 18) and a["pass@4"] == pytest.approx(2 / 3)
    assert a["maj@k"] == 0.5 and a["avg@k_ci95"] == [0.0, 0.75]
    (row,) = compare_evals({"eval": a}, {"eval": b})
    assert row["avg_b"] == pytest.approx(7 / 12) and row["diff"] == pytest.approx(1 / 6)
    assert row["diff_ci95"] == [0.0, 0.25] and row["verdict"] == "no clear difference"


def test_run_summary_names_the_eval_file_and_uses_the_first_set(tmp_path):
    from dapo_megatron.trainer.metrics_log import run_summary

    one = [
        {
            "step": 0,
            "eval/avg@k": 0.25,
            "eval/pass@k": 0.5,
            "eval/k": 8.0,
            "eval/avg@k_ci95_low": 0.2,
            "eval/avg@k_ci95_high": 0.3,
            "eval/maj@k": 0.4,
        }
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in one))
    lines = run_summary(tmp_path).splitlines()
    assert "  final eval:   avg@8 25.0% at step 0, pass@8 50.0% (warm start (step 0): not the trained policy)" in lines
    assert (
        f"  eval file:    {tmp_path / 'evals' / 'step_000000.json'} (eval avg@8 25.0%, 95% CI [20.0%, 30.0%], "
        "maj@8 40.0%)" in lines
    )
    several = [
        {
            "step": 4,
            "eval/aime24/avg@k": 0.125,
            "eval/aime24/pass@k": 0.5,
            "eval/aime24/k": 32.0,
            "eval/math500/avg@k": 0.75,
        }
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in several))
    assert "  final eval:   avg@32 12.5% at step 4, pass@32 50.0%" in run_summary(tmp_path).splitlines()


def test_console_eval_column_shows_the_first_set():
    from dapo_megatron.trainer.console import StepTable

    table = StepTable(total_steps=10)
    row = table.format_row(5, {"eval/aime24/avg@k": 0.125, "eval/math500/avg@k": 0.75})
    assert table.header().split()[:4] == ["step", "reward", "acc", "eval"]
    assert row.split()[:4] == ["5/10", "-", "-", "12.5%"]
