"""`dapo-megatron bench kernels | reward | rollout | actor | dataplane | rollout-quant | overlap | engine-abuse |
engine-health | reshard [args]`: the project's
benchmarks, each
printing a table and appending rows to a CSV in a results directory (speed is measured here, never
asserted in tests).

    dapo-megatron bench reward                         # appends to ./results/reward.csv
    dapo-megatron bench kernels --results-dir /scratch/bench   # -> /scratch/bench/kernels.csv
    dapo-megatron bench rollout --csv /tmp/rollout.csv         # one exact file instead

Results go to `--results-dir` (default `./results/`, relative to where the command runs, never the
installed package or the checkout's source), one `<bench>.csv` per benchmark; `--csv FILE` names
the file itself. The tables quoted in the documentation (measured, dated, with the machine) live in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

BENCHES = {
    "kernels": "dapo_kernels.bench.run",  # fused log-prob/entropy + policy loss vs torch / Liger (GPU)
    "reward": "dapo_megatron.benchmarks.reward",  # math_dapo scoring throughput on 20K-token responses
    "rollout": "dapo_megatron.benchmarks.rollout",  # CPU rollout server tokens/s and weight-sync bandwidth
    "actor": "dapo_megatron.benchmarks.actor",  # Megatron actor training throughput and MFU (GPU)
    "dataplane": "dapo_megatron.benchmarks.dataplane",  # batch scatter + weight export of a 32B-shaped step (gloo)
    # bf16 vs modelopt FP8 CPU engine: weight bytes, tok/s, mismatch
    "rollout-quant": "dapo_megatron.benchmarks.rollout_quant",
    # the embedded task at rollout.max_staleness 0 and 1: step time, hidden share
    "overlap": "dapo_megatron.benchmarks.overlap",
    # CPU engine under garbage and 50 MB bodies: 5xx count, peak RSS
    "engine-abuse": "dapo_megatron.benchmarks.engine_abuse",
    # CPU engine /health latency while 16 MB bodies are parsed
    "engine-health": "dapo_megatron.benchmarks.engine_health",
    # an actor checkpoint saved under one layout, loaded under another: seconds, disk, peak RSS (torchrun)
    "reshard": "dapo_megatron.benchmarks.reshard",
}
DEFAULT_RESULTS_DIR = "results"


def add_output_args(parser: argparse.ArgumentParser, *, name: str) -> None:
    """--results-dir DIR (default ./results) and --csv FILE, the same on every benchmark."""
    parser.add_argument(
        "--results-dir",
        default=DEFAULT_RESULTS_DIR,
        help=f"directory of the results CSVs; rows go to DIR/{name}.csv (default ./{DEFAULT_RESULTS_DIR})",
    )
    parser.add_argument("--csv", default=None, help="append to this CSV file instead (overrides --results-dir)")


def results_csv(args: argparse.Namespace, *, name: str) -> Path:
    return Path(args.csv) if args.csv else Path(args.results_dir) / f"{name}.csv"


def check_header(path: str | Path, fields: Iterable[str]) -> None:
    """Refuse a CSV whose header is not `fields` (rows would land in the wrong columns); a benchmark
    that runs for minutes calls this before it starts, so its rows are never lost at the end."""
    path, fields = Path(path), list(fields)
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open(newline="") as fh:
        header = next(csv.reader(fh), [])
    if header != fields:
        raise ValueError(
            f"{path}: its columns {header} are not this benchmark's {fields} (an older version's "
            "file?); pass another --csv or --results-dir, or move the file away"
        )


def append_rows(path: str | Path, rows: Sequence[Mapping[str, object]], *, fields: Iterable[str]) -> Path:
    """Append rows to a CSV (header written when the file is new or empty); creates the directory."""
    path = Path(path)
    fields = list(fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    check_header(path, fields)
    with path.open("a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerows(rows)
    print(f"appended {len(rows)} row(s) to {path}")
    return path


def main(argv: list[str]) -> int:
    usage = f"usage: dapo-megatron bench {{{' | '.join(BENCHES)}}} [--results-dir DIR | --csv FILE] [args]"
    if argv and argv[0] in ("-h", "--help"):  # `bench NAME --help`: that benchmark's options
        print(f"{usage}\n\n{__doc__}")
        return 0
    if not argv or argv[0] not in BENCHES:
        print(usage, file=sys.stderr)
        return 2
    if "-h" in argv[1:] or "--help" in argv[1:]:  # a torch benchmark's options from its parser alone (parsers.py)
        parsers = importlib.import_module("dapo_megatron.benchmarks.parsers").PARSERS
        if argv[0] in parsers:
            parsers[argv[0]]().parse_args(argv[1:])  # prints the help and exits 0
    return int(importlib.import_module(BENCHES[argv[0]]).main(argv[1:]) or 0)
