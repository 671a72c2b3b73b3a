"""A sequence-level rollout correction (algo/rollout_correction.py: sequence-level truncated weight,
geometric rejection and the veto) on gloo ranks (fp32, tiny Qwen2): micro-batches x DP=2, and
micro-batches x DP=2 x CP=2 (every sequence cut in 4 chunks over 2 ranks), give the loss and gradient of
one big batch in float64 (transformers, one response at a time: tests/helpers_rollout_correction.py).
A per-shard sequence ratio (each CP rank summing only its chunks) would change which responses are
rejected and the weights of the others."""

import pytest
import torch

from helpers_actor import grads_rank
from helpers_fp32 import step_bounds
from helpers_rollout_correction import VETOED_SAMPLE, corrected_samples, hf_corrected_step, reference_factors

ALGO = dict(seq_is_cap=1.5, rejection="geometric", rejection_upper=1.2, veto_threshold=0.05)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return str(save_tiny_hf(tmp_path_factory.mktemp("qwen"), arch="qwen2", tied=False))


@pytest.mark.parametrize("world, cp, budget", [(2, 1, 22), (4, 2, 24)], ids=["dp2", "dp2-cp2"])
def test_sequence_level_correction_gives_the_big_batch_gradient(rank_pool, tiny_dir, world, cp, budget):
    samples = corrected_samples(tiny_dir)
    factors = reference_factors(samples, seq_is_cap=1.5, upper=1.2, lower=1 / 1.2, veto=0.05)
    # the case is not vacuous: responses rejected (geometric) or vetoed, kept at the cap, kept below it
    assert factors[VETOED_SAMPLE] == 0 and sum(f == 0 for f in factors) >= 3
    assert any(f == 1.5 for f in factors) and any(0 < f < 1.5 for f in factors)
    masked = sum(len(s.response_ids) for s, f in zip(samples, factors) if f == 0)
    ref = step_bounds(
        hf_corrected_step(tiny_dir, samples, dtype=torch.float32, factors=factors),
        hf_corrected_step(tiny_dir, samples, dtype=torch.float64, factors=factors),
    )
    results = rank_pool(world).run(grads_rank, tiny_dir, samples, budget, ALGO, cp)
    trained = sum(sum(s.response_mask()) for s in samples)
    for metrics, num_micro, grads in results:
        assert num_micro >= 2  # several micro-batches on every DP rank
        assert metrics["loss_denominator"] == trained  # masked responses stay in D
        masked_trained = sum(sum(s.response_mask()) for s, f in zip(samples, factors) if f == 0)
        assert metrics["correction_masked_frac"] == pytest.approx(masked_trained / trained, rel=1e-12)
        worst = max(ref.check_loss(metrics["loss"], f"cp={cp}"), ref.check_grads(grads, f"cp={cp}"))
    print(
        f"sequence-level correction world={world} cp={cp}: {sum(f == 0 for f in factors)} of 12 responses "
        f"({masked} tokens) masked; worst error / fp32 bound {worst:.2f}"
    )
