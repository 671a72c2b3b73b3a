"""Shared benchmark plumbing: CUDA-event timing (median, p20, p80), peak extra memory, the bf16
matmul and copy ceilings measured in the same run, and the results CSV.

CSV columns (one file for every kernel benchmark, appended to):
    kernel, provider, mode, metric, unit, x, p50, p20, p80, device, date
"""

from __future__ import annotations

import csv
import datetime as _dt
import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

CSV_FIELDS = ("kernel", "provider", "mode", "metric", "unit", "x", "p50", "p20", "p80", "device", "date")
# relative to where the benchmark runs (`dapo-megatron bench kernels --results-dir DIR` names another):
# results never land in the installed package or the checkout's source; docs/benchmarks.md holds the tables
DEFAULT_CSV = Path("results") / "kernels.csv"


def device_name() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(torch.cuda.current_device())


def today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """(p50, p20, p80) by linear interpolation; one value gives itself three times."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    cuts = statistics.quantiles(sorted(values), n=10, method="inclusive")  # deciles: cuts[1]=p20, cuts[7]=p80
    return statistics.median(values), cuts[1], cuts[7]


def time_calls(
    fn: Callable[[], object],
    *,
    repeats: int,
    warmup: int = 1,
    reset: Callable[[], None] | None = None,
    device: str = "cuda",
):
    """Milliseconds per call as (p50, p20, p80): one CUDA-event pair per call on a GPU (reset runs
    outside the timed region); on CPU (the interpreter dry run of the tests) a host clock."""
    for _ in range(warmup):
        if reset:
            reset()
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if reset:
            reset()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return quantiles(times)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class PeakMemory:
    """Peak bytes allocated above the level at entry (inputs, weights); None on CPU."""

    def __init__(self, device: str):
        self.device = device
        self.extra_bytes: int | None = None

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.extra_bytes = torch.cuda.max_memory_allocated() - self.base
        return False


def bf16_matmul_tflops(n: int, h: int, v: int, *, repeats: int, device: str = "cuda") -> float:
    """TFLOP/s of [n, h] @ [h, v] in bf16 (cuBLAS), the ceiling the fused kernel is compared with.
    Random inputs (zeros run faster), output in bf16."""
    a = torch.randn(n, h, device=device, dtype=torch.bfloat16)
    b = torch.randn(v, h, device=device, dtype=torch.bfloat16)
    try:
        p50, _, _ = time_calls(functools.partial(torch.matmul, a, b.t()), repeats=repeats, device=device)
    finally:
        del a, b
        if device == "cuda":
            torch.cuda.empty_cache()
    return 2.0 * n * h * v / (p50 * 1e-3) / 1e12


def copy_bandwidth_gbs(*, num_bytes: int = 2 << 30, repeats: int = 10, device: str = "cuda") -> float:
    """Device-to-device copy GB/s counting bytes read plus bytes written."""
    src = torch.randn(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    p50, _, _ = time_calls(functools.partial(dst.copy_, src), repeats=repeats, device=device)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return 2.0 * num_bytes / (p50 * 1e-3) / 1e9


class CsvWriter:
    """Collects rows, prints them as a table, appends them to the CSV."""

    def __init__(self, path: str | os.PathLike | None, kernel: str):
        self.path = Path(path) if path else DEFAULT_CSV
        self.kernel = kernel
        self.rows: list[dict] = []
        self.device, self.date = device_name(), today()

    def add(self, provider: str, mode: str, metric: str, unit: str, x: str, p50, p20=None, p80=None):
        fmt = lambda v: "" if v is None else (v if isinstance(v, str) else f"{v:.6g}")  # noqa: E731
        self.rows.append(
            {
                "kernel": self.kernel,
                "provider": provider,
                "mode": mode,
                "metric": metric,
                "unit": unit,
                "x": x,
                "p50": fmt(p50),
                "p20": fmt(p20 if p20 is not None else p50 if isinstance(p50, str) else None),
                "p80": fmt(p80 if p80 is not None else p50 if isinstance(p50, str) else None),
                "device": self.device,
                "date": self.date,
            }
        )

    def flush(self) -> None:
        if not self.rows:
            return
        new = not self.path.exists() or self.path.stat().st_size == 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(self.rows)
        print(f"appended {len(self.rows)} rows to {self.path}")
        self.rows = []


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
