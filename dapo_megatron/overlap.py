"""The step timeline of a run (phase start/end stamps from the driver) and `dapo-megatron bench overlap`.

    write_timeline(driver.timeline, run_dir)       # <run_dir>/timeline.jsonl and timeline.png
    hidden_fraction(timeline)                      # share of the shorter of generation / training hidden
    dapo-megatron bench overlap --steps 12         # the embedded task at staleness 0 and 1, alternating

Phases (driver.py, rollout/async_rollout.py): "generate" (the engines' work on a step's batch: the
sampler's collect, from its first request to its last reply), "wait" (the trainer blocked on a batch
that is still generating; staleness >= 1 only), "train" (driver rank from the batch in hand to the
weight push: scatter, log-probs, updates), "sync" (the weight push), "paused" (generation paused
around a push). Those are time.time() of the driver process, the one that talks to the engines.
"engine" is stamped by the engines themselves: the union of the spans in which they worked on the
batch's requests (request_received_ts .. + e2e_latency of every reply, rollout/sampler.py:
engine_span), in their epoch clock (the same host's on one machine; NTP-synchronised across nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAINER_PHASES = ("train", "sync")
COLORS = {"engine": "tab:red", "generate": "tab:orange", "wait": "tab:gray", "train": "tab:blue",
          "sync": "tab:green"}


def engine_phases(spans: list[tuple[float, float]], step: int) -> list[tuple[str, int, float, float]]:
    """A batch's "engine" timeline entries: the union of the engines' own spans for its replies."""
    return [("engine", step, a, b) for a, b in _union(spans)]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def _hidden(gen: list[tuple[float, float]], trn: list[tuple[float, float]]) -> tuple[float, float]:
    both = _intersection(gen, trn)
    shorter = min(_length(gen), _length(trn))
    return both, (both / shorter if shorter > 0 else 0.0)


def hidden_fraction(timeline: list[tuple[str, int, float, float]]) -> dict[str, float]:
    """Seconds of generation, of training (train + sync), of both at once, and the fraction of the
    shorter of the two that ran under the longer one (0 = sequential, 1 = fully hidden); the same
    from the engines' own stamps ("engine") against the trainer's phases (engine_*)."""
    def lane(*phases: str) -> list[tuple[float, float]]:
        return _union([(a, b) for p, _, a, b in timeline if p in phases])

    gen, eng, trn = lane("generate"), lane("engine"), lane(*TRAINER_PHASES)
    overlap, hidden = _hidden(gen, trn)
    engine_overlap, engine_hidden = _hidden(eng, trn)
    return {"generate_s": _length(gen), "train_s": _length(trn), "overlap_s": overlap, "hidden_fraction": hidden,
            "engine_s": _length(eng), "engine_overlap_s": engine_overlap, "engine_hidden_fraction": engine_hidden}


def step_wall_times(timeline: list[tuple[str, int, float, float]]) -> list[float]:
    """Seconds from the end of one step's weight push to the end of the next one's (steps 1..)."""
    ends = sorted(b for p, _, _, b in timeline if p == "sync")
    return [b - a for a, b in zip(ends, ends[1:])]


def write_timeline(timeline: list[tuple[str, int, float, float]], run_dir: str | Path) -> Path:
    """<run_dir>/timeline.jsonl (one phase a line, seconds from the first stamp) and timeline.png."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = min(a for _, _, a, _ in timeline)
    rows = [{"phase": p, "step": s, "start": a - t0, "end": b - t0} for p, s, a, b in timeline]
    path = run_dir / "timeline.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_timeline(rows, run_dir / "timeline.png")
    return path


