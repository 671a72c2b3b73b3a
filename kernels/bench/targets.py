"""Issue 27's targets judged from a kernels.csv written by `dapo-megatron bench kernels` on a GPU.

    python -m dapo_kernels.bench.targets results/kernels.csv        # exit 0 only if every target holds
    python -m dapo_kernels.bench.targets results/kernels.csv --device "NVIDIA H100 80GB HBM3"

The targets (docs/benchmarks.md, "Kernel targets"):
  T1  LM head, per shape of the table and per mode (fwd, fwd_bwd): the best of our providers has at
      least Liger's TFLOP/s;
  T2  LM head, fwd_bwd at 32B (H=5120), tp1, N=65536: >= 650 TFLOP/s;
  T3  LM head, fwd_bwd, per shape: that provider's peak extra memory (entropy included) <= Liger's;
  T4  policy loss, the fused call (it writes the gradient) at T=16777216: >= 70% of the device copy
      bandwidth measured in the same run;
  T5  policy loss, the fused call at T=65536 (one micro-batch): p50 <= 0.040 ms.
Each target says PASS, FAIL (with the numbers) or NOT MEASURED (its rows are not in the CSV: a
--quick run covers the 7B rows only). A provider that wins T1 everywhere and T3 everywhere is named
as the candidate default. Only rows of one device are judged (the newest date's when --device is not
given), the newest row per (provider, mode, metric, shape).
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass, field
from pathlib import Path

OURS = ("fused", "fused_cublas", "fused_tma", "fused_rowchunk")
TFLOPS_32B_TP1_64K = 650.0
COPY_FRACTION = 0.70
LOSS_TOKENS_BANDWIDTH = 16777216
LOSS_TOKENS_LATENCY = 65536
LOSS_LATENCY_MS = 0.040
H_32B = 5120


@dataclass
class Verdict:
    target: str
    status: str = "NOT MEASURED"  # PASS | FAIL | NOT MEASURED
    lines: list[str] = field(default_factory=list)

    def check(self, ok: bool, line: str) -> None:
        """One judged row: any failing row fails the target."""
        self.status = "PASS" if ok and self.status != "FAIL" else "FAIL"
        self.lines.append(f"{'ok  ' if ok else 'FAIL'} {line}")


def read_rows(path: str | Path, device: str | None = None) -> tuple[str, dict]:
    """(device, {(kernel, provider, mode, metric, x): p50}) of one device; the last row of a key wins
    (the CSV is appended to, so later rows are newer)."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("device") and r["device"] != "cpu"]
    if device is None:
        if not rows:
            raise ValueError(f"{path}: no GPU rows (device column other than 'cpu')")
        device = max(rows, key=lambda r: r["date"])["device"]
    rows = [r for r in rows if r["device"] == device]
    if not rows:
        raise ValueError(f"{path}: no rows of device {device!r}")
    table = {}
    for r in rows:
        table[(r["kernel"], r["provider"], r["mode"], r["metric"], r["x"])] = r["p50"]
    return device, table


