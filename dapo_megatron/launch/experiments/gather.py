"""Gather per-checkpoint eval results (one JSON object per file) into one table: markdown and CSV.

    python -m dapo_megatron.launch.experiments.gather RUN_DIR/eval      # run by slurm/eval_gather.sbatch
    python -m dapo_megatron.launch.experiments.gather --ladder SWEEP_DIR  # the ablation ladder: rung vs the one before

Each `<checkpoint>.json` becomes one row: `checkpoint` (the file name) then its scalar fields, nested objects
flattened with dots (`{"aime": {"avg@32": 0.5}}` -> column `aime.avg@32`). Rows are in step order
(the first integer in the checkpoint name, e.g. step_000120 -> 120), columns in first-seen order;
a field missing from a file is an empty cell. Writes results.md and results.csv next to the JSONs.
Where a row and the one before it hold per-problem records of the same problems (trainer/evaluation/report.py),
the row also says whether it beats its predecessor: `diff_vs_prev` (avg@k difference), its paired-bootstrap
95% interval `diff_vs_prev_ci95` and `beats_prev` (yes / no: worse / unclear), per eval set.

--ladder SWEEP_DIR: the runs of a sweep (slurm/sweep_runs.tsv, in rung order: configs/ablations/0..5),
each run's newest eval (<run>/evals/step_N.json), one row per rung with avg@k, its interval and the same
comparison with the previous rung (a `note` where the score is not the run's last step's: the warm start);
written to SWEEP_DIR/ablation_summary.md and .csv.
"""

from __future__ import annotations

import csv
import io
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from dapo_megatron.config import RawJson
from dapo_megatron.trainer.evaluation.scored_step import last_trained_step, score_note
from dapo_megatron.trainer.metrics_log import METRICS_FILE, read_jsonl

if TYPE_CHECKING:  # imported where used at run time (it brings torch)
    from dapo_megatron.trainer.evaluation.report import EvalReport

TABLE_STEM = "results"
LADDER_STEM = "ablation_summary"
SKIPPED = ("interval", "maj_tie_rule")  # how the numbers were made: in the JSON, not a column

# a table cell: a JSON scalar of a result file (flattened), a formatted interval or a verdict
Cell: TypeAlias = str | int | float | bool | None
Row: TypeAlias = dict[str, Cell]  # column -> cell, one results file or sweep run


def _flatten(obj: RawJson, prefix: str = "") -> Row:
    """A result file's scalars as columns: nested keys joined with '.', intervals formatted, lists left out."""
    flat: Row = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if key in SKIPPED:
            continue
        if key.endswith("_ci95") and isinstance(value, list) and len(value) == 2:
            flat[name] = _interval(value)
        elif isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        elif isinstance(value, (str, int, float, bool)) or value is None:
            flat[name] = value
        # lists (per-sample details) do not belong in a summary table
    return flat


def _step_key(name: str) -> tuple[int, str]:
    match = re.search(r"\d+", name)
    return (int(match.group()) if match else -1, name)


def _interval(value: list) -> str:
    return f"[{float(value[0]):.4f}, {float(value[1]):.4f}]"


def _vs_previous(prev: RawJson | None, data: RawJson) -> Row:
    """diff_vs_prev / diff_vs_prev_ci95 / beats_prev per eval set shared with the previous row's file
    (sets.<name>. in front with several sets); {} where either file has no per-problem records."""
    from dapo_megatron.trainer.evaluation.report import compare_evals

    if prev is None or not isinstance(prev.get("problems", prev.get("sets")), (list, dict)):
        return {}
    try:
        sets_prev, sets_now = (_sets_of(d) for d in (prev, data))
        rows = compare_evals(sets_prev, sets_now, where_a="the previous row", where_b="this row")
    except (ValueError, KeyError, TypeError) as err:
        return {"beats_prev": f"not comparable: {err}"}
    out: Row = {}
    for row in rows:
        prefix = "" if "sets" not in data else f"sets.{row['set']}."
        out[f"{prefix}diff_vs_prev"] = row["diff"]
        out[f"{prefix}diff_vs_prev_ci95"] = _interval(row["diff_ci95"])
        out[f"{prefix}beats_prev"] = {"B better": "yes", "B worse": "no: worse"}.get(row["verdict"], "unclear")
    return out


def _sets_of(data: RawJson) -> dict[str, EvalReport]:
    if isinstance(data.get("sets"), dict):
        return data["sets"]
    if not isinstance(data.get("problems"), list):
        raise ValueError("no per-problem records")
    return {str(data.get("set", "eval")): data}


