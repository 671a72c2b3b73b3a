"""<run_dir>/logs/train.log: the console's text, kept in the run directory and appended across resumes.

    console_log.start(run_dir, header="dapo-megatron train configs/runs/tiny_cpu.yaml")   # the launcher
    console_log.start(run_dir)                                                             # the driver rank

Both the local launcher (its phase lines, the closing summary, an error's line) and the driver rank (the
step table, evals, checkpoints) copy what they write to sys.stdout and sys.stderr into the same file,
each line whole (O_APPEND: two processes' lines never mix within a line); under Slurm the driver rank's
lines are there too. The terminal still gets everything unchanged (isatty() is the terminal's, so
progress bars still draw there); the file gets each line once: a progress bar's redraws (carriage
returns, cursor moves) keep only their last state, and a bar erased at its end leaves nothing.
A second start in one process (the launcher after a resume decision) is a no-op.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import threading
from pathlib import Path
from typing import TextIO

LOG_FILE = Path("logs") / "train.log"
HEADER_MARK = "====="  # a start's first line: `===== <UTC time> <command> (pid N) =====`
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours, cursor moves and line clears of progress bars
_started: list[_LineSink] = []


def log_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOG_FILE


class _LineSink:
    """Whole lines to the log file, a progress bar's redraws reduced to their last state."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            self._pending += text
            if "\n" not in self._pending:
                return
            *lines, self._pending = self._pending.split("\n")
            kept = [_last_state(line) for line in lines]
            out = "".join(line + "\n" for line in kept if line is not None)
            if out:
                os.write(self._fd, out.encode("utf-8", "replace"))


def _last_state(line: str) -> str | None:
    """What a terminal would show of the line; None for a progress bar that erased itself."""
    redrawn = "\r" in line or "\x1b[" in line
    shown = _ANSI.sub("", line).rsplit("\r", 1)[-1]
    return None if redrawn and not shown.strip() else shown


class _Tee:
    """A text stream that also copies what it is given to a _LineSink; everything else is the stream's."""

    def __init__(self, stream: TextIO, sink: _LineSink) -> None:
        self._stream = stream
        self._sink = sink

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        self._sink.write(text)
        return written

    def __getattr__(self, name: str) -> object:  # flush, isatty, fileno, encoding, ...: the stream's
        return getattr(self._stream, name)


def start(run_dir: str | Path, *, header: str = "") -> Path:
    """From now on this process's stdout and stderr are copied to <run_dir>/logs/train.log (appended);
    header: one dated line first (the command that started, so a resume is visible in the file)."""
    path = log_path(run_dir)
    if _started:
        return path
    sink = _LineSink(path)
    _started.append(sink)
    if header:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        sink.write(f"{HEADER_MARK} {now} {header} (pid {os.getpid()}) {HEADER_MARK}\n")
    sys.stdout = _Tee(sys.stdout, sink)
    sys.stderr = _Tee(sys.stderr, sink)
    return path
