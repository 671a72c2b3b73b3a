"""The production compute path on CPU: the Actor with the fused Triton kernels (run by the Triton
interpreter here, compiled on a GPU: the same call path, lm_head.token_logprobs_entropy and the
"dapo" policy loss that algo.objective calls) equals the Actor with the plain-torch head and loss, on
gloo ranks, fp32.

At TP=1 (x DP=2), TP=2, TP=2 with sequence parallelism, CP=2, and on an odd-vocabulary tied Llama
(vocab 301: the actor pads it to 302 rows at TP=2, the head must exclude the padding row):
  - Actor.logprobs: log-probs and entropies of both paths within fp32 rounding of transformers' float64
    ones (tests/helpers_fp32.py: the bound is measured from the transformers model run in fp32);
  - one Actor.train step: every count equal, every other stat equal within that rounding, and the loss,
    grad norm, gradient of every weight and the updated weights of both paths within fp32 rounding of the
    float64 step;
  - and the fused TP=2 + SP step is the plain-torch TP=1 x DP=2 step in the same sense.
And the fused policy loss alone (plain-torch head) under seq-mean-token-mean + overlong filter +
TIS + KL (fractional per-token weights) over 3 micro-batches x DP=2: value, gradient, every stat.
And bf16 at TP=2 with SP (the GPU configuration) through the interpreter.

    pytest tests/distributed/test_actor_fused.py -q -s      (-s prints the measured differences)
"""

import pytest
import torch
from safetensors.torch import load_file

from helpers_actor import (
    STEP,
    fill_rl_fields,
    gradients_before_the_step,
    hf_logprobs,
    hf_seq_mean_step,
    make_cfg,
    make_samples,
)
from helpers_fp32 import (
    U32,
    StepBounds,
    TokenBounds,
    adam_first_step,
    adam_weight_bounds,
    check_weights,
    min_distance_to_clip_edges,
    reference_step,
    step_bounds,
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


def _step_rank(hf_dir, samples, *, tp, sp, budget, fused_logprob, fused_policy_loss, algo=None, cp=1):
    """Every rank: Actor.logprobs, then one train step; returns (logprobs, entropies, metrics, the
    gradient and the updated weights by HF name). The gradient is read just before the optimizer
    step (FP32 optimizer without sharding: each main_grad holds the full reduced gradient)."""
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with gradients_before_the_step() as captured, model_parallel(tp=tp, cp=cp, seed=7) as layout:
        cfg = make_cfg(tp=tp, cp=cp, micro_batch_tokens=budget, sequence_parallel=sp, lr=1e-3, warmup_steps=0)
        cfg.actor.use_distributed_optimizer = False
        cfg.actor.fused_logprob, cfg.actor.fused_policy_loss = fused_logprob, fused_policy_loss
        for key, value in (algo or {}).items():
            setattr(cfg.algorithm, key, value)
        actor = captured.actor = Actor(actor_settings(cfg), hf_dir, layout)
        for group in actor.optimizer.param_groups:
            group["eps"] = 1e-4  # bounds Adam's lr/eps slope at g ~ 0 (see test_actor_train.py)
        out = actor.logprobs(samples)
        metrics = actor.train(samples, step=0)
        weights = {k: v.clone() for k, v in actor.iter_hf_weights()}
    return out.logprobs, out.entropies, metrics, captured.grads, weights


def _references(hf_dir, samples):
    """The float64 step, the float64 log-probs with their fp32 bounds, and the initial weights."""
    return reference_step(hf_dir, samples), token_bounds(hf_dir, samples), load_file(f"{hf_dir}/model.safetensors")


def _max_diff(a_list, b_list) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(a_list, b_list))


COUNT_KEYS = ("num_tokens", "loss_denominator", "num_micro_batches", "update_skipped")
CLIP_KEYS = ("clipfrac_low", "clipfrac_high", "dualclip_frac")


def _assert_same_step(ref, fused, exact: StepBounds, tokens: TokenBounds, samples, before, *, label, same_layout=True):
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


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    root = tmp_path_factory.mktemp("fused_actor")
    return {
        "qwen2": str(save_tiny_hf(root / "qwen2", arch="qwen2", tied=False)),
        # odd vocabulary (the actor pads 301 -> 302 at TP=2), tied embeddings, 8 heads / 2 KV groups (GQA 4:1)
        "llama_v301_tied": str(
            save_tiny_hf(
                root / "llama", arch="llama", tied=True, seed=3, shape=dict(vocab_size=301, num_attention_heads=8)
            )
        ),
    }


