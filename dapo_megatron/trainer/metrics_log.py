"""Per-step metrics: a console table, `<run_dir>/metrics.jsonl`, wandb (offline by default), PNG curves.

    logger = MetricsLogger(run_dir, wandb_mode="offline", wandb_project="dapo-megatron", config=cfg.to_dict())
    logger.log(step, {"reward/mean": 0.1, "acc/mean": 0.55, ...})   # one JSON line, one table row
    logger.close()                                                  # finishes wandb, writes curves.png

    dapo-megatron plot RUN_DIR [--out FILE.png]      # the PNG of a finished or running run

Metric names are "group/name" (wandb groups panels by the prefix). The console shows the fixed
columns of console.STEP_COLUMNS (a table that fits 120 characters); every key goes to the JSONL and wandb. On resume
from step k,
`MetricsLogger(..., resume_step=k)` drops the JSONL lines of steps after k (written after the last
checkpoint) so the file reads as if the run had never stopped, and continues the run's wandb run (its id
in <run_dir>/run.json: trainer/run_record.py), saying in one line when the lr schedule changed.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, TextIO, TypeAlias

from dapo_megatron.config import RawJson
from dapo_megatron.trainer import console as _console
from dapo_megatron.trainer.evaluation.scored_step import last_trained_step, score_note
from dapo_megatron.trainer.run_record import RunRecord

__all__ = [
    "PLOT_PANELS",
    "MetricsLogger",
    "read_jsonl",
    "build_figure",
    "plot_run",
    "plot_main",
    "progress",
]

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"

# one value of a metrics.jsonl record: a number, or the text of a non-finite one ("nan", "inf": _jsonable)
MetricValue: TypeAlias = float | int | str
MetricsRecord: TypeAlias = dict[str, MetricValue]  # "step" and every metric logged at that step

# A column or curve shows the first of these keys a step has (console.ALIASES: the old-policy
# entropy comes for free with the pi_old forward; the actor's updates may report their own).
ALIASES = _console.ALIASES
_get = _console._get


# PNG panels: (title, [(metric key, legend label), ...]); panels with no data are left out.
PLOT_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "accuracy",
        (
            ("acc/mean", "train acc (kept groups)"),
            ("sampler/acc_all", "train acc (all)"),
            ("eval/avg@k", "eval avg@k"),
            ("eval/pass@k", "eval pass@k"),
        ),
    ),
    ("reward", (("reward/mean", "reward"),)),
    ("response length", (("response_length/mean", "mean"), ("response_length/max", "max"))),
    ("entropy / KL", (("actor/entropy", "entropy"), ("actor/approx_kl", "approx KL"))),
    ("clip fraction", (("actor/clipfrac_low", "low"), ("actor/clipfrac_high", "high"))),
    ("step time (s)", (("time/gen_s", "generate"), ("time/train_s", "train"), ("time/step_s", "step"))),
)


def _jsonable(value: object) -> object:
    item = getattr(value, "item", None)
    if callable(item):  # 0-dim tensors / numpy scalars
        value = item()
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)  # JSON has no NaN; "nan" / "inf" keep the fact visible
    return value


class MetricsLogger:
    """Writes each step's metrics to the console, `<run_dir>/metrics.jsonl` and wandb."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        wandb_mode: Literal["offline", "online", "disabled"] = "offline",
        wandb_project: str = "dapo-megatron",
        run_name: str | None = None,
        config: RawJson | None = None,
        resume_step: int | None = None,
        console: TextIO | None = sys.stdout,
        header_every: int = 20,
    ) -> None:
        if wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"trainer.wandb_mode={wandb_mode!r} is not allowed; choose offline, online or disabled")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None and self.path.is_file():
            # a crash mid-write leaves a last line without its newline: drop it, say so; a broken line
            # anywhere else is still an error naming it (read_jsonl)
            records = read_jsonl(
                self.path,
                drop_partial_last=True,
                on_drop=lambda note: print(f"[metrics] {note}", file=console or sys.stdout, flush=True),
            )
            kept = [r for r in records if int(r.get("step", -1)) <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        elif resume_step is None and self.path.is_file():
            self.path.unlink()  # a fresh run in an old directory starts a fresh file
        self._file = self.path.open("a")
        self._console = console
        total_steps = (config or {}).get("trainer", {}).get("total_steps") if isinstance(config, Mapping) else None
        self._table = _console.StepTable(total_steps=total_steps, header_every=header_every, out=console)
        # run.json: one wandb run per training run (its id kept across --resume and requeues), the lr schedule
        self.record = RunRecord.open(self.run_dir, resume=resume_step is not None, config=dict(config or {}))
        if resume_step is not None and (change := self.record.schedule_change(step=resume_step)):
            print(change, file=console or sys.stdout, flush=True)
        self._wandb = None
        if wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=wandb_project,
                name=run_name or self.run_dir.name,
                dir=str(self.run_dir),
                mode=wandb_mode,
                config=dict(config or {}),
                id=self.record.wandb_id,
                resume="allow" if resume_step is not None else None,
                # quiet: no closing history/summary block on stderr (the run's own summary says it);
                # close() names the offline run's sync command in one line instead
                settings=wandb.Settings(quiet=True),
            )

    def log(self, step: int, metrics: Mapping[str, object]) -> dict[str, object]:
        record = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._console is not None:
            self._table.print_row(step, record)
        if self._wandb is not None:
            self._wandb.log(
                {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}, step=int(step)
            )
        return record

    def close(self, *, plot: bool = True, exit_code: int = 0) -> Path | None:
        """Flush, finish wandb (with `exit_code`: non-zero marks the run failed) and (by default) write
        `<run_dir>/curves.png` from metrics.jsonl (no history is kept in memory); returns the PNG path."""
        if not self._file.closed:
            self._file.close()
        if self._wandb is not None:
            offline = self._wandb.settings.mode == "offline"
            sync_dir = self._wandb.settings.sync_dir
            self._wandb.finish(exit_code=exit_code)
            self._wandb = None
            if offline and self._console is not None:
                print(f"wandb: offline run; upload it with `wandb sync {sync_dir}`", file=self._console, flush=True)
        if plot and self.path.is_file() and self.path.stat().st_size:
            return plot_run(self.run_dir)
        return None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """Whichever way the run ends: a run left by an exception is finished in wandb as failed (exit code 1)."""
        self.close(exit_code=0 if exc_type is None else 1)


