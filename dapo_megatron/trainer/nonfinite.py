"""The non-finite guard: an update with a NaN/inf loss or grad norm is skipped
(actor/actor.py: actor/nonfinite=1); trainer.max_nonfinite_in_row of them in a row stop the run.

    guard = NonFiniteGuard(max_in_row=3, in_row=state.nonfinite_in_row, last_good=checkpointer.latest)
    guard.observe(log)          # counts the step; log["nonfinite_in_row"]
    guard.stop_if_exceeded()    # after the step is logged: RuntimeError naming the last good checkpoint
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


class NonFiniteGuard:
    def __init__(self, *, max_in_row: int, in_row: int = 0, last_good: Callable[[], Path | None]) -> None:
        self.max_in_row = max_in_row
        self.in_row = in_row  # carried by checkpoints (TrainerState.nonfinite_in_row)
        self.last_good = last_good

    def observe(self, log: dict[str, float]) -> None:
        self.in_row = self.in_row + 1 if log.get("actor/nonfinite") else 0
        log["nonfinite_in_row"] = float(self.in_row)

    def stop_if_exceeded(self) -> None:
        if self.in_row >= self.max_in_row:
            raise RuntimeError(
                f"{self.in_row} updates in a row had a NaN/inf loss or grad norm "
                f"(trainer.max_nonfinite_in_row={self.max_in_row}); stopping. "
                f"Last good checkpoint: {self.last_good()}"
            )
