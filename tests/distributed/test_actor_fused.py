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
    fill_rl_fields,
    hf_logprobs,
    hf_seq_mean_step,
    make_cfg,
    make_samples,
)
from helpers_fp32 import (
    step_bounds,
    token_bounds,
)
from helpers_step_compare import assert_same_step, max_diff, references, step_rank, tiny_model_dirs


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return tiny_model_dirs(tmp_path_factory.mktemp("fused_actor"))


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
    exact, tokens, before = references(hf_dir, samples)
    pool = rank_pool(2)
    ref = pool.run(
        step_rank, hf_dir, samples, tp=tp, sp=sp, cp=cp, budget=40, fused_logprob=False, fused_policy_loss=False
    )
    fused = pool.run(
        step_rank, hf_dir, samples, tp=tp, sp=sp, cp=cp, budget=40, fused_logprob=True, fused_policy_loss=True
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
    worst = assert_same_step(ref[0], fused[0], exact, tokens, samples, before, label=f"{model} tp={tp} sp={sp}")
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
    exact, tokens, before = references(hf_dir, samples)
    pool = rank_pool(2)
    ref = pool.run(step_rank, hf_dir, samples, tp=1, sp=False, budget=40, fused_logprob=False, fused_policy_loss=False)[
        0
    ]
    fused = pool.run(step_rank, hf_dir, samples, tp=2, sp=True, budget=40, fused_logprob=True, fused_policy_loss=True)[
        0
    ]
    lp_worst = max(tokens.check(ref[0], ref[1], "torch tp1"), tokens.check(fused[0], fused[1], "fused tp2+sp"))
    worst = assert_same_step(
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
    ref = pool.run(step_rank, hf_dir, samples, fused_policy_loss=False, **kw)[0]
    fused = pool.run(step_rank, hf_dir, samples, fused_policy_loss=True, **kw)[0]
    assert ref[2]["num_micro_batches"] == 3 and ref[2]["loss_denominator"] == 10
    assert ref[2]["dualclip_frac"] + ref[2]["clipfrac_low"] + ref[2]["clipfrac_high"] > 0
    assert all(torch.equal(a, b) for a, b in zip(fused[0], ref[0]))  # the head is the same plain torch
    loss_args = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, tis_cap=1.5, kl_coef=0.1)
    exact = step_bounds(
        hf_seq_mean_step(hf_dir, samples, dtype=torch.float32, **loss_args),
        hf_seq_mean_step(hf_dir, samples, dtype=torch.float64, **loss_args),
    )
    worst = assert_same_step(
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
    assert max_diff(fused, want) <= 0.15  # bf16 activations: measured ~0.08 on the plain-torch path
    assert max_diff(fused, want) > 1e-4  # really ran in bf16
    # same bf16 hidden states and weights; the fused head keeps fp32 logits where the torch head
    # rounds the [N, V] logits to bf16: half an ulp (2^-9 relative) of |z| <= ~20 on the target
    # logit and on the log-sum-exp, 2 * 20 * 2^-9 = 0.08 at most
    assert max_diff(fused, ref) <= 0.1
    assert metrics["loss"] == -1.0 and metrics["ratio_max"] == 1.0 and metrics["clipfrac_high"] == 0.0
    assert metrics["update_skipped"] == 0 and metrics["grad_norm"] > 0
    print(
        f"\n[fused actor bf16 tp2 sp] vs transformers {max_diff(fused, want):.3e}, vs torch head "
        f"{max_diff(fused, ref):.3e}"
    )