def read_timeline(path: str | Path) -> list[tuple[str, int, float, float]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [(r["phase"], int(r["step"]), float(r["start"]), float(r["end"])) for r in rows]


def plot_timeline(rows: list[dict], path: Path) -> None:
    """One lane per phase on one time axis, each bar labelled with its step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [p for p in ("engine", "generate", "wait", "train", "sync") if any(r["phase"] == p for r in rows)]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(lanes) + 1.2))
    span = max((r["end"] for r in rows), default=1.0) - min((r["start"] for r in rows), default=0.0)
    for y, lane in enumerate(lanes):
        for r in rows:
            if r["phase"] == lane:
                ax.barh(y, r["end"] - r["start"], left=r["start"], color=COLORS[lane], edgecolor="black", lw=0.3)
                # a label only where it fits (the engines' spans come in many small pieces)
                if lane in ("engine", "generate", "train") and r["end"] - r["start"] > 0.008 * span:
                    ax.text((r["start"] + r["end"]) / 2, y, str(r["step"]), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first stamp (driver's clock; the engine lane: the engines' own stamps)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- the benchmark
FIELDS = ("date", "machine", "cores", "staleness", "run", "steps", "step_wall_s", "step_mean_s", "generate_s",
          "train_s", "overlap_s", "hidden_fraction", "engine_s", "engine_overlap_s", "engine_hidden_fraction",
          "eval_step", "eval_avg_at_k")


def _run(config: str, out: Path, staleness: int, steps: int, eval_every: int, extra: list[str]) -> dict:
    over = [f"trainer.output_dir={out}", f"trainer.total_steps={steps}", "trainer.wandb_mode=disabled",
            f"rollout.max_staleness={staleness}", "rollout.placement=disaggregated", "trainer.save_every=0",
            "trainer.keep_best_checkpoint=false",
            f"trainer.eval_every={eval_every}"]
    if staleness:
        over.append("algorithm.tis_cap=2.0")
    cmd = [sys.executable, "-m", "dapo_megatron.cli", "train", config, *over, *extra, "--overwrite", "--skip-plan"]
    proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench overlap: staleness {staleness} run failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    timeline = read_timeline(out / "timeline.jsonl")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/avg@k" in m]
    walls = step_wall_times(timeline)
    walls = sorted(walls)  # the median: a step with an eval in it is not a step's wall time
    return {**hidden_fraction(timeline), "steps": steps, "step_wall_s": walls[len(walls) // 2] if walls else 0.0,
            "step_mean_s": sum(walls) / len(walls) if walls else 0.0,
            "eval_step": evals[-1]["step"], "eval_avg_at_k": evals[-1]["eval/avg@k"]}


def main(argv: list[str] | None = None) -> int:
    import platform

    from dapo_megatron.bench import add_output_args, append_rows, check_header, results_csv

    ap = argparse.ArgumentParser(prog="dapo-megatron bench overlap", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/runs/tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=0, help="held-out eval every N steps (default: at the end)")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of runs (staleness 0, then 1)")
    ap.add_argument("--first", type=int, choices=(0, 1), default=0, help="which staleness runs first in each pair")
    ap.add_argument("--engine-cores", default="", help="CPU cores of the engine, e.g. 0 (rollout.cpu_engine_cores; "
                    "default: not pinned)")
    ap.add_argument("--actor-cores", default="", help="CPU cores of the actor ranks, e.g. 1 (actor.cpu_cores). With "
                    "--engine-cores: each side on cores of its own, as disaggregated engines on GPUs of their own")
    ap.add_argument("--out", default=None, help="run directories (default: a temporary one)")
    ap.add_argument("overrides", nargs="*", help="section.key=value for every run")
    add_output_args(ap, name="overlap")
    args = ap.parse_args(argv)
    check_header(results_csv(args, name="overlap"), FIELDS)  # before minutes of runs, not after
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_overlap_"))
    date, machine = time.strftime("%Y-%m-%d", time.gmtime()), f"{platform.machine()} {os.cpu_count()} cores"
    overrides = list(args.overrides)
    for key, cores in (("rollout.cpu_engine_cores", args.engine_cores), ("actor.cpu_cores", args.actor_cores)):
        if cores:
            overrides.append(f"{key}=[{cores}]")
    pinning = (f"engine {args.engine_cores or '-'} / actor {args.actor_cores or '-'}"
               if args.engine_cores or args.actor_cores else "shared")
    rows = []
    for rep in range(args.repeats):
        # alternating, so that drift of the shared machine hits both alike
        for staleness in ((0, 1) if args.first == 0 else (1, 0)):
            out = root / f"s{staleness}_r{rep}"
            row = {"date": date, "machine": machine, "cores": pinning, "staleness": staleness, "run": str(out),
                   **_run(args.config, out, staleness, args.steps, args.eval_every or args.steps, overrides)}
            rows.append(row)
            print(f"staleness {staleness}  step {row['step_wall_s']:.2f} s (mean {row['step_mean_s']:.2f})  generate {row['generate_s']:.1f} s  "
                  f"train {row['train_s']:.1f} s  hidden {100 * row['hidden_fraction']:.0f}% "
                  f"(engines' stamps {100 * row['engine_hidden_fraction']:.0f}%)  "
                  f"avg@k {row['eval_avg_at_k']:.3f} @ step {row['eval_step']}  ({out}/timeline.png)", flush=True)
    print(f"\n{'cores':>20} {'staleness':>9} {'step s':>7} {'mean s':>7} {'gen s':>7} {'train s':>7} {'hidden':>7} {'eng hid':>7} {'avg@k':>6}")
    for r in rows:
        print(f"{r['cores']:>20} {r['staleness']:>9} {r['step_wall_s']:>7.2f} {r['step_mean_s']:>7.2f} {r['generate_s']:>7.1f} {r['train_s']:>7.1f} "
              f"{100 * r['hidden_fraction']:>6.0f}% {100 * r['engine_hidden_fraction']:>6.0f}% {r['eval_avg_at_k']:>6.3f}")
    append_rows(results_csv(args, name="overlap"), rows, fields=FIELDS)
    return 0
