"""A run's progress as its directory tells it, while it runs or after: the step of trainer.total_steps, time
per step and the time left, tokens/s, the last eval with its interval, the engines registered, the
last error line of logs/train.log. `dapo-megatron status RUN_DIR` (launch/run_status.py) adds whether
the run is live (its lock, or its Slurm job) and prints these lines.

    progress = read_progress(Path("outputs/tiny_cpu"))
    print("\n".join(progress.lines()))

Only files are read (metrics.jsonl, run.json, engines/, logs/): no torch, a second's work on any run.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from dapo_megatron.trainer.console_log import HEADER_MARK, log_path
from dapo_megatron.trainer.metrics_log import METRICS_FILE, MetricsRecord, read_jsonl
from dapo_megatron.trainer.run_record import RUN_FILE

TIMELINE_FILE = "timeline.jsonl"  # trainer/timeline.py's stream of the driver's phases
RECENT_STEPS = 10  # time per step: the median of the last RECENT_STEPS steps
_ERROR = re.compile(r"error|Traceback|Exception|FAILED|failed|Killed|out of memory", re.IGNORECASE)
_ERROR_TAIL_BYTES = 256 << 10  # the end of logs/train.log is enough to find its last error line


@dataclass
class RunProgress:
    run_dir: Path
    step: int | None = None  # the newest step trained (metrics.jsonl)
    total_steps: int | None = None  # this start's trainer.total_steps (run.json)
    step_s: float | None = None  # median of the last RECENT_STEPS steps' time/step_s
    wall_step_s: float | None = None  # wall time per step over the last RECENT_STEPS (evals, checkpoints too)
    rollout_tok_s: float | None = None
    train_tok_s: float | None = None
    eval_line: str = ""  # "avg@8 71.3% [65.0%, 77.1%] (95% CI) at step 20"
    engines: list[str] = field(default_factory=list)  # "url (up)" / "url (registered)"
    last_error: str = ""

    @property
    def eta_s(self) -> float | None:
        per_step = self.wall_step_s or self.step_s
        if self.step is None or self.total_steps is None or per_step is None:
            return None
        return max(0, self.total_steps - self.step) * per_step

    def lines(self) -> list[str]:
        total = f" of {self.total_steps}" if self.total_steps else ""
        step = "none trained yet" if self.step is None else f"{self.step}{total}"
        speed = "-" if self.step_s is None else f"{self.step_s:.1f} s per step (median of the last {RECENT_STEPS})"
        if self.wall_step_s is not None:
            speed += f", {self.wall_step_s:.1f} s of wall time with evals and checkpoints"
        rates = [
            f"{name} {_kilo(value)} tok/s"
            for name, value in (("rollout", self.rollout_tok_s), ("train", self.train_tok_s))
            if value is not None
        ]
        eta = self.eta_s
        left = "-" if eta is None else f"{_duration(eta)} ({max(0, (self.total_steps or 0) - (self.step or 0))} steps)"
        return [
            f"  step:        {step}",
            f"  speed:       {speed}" + (f"; {', '.join(rates)}" if rates else ""),
            f"  time left:   {left}",
            f"  last eval:   {self.eval_line or 'none yet'}",
            f"  engines:     {', '.join(self.engines) if self.engines else 'none registered'}",
            f"  log:         {log_path(self.run_dir)}",
            f"  last error:  {self.last_error or '(none in the log)'}",
        ]


def _kilo(value: float) -> str:
    return f"{value / 1e3:.1f}K" if value >= 1e3 else f"{value:.0f}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s" if minutes else f"{secs} s"


def read_progress(run_dir: str | Path) -> RunProgress:
    run_dir = Path(run_dir)
    progress = RunProgress(run_dir=run_dir, total_steps=_total_steps(run_dir))
    path = run_dir / METRICS_FILE
    records = read_jsonl(path, drop_partial_last=True) if path.is_file() else []
    steps = [r for r in records if isinstance(r.get("time/step_s"), (int, float))]
    if steps:
        progress.step = int(steps[-1]["step"])
        progress.step_s = statistics.median(float(r["time/step_s"]) for r in steps[-RECENT_STEPS:])
        for attr, key in (("rollout_tok_s", "throughput/rollout_tok_s"), ("train_tok_s", "throughput/train_tok_s")):
            value = steps[-1].get(key)
            if isinstance(value, (int, float)):
                setattr(progress, attr, float(value))
    progress.wall_step_s = _wall_step_s(run_dir / TIMELINE_FILE)
    progress.eval_line = _last_eval(records)
    progress.engines = _engines(run_dir / "engines")
    progress.last_error = _last_error(log_path(run_dir))
    return progress


def _wall_step_s(path: Path) -> float | None:
    """Seconds between the starts of generation of the last RECENT_STEPS steps (timeline.jsonl, the
    driver's phases): what a step costs the run with its evals, checkpoints and everything between."""
    starts: dict[int, float] = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written
        if row.get("phase") == "generate":
            starts[int(row["step"])] = min(float(row["start"]), starts.get(int(row["step"]), math.inf))
    steps = sorted(starts)[-(RECENT_STEPS + 1) :]
    if len(steps) < 2:
        return None
    return (starts[steps[-1]] - starts[steps[0]]) / (steps[-1] - steps[0])


def _total_steps(run_dir: Path) -> int | None:
    try:
        value = json.loads((run_dir / RUN_FILE).read_text())["lr_schedule"]["total_steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(value) if isinstance(value, (int, float)) else None


def _last_eval(records: list[MetricsRecord]) -> str:
    """The newest eval record's headline (the first eval set's with several) and its 95% interval."""
    for record in reversed(records):
        key = "eval/avg@k" if "eval/avg@k" in record else next((k for k in record if k.endswith("/avg@k")), None)
        if key is None or not isinstance(record[key], (int, float)):
            continue
        pre = key.removesuffix("avg@k")
        k = record.get(f"{pre}k")
        low, high = record.get(f"{pre}avg@k_ci95_low"), record.get(f"{pre}avg@k_ci95_high")
        name = f"avg@{int(k)}" if isinstance(k, (int, float)) else "avg@k"
        ci = f" [{low:.1%}, {high:.1%}] (95% CI)" if isinstance(low, float) and isinstance(high, float) else ""
        where = f" ({pre.strip('/')})" if pre != "eval/" else ""
        return f"{name} {float(record[key]):.1%}{ci} at step {record['step']}{where}"
    return ""


def _engines(register_dir: Path) -> list[str]:
    """Each registered engine: up when its process (on this host) is alive, registered otherwise."""
    out = []
    for path in sorted(register_dir.glob("*.json")) if register_dir.is_dir() else []:
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        pid, here = rec.get("pid"), rec.get("host") in (socket.gethostname(), "127.0.0.1", "localhost")
        state = "registered"
        if here and isinstance(pid, int):
            state = "up" if _alive(pid) else "gone"
        out.append(f"{rec.get('url', path.stem)} ({state})")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _last_error(path: Path) -> str:
    """The last line of the log naming an error since the run's latest start (the end of the file is read)."""
    if not path.is_file():
        return ""
    with path.open("rb") as handle:
        handle.seek(max(0, path.stat().st_size - _ERROR_TAIL_BYTES))
        tail = handle.read().decode("utf-8", "replace").splitlines()
    for line in reversed(tail):
        if line.startswith(HEADER_MARK):  # an earlier start's errors are not this start's
            return ""
        if _ERROR.search(line):
            return line.strip()
    return ""
