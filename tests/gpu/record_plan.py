"""Write a GPU run's measured step times into the plan, so that the next plan is a measured one.

    python tests/gpu/record_plan.py OUT/results.jsonl [--plan tests/gpu/plan.tsv] [--device NAME] [--date D]

For every step that ended ok the plan row gets measured_s, measured_on (the GPU that preflight reported
in the same results file, or --device) and date, and budget_s becomes the measured seconds plus a margin:
max(x1.25, +15 s), rounded up to 5 s. A failed step stopped early, so its seconds are not the step's
length: they may RAISE its budget (the same margin), never lower it, and its measured columns are left
alone (issue 49: a transfer_tests failing at 12 s had cut its budget from 50 to 30). A step that hit its
budget (timeout) keeps its row and is listed: it needs more than its budget, by how much is not known.
Skipped steps are left alone. Comments and row order are kept; the call totals (+ the setup and margin
run_all.sh keeps) are printed against the 540 s limit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

CALL_LIMIT_S = 540
SETUP_S, MARGIN_S = 15, 30  # run_all.sh's: the wheels' install inside a call, and the margin a call keeps
COLUMNS = ["call", "step", "budget_s", "measured_s", "measured_on", "date", "needs", "command"]


def budget_from(measured_s: float) -> int:
    return int(5 * math.ceil(max(measured_s * 1.25, measured_s + 15) / 5))


def read_results(path: Path) -> list[dict]:
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({err})") from None
    return rows


def record(plan: Path, results: list[dict], *, device: str | None, date: str) -> list[str]:
    """Rewrite `plan` from `results`; returns the lines to print (updates, timeouts, totals)."""
    device = device or next(
        (
            r.get("metrics", {}).get("gpu")
            for r in results
            if r.get("step") == "preflight" and r.get("metrics", {}).get("gpu")
        ),
        None,
    )
    if not device:
        raise ValueError("no device: the results hold no preflight step with a GPU name; pass --device")
    finished = {r["step"]: r for r in results if r.get("status") == "ok"}
    failed = {r["step"]: r for r in results if r.get("status") == "failed"}
    timed_out = {r["step"]: r for r in results if r.get("status") == "timeout"}
    report, out_lines, totals = [], [], {}
    for line in plan.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            out_lines.append(line)
            continue
        fields = dict(zip(COLUMNS, line.split("\t")))
        step = fields["step"]
        if step in finished:
            seconds = float(finished[step]["seconds"])
            fields.update(
                budget_s=str(budget_from(seconds)),
                measured_s=f"{seconds:.1f}",
                measured_on=device.replace("\t", " "),
                date=date,
            )
            report.append(f"{step}: ok in {seconds:.1f} s -> budget_s {fields['budget_s']}")
        elif step in failed:
            seconds = float(failed[step]["seconds"])
            budget = max(int(fields["budget_s"]), budget_from(seconds))
            change = "raised to" if budget > int(fields["budget_s"]) else "kept at"
            fields["budget_s"] = str(budget)
            report.append(f"{step}: FAILED after {seconds:.1f} s (not its length) -> budget_s {change} {budget}")
        elif step in timed_out:
            report.append(
                f"{step}: TIMEOUT at its budget of {fields['budget_s']} s: it needs more; raise budget_s "
                "by hand (or split the step)"
            )
        totals[fields["call"]] = totals.get(fields["call"], 0) + int(fields["budget_s"])
        out_lines.append("\t".join(fields.get(c, "-") for c in COLUMNS))
    plan.write_text("\n".join(out_lines) + "\n")
    for call, total in totals.items():
        over = ""
        if total + SETUP_S + MARGIN_S > CALL_LIMIT_S:
            over = f"  OVER the {CALL_LIMIT_S} s limit with {SETUP_S} s setup + {MARGIN_S} s margin: move a step"
        report.append(f"call {call}: total_s {total}{over}")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--plan", default=str(Path(__file__).with_name("plan.tsv")))
    ap.add_argument("--device", default=None, help="default: the GPU name preflight wrote into the results")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args(argv)
    try:
        lines = record(Path(args.plan), read_results(Path(args.results)), device=args.device, date=args.date)
    except ValueError as err:
        print(f"record_plan: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 1 if any("OVER" in line or "TIMEOUT" in line for line in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
