"""The step timeline of a run (phase start/end stamps from the driver); `dapo-megatron bench overlap`
(benchmarks/overlap.py) runs the embedded task at two staleness values and reads it.

    timeline = Timeline(run_dir)                   # the driver's: each stamp appended to timeline.jsonl as it comes
    timeline.append(("train", 3, start, end))      # O(1) memory however long the run (nothing kept but the file)
    timeline.close()                               # timeline.jsonl in seconds from the first stamp, and timeline.png
    write_timeline(stamps, run_dir)                # the same two files from a list of stamps
    hidden_fraction(timeline)                      # share of the shorter of generation / training hidden

Phases (trainer/driver.py, rollout/async_rollout.py): "generate" (the engines' work on a step's batch: the
sampler's collect, from its first request to its last reply), "wait" (the trainer blocked on a batch
that is still generating; staleness >= 1 only), "train" (driver rank from the batch in hand to the
weight push: scatter, log-probs, updates), "sync" (the weight push), "paused" (generation paused
around a push), "eval" (the held-out evaluation between two steps, labelled with the next step). Those are time.time()
of the driver process, the one that talks to the engines.
"engine" is stamped by the engines themselves: the union of the spans in which they worked on the
batch's requests (request_received_ts .. + e2e_latency of every reply, rollout/sampler.py:
engine_span), in their epoch clock (the same host's on one machine; NTP-synchronised across nodes).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from dapo_megatron.rollout.async_rollout import _union, engine_phases  # noqa: F401 (re-exported)

TRAINER_PHASES = ("train", "sync")
COLORS = {
    "engine": "tab:red",
    "generate": "tab:orange",
    "wait": "tab:gray",
    "train": "tab:blue",
    "sync": "tab:green",
    "eval": "tab:purple",
}
LANES = ("engine", "generate", "wait", "train", "sync", "eval")  # top to bottom


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
    return {
        "generate_s": _length(gen),
        "train_s": _length(trn),
        "overlap_s": overlap,
        "hidden_fraction": hidden,
        "engine_s": _length(eng),
        "engine_overlap_s": engine_overlap,
        "engine_hidden_fraction": engine_hidden,
    }


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


Stamp = tuple[str, int, float, float]  # (phase, step, start, end), time.time() of the driver (or the engines)


class Timeline:
    """The run's phase stamps, streamed to <run_dir>/timeline.jsonl as they come (epoch seconds while the
    run lives), so that the driver's memory does not grow with the run's length; close() rewrites the
    file in seconds from the first stamp (write_timeline's format) and draws timeline.png from it.
    append/extend are called from the driver's thread and the overlapped rollout's (rollout/async_rollout.py)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "timeline.jsonl"
        self.count = 0  # stamps written
        self._closed = False
        self._file: IO[str] | None = None  # opened with the first stamp: a run that stamps nothing writes nothing
        self._lock = threading.Lock()

    def append(self, stamp: Stamp) -> None:
        self.extend((stamp,))

    def extend(self, stamps: Iterable[Stamp]) -> None:
        stamps = list(stamps)
        if not stamps:
            return
        with self._lock:
            if self._closed:
                return  # a stamp of the producer thread after close: the file is final
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("w")  # this process's stamps (a resumed run starts a new file)
            for phase, step, start, end in stamps:
                self._file.write(json.dumps({"phase": phase, "step": step, "start": start, "end": end}) + "\n")
            self._file.flush()  # a run that dies keeps what it stamped
            self.count += len(stamps)

    def close(self) -> Path | None:
        """timeline.jsonl in seconds from the first stamp, and timeline.png; None when nothing was stamped."""
        with self._lock:
            self._closed = True
            if self._file is None:
                return None
            self._file.close()
            self._file = None
        return write_timeline(read_timeline(self.path), self.path.parent)


def read_timeline(path: str | Path) -> list[tuple[str, int, float, float]]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [(r["phase"], int(r["step"]), float(r["start"]), float(r["end"])) for r in rows]


def plot_timeline(rows: list[dict], path: Path) -> list[str]:
    """One lane per phase on one time axis, each bar labelled with its step; returns the lanes drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [p for p in LANES if any(r["phase"] == p for r in rows)]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(lanes) + 1.2))
    span = max((r["end"] for r in rows), default=1.0) - min((r["start"] for r in rows), default=0.0)
    for y, lane in enumerate(lanes):
        for r in rows:
            if r["phase"] == lane:
                ax.barh(y, r["end"] - r["start"], left=r["start"], color=COLORS[lane], edgecolor="black", lw=0.3)
                # a label only where it fits (the engines' spans come in many small pieces)
                if lane in ("engine", "generate", "train", "eval") and r["end"] - r["start"] > 0.008 * span:
                    ax.text((r["start"] + r["end"]) / 2, y, str(r["step"]), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first stamp (driver's clock; the engine lane: the engines' own stamps)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return lanes
