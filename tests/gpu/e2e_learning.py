"""The learning check of run_all.sh's e2e steps: held-out avg@k rose by at least --min-gain within the run.

    python tests/gpu/e2e_learning.py RUN_DIR --min-gain 0.30 [--within 30] [--json FILE]

Reads RUN_DIR/metrics.jsonl (the eval rows: step, eval/avg@k); prints the curve and the median step time
(--json: also as one JSON object, run_all.sh's step metrics); exits 1 when the best eval at step <= --within
is not at least --min-gain above the step-0 eval.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--min-gain", type=float, required=True, help="avg@k points as a fraction (0.30 = 30 points)")
    ap.add_argument("--within", type=int, default=30, help="steps")
    ap.add_argument("--json", default=None, help="also write the numbers here as one JSON object")
    args = ap.parse_args(argv)
    rows = [
        json.loads(line) for line in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    evals = [(int(r["step"]), float(r["eval/avg@k"])) for r in rows if "eval/avg@k" in r]
    times = [float(r["time/step_s"]) for r in rows if "time/step_s" in r]
    if not evals or evals[0][0] != 0:
        print(f"{args.run_dir}: no step-0 eval in metrics.jsonl", file=sys.stderr)
        return 1
    start = evals[0][1]
    best = max(acc for step, acc in evals if step <= args.within)
    curve = " -> ".join(f"{acc:.1%}@{step}" for step, acc in evals)
    median = f", median step {statistics.median(times):.2f} s" if times else ""
    print(
        f"{args.run_dir}: avg@k {curve}; gain {best - start:+.1%} within {args.within} steps "
        f"(need {args.min_gain:+.0%}){median}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "avg_at_k": {str(step): round(acc, 4) for step, acc in evals},
                    "gain": round(best - start, 4),
                    "min_gain": args.min_gain,
                    "within": args.within,
                    "median_step_s": round(statistics.median(times), 3) if times else None,
                }
            )
        )
    return 0 if best - start >= args.min_gain else 1


if __name__ == "__main__":
    raise SystemExit(main())
