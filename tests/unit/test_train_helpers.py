"""Pure helpers of the training loop: the per-step reduction of the updates, the phase clock.
(The mini-batch split: tests/unit/test_dataplane_batch.py; the DP-reduced entropy and mismatch:
tests/distributed/test_dataplane_scatter.py.)"""

from dapo_megatron.trainer.step_metrics import Clock, reduce_updates


def test_reduce_updates_means_sums_and_maxima():
    a = {"loss": 1.0, "grad_norm": 2.0, "ratio_max": 1.5, "num_tokens": 10.0, "nonfinite": 0.0, "update_skipped": 0.0}
    b = {"loss": 3.0, "grad_norm": 6.0, "ratio_max": 1.2, "num_tokens": 30.0, "nonfinite": 1.0, "update_skipped": 1.0}
    out = reduce_updates([a, b])
    assert out["actor/loss"] == 2.0 and out["actor/grad_norm"] == 4.0  # means
    assert out["actor/num_tokens"] == 40.0 and out["actor/nonfinite"] == 1.0  # sums
    assert out["actor/ratio_max"] == 1.5 and out["actor/grad_norm_max"] == 6.0  # maxima
    assert out["actor/num_updates"] == 2.0
    assert reduce_updates([]) == {"actor/num_updates": 0.0}  # a step with nothing kept


def test_clock_names_each_phase_and_the_whole_step():
    clock = Clock()
    clock.lap("gen")
    clock.lap("train")
    out = clock.metrics()
    assert set(out) == {"time/gen_s", "time/train_s", "time/step_s"}
    assert abs(out["time/step_s"] - out["time/gen_s"] - out["time/train_s"]) < 1e-9
