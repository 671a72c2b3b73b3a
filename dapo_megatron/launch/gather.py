"""Gather per-checkpoint eval results (one JSON object per file) into one table: markdown and CSV.

    python -m dapo_megatron.launch.gather RUN_DIR/eval      # run by slurm/eval_gather.sbatch

Each `<checkpoint>.json` becomes one row: `checkpoint` (the file name) then its scalar fields, nested objects
flattened with dots (`{"aime": {"avg@32": 0.5}}` -> column `aime.avg@32`). Rows are in step order
(the first integer in the checkpoint name, e.g. step_000120 -> 120), columns in first-seen order;
a field missing from a file is an empty cell. Writes results.md and results.csv next to the JSONs.
"""

from __future__ import annotations

import csv
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

TABLE_STEM = "results"


def _flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        elif isinstance(value, (str, int, float, bool)) or value is None:
            flat[name] = value
        # lists (per-sample details) do not belong in a summary table
    return flat


def _step_key(name: str) -> tuple[int, str]:
    match = re.search(r"\d+", name)
    return (int(match.group()) if match else -1, name)


def load_rows(results_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(results_dir.glob("*.json"), key=lambda p: _step_key(p.stem)):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"eval result {path}: not JSON ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"eval result {path}: expected a JSON object, got {type(data).__name__}")
        # the file name names the row; a "checkpoint" field inside (eval writes the full path) is dropped
        rows.append({"checkpoint": path.stem, **{k: v for k, v in _flatten(data).items() if k != "checkpoint"}})
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):  # counts stored as floats read as counts: 8.0 -> 8, 0.25 -> 0.2500
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4f}"
    return str(value)


def to_markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict[str, Any]], columns: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: "" if row.get(c) is None else row.get(c) for c in columns})
    return buf.getvalue()


def gather(results_dir: str | Path) -> tuple[Path, Path]:
    results_dir = Path(results_dir)
    rows = load_rows(results_dir)
    if not rows:
        raise ValueError(f"no eval results (*.json) in {results_dir}")
    columns: list[str] = []
    for row in rows:
        columns.extend(c for c in row if c not in columns)
    md, csv_path = results_dir / f"{TABLE_STEM}.md", results_dir / f"{TABLE_STEM}.csv"
    md.write_text(to_markdown(rows, columns))
    csv_path.write_text(to_csv(rows, columns))
    return md, csv_path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m dapo_megatron.launch.gather RESULTS_DIR", file=sys.stderr)
        return 2
    try:
        md, csv_path = gather(argv[0])
    except ValueError as err:
        print(f"gather: error: {err}", file=sys.stderr)
        return 2
    print(md.read_text(), end="")
    print(f"wrote {md} and {csv_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
