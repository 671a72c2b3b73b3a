"""When the loop evaluates: step 0 (the curve's starting point, a fresh run only), every
trainer.eval_every updates and the run's last step (trainer.total_steps, also after --resume: a run's
summary is the trained policy's score, never an older step's); none with eval_every 0. The driver's
eval with the fault policy around it (an engine lost during an eval costs the eval, never the step:
trainer/recovery.py).

    evaluator = Evaluator(faults, eval_every=cfg.trainer.eval_every)
    if evaluator.should_evaluate(step + 1, last=step + 1 == total_steps):
        log.update(evaluator.evaluate(step + 1))   # every rank (a re-sync may be needed); scores on the driver
"""

from __future__ import annotations

from dapo_megatron.trainer.recovery import FaultPolicy


class Evaluator:
    def __init__(self, faults: FaultPolicy, *, eval_every: int) -> None:
        self.faults = faults
        self.eval_every = eval_every  # 0 = never

    def should_evaluate(self, updates: int, *, last: bool = False) -> bool:
        """last: `updates` is the run's last step (evaluated whatever eval_every, unless evals are off)."""
        return bool(self.eval_every) and (updates % self.eval_every == 0 or last)

    def evaluate(self, updates: int) -> dict[str, float]:
        """The eval of the weights after `updates` updates: its scores on the driver, {} elsewhere."""
        return self.faults.around_eval(updates=updates)