def read_jsonl(
    path: str | Path, *, drop_partial_last: bool = False, on_drop: Callable[[str], None] | None = None
) -> list[MetricsRecord]:
    """Records of a metrics.jsonl; a broken line raises ValueError naming the file and line.

    drop_partial_last: a last line with no newline that is not valid JSON (what a process killed in the
    middle of a write leaves) is dropped instead, and on_drop gets a sentence saying so."""
    text = Path(path).read_text()
    lines = text.splitlines()
    partial_last = bool(text) and not text.endswith("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if drop_partial_last and partial_last and number == len(lines):
                if on_drop is not None:
                    on_drop(
                        f"{path}: dropped line {number}, a partial record with no newline ({len(line)} "
                        f"characters: what a crash in the middle of a write leaves)"
                    )
                break
            raise ValueError(f"{path}: line {number} is not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}: line {number} is not a metrics record with a 'step' field")
        records.append(record)
    return records


def _series(records: Sequence[Mapping[str, MetricValue]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        value = _get(r, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            xs.append(int(r["step"]))
            ys.append(float(value))
    return xs, ys


def build_figure(records: Sequence[Mapping[str, MetricValue]], *, title: str = ""):
    """A matplotlib Figure with one panel per PLOT_PANELS entry that has data (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    panels = [
        (t, [(k, lbl, *_series(records, k)) for k, lbl in keys + (_eval_set_keys(records) if t == "accuracy" else ())])
        for t, keys in PLOT_PANELS
    ]
    panels = [(t, [s for s in series if s[2]]) for t, series in panels]
    panels = [(t, series) for t, series in panels if series]
    if not panels:
        raise ValueError("no plottable metrics: none of the PLOT_PANELS keys has a numeric value")
    cols = 3 if len(panels) > 4 else 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(5 * cols, 3.4 * rows), layout="constrained")
    for i, (panel_title, series) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for key, label, xs, ys in series:
            (line,) = ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
            band = _ci_band(records, key)
            if band is not None:  # the eval's 95% bootstrap interval over problems (trainer/evaluation/report.py)
                ax.fill_between(band[0], band[1], band[2], color=line.get_color(), alpha=0.2, label=f"{label} 95% CI")
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def _eval_set_keys(records: Sequence[Mapping[str, MetricValue]]) -> tuple[tuple[str, str], ...]:
    """(eval/<set>/avg@k, label) of every eval set of a run with several (data.eval_sets), first-seen order."""
    names: list[str] = []
    for r in records:
        for key in r:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval" and parts[2] == "avg@k" and parts[1] not in names:
                names.append(parts[1])
    return tuple((f"eval/{name}/avg@k", f"eval {name} avg@k") for name in names)


def _ci_band(
    records: Sequence[Mapping[str, MetricValue]], key: str
) -> tuple[list[int], list[float], list[float]] | None:
    """(steps, low, high) of `key`'s interval (<key>_ci95_low / _high), or None where it has none."""
    xs_low, low = _series(records, f"{key}_ci95_low")
    xs_high, high = _series(records, f"{key}_ci95_high")
    return (xs_low, low, high) if low and xs_low == xs_high else None


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the curves of `<run_dir>/metrics.jsonl` to `out` (default `<run_dir>/curves.png`)."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no metrics file (is {run_dir} a run directory?)")
    records = read_jsonl(path, drop_partial_last=True)  # a running run may be mid-write
    if not records:
        raise ValueError(f"{path}: no records yet")
    out = Path(out) if out else run_dir / CURVES_FILE
    build_figure(records, title=run_dir.name).savefig(out, dpi=100)
    return out


def plot_main(argv: list[str]) -> int:
    """`dapo-megatron plot RUN_DIR [--out FILE.png]`: PNG of a run's curves."""
    import argparse

    parser = argparse.ArgumentParser(prog="dapo-megatron plot", description=plot_main.__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    print(plot_run(args.run_dir, args.out))
    return 0


def progress(total: int, *, desc: str, enabled: bool = True):
    """A tqdm bar for generation rounds / training micro-batches (off when stderr is not a terminal)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=False, disable=not enabled or not sys.stderr.isatty())


# --------------------------------------------------------------------------------------------------
# The closing summary


def _fmt_s(seconds: float) -> str:
    if seconds >= 60:
        return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"
    return f"{seconds:.1f} s"


def run_summary(
    run_dir: str | Path,
    *,
    phase_seconds: Mapping[str, float] | None = None,
    ranks_wall_s: float | None = None,
    wall_s: float | None = None,
) -> str:
    """Where things are and how the run went: run directory, curves, final and best eval, the
    checkpoints on disk, and time per phase (start-up phases as measured by the launcher; the
    ranks' phases summed from metrics.jsonl; `other` = the rest of the ranks' wall time: their
    start-up, checkpoints, logging)."""
    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else []
    lines = [f"{_console.PREFIX} done. run directory: {run_dir}"]
    curves = run_dir / CURVES_FILE
    lines.append(f"  curves:       {curves if curves.is_file() else '(not written)'}")
    lines.append(f"  metrics:      {run_dir / METRICS_FILE} ({len(records)} records)")
    lines += _eval_lines(run_dir, records)
    lines += _checkpoint_lines(run_dir)
    lines += _time_lines(records, phase_seconds=phase_seconds, ranks_wall_s=ranks_wall_s, wall_s=wall_s)
    return "\n".join(lines)


def _eval_lines(run_dir: Path, records: list[MetricsRecord]) -> list[str]:
    """The final and the best eval of the run (its first set's numbers with several: the one that picks
    the best checkpoint), and the final eval's file with its interval."""
    lines = []
    # a run with several eval sets (data.eval_sets): the first set's numbers (the one that picks the best checkpoint)
    sets = _eval_set_keys(records)
    pre = "eval/" if any("eval/avg@k" in r for r in records) or not sets else sets[0][0].removesuffix("avg@k")
    evals = [
        (int(r["step"]), float(r[f"{pre}avg@k"]), r.get(f"{pre}pass@k"), r.get(f"{pre}k"))
        for r in records
        if isinstance(r.get(f"{pre}avg@k"), (int, float))
    ]
    if evals:
        k = evals[-1][3]
        name = f"avg@{int(k)}" if isinstance(k, (int, float)) else "avg@k"
        step, value, pass_k, _ = evals[-1]
        extra = f", pass@{int(k)} {float(pass_k):.1%}" if isinstance(pass_k, (int, float)) and k else ""
        note = score_note(eval_step=step, trained_step=last_trained_step(records))
        lines.append(f"  final eval:   {name} {value:.1%} at step {step}{extra}" + (f" ({note})" if note else ""))
        last = next(r for r in reversed(records) if isinstance(r.get(f"{pre}avg@k"), (int, float)))
        if f"{pre}avg@k_ci95_low" in last:  # the eval file (trainer/evaluation/report.py) holds every problem's record
            lines.append(
                f"  eval file:    {run_dir / 'evals' / f'step_{step:06d}.json'} ({pre.strip('/')} {name} "
                f"{value:.1%}, 95% CI [{last[f'{pre}avg@k_ci95_low']:.1%}, {last[f'{pre}avg@k_ci95_high']:.1%}]"
                + (f", maj@{int(k)} {last[f'{pre}maj@k']:.1%}" if f"{pre}maj@k" in last and k else "")
                + ")"
            )
        best_step, best, _, _ = max(evals, key=lambda e: (e[1], -e[0]))  # the earliest of equal bests
        first = evals[0]
        lines.append(
            f"  best eval:    {name} {best:.1%} at step {best_step} "
            f"(step {first[0]}: {first[1]:.1%}, {len(evals)} evals)"
        )
    else:
        lines.append("  eval:         none logged (trainer.eval_every=0?)")
    return lines


def _checkpoint_lines(run_dir: Path) -> list[str]:
    """The checkpoints on disk and the best one kept aside."""
    from dapo_megatron.trainer.checkpoint.files import best_checkpoint, list_checkpoints

    lines = []
    checkpoints = list_checkpoints(run_dir)
    if checkpoints:
        names = ", ".join(path.name for _, path in checkpoints)
        lines.append(f"  checkpoints:  {names} in {run_dir / 'checkpoints'}")
    else:
        lines.append("  checkpoints:  none")
    best_ckpt = best_checkpoint(run_dir)
    if best_ckpt is not None:
        lines.append(f"  best ckpt:    {best_ckpt[2]} (eval {best_ckpt[1]:.1%}, kept by trainer.keep_best_checkpoint)")
    return lines


def _time_lines(
    records: list[MetricsRecord],
    *,
    phase_seconds: Mapping[str, float] | None,
    ranks_wall_s: float | None,
    wall_s: float | None,
) -> list[str]:
    """Time per phase (the launcher's start-up phases, the ranks' phases summed from metrics.jsonl, the
    rest of the ranks' wall time as `other`) and the steps' total and median."""
    lines = []
    steps = [r for r in records if int(r.get("step", 0)) > 0 and "time/step_s" in r]
    sums = {
        key: sum(float(r.get(key, 0.0)) for r in records)
        for key in ("time/gen_s", "time/logprob_s", "time/train_s", "time/sync_s", "time/eval_s")
    }
    trained = [
        ("generate", sums["time/gen_s"]),
        ("log-probs", sums["time/logprob_s"]),
        ("train", sums["time/train_s"]),
        ("weight sync", sums["time/sync_s"]),
        ("eval", sums["time/eval_s"]),
    ]
    ran = [(name, secs) for name, secs in trained if secs > 0]
    if ranks_wall_s is not None:
        ran.append(("other", max(0.0, ranks_wall_s - sum(secs for _, secs in trained))))
    label = "  time:         "
    for title, items in (("start-up", list((phase_seconds or {}).items())), ("ranks", ran)):
        if items:
            lines.append(f"{label}{title}: " + ", ".join(f"{name} {_fmt_s(secs)}" for name, secs in items))
            label = " " * len(label)
    if steps:
        step_total = sum(float(r["time/step_s"]) for r in steps)
        lines.append(
            f"  steps:        {len(steps)} in {_fmt_s(step_total)} "
            f"(median {sorted(float(r['time/step_s']) for r in steps)[len(steps) // 2]:.2f} s per step)"
            + (f"; whole command {_fmt_s(wall_s)}" if wall_s is not None else "")
        )
    return lines
