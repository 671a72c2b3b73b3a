"""The actor under virtual pipeline stages (PP=2 x VPP=2: each rank holds two chunks of one layer of a
4-layer tiny Qwen2, run by megatron's interleaved schedule), on gloo ranks, fp32.

What must hold, and why it could fail:
- the interleaved schedule takes micro-batches in whole groups of pp (a count of 3 is refused by megatron),
  so the actor plans a multiple of pp, padding with an empty micro-batch where a rank has too few sequences;
- one train step gives the float64 step's loss, grad norm and updated weights within the fp32 bounds of
  the layout-parity tests (tests/helpers_fp32.py). It failed before the fix in actor/model.py
  (_pipeline_p2p_kwargs): at PP=2 the interleaved schedule sends an activation forward and a gradient
  backward to the same peer in one call, and megatron's batched p2p matched them crossed (loss 1.444 for
  0.285, ratio_max 47); the forward-only log-probs were right all along, so only a train step shows it;
- a rank with fewer sequences than pp trains on an empty (padding-only) micro-batch too (1 sequence on 2
  ranks, 3 over DP=2): the same bounds; it failed before (the loss read the empty micro-batch's old
  log-probs, which it has none of, and the other stage then hung in the pipeline exchange);
- with DP=2 on top (4 ranks: PP=2 x VPP=2 x DP=2), the same; the log-probs and entropies of every token
  are the float64 transformers model's within their fp32 bounds.
Checkpoints under VPP moving to and from other layouts: tests/distributed/test_actor_reshard.py."""

import functools

import pytest
import torch

from helpers_actor import STEP, fill_rl_fields, hf_logprobs, make_cfg, make_samples
from helpers_fp32 import adam_first_step, adam_weight_bounds, check_weights, reference_step, token_bounds


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return str(save_tiny_hf(tmp_path_factory.mktemp("qwen4"), arch="qwen2", tied=False, num_layers=4))


@functools.cache
def _reference(tiny4_dir, num_samples=10):
    """The samples, the float64 step on them with its fp32 bounds, and the float64 weights after one Adam
    update with their per-entry bounds (as test_actor_train.py's layout tests)."""
    from safetensors.torch import load_file

    samples = make_samples(num_samples, seed=5)
    logps, _ = hf_logprobs(tiny4_dir, samples)
    samples = fill_rl_fields(samples, logps, seed=2)
    ref = reference_step(tiny4_dir, samples)
    before = load_file(f"{tiny4_dir}/model.safetensors")
    after = adam_first_step(before, ref.exact.grads, **STEP)
    bounds = adam_weight_bounds(ref, before, lr=STEP["lr"], eps=STEP["eps"], grad_clip=STEP["grad_clip"])
    return samples, ref, before, after, bounds


def _step_rank(hf_dir, samples, vpp):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(pp=2, vpp=vpp, seed=7) as layout:
        cfg = make_cfg(pp=2, vpp=vpp, micro_batch_tokens=40, lr=1e-3, warmup_steps=0)
        actor = Actor(actor_settings(cfg), hf_dir, layout)
        for group in actor.optimizer.param_groups:
            group["eps"] = STEP["eps"]  # test_actor_train.py says why
        gathered = actor.logprobs(samples)  # every sample on every rank
        logprobs = (gathered.logprobs, gathered.entropies)
        metrics = actor.train(samples, step=0)
        weights = {k: v.clone() for k, v in actor.iter_hf_weights()}
        actor.close()
    return metrics, weights, logprobs


@pytest.mark.parametrize(
    "world,num_samples",
    [(2, 10), (4, 10), (2, 1), (4, 3)],
    # one sequence in two micro-batches; 3 over DP=2: the rank with one has an empty micro-batch
    ids=["pp2-vpp2", "pp2-vpp2-dp2", "an-empty-micro-batch", "an-empty-micro-batch-dp2"],
)
def test_an_interleaved_pipeline_step_is_the_float64_step(rank_pool, tiny4_dir, world, num_samples):
    samples, ref, before, after, bounds = _reference(tiny4_dir, num_samples)
    tokens = token_bounds(tiny4_dir, samples)
    results = rank_pool(world).run(_step_rank, tiny4_dir, samples, 2)
    worst = 0.0
    for metrics, weights, logprobs in results:
        assert metrics["update_skipped"] == 0
        assert metrics["num_micro_batches"] % 2 == 0  # whole groups of pp for the interleaved schedule
        worst = max(
            worst,
            ref.check_loss(metrics["loss"], f"world {world}"),
            ref.check_grad_norm(metrics["grad_norm"], f"world {world}"),
            check_weights(weights, after, bounds, f"world {world}"),
        )
        worst = max(worst, tokens.check(*logprobs, f"world {world}"))
        assert metrics["num_tokens"] == sum(sum(s.response_mask()) for s in samples)
    assert all(torch.equal(results[0][1][n], r[1][n]) for r in results for n in after)  # one model on every rank
    moved = max(float((w - before[name].double()).abs().max()) for name, w in after.items())
    assert moved > 5e-4  # ~lr = 1e-3: a crossed activation moves the weights far beyond the bounds
    print(f"PP=2 x VPP=2 on {world} ranks: worst error / fp32 bound {worst:.2f}")
