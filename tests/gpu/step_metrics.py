"""Small helpers of tests/gpu/run_all.sh: a step's key numbers as one JSON object, and the results line.

    python tests/gpu/step_metrics.py record RESULTS --call N --step NAME --status ok --seconds 12.3 --rc 0 \
        --budget 30 --started-at 1500 [--note TEXT] [--metrics STEP.json]   # appends one line, flushed
    python tests/gpu/step_metrics.py junit FILE.xml [--flag NAME=SUBSTRING]...
                                          # {"passed", "failed", "errors", "skipped"[, NAME: bool]}
    python tests/gpu/step_metrics.py csv FILE COLUMN...           # those columns of the CSV's last row
    python tests/gpu/step_metrics.py csv-rows FILE KERNEL         # the actor bench rows of one attention kernel
    python tests/gpu/step_metrics.py attention-rows FILE          # the actor bench rows by packing, tokens, kernel
    python tests/gpu/step_metrics.py targets TEXT                 # dapo_kernels.bench.targets' verdicts
    python tests/gpu/step_metrics.py needs RESULTS STEP[.METRIC],...  # exit 0 if met, else 1 and why
    python tests/gpu/step_metrics.py h200-targets OUT             # issue 49's targets from a call's OUT

Standard library only: it runs before the carried wheels are installed, and in the CPU tests of the runner.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from h200_targets import judge_out_dir


def _number(text: str):
    try:
        value = float(text)
    except (TypeError, ValueError):
        return text
    return int(value) if value.is_integer() and "." not in text else value


def read_metrics(path: str) -> tuple[dict, str]:
    """(the step's metrics object, a note when its file is missing or not one JSON object)."""
    if not path or not Path(path).is_file():
        return {}, ""
    try:
        value = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:  # a step cut off while writing it
        return {}, f"metrics file {path} is not JSON ({err})"
    return (value, "") if isinstance(value, dict) else ({}, f"metrics file {path} holds a {type(value).__name__}")


def record(args: argparse.Namespace) -> int:
    metrics, problem = read_metrics(args.metrics)
    line = {
        "call": args.call,
        "step": args.step,
        "status": args.status,
        "seconds": round(args.seconds, 3),
        "rc": args.rc,
        "budget_s": args.budget,
        "started_at_s": round(args.started_at / 1000, 3),
        "metrics": metrics,
    }
    note = "; ".join(n for n in (args.note, problem) if n)
    if note:
        line["note"] = note
    with open(args.results, "a") as fh:  # on disk before the next step starts
        fh.write(json.dumps(line) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return 0


def junit(path: str, flags: dict[str, str] | None = None) -> dict:
    """pytest's counts; per flag NAME -> SUBSTRING, NAME: true when at least one test whose name holds
    SUBSTRING ran and every such test passed (a step's later steps can need it: plan.tsv's needs)."""
    flags = flags or {}
    if not Path(path).is_file():
        return {"junit": "missing", **dict.fromkeys(flags, False)}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    out: dict = {
        "passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
        "failed": total["failures"],
        "errors": total["errors"],
        "skipped": total["skipped"],
    }
    cases = list(root.iter("testcase"))
    for name, part in flags.items():
        chosen = [c for c in cases if part in c.get("name", "")]
        bad = ("failure", "error", "skipped")
        out[name] = bool(chosen) and not any(c.find(tag) is not None for c in chosen for tag in bad)
    return out


def needs(results: str, spec: str) -> tuple[bool, str]:
    """(met, why not): each comma-separated STEP (ended ok earlier in this call) or STEP.METRIC (its metrics
    hold METRIC = true) against the call's results.jsonl; the last line of a step counts."""
    lines = []
    if Path(results).is_file():
        lines = [json.loads(line) for line in Path(results).read_text().splitlines() if line.strip()]
    last = {r.get("step"): r for r in lines}
    for need in (n for n in spec.split(",") if n):
        step, _, metric = need.partition(".")
        row = last.get(step)
        if row is None:
            return False, f"needs {need}: {step} has not run earlier in this call"
        if not metric and row.get("status") != "ok":
            return False, f"needs {need}: {step} ended {row.get('status')}"
        if metric and row.get("metrics", {}).get(metric) is not True:
            got = row.get("metrics", {}).get(metric, "absent")
            return False, f"needs {need}: {step} ended {row.get('status')} with {metric}={json.dumps(got)}"
    return True, ""


def csv_last_row(path: str, columns: list[str]) -> dict:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        return {}
    return {c: _number(rows[-1].get(c, "")) for c in columns}


def csv_rows(path: str, kernel: str) -> dict:
    """{"<tokens>": {step_s_p50, tokens_per_s, mfu, peak_mem_gib, status}} of one attention kernel's rows."""
    with open(path, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("attention_kernel") == kernel]
    keys = ("status", "step_s_p50", "tokens_per_s", "mfu", "peak_mem_gib", "recompute")
    return {r["tokens_per_micro_batch"]: {k: _number(r.get(k, "")) for k in keys} for r in rows}


def attention_rows(path: str) -> dict:
    """{"<packing>_<tokens>_<kernel>": {status, step_s_p50, tokens_per_s, tflops_per_gpu, mfu, host_syncs,
    peak_mem_gib}}: the attention rows (sdpa / flex / varlen side by side on one layout)."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    keys = ("status", "step_s_p50", "tokens_per_s", "tflops_per_gpu", "mfu", "host_syncs", "peak_mem_gib")
    return {
        f"{r.get('packing') or 'equal'}_{r['tokens_per_micro_batch']}_{r['attention_kernel']}": {
            k: _number(r.get(k, "")) for k in keys
        }
        for r in rows
    }


def targets(path: str) -> dict:
    """{"T1": "PASS", ...} from the text of `python -m dapo_kernels.bench.targets`."""
    out = {}
    for line in Path(path).read_text().splitlines():
        for status in ("PASS", "FAIL", "NOT MEASURED"):
            if line.startswith(status) and " T" in line:
                out[line[len(status) :].split()[0]] = status
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "needs" and len(rest) == 2:
        met, why = needs(rest[0], rest[1])
        print(why or f"needs {rest[1]}: met")
        return 0 if met else 1
    if command == "h200-targets" and len(rest) == 1:
        text, _ = judge_out_dir(Path(rest[0]))
        print(text)
        return 0
    if command == "junit" and rest:
        ap = argparse.ArgumentParser(prog="step_metrics.py junit")
        ap.add_argument("xml")
        ap.add_argument("--flag", action="append", default=[], help="NAME=SUBSTRING")
        args = ap.parse_args(rest)
        flags = dict(f.split("=", 1) for f in args.flag)
        print(json.dumps(junit(args.xml, flags)))
        return 0
    if command == "record":
        ap = argparse.ArgumentParser(prog="step_metrics.py record")
        ap.add_argument("results")
        ap.add_argument("--call", type=int, required=True)
        ap.add_argument("--step", required=True)
        ap.add_argument("--status", choices=["ok", "failed", "timeout", "skipped"], required=True)
        ap.add_argument("--seconds", type=float, required=True)
        ap.add_argument("--rc", type=int, required=True)
        ap.add_argument("--budget", type=int, required=True)
        ap.add_argument("--started-at", type=int, required=True, help="milliseconds since the call started")
        ap.add_argument("--note", default="")
        ap.add_argument("--metrics", default="")
        return record(ap.parse_args(rest))
    handlers = {
        "csv": lambda: csv_last_row(rest[0], rest[1:]),
        "csv-rows": lambda: csv_rows(rest[0], rest[1]),
        "attention-rows": lambda: attention_rows(rest[0]),
        "targets": lambda: targets(rest[0]),
    }
    if command not in handlers or not rest:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(handlers[command]()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
