"""A step's timing and metrics, in one place: every phase's lap and every metric of trainer/train.py's
step goes through one StepRecord, so that the step itself reads as the algorithm.

    record = StepRecord()
    record.add(stats).lap("gen")                  # metrics, then the time since the last lap as time/gen_s
    log = record.finish(updates, batch=batch, driver=driver)   # + the updates' reduction, time/step_s, ...
"""

from __future__ import annotations

from collections.abc import Mapping

from dapo_megatron.trainer.step_metrics import Clock, reduce_updates


class StepRecord:
    def __init__(self) -> None:
        self.clock = Clock()
        self.log: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float] | None) -> StepRecord:
        if metrics:
            self.log.update(metrics)
        return self

    def lap(self, phase: str) -> StepRecord:
        self.clock.lap(phase)
        return self

    def finish(self, updates: list[dict[str, float]], *, batch=None, driver=None) -> dict[str, float]:
        """The step's metrics: the mini-batch updates reduced (means, sums of counts, maxima), the
        phases' seconds; on the driver also the training throughput, the batch's size and the engines'
        events (dropped / back / rejoined: console lines + counts)."""
        log = self.log
        log.update(reduce_updates(updates))
        log.setdefault("actor/entropy_old", 0.0)
        log.update(self.clock.metrics())
        if driver is not None:
            log["throughput/train_tok_s"] = batch.num_tokens / max(self.clock.laps.get("train", 0.0), 1e-9)
            log["dataplane/batch_mb"] = batch.nbytes() / 2**20
            log.update(driver.engine_events())
        return log
