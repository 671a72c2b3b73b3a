"""A progress line for a long phase: count, rate and time left, redrawn in place in a terminal and one
plain line per interval otherwise (a Slurm log, logs/train.log, a pipe), so a long phase is never silent
and a log stays readable.

    line = ProgressLine("[train] model: warm start", total=1000, unit="steps")
    for step in range(1000):
        ...
        line.update(step + 1)          # a terminal: redrawn at most 10 times a second; a file: every 15 s
    line.close()                       # a terminal: the line erased (the phase's own closing line follows)

The first plain line comes after `interval_s`, so a phase that is over sooner prints nothing more than it
did before.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_S = 0.1  # a terminal's redraws at most this often
INTERVAL_S = 15.0  # a plain line at most this often when the output is not a terminal


def duration(seconds: float) -> str:
    """8 s, 2 min 05 s, 1 h 04 min."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


class ProgressLine:
    def __init__(
        self,
        label: str,
        *,
        total: int,
        unit: str = "steps",
        out: TextIO | None = None,
        interval_s: float = INTERVAL_S,
        clock=time.monotonic,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.out = out if out is not None else sys.stdout
        self.terminal = bool(getattr(self.out, "isatty", lambda: False)())
        self.interval_s = interval_s
        self._clock = clock
        self._start = self._last = clock()
        self._drawn = False

    def text(self, done: int) -> str:
        elapsed = self._clock() - self._start
        rate = done / elapsed if elapsed > 0 else 0.0
        left = f", {duration((self.total - done) / rate)} left" if rate > 0 and done < self.total else ""
        return f"{self.label} {done}/{self.total} {self.unit} ({rate:.1f}/s, {duration(elapsed)}{left})"

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