def _read_object(path: Path) -> RawJson:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"eval result {path}: not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"eval result {path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_rows(results_dir: Path) -> list[Row]:
    rows: list[Row] = []
    prev: RawJson | None = None
    for path in sorted(results_dir.glob("*.json"), key=lambda p: _step_key(p.stem)):
        data = _read_object(path)
        # the file name names the row; a "checkpoint" field inside (eval writes the full path) is dropped
        rows.append(
            {
                "checkpoint": path.stem,
                **{k: v for k, v in _flatten(data).items() if k != "checkpoint"},
                **_vs_previous(prev, data),
            }
        )
        prev = data
    return rows


def ladder_rows(sweep_dir: Path) -> list[Row]:
    """One row per run of the sweep, in slurm/sweep_runs.tsv order: its newest eval and the comparison
    with the previous rung."""
    from dapo_megatron.trainer.evaluation.report import load_eval_sets

    runs_file = sweep_dir / "slurm" / "sweep_runs.tsv"
    if not runs_file.is_file():
        raise ValueError(
            f"{runs_file}: no sweep runs list (is {sweep_dir} a sweep directory of `slurm submit --sweep`?)"
        )
    rows: list[Row] = []
    prev: RawJson | None = None
    for number, line in enumerate(runs_file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        rung, _, run_dir = line.partition("\t")
        if not run_dir:
            raise ValueError(f"{runs_file}: line {number} is not '<config stem><TAB><run dir>'")
        try:
            path, sets = load_eval_sets(run_dir)
        except ValueError as err:
            rows.append({"rung": rung, "eval": f"none: {err}"})
            continue
        data = _read_object(path)
        summary = {k: v for k, v in _flatten(data).items() if k != "checkpoint"}
        keep = [k for k in summary if k == "step" or k.endswith(("avg@k", "avg@k_ci95", "maj@k", "pass@k"))]
        note = _score_note(Path(run_dir), summary.get("step"))
        rows.append(
            {"rung": rung, "eval": str(path), **{k: summary[k] for k in keep}, **note, **_vs_previous(prev, data)}
        )
        prev = data
    return rows


def _score_note(run_dir: Path, step: Cell) -> Row:
    """{"note": ...} when a run's newest eval is not its trained policy's (trainer/evaluation/scored_step.py)."""
    if not isinstance(step, (int, float)):
        return {}
    metrics = run_dir / METRICS_FILE
    records = read_jsonl(metrics, drop_partial_last=True) if metrics.is_file() else []
    note = score_note(eval_step=int(step), trained_step=last_trained_step(records))
    return {"note": note} if note else {}


def _cell(value: Cell) -> str:
    if value is None:
        return ""
    if isinstance(value, float):  # counts stored as floats read as counts: 8.0 -> 8, 0.25 -> 0.2500
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4f}"
    return str(value)


def to_markdown(rows: Sequence[Mapping[str, Cell]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: Sequence[Mapping[str, Cell]], columns: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: "" if row.get(c) is None else row.get(c) for c in columns})
    return buf.getvalue()


def gather(results_dir: str | Path, *, ladder: bool = False) -> tuple[Path, Path]:
    results_dir = Path(results_dir)
    rows = ladder_rows(results_dir) if ladder else load_rows(results_dir)
    if not rows:
        raise ValueError(f"no eval results (*.json) in {results_dir}" if not ladder else f"{results_dir}: no runs")
    columns: list[str] = []
    for row in rows:
        columns.extend(c for c in row if c not in columns)
    stem = LADDER_STEM if ladder else TABLE_STEM
    md, csv_path = results_dir / f"{stem}.md", results_dir / f"{stem}.csv"
    md.write_text(to_markdown(rows, columns))
    csv_path.write_text(to_csv(rows, columns))
    return md, csv_path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ladder = argv[:1] == ["--ladder"]
    argv = argv[1:] if ladder else argv
    if len(argv) != 1:
        print(
            "usage: python -m dapo_megatron.launch.experiments.gather RESULTS_DIR | --ladder SWEEP_DIR", file=sys.stderr
        )
        return 2
    try:
        md, csv_path = gather(argv[0], ladder=ladder)
    except ValueError as err:
        print(f"gather: error: {err}", file=sys.stderr)
        return 2
    print(md.read_text(), end="")
    print(f"wrote {md} and {csv_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
