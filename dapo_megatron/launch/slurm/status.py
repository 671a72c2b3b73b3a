"""`dapo-megatron slurm status RUN_DIR`: the jobs of a run (from <run_dir>/slurm/jobs.json), their
Slurm state, the registered rollout engines and the last metrics line of each training run.

Job state comes from `squeue` (queued and running jobs, array tasks one per line), then
`scontrol show job` (finished jobs, kept by slurmctld for MinJobAge seconds), then `sacct` (needs
accounting, which many small clusters and the local test cluster do not have). A job none of them
knows is shown as `gone` rather than failing the command.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

Runner = Callable[[list[str]], str | None]  # argv -> stdout, or None when the command fails


def _run(argv: list[str]) -> str | None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout if result.returncode == 0 else None


def job_rows(job_id: str, run: Runner = _run) -> list[dict[str, str]]:
    """One row per job or array task: {id, state, elapsed, restarts, reason}."""
    out = run(["squeue", "-h", "-r", "-j", job_id, "-o", "%i|%T|%M|%r"])
    if out and out.strip():
        rows = []
        for line in out.strip().splitlines():
            task, state, elapsed, reason = (line.split("|") + ["", "", "", ""])[:4]
            rows.append({"id": task, "state": state, "elapsed": elapsed, "restarts": "", "reason": reason})
        return rows
    out = run(["scontrol", "-o", "show", "job", job_id])
    if out and out.strip():
        rows = []
        for line in out.strip().splitlines():
            f = dict(part.split("=", 1) for part in line.split() if "=" in part)
            task = f"{f['ArrayJobId']}_{f['ArrayTaskId']}" if f.get("ArrayTaskId") else f.get("JobId", job_id)
            rows.append(
                {
                    "id": task,
                    "state": f.get("JobState", "?"),
                    "elapsed": f.get("RunTime", ""),
                    "restarts": f.get("Restarts", ""),
                    "reason": f.get("Reason", ""),
                }
            )
        return rows
    out = run(["sacct", "-n", "-P", "-X", "-j", job_id, "--format=JobID,State,Elapsed,Reason"])
    if out and out.strip():
        rows = []
        for line in out.strip().splitlines():
            task, state, elapsed, reason = (line.split("|") + ["", "", "", ""])[:4]
            rows.append({"id": task, "state": state, "elapsed": elapsed, "restarts": "", "reason": reason})
        return rows
    return [
        {
            "id": job_id,
            "state": "gone",
            "elapsed": "",
            "restarts": "",
            "reason": "not in squeue or scontrol; sacct unavailable",
        }
    ]


def last_metrics(run_dir: Path) -> dict | None:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    last = None
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                last = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written right now
    return last


def _run_dirs(run_dir: Path) -> list[tuple[str, Path]]:
    """The training runs of this directory: itself, or each run of a sweep (slurm/sweep_runs.tsv)."""
    runs = run_dir / "slurm" / "sweep_runs.tsv"
    if runs.exists():
        pairs = [line.split("\t", 1) for line in runs.read_text().splitlines() if "\t" in line]
        return [(name, Path(path)) for name, path in pairs]
    return [(run_dir.name, run_dir)]


def summarize(run_dir: str | Path, run: Runner = _run) -> str:
    run_dir = Path(run_dir)
    jobs = read_jobs(run_dir)
    lines = [f"run {run_dir}", "", f"{'role':<12} {'job':<12} {'state':<12} {'elapsed':<10} {'restarts':<8} reason"]
    for job in jobs:
        for row in job_rows(job["job_id"], run):
            lines.append(
                f"{job['role']:<12} {row['id']:<12} {row['state']:<12} {row['elapsed']:<10} "
                f"{row['restarts']:<8} {row['reason']}"
            )
    engines = sorted((run_dir / "engines").glob("*.json")) if (run_dir / "engines").is_dir() else []
    if engines:
        lines += ["", f"registered engines ({run_dir / 'engines'}):"]
        for path in engines:
            try:
                rec = json.loads(path.read_text())
                lines.append(
                    f"  {rec.get('url', '?')}  tp={rec.get('tp_size', '?')}  since {rec.get('started_at', '?')}"
                )
            except json.JSONDecodeError:
                lines.append(f"  {path.name}: unreadable")
    for name, path in _run_dirs(run_dir):
        metrics = last_metrics(path)
        if metrics is not None:
            lines += ["", f"last metrics of {name} ({path / 'metrics.jsonl'}):", "  " + json.dumps(metrics)]
    return "\n".join(lines)


def read_jobs(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "slurm" / "jobs.json"
    if not path.exists():
        raise ValueError(f"{run_dir}: no slurm/jobs.json (was the run submitted with `dapo-megatron slurm submit`?)")
    return json.loads(path.read_text())["jobs"]
