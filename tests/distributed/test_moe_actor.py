"""The Actor on a tiny Qwen3-MoE (gloo ranks, fp32): log-probs equal transformers' at EP=2 and at
TP=2 x EP=2 (ETP=1, sequence parallel), and one DAPO update at EP=2 (each rank holds half the
experts, tokens cross ranks through the all-to-all) moves every weight exactly as at EP=1 (experts
replicated), as does one at TP=2 x EP=2."""

from __future__ import annotations

import pytest
import torch

from helpers_actor import STEP, fill_rl_fields, hf_logprobs, make_samples, moe_cfg
from helpers_fp32 import adam_first_step, adam_weight_bounds, check_weights, reference_step


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return str(save_tiny_hf(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", num_layers=2, seed=6))


def logprobs_on_rank(hf_dir, samples, tp, ep, etp):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(tp=tp, ep=ep, etp=etp, seed=7) as layout:
        actor = Actor(actor_settings(moe_cfg(tp=tp, ep=ep, etp=etp)), hf_dir, layout)
        return actor.logprobs(samples).logprobs


@pytest.mark.parametrize("tp,ep,etp", [(1, 2, None), (2, 2, 1)])
def test_moe_actor_logprobs_match_transformers(rank_pool, moe_dir, tp, ep, etp):
    samples = make_samples(7, seed=1)
    want, _ = hf_logprobs(moe_dir, samples)
    first, second = rank_pool(2).run(logprobs_on_rank, moe_dir, samples, tp, ep, etp)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert max(float((a - b).abs().max()) for a, b in zip(first, want)) <= 1e-5


def updated_weights_on_rank(hf_dir, samples, tp, ep, etp):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(tp=tp, ep=ep, etp=etp, seed=7) as layout:
        actor = Actor(
            actor_settings(moe_cfg(tp=tp, ep=ep, etp=etp, micro_batch_tokens=40, lr=1e-3, warmup_steps=0)),
            hf_dir,
            layout,
        )
        for group in actor.optimizer.param_groups:
            group["eps"] = 1e-4  # see test_actor_train: bounds Adam's amplification of rounding at g ~ 0
        metrics = actor.train(samples, step=0)
        weights = {k: v.clone() for k, v in actor.iter_hf_weights()}
    return metrics, weights


def test_train_step_at_ep2_equals_ep1(rank_pool, moe_dir):
    """EP=1, EP=2 and TP=2 x EP=2: each within fp32 rounding of the float64 step on the transformers
    Qwen3-MoE (tests/helpers_fp32.py), so within twice that of each other."""
    from safetensors.torch import load_file

    samples = make_samples(10, seed=5)
    logps, _ = hf_logprobs(moe_dir, samples)
    samples = fill_rl_fields(samples, logps, seed=2)
    ref = reference_step(moe_dir, samples)
    before = load_file(f"{moe_dir}/model.safetensors")
    after = adam_first_step(before, ref.exact.grads, **STEP)
    bounds = adam_weight_bounds(ref, before, lr=STEP["lr"], eps=STEP["eps"], grad_clip=STEP["grad_clip"])
    pool = rank_pool(2)
    worst = {}
    for label, layout in (("ep1", (1, 1, None)), ("ep2", (1, 2, None)), ("tp2-ep2", (2, 2, 1))):
        results = pool.run(updated_weights_on_rank, moe_dir, samples, *layout)
        for m, w in results:
            assert m["update_skipped"] == 0
            worst[label] = round(
                max(
                    ref.check_loss(m["loss"], label),
                    ref.check_grad_norm(m["grad_norm"], label),
                    check_weights(w, after, bounds, label),
                ),
                2,
            )
        assert all(torch.equal(results[0][1][name], results[1][1][name]) for name in after)
    print(f"moe step vs float64: worst error / fp32 bound {worst}")
    moved_experts = 0
    for name, w in after.items():
        if ".experts." in name:
            moved_experts += int(float((w - before[name].double()).abs().max()) > 5e-4)  # ~lr = 1e-3
    assert moved_experts >= 3 * 4  # gate, up and down of all 4 experts of the sparse layer moved
