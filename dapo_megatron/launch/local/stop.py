"""Ctrl-C and SIGTERM to a local `dapo-megatron train`: a stop request, as Slurm's preemption is.

    with LocalStop(run_dir / STOP_FILE) as stop:                  # while the actor ranks run
        rc = procs.run_foreground("actor", cmd, env={**stop.rank_env()})
    if stop.received: return stop.exit_code                       # 130 (SIGINT) / 143 (SIGTERM)

First signal: the launcher writes its name into the request file the ranks watch ($DAPO_PREEMPT_FILE,
trainer/preemption.py): every rank finishes the step in flight, they write its checkpoint together, the
driver prints "stopped at step N (SIGTERM): checkpoint ...; continue with --resume" and the ranks exit
0; then the launcher stops the engines as on any exit (launch/local/launcher.py) and exits 128 + the signal.
The ranks and engines run in sessions of their own, so a terminal's Ctrl-C reaches the launcher only.
Second signal: StopNow (a KeyboardInterrupt) is raised in the launcher: the ranks are killed at once,
the steps since the newest checkpoint are lost, and `stopped_at_once` says which.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TypeAlias

# what signal.signal takes and returns: a function, SIG_DFL / SIG_IGN, or None (a handler not set from Python)
SignalHandler: TypeAlias = Callable[[int, FrameType | None], object] | int | None

STOP_FILE = "stop_request"  # in the run directory: the ranks' $DAPO_PREEMPT_FILE


class StopNow(KeyboardInterrupt):
    """Stop without waiting for the step in flight (a second Ctrl-C, or a signal before the ranks run)."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


class LocalStop:
    def __init__(self, request_file: str | Path) -> None:
        self.request_file = Path(request_file)
        self.received: signal.Signals | None = None
        self._previous: dict[int, SignalHandler] = {}  # signal.signal's handlers

    def __enter__(self) -> LocalStop:
        self.request_file.unlink(missing_ok=True)  # an earlier run's request must not stop this one
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self.request_file.unlink(missing_ok=True)

    def rank_env(self) -> dict[str, str]:
        from dapo_megatron.trainer.preemption import PREEMPT_FILE_ENV

        return {PREEMPT_FILE_ENV: str(self.request_file)}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            raise StopNow(signum)
        self.received = signal.Signals(signum)
        self.request_file.write_text(self.received.name)
        print(
            f"[train] {self.received.name}: the step in flight finishes and is checkpointed, then the run stops "
            "(Ctrl-C again stops at once and loses the steps since the newest checkpoint)",
            file=sys.stderr,
            flush=True,
        )

    @property
    def exit_code(self) -> int:
        return 128 + int(self.received) if self.received is not None else 0


def stopped_at_once(stop: KeyboardInterrupt, run_dir: str | Path) -> int:
    """The one line for a stop that did not wait for a checkpoint, naming what is lost; the exit code."""
    from dapo_megatron.trainer.checkpoint.files import latest_checkpoint

    signum = stop.signum if isinstance(stop, StopNow) else int(signal.SIGINT)
    name = signal.Signals(signum).name
    newest = latest_checkpoint(run_dir)
    if newest is None:
        lost = "no checkpoint was written, so nothing of this run is kept"
    else:
        lost = f"the steps after {newest} are lost; continue from it with --resume"
    print(f"stopped at once ({name}): {lost}", file=sys.stderr, flush=True)
    return 128 + signum
