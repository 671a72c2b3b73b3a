"""A progress line for a long phase: count, rate and time left, redrawn in place in a terminal and one
plain line per interval otherwise (a Slurm log, logs/train.log, a pipe), so a long phase is never silent
and a log stays readable.

    line = ProgressLine("[train] model: warm start", total=1000, unit="steps")
    for step in range(1000):
        ...
        line.update(step + 1)          # a terminal: redrawn at most 10 times a second; a file: every 15 s
    line.close()                       # a terminal: the line erased (the phase's own closing line follows)

$DAPO_PROGRESS_INTERVAL_S sets the plain interval (seconds; 0: a line at every update).

The first plain line comes after `interval_s`, so a phase that is over sooner prints nothing more than it
did before. total=None: a count without an end known in advance (bytes a checkpoint load has read):
count, rate and time so far. ProgressLines: one line per label, for callbacks that report several
things in turn (each prompt file of a data check). ticking(): a thread updates a line from a count
the work does not report itself (bytes below a directory while megatron-core writes a checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

REDRAW_S = 0.1  # a terminal's redraws at most this often
INTERVAL_S = 15.0  # a plain line at most this often when the output is not a terminal
INTERVAL_ENV = "DAPO_PROGRESS_INTERVAL_S"  # another interval for plain output (a Slurm log: 60; a test: 0)


def plain_interval_s() -> float:
    """$DAPO_PROGRESS_INTERVAL_S, else INTERVAL_S; a bad value names the variable."""
    raw = os.environ.get(INTERVAL_ENV, "")
    try:
        value = float(raw) if raw else INTERVAL_S
    except ValueError:
        raise ValueError(f"${INTERVAL_ENV}={raw!r}: seconds between two progress lines, a number >= 0") from None
    if value < 0:
        raise ValueError(f"${INTERVAL_ENV}={raw!r}: seconds between two progress lines, a number >= 0")
    return value


def duration(seconds: float) -> str:
    """8 s, 2 min 05 s, 1 h 04 min."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def rate(per_s: float) -> str:
    """12.5/s, 41.3K/s, 2.1M/s: a data file's rows go by in thousands a second."""
    for scale, suffix in ((1e6, "M"), (1e3, "K")):
        if per_s >= scale:
            return f"{per_s / scale:.1f}{suffix}/s"
    return f"{per_s:.1f}/s"


class ProgressLine:
    def __init__(
        self,
        label: str,
        *,
        total: int | None,
        unit: str = "steps",
        out: TextIO | None = None,
        interval_s: float | None = None,
        clock=time.monotonic,
    ) -> None:
        """interval_s: between two plain lines (default: plain_interval_s())."""
        self.label, self.total, self.unit = label, total, unit
        self.out = out if out is not None else sys.stdout
        self.terminal = bool(getattr(self.out, "isatty", lambda: False)())
        self.interval_s = plain_interval_s() if interval_s is None else interval_s
        self._clock = clock
        self._start = self._last = clock()
        self._drawn = False

    def text(self, done: int) -> str:
        elapsed = self._clock() - self._start
        per_s = done / elapsed if elapsed > 0 else 0.0
        if self.total is None:
            return f"{self.label} {done} {self.unit} ({rate(per_s)}, {duration(elapsed)})"
        left = f", {duration((self.total - done) / per_s)} left" if per_s > 0 and done < self.total else ""
        return f"{self.label} {done}/{self.total} {self.unit} ({rate(per_s)}, {duration(elapsed)}{left})"

    def update(self, done: int) -> None:
        now = self._clock()
        if now - self._last < (REDRAW_S if self.terminal else self.interval_s):
            return
        self._last = now
        if self.terminal:
            self.out.write("\r\x1b[K" + self.text(done))
            self._drawn = True
        else:
            self.out.write(self.text(done) + "\n")
        self.out.flush()

    def close(self) -> None:
        """Erase a terminal's line (the phase's closing line takes its place); nothing for plain output."""
        if self._drawn:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._drawn = False


class ProgressLines:
    """`(label, done, total)` callbacks drawn as one ProgressLine per label ("<prefix> <label>:"), each
    closed when done reaches total: the data check's files, one after the other."""

    def __init__(self, prefix: str, *, unit: str, out: TextIO | None = None, interval_s: float | None = None) -> None:
        self.prefix, self.unit, self.out, self.interval_s = prefix, unit, out, interval_s
        self._lines: dict[str, ProgressLine] = {}

    def __call__(self, label: str, done: int, total: int) -> None:
        line = self._lines.get(label)
        if line is None:
            line = self._lines[label] = ProgressLine(
                f"{self.prefix} {label}:", total=total, unit=self.unit, out=self.out, interval_s=self.interval_s
            )
        line.update(done)
        if done >= total:
            line.close()


@contextlib.contextmanager
def ticking(line: ProgressLine, count: Callable[[], int]) -> Iterator[None]:
    """Update `line` with `count()` from a thread while the block runs, for work that reports nothing
    itself. count() is asked once a second in a terminal and once per interval otherwise (a directory's
    size on a parallel file system is not free); the line is closed when the block ends."""
    stop = threading.Event()
    every_s = 1.0 if line.terminal else max(line.interval_s, 0.1)

    def tick() -> None:
        while not stop.wait(every_s):
            try:
                line.update(count())
            except OSError:  # a file gone while it was counted (a rename): the next tick counts again
                continue

    thread = threading.Thread(target=tick, name="progress-line", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        line.close()
