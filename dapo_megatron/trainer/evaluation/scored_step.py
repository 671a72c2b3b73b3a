"""Which policy a summary's score is from: the step of its eval against the run's last trained step.

    note = score_note(eval_step=0, trained_step=last_trained_step(read_jsonl(run_dir / "metrics.jsonl")))
    # "warm start (step 0): not the trained policy"

Every run ends with an eval of its last step (trainer/evaluation/evaluator.py), so a summary row whose
eval is older than the run's last step (a run from before that rule, a missed eval, a run stopped early)
or is the warm start's says so, in the train summary, `ladder` and `gather --ladder`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def last_trained_step(records: Iterable[Mapping[str, object]]) -> int | None:
    """The last step a run trained: its metrics.jsonl's newest record with a step time; None: none logged."""
    steps = [int(str(r["step"])) for r in records if "time/step_s" in r]
    return max(steps) if steps else None


def score_note(*, eval_step: int, trained_step: int | None) -> str:
    """'' when the score is the trained policy's (the run's last step); else what the score is."""
    if eval_step < 0:
        return "not a run checkpoint (a HF model)"
    if eval_step == 0:
        return "warm start (step 0): not the trained policy"
    if trained_step is not None and eval_step < trained_step:
        return f"step {eval_step}, not the last trained step {trained_step}"
    return ""