# budget 40 tokens: 2-3 packed micro-batches per rank (samples of up to 18 tokens)
@pytest.mark.parametrize(
    "model,tp,sp,cp",
    [
        ("qwen2", 1, False, 1),
        ("qwen2", 2, False, 1),
        ("qwen2", 2, True, 1),
        ("llama_v301_tied", 2, True, 1),
        ("qwen2", 1, False, 2),
    ],
    ids=["tp1_dp2", "tp2", "tp2_sp", "llama_v301_tied_tp2_sp", "cp2"],
)
def test_fused_actor_equals_torch_actor(rank_pool, tiny_dirs, model, tp, sp, cp):
    hf_dir = tiny_dirs[model]
    samples = make_samples(8, seed=11)
    hf_logps, hf_ents = hf_logprobs(hf_dir, samples)
    samples = fill_rl_fields(samples, hf_logps, seed=4)
    exact, tokens, before = _references(hf_dir, samples)
    pool = rank_pool(2)
    ref = pool.run(
        _step_rank, hf_dir, samples, tp=tp, sp=sp, cp=cp, budget=40, fused_logprob=False, fused_policy_loss=False
    )
    fused = pool.run(
        _step_rank, hf_dir, samples, tp=tp, sp=sp, cp=cp, budget=40, fused_logprob=True, fused_policy_loss=True
    )
    for rank_result in fused[1:]:  # identical on every rank
        assert all(torch.equal(a, b) for a, b in zip(rank_result[0], fused[0][0]))
        assert rank_result[2] == fused[0][2]
    # both within fp32 rounding of transformers' float64 log-probs (the odd vocabulary's padding row takes
    # no probability)
    lp_worst = max(tokens.check(ref[0][0], ref[0][1], "plain"), tokens.check(fused[0][0], fused[0][1], "fused"))
    vocab = 301 if model == "llama_v301_tied" else 300
    assert ref[0][4]["model.embed_tokens.weight"].shape[0] == vocab  # exported without the padding
    assert max(float(e.max()) for e in ref[0][1]) > 1.0  # far from one-hot: the entropies are compared
    assert ref[0][2]["clipfrac_low"] + ref[0][2]["clipfrac_high"] > 0  # the clip branches are hit
    worst = _assert_same_step(ref[0], fused[0], exact, tokens, samples, before, label=f"{model} tp={tp} sp={sp}")
    print(
        f"\n[fused actor] {model} tp={tp} sp={sp} cp={cp}: worst error / fp32 bound: log-probs {lp_worst:.2f}, "
        f"step {worst:.2f} (log-prob bound {tokens.logprob_bound:.2e})"
    )


def test_fused_tp2_sp_step_equals_torch_tp1_step(rank_pool, tiny_dirs):
    """Across layouts too: the fused TP=2 + sequence-parallel step (the hidden-state gather's
    backward only splits, the head all-reduces dL/dhidden) gives TP=1's gradient and weights."""
    hf_dir = tiny_dirs["qwen2"]
    samples = make_samples(8, seed=11)
    samples = fill_rl_fields(samples, hf_logprobs(hf_dir, samples)[0], seed=4)
    exact, tokens, before = _references(hf_dir, samples)
    pool = rank_pool(2)
    ref = pool.run(
        _step_rank, hf_dir, samples, tp=1, sp=False, budget=40, fused_logprob=False, fused_policy_loss=False
    )[0]
    fused = pool.run(_step_rank, hf_dir, samples, tp=2, sp=True, budget=40, fused_logprob=True, fused_policy_loss=True)[
        0
    ]
    lp_worst = max(tokens.check(ref[0], ref[1], "torch tp1"), tokens.check(fused[0], fused[1], "fused tp2+sp"))
    worst = _assert_same_step(
        ref, fused, exact, tokens, samples, before, label="fused tp2+sp vs torch tp1", same_layout=False
    )
    print(f"\n[fused tp2+sp vs torch tp1] worst error / fp32 bound: log-probs {lp_worst:.2f}, step {worst:.2f}")


