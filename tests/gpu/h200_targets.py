"""Issue 49's targets on the H200, judged from what a call of tests/gpu/run_all.sh wrote into its OUT folder.

    python tests/gpu/step_metrics.py h200-targets OUT      # run_all.sh --call N prints it at the call's end

Each target says PASS, FAIL (with the numbers) or NOT RUN (its step or rows are not in this OUT: another
call's, or cut off), so the same judge serves every call and a re-run on a fetched OUT here:
  e2e_colocated  the colocated tiny DAPO run learned (its step ended ok: e2e_learning.py's check);
  sync           the Qwen2.5-1.5B-shape colocated sync (colocated_sync.csv, GPU rows): p50 <= 0.3 s and
                 >= 10 GB/s, the read-back equal; its phases printed beside;
  attention_mfu  varlen on both layouts of attention_rows.csv (the 22,528-token document, the DAPO
                 packing): MFU >= 0.40 (sdpa's printed beside);
  lm_head        fused_tma (the provider, or the variants' tma0_* = its default tiles) >= Liger in TFLOP/s on
                 every row and mode both were timed on in one CSV (variants_logprob.csv, kernels.csv);
  lm_head_32b    32B (H 5120) tp 1 N 65,536 fwd_bwd: >= 650 TFLOP/s on the 8NHV count (6NHV printed beside);
  loss           the policy loss rows (kernel policy_loss, any CSV): the best candidate (torch excluded)
                 >= 80% of the copy bandwidth measured in the same run at 16M tokens fwd_bwd, and at 65,536
                 tokens <= 20 us fwd and <= 40 us fwd_bwd (CUDA events around the Python call).
The memory-bound target (loss) is a fraction of the copy measured on the device in the same run, never a
datasheet constant; the first line names the ceilings preflight measured in this call (copy, bf16 matmul),
and the sync's line its floor at that copy (the engine reads and writes every byte once).
Standard library only: it runs on the GPU machine before any wheel is installed.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

SYNC_MAX_S = 0.3
SYNC_MIN_GB_PER_S = 10.0
MFU_MIN = 0.40
TFLOPS_32B_MIN = 650.0
LOSS_COPY_FRACTION = 0.80
LOSS_BANDWIDTH_TOKENS = 16777216
LOSS_LATENCY_TOKENS = 65536
LOSS_FWD_MAX_US = 20.0
LOSS_FWD_BWD_MAX_US = 40.0


def _num(text) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _verdict(name: str, oks: list[bool], lines: list[str], not_run: str = "") -> str:
    if not oks:
        return f"NOT RUN  {name}: {not_run or 'no rows'}"
    head = f"{'PASS' if all(oks) else 'FAIL'}     {name}"
    return "\n".join([head, *(f"    {line}" for line in lines)])


def _results(out: Path) -> list[dict]:
    results = out / "results.jsonl"
    return [json.loads(x) for x in results.read_text().splitlines() if x.strip()] if results.is_file() else []


def ceilings(out: Path) -> dict:
    """{"gpu", "copy_gb_per_s", "matmul_bf16_tflops"} as preflight measured them in this call (those present)."""
    row = next((r for r in reversed(_results(out)) if r.get("step") == "preflight"), {})
    keys = ("gpu", "copy_gb_per_s", "matmul_bf16_tflops")
    return {k: row["metrics"][k] for k in keys if k in row.get("metrics", {})}


def _e2e(out: Path) -> str:
    row = next((r for r in reversed(_results(out)) if r.get("step") == "e2e_colocated"), None)
    if row is None or row.get("status") == "skipped":
        return _verdict("e2e_colocated learns", [], [], (row or {}).get("note", "not in this call"))
    gain = row.get("metrics", {})
    return _verdict("e2e_colocated learns", [row["status"] == "ok"], [f"{row['status']}, metrics {json.dumps(gain)}"])


def _sync(out: Path, copy_gb_per_s: float | None) -> str:
    path = out / "colocated_sync.csv"
    rows = [r for r in _rows(path) if not r.get("device", "").startswith("CPU")] if path.is_file() else []
    if not rows:
        return _verdict(f"sync <= {SYNC_MAX_S} s", [], [], "no GPU row in colocated_sync.csv")
    r = rows[-1]
    p50, gbs = _num(r.get("sync_s_p50")), _num(r.get("gb_per_s"))
    ok = p50 is not None and gbs is not None and p50 <= SYNC_MAX_S and gbs >= SYNC_MIN_GB_PER_S
    ok = ok and r.get("read_back") == "equal"
    phases = ", ".join(f"{k} {r.get(k)}" for k in ("export_s", "ipc_s", "engine_s", "session_s"))
    line = f"{r.get('bytes')} bytes: p50 {p50} s, {gbs} GB/s, read-back {r.get('read_back')} ({phases})"
    size = _num(r.get("bytes"))
    if copy_gb_per_s and size:
        line += f"; floor {2 * size / (copy_gb_per_s * 1e9) * 1e3:.1f} ms at this call's {copy_gb_per_s:.0f} GB/s copy"
    return _verdict(f"sync <= {SYNC_MAX_S} s and >= {SYNC_MIN_GB_PER_S:.0f} GB/s", [ok], [line])


def _attention(out: Path) -> str:
    path = out / "attention_rows.csv"
    rows = _rows(path) if path.is_file() else []
    oks, lines = [], []
    for layout in sorted({(r.get("packing") or "equal", r["tokens_per_micro_batch"]) for r in rows}):
        by_kernel = {
            r["attention_kernel"]: r
            for r in rows
            if ((r.get("packing") or "equal"), r["tokens_per_micro_batch"]) == layout
        }
        varlen = by_kernel.get("varlen")
        if varlen is None:
            continue
        mfu = _num(varlen.get("mfu"))
        oks.append(mfu is not None and mfu >= MFU_MIN)
        sdpa = by_kernel.get("sdpa", {}).get("mfu", "-")
        lines.append(
            f"{layout[0]} {layout[1]} tokens: varlen MFU {varlen.get('mfu') or varlen.get('status')} (sdpa {sdpa})"
        )
    return _verdict(f"varlen attention MFU >= {MFU_MIN}", oks, lines, "no varlen row in attention_rows.csv")


def _kernel_rows(out: Path) -> list[dict]:
    """Every kernel-bench row of every CSV in OUT, each tagged with its file (one CSV = one run)."""
    rows = []
    for path in sorted(out.glob("*.csv")):
        for r in _rows(path):
            if "kernel" in r and "provider" in r and r.get("device") not in (None, "", "cpu"):
                rows.append({**r, "file": path.name})
    return rows


def _is_fused_tma(provider: str) -> bool:
    return provider == "fused_tma" or provider.startswith("tma0_")


def _lm_head(rows: list[dict]) -> tuple[str, str]:
    lm = [r for r in rows if r["kernel"].startswith("linear_logprob_entropy") and r["metric"] == "tflops"]
    table: dict = {}
    for r in lm:  # the last row of a key wins (appended CSVs: later is newer)
        table[(r["file"], r["x"], r["mode"], r["provider"])] = _num(r["p50"])
    oks, lines, big_oks, big_lines = [], [], [], []
    for file, x, mode in sorted({k[:3] for k in table}):
        row = {p: v for (f, xx, m, p), v in table.items() if (f, xx, m) == (file, x, mode) and v is not None}
        tma = next((v for p, v in row.items() if _is_fused_tma(p)), None)
        if tma is not None and "liger" in row:
            oks.append(tma >= row["liger"])
            lines.append(f"{file} {x} {mode}: fused_tma {tma:.0f} vs liger {row['liger']:.0f} TFLOP/s")
        shape = dict(part.split("=", 1) for part in x.split(",") if "=" in part)
        if (shape.get("H"), shape.get("tp"), shape.get("N"), mode) == ("5120", "1", "65536", "fwd_bwd") and row:
            best = max((p for p in row if p not in ("liger", "cublas_bf16_matmul")), key=row.get, default=None)
            if best is not None:
                big_oks.append(row[best] >= TFLOPS_32B_MIN)
                big_lines.append(f"{file}: {best} {row[best]:.0f} TFLOP/s (8NHV), {row[best] * 6 / 8:.0f} on 6NHV")
    return (
        _verdict("LM head fused_tma >= Liger (same run)", oks, lines, "no fused_tma and liger rows side by side"),
        _verdict(f"LM head 32B tp1 N 65536 fwd_bwd >= {TFLOPS_32B_MIN:.0f} TFLOP/s", big_oks, big_lines),
    )


def _loss(rows: list[dict]) -> str:
    loss = [r for r in rows if r["kernel"] == "policy_loss" and r["provider"] != "torch"]
    table = {(r["file"], r["provider"], r["mode"], r["metric"], r["x"]): _num(r["p50"]) for r in loss}
    oks, lines = [], []
    for file in sorted({k[0] for k in table}):

        def best(mode: str, metric: str, tokens: int, pick, f=file) -> tuple[str, float] | None:
            got = {k[1]: v for k, v in table.items() if k[0] == f and k[2:] == (mode, metric, f"T={tokens}")}
            got = {p: v for p, v in got.items() if v is not None}
            return (pick(got, key=got.get), pick(got.values())) if got else None

        pct = best("fwd_bwd", "pct_of_copy", LOSS_BANDWIDTH_TOKENS, max)
        if pct:
            oks.append(pct[1] >= 100 * LOSS_COPY_FRACTION)
            lines.append(f"{file} {LOSS_BANDWIDTH_TOKENS} tokens fwd_bwd: {pct[0]} {pct[1]:.0f}% of the run's copy")
        for mode, limit in (("fwd", LOSS_FWD_MAX_US), ("fwd_bwd", LOSS_FWD_BWD_MAX_US)):
            ms = best(mode, "ms", LOSS_LATENCY_TOKENS, min)
            if ms:
                oks.append(ms[1] * 1e3 <= limit)
                lines.append(
                    f"{file} {LOSS_LATENCY_TOKENS} tokens {mode}: {ms[0]} {ms[1] * 1e3:.1f} us (<= {limit:.0f})"
                )
    name = f"policy loss >= {LOSS_COPY_FRACTION:.0%} of copy at 16M fwd_bwd, <= 20 / 40 us at 64K"
    return _verdict(name, oks, lines, "no policy_loss rows")


def judge_out_dir(out: Path) -> tuple[str, list[str]]:
    """(the report, one status word per target in order)."""
    rows = _kernel_rows(out)
    measured = ceilings(out)
    verdicts = [_e2e(out), _sync(out, measured.get("copy_gb_per_s")), _attention(out), *_lm_head(rows), _loss(rows)]
    statuses = [v.split()[0] + (" RUN" if v.startswith("NOT") else "") for v in verdicts]
    head = f"issue 49 targets (H200) from {out}; ceilings measured by preflight: {json.dumps(measured) or 'none'}"
    return "\n".join([head, *verdicts]), statuses
