"""Comparing two Actor train steps on gloo ranks (tests/distributed/test_actor_fused.py: fused kernels vs plain
torch; test_actor_head_loss.py: the one-pass head + loss vs the separate head and loss): the rank function
that runs Actor.logprobs + one step, the float64 references, and the assertion that both steps are within
fp32 rounding of the float64 step (tests/helpers_fp32.py) with every count equal."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from helpers_actor import STEP, gradients_before_the_step, make_cfg
from helpers_fp32 import (
    U32,
    StepBounds,
    TokenBounds,
    adam_first_step,
    adam_weight_bounds,
    check_weights,
    min_distance_to_clip_edges,
    reference_step,
    token_bounds,
)

STAT_KEYS = (
    "loss",
    "pg_loss",
    "kl_loss",
    "clipfrac_low",
    "clipfrac_high",
    "dualclip_frac",
    "approx_kl",
    "ratio_mean",
    "ratio_max",
    "entropy",
    "kl",
    "tis_weight",
    "num_tokens",
    "loss_denominator",
    "num_micro_batches",
    "update_skipped",
)


def step_rank(
    hf_dir,
    samples,
    *,
    tp,
    sp,
    budget,
    fused_logprob,
    fused_policy_loss,
    algo=None,
    cp=1,
    pp=1,
    vpp=None,
    head_loss="separate",
):
    """Every rank: Actor.logprobs, then one train step; returns (logprobs, entropies, metrics, the
    gradient and the updated weights by HF name). The gradient is read just before the optimizer
    step (FP32 optimizer without sharding: each main_grad holds the full reduced gradient).
    head_loss: actor.head_loss of the train step; vpp: virtual pipeline stages per rank (actor.vpp)."""
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with gradients_before_the_step() as captured, model_parallel(tp=tp, pp=pp, cp=cp, vpp=vpp, seed=7) as layout:
        cfg = make_cfg(
            tp=tp, pp=pp, cp=cp, vpp=vpp, micro_batch_tokens=budget, sequence_parallel=sp, lr=1e-3, warmup_steps=0
        )
        cfg.actor.use_distributed_optimizer = False
        cfg.actor.fused_logprob, cfg.actor.fused_policy_loss = fused_logprob, fused_policy_loss
        cfg.actor.head_loss = head_loss
        for key, value in (algo or {}).items():
            setattr(cfg.algorithm, key, value)
        actor = captured.actor = Actor(actor_settings(cfg), hf_dir, layout)
        for group in actor.optimizer.param_groups:
            group["eps"] = 1e-4  # bounds Adam's lr/eps slope at g ~ 0 (see test_actor_train.py)
        out = actor.logprobs(samples)
        metrics = actor.train(samples, step=0)
        weights = {k: v.clone() for k, v in actor.iter_hf_weights()}
    return out.logprobs, out.entropies, metrics, captured.grads, weights


def references(hf_dir, samples):
    """The float64 step, the float64 log-probs with their fp32 bounds, and the initial weights."""
    return reference_step(hf_dir, samples), token_bounds(hf_dir, samples), load_file(f"{hf_dir}/model.safetensors")


def max_diff(a_list, b_list) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(a_list, b_list))


COUNT_KEYS = ("num_tokens", "loss_denominator", "num_micro_batches", "update_skipped")
CLIP_KEYS = ("clipfrac_low", "clipfrac_high", "dualclip_frac")


def assert_same_step(ref, fused, exact: StepBounds, tokens: TokenBounds, samples, before, *, label, same_layout=True):
    """Both steps within fp32 rounding of the float64 step (loss, grad norm, every gradient, the updated
    weights; tests/helpers_fp32.py), every count equal, every other statistic equal within the rounding the
    float64 reference measures for the log-probs (ratio = exp(log p - log p_old): a log-prob error d is
    a relative error d of every ratio). Returns the worst error / bound of the fused step."""
    (_, _, m_ref, g_ref, w_ref), (_, _, m_fused, g_fused, w_fused) = ref, fused
    assert m_ref["update_skipped"] == 0 and m_ref["num_tokens"] > 0
    # no float64 ratio within 1e-4 of a clip edge, so fp32 rounding (~1e-6) cannot move a token across one:
    # the clip counts are exact on every CPU
    assert min_distance_to_clip_edges(exact.exact, samples) > 1e-4
    for key in COUNT_KEYS if same_layout else [k for k in COUNT_KEYS if k != "num_micro_batches"]:
        assert m_fused[key] == m_ref[key], f"{label}: {key}"
    # the same tokens are clipped on both sides; their (per-token weighted) fractions are sums of at most
    # num_tokens positive fp32 terms: relative rounding at most num_tokens * u
    for key in CLIP_KEYS:
        assert m_fused[key] == pytest.approx(m_ref[key], rel=m_ref["num_tokens"] * U32, abs=0), f"{label}: {key}"
    stat_rel = 2 * tokens.logprob_bound + 2 * tokens.entropy_bound  # each side within one bound of the truth
    for key in (k for k in STAT_KEYS if k not in COUNT_KEYS + CLIP_KEYS):
        assert m_fused[key] == pytest.approx(m_ref[key], rel=stat_rel, abs=stat_rel), f"{label}: {key}"
    bounds = adam_weight_bounds(exact, before, lr=STEP["lr"], eps=STEP["eps"], grad_clip=STEP["grad_clip"])
    after = adam_first_step(before, exact.exact.grads, **STEP)
    worst = 0.0
    for side, (m, g, w) in (("plain", (m_ref, g_ref, w_ref)), ("fused", (m_fused, g_fused, w_fused))):
        worst = max(
            exact.check_loss(m["loss"], f"{label} {side}"),
            exact.check_grad_norm(m["grad_norm"], f"{label} {side}"),
            exact.check_grads(g, f"{label} {side}"),
            check_weights(w, after, bounds, f"{label} {side}"),
        )
    assert max(float(g.abs().max()) for g in g_ref.values()) > 1e-2  # a real gradient
    return worst


def tiny_model_dirs(root) -> dict[str, str]:
    """The two tiny HF models of the step comparisons, saved under root: Qwen2 (untied) and an odd-vocabulary
    tied Llama (the actor pads 301 -> 302 at TP=2; 8 heads / 2 KV groups, GQA 4:1)."""
    from helpers_tiny import save_tiny_hf

    return {
        "qwen2": str(save_tiny_hf(root / "qwen2", arch="qwen2", tied=False)),
        "llama_v301_tied": str(
            save_tiny_hf(
                root / "llama", arch="llama", tied=True, seed=3, shape=dict(vocab_size=301, num_attention_heads=8)
            )
        ),
    }