def _num(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None  # "oom" or missing


def _shape(x: str) -> dict[str, int]:
    return {k: int(v.removesuffix("MiB")) for k, v in (part.split("=") for part in x.split(","))}


def _lm(table: dict, provider: str, mode: str, metric: str, x: str) -> float | None:
    return _num(table.get(("linear_logprob_entropy", provider, mode, metric, x)))


def _ours(table: dict, mode: str, metric: str, x: str) -> dict[str, float]:
    """Our providers' measured values of one row (oom and missing rows left out)."""
    values = {p: _lm(table, p, mode, metric, x) for p in OURS}
    return {p: v for p, v in values.items() if v is not None}


def judge(table: dict) -> tuple[list[Verdict], str | None]:
    shapes = sorted(
        {k[4] for k in table if k[0] == "linear_logprob_entropy" and k[1] == "liger"},
        key=lambda x: tuple(_shape(x).values()),
    )
    t1 = Verdict("T1 TFLOP/s >= Liger")
    t2 = Verdict("T2 >= 650 TFLOP/s fwd_bwd 32B tp1 64K")
    t3 = Verdict("T3 fwd_bwd extra memory <= Liger")
    wins_all = dict.fromkeys(OURS, True)
    seen = dict.fromkeys(OURS, False)
    for x in shapes:
        for mode in ("fwd", "fwd_bwd"):
            liger, ours = _lm(table, "liger", mode, "tflops", x), _ours(table, mode, "tflops", x)
            if liger is None or not ours:
                continue
            best = max(ours, key=lambda p: ours[p])
            t1.check(ours[best] >= liger, f"{x} {mode}: {best} {ours[best]:.0f} vs liger {liger:.0f}")
            for p in OURS:
                seen[p] |= p in ours
                wins_all[p] &= p in ours and ours[p] >= liger
        liger_mem, mems = (
            _lm(table, "liger", "fwd_bwd", "peak_extra_mem", x),
            _ours(table, "fwd_bwd", "peak_extra_mem", x),
        )
        if liger_mem is not None and mems:
            best = min(mems, key=lambda p: mems[p])
            t3.check(mems[best] <= liger_mem, f"{x}: {best} {mems[best]:.2f} GB vs liger {liger_mem:.2f} GB")
            for p in OURS:
                wins_all[p] &= p in mems and mems[p] <= liger_mem
    for x in sorted({k[4] for k in table if k[0] == "linear_logprob_entropy"}):
        s = _shape(x)
        ours = _ours(table, "fwd_bwd", "tflops", x)
        if s.get("H") == H_32B and s.get("tp") == 1 and s.get("N") == 65536 and ours:
            best = max(ours, key=lambda p: ours[p])
            t2.check(
                ours[best] >= TFLOPS_32B_TP1_64K,
                f"{x}: {best} {ours[best]:.0f} TFLOP/s (target {TFLOPS_32B_TP1_64K:.0f})",
            )
    candidate = next((p for p in OURS if seen[p] and wins_all[p]), None) if t1.lines else None
    return [t1, t2, t3, *_loss_targets(table)], candidate


def _loss(table: dict, mode: str, metric: str, tokens: int) -> float | None:
    return _num(table.get(("policy_loss", "fused", mode, metric, f"T={tokens}")))


def _loss_targets(table: dict) -> list[Verdict]:
    t4 = Verdict(f"T4 policy loss >= {COPY_FRACTION:.0%} of copy at {LOSS_TOKENS_BANDWIDTH} tokens")
    t5 = Verdict(f"T5 policy loss <= {LOSS_LATENCY_MS * 1e3:.0f} us at {LOSS_TOKENS_LATENCY} tokens")
    pct = _loss(table, "fwd", "pct_of_copy", LOSS_TOKENS_BANDWIDTH)
    if pct is not None:
        t4.check(pct >= 100 * COPY_FRACTION, f"fused fwd (gradient written): {pct:.0f}% of copy")
        bwd = _loss(table, "fwd_bwd", "pct_of_copy", LOSS_TOKENS_BANDWIDTH)
        if bwd is not None:
            t4.lines.append(f"(not judged) fused fwd_bwd, with the backward's multiply: {bwd:.0f}% of copy")
    ms = _loss(table, "fwd", "ms", LOSS_TOKENS_LATENCY)
    if ms is not None:
        t5.check(ms <= LOSS_LATENCY_MS, f"fused fwd: {ms * 1e3:.1f} us")
        bwd = _loss(table, "fwd_bwd", "ms", LOSS_TOKENS_LATENCY)
        if bwd is not None:
            t5.lines.append(f"(not judged) fused fwd_bwd: {bwd * 1e3:.1f} us")
    return [t4, t5]


def report(path: str | Path, device: str | None = None) -> tuple[str, bool]:
    """(text, every target measured and passing)."""
    device, table = read_rows(path, device)
    verdicts, candidate = judge(table)
    out = [f"issue 27 targets from {path} ({device})"]
    for v in verdicts:
        out.append(f"{v.status:12s} {v.target}")
        out.extend(f"    {line}" for line in v.lines)
    out.append(f"candidate default (wins T1 and T3 on every measured shape): {candidate or 'none'}")
    return "\n".join(out), all(v.status == "PASS" for v in verdicts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="kernels.csv from `dapo-megatron bench kernels`")
    parser.add_argument("--device", default=None, help="judge this device's rows (default: the newest row's)")
    args = parser.parse_args(argv)
    text, ok = report(args.csv, args.device)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