def test_fused_policy_loss_equals_torch_in_the_actor(rank_pool, tiny_dirs):
    """Only the loss switches (actor.fused_policy_loss): seq-mean-token-mean, overlong filter, TIS
    and k3 KL give fractional per-token weights, over 3 micro-batches per DP rank."""
    hf_dir = tiny_dirs["qwen2"]
    samples = make_samples(12, seed=4)
    samples = fill_rl_fields(samples, hf_logprobs(hf_dir, samples)[0], seed=3)
    gen = torch.Generator().manual_seed(9)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        s.rollout_logprobs = (torch.tensor(s.old_logprobs) + 0.5 * torch.randn(n, generator=gen)).tolist()
        s.ref_logprobs = (torch.tensor(s.old_logprobs) + 0.2 * torch.randn(n, generator=gen)).tolist()
        s.truncated = i in (2, 7)
    algo = dict(
        loss_agg_mode="seq-mean-token-mean", overlong_filter=True, tis_cap=1.5, use_kl=True, kl_coef=0.1, kl_kind="k3"
    )
    pool = rank_pool(2)
    kw = dict(tp=1, sp=False, budget=22, fused_logprob=False, algo=algo)
    ref = pool.run(_step_rank, hf_dir, samples, fused_policy_loss=False, **kw)[0]
    fused = pool.run(_step_rank, hf_dir, samples, fused_policy_loss=True, **kw)[0]
    assert ref[2]["num_micro_batches"] == 3 and ref[2]["loss_denominator"] == 10
    assert ref[2]["dualclip_frac"] + ref[2]["clipfrac_low"] + ref[2]["clipfrac_high"] > 0
    assert all(torch.equal(a, b) for a, b in zip(fused[0], ref[0]))  # the head is the same plain torch
    loss_args = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, tis_cap=1.5, kl_coef=0.1)
    exact = step_bounds(
        hf_seq_mean_step(hf_dir, samples, dtype=torch.float32, **loss_args),
        hf_seq_mean_step(hf_dir, samples, dtype=torch.float64, **loss_args),
    )
    worst = _assert_same_step(
        ref,
        fused,
        exact,
        token_bounds(hf_dir, samples),
        samples,
        load_file(f"{hf_dir}/model.safetensors"),
        label="fused policy loss",
    )
    print(
        f"\n[fused policy loss] worst error / fp32 bound {worst:.2f}, "
        f"loss {fused[2]['loss']:.6f} vs {ref[2]['loss']:.6f}"
    )


def _bf16_rank(hf_dir, samples, fused):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    cfg = make_cfg(tp=2, micro_batch_tokens=64, sequence_parallel=True, fused=fused, lr=1e-3, warmup_steps=0)
    cfg.actor.precision = "bf16"
    with model_parallel(tp=2, seed=7) as layout:
        actor = Actor(actor_settings(cfg), hf_dir, layout)
        out = actor.logprobs(samples)
        for s, lp in zip(samples, out.logprobs):
            s.old_logprobs = lp.tolist()
            s.advantage = 1.0
        metrics = actor.train(samples, step=0)
    return out.logprobs, metrics


def test_bf16_fused_actor_tp2_sp(rank_pool, tiny_dirs):
    """bf16 weights (the GPU configuration): in the interpreter the kernels cast bf16 tiles to fp32
    before tl.dot (the one interpreter-only branch: its bf16 dot multiplies raw bit patterns).
    Log-probs within bf16 error of transformers and of the plain-torch bf16 head; the train forward
    reproduces logprobs() bit for bit, so the on-policy step has ratio exactly 1 and loss exactly -1."""
    hf_dir = tiny_dirs["llama_v301_tied"]
    samples = make_samples(6, seed=1)
    want, _ = hf_logprobs(hf_dir, samples)
    (fused, metrics), _ = rank_pool(2).run(_bf16_rank, hf_dir, samples, True)
    (ref, _), _ = rank_pool(2).run(_bf16_rank, hf_dir, samples, False)
    assert _max_diff(fused, want) <= 0.15  # bf16 activations: measured ~0.08 on the plain-torch path
    assert _max_diff(fused, want) > 1e-4  # really ran in bf16
    # same bf16 hidden states and weights; the fused head keeps fp32 logits where the torch head
    # rounds the [N, V] logits to bf16: half an ulp (2^-9 relative) of |z| <= ~20 on the target
    # logit and on the log-sum-exp, 2 * 20 * 2^-9 = 0.08 at most
    assert _max_diff(fused, ref) <= 0.1
    assert metrics["loss"] == -1.0 and metrics["ratio_max"] == 1.0 and metrics["clipfrac_high"] == 0.0
    assert metrics["update_skipped"] == 0 and metrics["grad_norm"] > 0
    print(
        f"\n[fused actor bf16 tp2 sp] vs transformers {_max_diff(fused, want):.3e}, vs torch head "
        f"{_max_diff(fused, ref):.3e}"
    )
