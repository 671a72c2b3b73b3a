"""The tiny ablation ladder's summary: per rung avg@k over seeds with its interval, the paired difference
to the previous rung, and the logged mechanism of each technique (launch/experiments/ladder.py runs the rungs).

    rows = ladder_summary(runs)          # runs: [(rung, {seed: run_dir})] in rung order
    write_summary(out_dir, rows, runs)   # ablation_summary.md / .csv / .png

The numbers, per rung (every run's final eval: <run_dir>/evals/step_N.json, with per-problem records):
* avg@k: the mean over the held-out problems of s_i, problem i's accuracy c_i / n averaged over the
  rung's seeds; avg@k_ci95: the percentile bootstrap over problems of that mean (algo/eval_stats.py);
* diff_vs_prev: the same mean of s_i(rung) - s_i(previous rung), over the seeds both rungs finished
  (a seed shares its warm start and sampling seed across rungs), with the paired-bootstrap interval
  over problems; beats_prev: yes when the interval is above 0, "no: worse" below, else unclear.
  The interval resamples problems, not seeds: seed-to-seed spread shows in the per-seed columns
  (avg@k_seed<S>, and diff_seed<S>: that seed's avg@k minus the previous rung's with the same seed).
* the mechanism, averaged over the steps of each run and then over seeds (metrics.jsonl): entropy
  (actor/entropy, also over the last 10 steps), response length, truncated fraction
  (response_length/clip_ratio), generation rounds and the kept fraction of generated groups
  (sampler/rounds, sampler/groups_kept / sampler/groups_seen), the shares of all-correct and all-wrong
  groups generated (sampler/groups_all_correct, _all_wrong: counted with the filter off too) and the
  training time of the run (the sum of time/step_s); and from the final evals' records, the share of
  responses truncated at the budget and the mean response length.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeAlias

from dapo_megatron.algo.eval_stats import bootstrap_mean_ci, paired_bootstrap_diff
from dapo_megatron.launch.experiments.gather import LADDER_STEM, to_csv, to_markdown
from dapo_megatron.trainer.evaluation.report import EvalReport, load_eval_sets
from dapo_megatron.trainer.evaluation.scored_step import last_trained_step, score_note
from dapo_megatron.trainer.metrics_log import read_jsonl

PLOT_FILE = "ablation_summary.png"
MECHANISM = {  # column -> (metrics.jsonl key, steps averaged: None = all, N = the last N)
    "entropy": ("actor/entropy", None),
    "entropy_last10": ("actor/entropy", 10),
    "response_length": ("response_length/mean", None),
    "truncated_frac": ("response_length/clip_ratio", None),
    "gen_rounds": ("sampler/rounds", None),
    "rollout_acc": ("sampler/acc_all", None),  # every scored response (acc/mean: the kept groups only)
}
GROUP_SHARES = {  # column -> metrics.jsonl count, summed over steps and divided by the groups generated
    "kept_group_frac": "sampler/groups_kept",
    "all_correct_group_frac": "sampler/groups_all_correct",
    "all_wrong_group_frac": "sampler/groups_all_wrong",
}
LEADING = (  # the columns a reader wants first; the per-seed and mechanism columns follow
    "rung",
    "seeds",
    "step",
    "note",  # a score that is not the trained policy's says so (trainer/evaluation/scored_step.py)
    "k",
    "num_prompts",
    "avg@k",
    "avg@k_ci95_low",
    "avg@k_ci95_high",
    "diff_vs_prev",
    "diff_ci95_low",
    "diff_ci95_high",
    "beats_prev",
    "paired_seeds",
)
CURVES = (  # metrics.jsonl key, panel title: the curves per rung, mean over seeds, SMOOTH-step moving mean
    ("sampler/acc_all", "rollout accuracy, every scored response (sampler/acc_all)"),
    ("actor/entropy", "entropy (actor/entropy)"),
    ("response_length/mean", "response length (tokens)"),
    ("response_length/clip_ratio", "truncated share (response_length/clip_ratio)"),
)
SMOOTH = 5

Runs = list[tuple[str, dict[int, Path]]]
# one rung's row: the LEADING columns, per-seed columns (avg@k_seed<S>, diff_seed<S>) and the mechanism's;
# numbers, and text for the rung's name and the verdict
LadderRow: TypeAlias = dict[str, float | int | str]


def final_eval(run_dir: Path) -> EvalReport:
    """The newest eval of a run (its single default set): the report with per-problem records."""
    path, sets = load_eval_sets(run_dir)
    if len(sets) != 1:
        raise ValueError(f"{path}: the ladder compares one eval set, this file has {sorted(sets)}")
    report = next(iter(sets.values()))
    return {**report, "path": str(path)}


def problem_scores(reports: list[EvalReport], *, where: str) -> list[float]:
    """s_i: problem i's accuracy c_i / n averaged over the given runs' reports (all on the same problems)."""
    hashes = [p["prompt_hash"] for p in reports[0]["problems"]]
    for report in reports[1:]:
        if [p["prompt_hash"] for p in report["problems"]] != hashes:
            raise ValueError(
                f"{where}: {report['path']} and {reports[0]['path']} were not evaluated on the same problems; "
                "every run of a ladder must use the same data.synthetic (or eval) set"
            )
    per_run = [[p["correct"] / p["n"] for p in report["problems"]] for report in reports]
    return [sum(col) / len(col) for col in zip(*per_run)]


def _score_notes(reports: dict[int, EvalReport], seed_dirs: dict[int, Path]) -> dict[str, str]:
    """{"note": ...} when a seed's score is not its trained policy's (the warm start, an older step); else {}."""
    notes = []
    for seed, report in reports.items():
        path = seed_dirs[seed] / "metrics.jsonl"
        records = read_jsonl(path, drop_partial_last=True) if path.is_file() else []
        note = score_note(eval_step=int(report["step"]), trained_step=last_trained_step(records))
        if note:
            notes.append(f"seed {seed}: {note}")
    return {"note": "; ".join(notes)} if notes else {}


def _mechanism(run_dir: Path) -> dict[str, float]:
    path = run_dir / "metrics.jsonl"
    records = read_jsonl(path, drop_partial_last=True) if path.is_file() else []
    steps = [r for r in records if "actor/entropy" in r]  # training steps (evals log their own records)
    out: dict[str, float] = {}
    for column, (key, last) in MECHANISM.items():
        values = [float(r[key]) for r in steps if isinstance(r.get(key), (int, float))]
        values = values[-last:] if last else values
        if values:
            out[column] = sum(values) / len(values)
    seen = sum(float(r.get("sampler/groups_seen", 0)) for r in steps)
    for column, key in GROUP_SHARES.items():
        if seen and any(key in r for r in steps):
            out[column] = sum(float(r.get(key, 0)) for r in steps) / seen
    times = [float(r["time/step_s"]) for r in steps if isinstance(r.get("time/step_s"), (int, float))]
    if times:
        out["train_s"] = sum(times)
    return out


def _eval_lengths(reports: list[EvalReport]) -> dict[str, float]:
    """The final evals' truncated share (responses cut at the budget / responses) and mean response
    tokens (per-problem means averaged), over the rung's seeds."""
    problems = [p for report in reports for p in report["problems"]]
    return {
        "eval_truncated_frac": sum(p["truncated"] for p in problems) / sum(p["n"] for p in problems),
        "eval_response_tokens": sum(p["mean_response_tokens"] for p in problems) / len(problems),
    }


