"""Reading a run directory in the Slurm and multi-host tests: its metrics and its jobs' logs."""

from __future__ import annotations

import json
from pathlib import Path


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records ([] before the first step)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def logs(run_dir: Path, *, tail: int | None = None, named: bool = False) -> str:
    """The jobs' logs (<run_dir>/slurm/logs/*.out) joined, each cut to its last `tail` characters and
    headed by its name when `named`."""
    parts = []
    for path in sorted((run_dir / "slurm" / "logs").glob("*.out")):
        text = path.read_text(errors="replace")
        text = text[-tail:] if tail else text
        parts.append(f"==> {path.name}\n{text}" if named else text)
    return "\n".join(parts)
