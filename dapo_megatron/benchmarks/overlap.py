"""`dapo-megatron bench overlap`: the embedded task at rollout.max_staleness 0 and 1, alternating; step
time and the share of generation / training hidden behind the other, read from each run's timeline
(trainer/timeline.py).

    dapo-megatron bench overlap --steps 12
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

from dapo_megatron.benchmarks import parsers
from dapo_megatron.benchmarks.run import append_rows, check_header, results_csv
from dapo_megatron.trainer.timeline import hidden_fraction, read_timeline, step_wall_times

FIELDS = (
    "date",
    "machine",
    "cores",
    "staleness",
    "run",
    "steps",
    "step_wall_s",
    "step_mean_s",
    "generate_s",
    "train_s",
    "overlap_s",
    "hidden_fraction",
    "engine_s",
    "engine_overlap_s",
    "engine_hidden_fraction",
    "eval_step",
    "eval_avg_at_k",
)


def _run(config: str, out: Path, staleness: int, steps: int, eval_every: int, extra: list[str]) -> dict:
    over = [
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        "trainer.wandb_mode=disabled",
        f"rollout.max_staleness={staleness}",
        "rollout.placement=disaggregated",
        "trainer.save_every=0",
        "trainer.keep_best_checkpoint=false",
        f"trainer.eval_every={eval_every}",
    ]
    if staleness:
        over.append("algorithm.tis_cap=2.0")
    cmd = [sys.executable, "-m", "dapo_megatron.cli", "train", config, *over, *extra, "--overwrite", "--skip-plan"]
    proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench overlap: staleness {staleness} run failed ({proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    timeline = read_timeline(out / "timeline.jsonl")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/avg@k" in m]
    walls = step_wall_times(timeline)
    walls = sorted(walls)  # the median: a step with an eval in it is not a step's wall time
    return {
        **hidden_fraction(timeline),
        "steps": steps,
        "step_wall_s": walls[len(walls) // 2] if walls else 0.0,
        "step_mean_s": sum(walls) / len(walls) if walls else 0.0,
        "eval_step": evals[-1]["step"],
        "eval_avg_at_k": evals[-1]["eval/avg@k"],
    }


def _parser() -> argparse.ArgumentParser:
    return parsers.overlap()  # torch-free: `bench overlap --help` answers at once


def main(argv: list[str] | None = None) -> int:
    import platform

    args = _parser().parse_intermixed_args(argv)  # flags and key=value overrides in any order
    check_header(results_csv(args, name="overlap"), FIELDS)  # before minutes of runs, not after
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_overlap_"))
    date, machine = time.strftime("%Y-%m-%d", time.gmtime()), f"{platform.machine()} {os.cpu_count()} cores"
    overrides = list(args.overrides)
    for key, cores in (("rollout.cpu_engine_cores", args.engine_cores), ("actor.cpu_cores", args.actor_cores)):
        if cores:
            overrides.append(f"{key}=[{cores}]")
    pinning = (
        f"engine {args.engine_cores or '-'} / actor {args.actor_cores or '-'}"
        if args.engine_cores or args.actor_cores
        else "shared"
    )
    rows = []
    for rep in range(args.repeats):
        # alternating, so that drift of the shared machine hits both alike
        for staleness in (0, 1) if args.first == 0 else (1, 0):
            out = root / f"s{staleness}_r{rep}"
            row = {
                "date": date,
                "machine": machine,
                "cores": pinning,
                "staleness": staleness,
                "run": str(out),
                **_run(args.config, out, staleness, args.steps, args.eval_every or args.steps, overrides),
            }
            rows.append(row)
            print(
                f"staleness {staleness}  step {row['step_wall_s']:.2f} s (mean {row['step_mean_s']:.2f})  "
                f"generate {row['generate_s']:.1f} s  "
                f"train {row['train_s']:.1f} s  hidden {100 * row['hidden_fraction']:.0f}% "
                f"(engines' stamps {100 * row['engine_hidden_fraction']:.0f}%)  "
                f"avg@k {row['eval_avg_at_k']:.3f} @ step {row['eval_step']}  ({out}/timeline.png)",
                flush=True,
            )
    print(
        f"\n{'cores':>20} {'staleness':>9} {'step s':>7} {'mean s':>7} {'gen s':>7} {'train s':>7} "
        f"{'hidden':>7} {'eng hid':>7} {'avg@k':>6}"
    )
    for r in rows:
        print(
            f"{r['cores']:>20} {r['staleness']:>9} {r['step_wall_s']:>7.2f} {r['step_mean_s']:>7.2f} "
            f"{r['generate_s']:>7.1f} {r['train_s']:>7.1f} "
            f"{100 * r['hidden_fraction']:>6.0f}% {100 * r['engine_hidden_fraction']:>6.0f}% {r['eval_avg_at_k']:>6.3f}"
        )
    append_rows(results_csv(args, name="overlap"), rows, fields=FIELDS)
    return 0