def ladder_summary(runs: Runs) -> list[LadderRow]:
    """One row per rung with at least one finished run (see the module docstring for each number)."""
    rows: list[LadderRow] = []
    prev: tuple[str, dict[int, EvalReport]] | None = None
    for rung, seed_dirs in runs:
        reports = {seed: final_eval(d) for seed, d in sorted(seed_dirs.items())}
        if not reports:
            continue
        scores = problem_scores(list(reports.values()), where=f"rung {rung}")
        low, high = bootstrap_mean_ci(scores)
        row: LadderRow = {
            "rung": rung,
            "seeds": len(reports),
            "step": min(int(r["step"]) for r in reports.values()),
            **_score_notes(reports, seed_dirs),
            "k": reports[next(iter(reports))]["k"],
            "num_prompts": len(scores),
            "avg@k": sum(scores) / len(scores),
            "avg@k_ci95_low": low,
            "avg@k_ci95_high": high,
        }
        if prev is not None:
            common = sorted(set(prev[1]) & set(reports))
            if common:
                before = problem_scores([prev[1][s] for s in common], where=f"rung {prev[0]}")
                now = problem_scores([reports[s] for s in common], where=f"rung {rung}")
                problem_scores([prev[1][common[0]], reports[common[0]]], where=f"rungs {prev[0]} and {rung}")
                diff = paired_bootstrap_diff(before, now)
                row.update(
                    diff_vs_prev=diff["diff"],
                    diff_ci95_low=diff["low"],
                    diff_ci95_high=diff["high"],
                    beats_prev={"B better": "yes", "B worse": "no: worse"}.get(str(diff["verdict"]), "unclear"),
                    paired_seeds=len(common),
                )
                for seed in common:  # the same seed (warm start, sampling) on both rungs: the spread over seeds
                    row[f"diff_seed{seed}"] = reports[seed]["avg@k"] - prev[1][seed]["avg@k"]
        for seed, report in reports.items():
            row[f"avg@k_seed{seed}"] = report["avg@k"]
        row.update(_eval_lengths(list(reports.values())))
        mech = [_mechanism(seed_dirs[s]) for s in reports]
        for column in [*MECHANISM, *GROUP_SHARES, "train_s"]:
            values = [m[column] for m in mech if column in m]
            if values:
                row[column] = sum(values) / len(values)
        rows.append(row)
        prev = (rung, reports)
    return rows


def write_summary(out_dir: Path, rows: list[LadderRow], runs: Runs, *, note: str = "") -> list[Path]:
    """ablation_summary.md (note + table), .csv and .png under out_dir; returns the paths written."""
    columns: list[str] = [c for c in LEADING if any(c in row for row in rows)]
    for row in rows:
        columns.extend(c for c in row if c not in columns)
    md, csv_path = out_dir / f"{LADDER_STEM}.md", out_dir / f"{LADDER_STEM}.csv"
    flagged = [str(row["rung"]) for row in rows if row.get("note")]
    if flagged:  # said above the table too: a rung compared on its warm start compares nothing trained
        note = (note + "\n\n" if note else "") + (
            f"NOT THE TRAINED POLICY: the score of {', '.join(flagged)} is not from its run's last step "
            "(see the note column)."
        )
    md.write_text((note + "\n\n" if note else "") + to_markdown(rows, columns))
    csv_path.write_text(to_csv(rows, columns))
    paths = [md, csv_path]
    if rows:
        paths.append(plot_summary(out_dir / PLOT_FILE, rows, runs))
    return paths


def _mean_curve(run_dirs: list[Path], key: str) -> tuple[list[int], list[float]]:
    """Per step, the mean over runs of `key` (steps every run logged)."""
    by_step: dict[int, list[float]] = {}
    for run_dir in run_dirs:
        path = run_dir / "metrics.jsonl"
        for r in read_jsonl(path, drop_partial_last=True) if path.is_file() else []:
            if isinstance(r.get(key), (int, float)):
                by_step.setdefault(int(r["step"]), []).append(float(r[key]))
    steps = sorted(s for s, v in by_step.items() if len(v) == len(run_dirs))
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def plot_summary(path: Path, rows: list[LadderRow], runs: Runs) -> Path:
    """Six panels: avg@k per rung (95% interval, seeds as crosses), the paired difference to the previous
    rung (95% interval), and per rung the CURVES (train accuracy, entropy, response length, truncated
    share; mean over seeds, smoothed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(18, 8), layout="constrained")
    names = [str(r["rung"]) for r in rows]
    x = list(range(len(rows)))
    ax = fig.add_subplot(2, 3, 1)
    avg = [float(r["avg@k"]) for r in rows]  # the row's numbers are floats (ladder_summary)
    err = [
        [a - float(r["avg@k_ci95_low"]) for a, r in zip(avg, rows)],
        [float(r["avg@k_ci95_high"]) - a for a, r in zip(avg, rows)],
    ]
    ax.errorbar(x, avg, yerr=err, fmt="o", capsize=4, label="avg@k over seeds, 95% CI")
    for xi, r in zip(x, rows):
        seeds = [v for k, v in r.items() if k.startswith("avg@k_seed")]
        ax.plot([xi] * len(seeds), seeds, "x", color="grey")
    ax.set_title("held-out avg@k per rung (x: single seeds)")
    ax.set_xticks(x, names, rotation=20, fontsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = fig.add_subplot(2, 3, 2)
    with_diff = [(xi, r) for xi, r in zip(x, rows) if "diff_vs_prev" in r]
    if with_diff:
        d = [float(r["diff_vs_prev"]) for _, r in with_diff]
        lo = [v - float(r["diff_ci95_low"]) for v, (_, r) in zip(d, with_diff)]
        hi = [float(r["diff_ci95_high"]) - v for v, (_, r) in zip(d, with_diff)]
        ax.errorbar([xi for xi, _ in with_diff], d, yerr=[lo, hi], fmt="o", capsize=4, color="C1")
        for xi, r in with_diff:
            seeds = [v for k, v in r.items() if k.startswith("diff_seed")]
            ax.plot([xi] * len(seeds), seeds, "x", color="grey")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_title("paired difference to the previous rung, 95% CI (x: single seeds)")
    ax.set_xticks(x, names, rotation=20, fontsize=7)
    ax.grid(alpha=0.3)
    for i, (key, title) in enumerate(CURVES):
        ax = fig.add_subplot(2, 3, 3 + i)
        for rung, seed_dirs in runs:
            steps, values = _mean_curve(list(seed_dirs.values()), key)
            if steps:
                smooth = [
                    sum(values[max(0, i - SMOOTH + 1) : i + 1]) / len(values[max(0, i - SMOOTH + 1) : i + 1])
                    for i in range(len(values))
                ]
                ax.plot(steps, smooth, label=rung)
        ax.set_title(f"{title}\nmean over seeds, {SMOOTH}-step moving mean", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=90)
    return path
