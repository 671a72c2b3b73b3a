"""actor.head_loss=one_pass in the real Actor (megatron on gloo ranks, dapo_kernels.linear_dapo_loss in the
Triton interpreter, fp32): the one-pass head + loss step equals the separate head + loss step.

Each step is checked against the float64 step of transformers' model (tests/helpers_fp32.py: within fp32
rounding of it, the bound measured on this CPU) for the loss, the grad norm, the gradient of every weight and
the updated weights; every count equal, every other logged statistic equal within the log-prob rounding.
At TP=1 x DP=2, CP=2, PP=2 (several micro-batches per rank) and PP=2 x VPP=2 (4-layer models, megatron's
interleaved schedule), TP=2 (the vocab-parallel op), TP=2 + sequence
parallelism, the odd-vocabulary tied Llama at TP=2 (a padding row) and at PP=2 (the last stage's copy of the
embeddings); the one-pass step over 2-3 micro-batches equals the one-pass step over one micro-batch per rank;
seq-mean-token-mean + overlong filter + truncated importance weights (fractional per-token weights) over 3
micro-batches. The old-log-prob pass is the same computation under both settings (bit for bit). And bf16 at
TP=2 + SP (the GPU configuration) on an on-policy step against the separate fused kernels.

    pytest tests/distributed/test_actor_head_loss.py -q -s      (-s prints the measured errors / bounds)
"""

import pytest
import torch
from safetensors.torch import load_file

from helpers_actor import fill_rl_fields, hf_logprobs, hf_seq_mean_step, make_cfg, make_samples
from helpers_fp32 import step_bounds, token_bounds
from helpers_step_compare import assert_same_step, references, step_rank, tiny_model_dirs

# the separate step: plain-torch head and loss (fast in the interpreter's process; test_actor_fused.py shows
# the fused separate path equals it); the one-pass step's old-log-prob pass is the same plain-torch head
SEPARATE = dict(fused_logprob=False, fused_policy_loss=False, head_loss="separate")
ONE_PASS = dict(fused_logprob=False, fused_policy_loss=False, head_loss="one_pass")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return tiny_model_dirs(tmp_path_factory.mktemp("head_loss_actor"))


def _same_logprob_pass(separate, one_pass) -> None:
    """Actor.logprobs does not depend on actor.head_loss: bit for bit."""
    assert all(torch.equal(a, b) for a, b in zip(separate[0], one_pass[0]))
    assert all(torch.equal(a, b) for a, b in zip(separate[1], one_pass[1]))


# budget 40 tokens: 2-3 packed micro-batches per rank (samples of up to 18 tokens)
@pytest.mark.parametrize(
    "model,tp,sp,cp,pp",
    [
        ("qwen2", 1, False, 1, 1),
        ("qwen2", 2, False, 1, 1),
        ("qwen2", 2, True, 1, 1),
        ("llama_v301_tied", 2, True, 1, 1),
        ("qwen2", 1, False, 2, 1),
        ("qwen2", 1, False, 1, 2),
        ("llama_v301_tied", 1, False, 1, 2),
    ],
    ids=["tp1_dp2", "tp2", "tp2_sp", "llama_v301_tied_tp2_sp", "cp2", "pp2", "llama_v301_tied_pp2"],
)
def test_one_pass_step_equals_separate_step(rank_pool, tiny_dirs, model, tp, sp, cp, pp):
    hf_dir = tiny_dirs[model]
    samples = make_samples(8, seed=11)
    samples = fill_rl_fields(samples, hf_logprobs(hf_dir, samples)[0], seed=4)
    exact, tokens, before = references(hf_dir, samples)
    pool = rank_pool(2)
    layout = dict(tp=tp, sp=sp, cp=cp, pp=pp)
    separate = pool.run(step_rank, hf_dir, samples, budget=40, **layout, **SEPARATE)
    one_pass = pool.run(step_rank, hf_dir, samples, budget=40, **layout, **ONE_PASS)
    for rank_result in one_pass[1:]:  # the metrics are identical on every rank
        assert rank_result[2] == one_pass[0][2]
    assert set(one_pass[0][2]) == set(separate[0][2])  # the same logged keys
    _same_logprob_pass(separate[0], one_pass[0])
    assert separate[0][2]["num_micro_batches"] >= 2
    assert separate[0][2]["clipfrac_low"] + separate[0][2]["clipfrac_high"] > 0  # the clip branches are hit
    worst = assert_same_step(
        separate[0], one_pass[0], exact, tokens, samples, before, label=f"one_pass {model} {layout}"
    )
    # two different computations (one_pass really ran): no gradient tensor is bit for bit the separate one's
    assert not any(torch.equal(g, separate[0][3][name]) for name, g in one_pass[0][3].items())
    m_sep, m_one = separate[0][2], one_pass[0][2]
    print(
        f"\n[one_pass actor] {model} {layout}: worst error / fp32 bound {worst:.2f}; loss "
        f"{m_one['loss']:.9f} vs {m_sep['loss']:.9f}, grad norm {m_one['grad_norm']:.9f} vs {m_sep['grad_norm']:.9f}"
    )


def test_one_pass_micro_batches_equal_one_batch(rank_pool, tiny_dirs):
    """The one-pass step over 2-3 micro-batches per rank (budget 40) equals it over one micro-batch per rank
    (budget 256): megatron's schedule scales the op's stored gradients by its loss scale per micro-batch and
    sums them, the global D makes the sum the big batch's."""
    hf_dir = tiny_dirs["qwen2"]
    samples = make_samples(8, seed=11)
    samples = fill_rl_fields(samples, hf_logprobs(hf_dir, samples)[0], seed=4)
    exact, tokens, before = references(hf_dir, samples)
    pool = rank_pool(2)
    many = pool.run(step_rank, hf_dir, samples, tp=1, sp=False, budget=40, **ONE_PASS)[0]
    one = pool.run(step_rank, hf_dir, samples, tp=1, sp=False, budget=256, **ONE_PASS)[0]
    assert many[2]["num_micro_batches"] >= 2 and one[2]["num_micro_batches"] == 1
    worst = assert_same_step(
        one, many, exact, tokens, samples, before, label="one_pass micro-batches vs one batch", same_layout=False
    )
    print(f"\n[one_pass micro-batches vs one batch] worst error / fp32 bound {worst:.2f}")


def test_one_pass_weighted_objective_equals_separate(rank_pool, tiny_dirs):
    """seq-mean-token-mean (w_t = m_t / n_seq(t)), the overlong filter (truncated samples masked) and the
    truncated importance weight c_t = min(pi_old / pi_rollout, 1.5) as the op's per-token loss weight, over 3
    micro-batches per DP rank: value, gradient, updated weights and every statistic (tis_weight included)."""
    hf_dir = tiny_dirs["qwen2"]
    samples = make_samples(12, seed=4)
    samples = fill_rl_fields(samples, hf_logprobs(hf_dir, samples)[0], seed=3)
    gen = torch.Generator().manual_seed(9)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        s.rollout_logprobs = (torch.tensor(s.old_logprobs) + 0.5 * torch.randn(n, generator=gen)).tolist()
        s.ref_logprobs = list(s.old_logprobs)  # read by the float64 reference's KL term, weighted 0 here
        s.truncated = i in (2, 7)
    algo = dict(loss_agg_mode="seq-mean-token-mean", overlong_filter=True, tis_cap=1.5)
    pool = rank_pool(2)
    separate = pool.run(step_rank, hf_dir, samples, tp=1, sp=False, budget=22, algo=algo, **SEPARATE)[0]
    one_pass = pool.run(step_rank, hf_dir, samples, tp=1, sp=False, budget=22, algo=algo, **ONE_PASS)[0]
    assert separate[2]["num_micro_batches"] == 3 and separate[2]["loss_denominator"] == 10
    assert 0 < separate[2]["tis_weight"] < 1.5 and separate[2]["tis_weight"] != 1.0  # c_t really weights tokens
    loss_args = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0, tis_cap=1.5, kl_coef=0.0)
    exact = step_bounds(
        hf_seq_mean_step(hf_dir, samples, dtype=torch.float32, **loss_args),
        hf_seq_mean_step(hf_dir, samples, dtype=torch.float64, **loss_args),
    )
    worst = assert_same_step(
        separate,
        one_pass,
        exact,
        token_bounds(hf_dir, samples),
        samples,
        load_file(f"{hf_dir}/model.safetensors"),
        label="one_pass seq-mean-token-mean + TIS",
    )
    assert one_pass[2]["tis_weight"] == separate[2]["tis_weight"]  # the same c_t, summed in the same order
    print(
        f"\n[one_pass seq-mean-token-mean + overlong + TIS] worst error / fp32 bound {worst:.2f}, "
        f"loss {one_pass[2]['loss']:.9f} vs {separate[2]['loss']:.9f}"
    )


def _bf16_rank(hf_dir, samples, head_loss):
    """bf16 at TP=2 + SP (the GPU configuration), the fused kernels: old log-probs from Actor.logprobs, advantage
    1 (an on-policy step), one train step; returns the metrics."""
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    cfg = make_cfg(tp=2, micro_batch_tokens=64, sequence_parallel=True, fused=True, lr=1e-3, warmup_steps=0)
    cfg.actor.precision, cfg.actor.head_loss = "bf16", head_loss
    with model_parallel(tp=2, seed=7) as layout:
        actor = Actor(actor_settings(cfg), hf_dir, layout)
        out = actor.logprobs(samples)
        for s, lp in zip(samples, out.logprobs):
            s.old_logprobs = lp.tolist()
            s.advantage = 1.0
        metrics = actor.train(samples, step=0)
    return metrics


def test_bf16_one_pass_tp2_sp_on_policy_step(rank_pool, tiny_dirs):
    """bf16 at TP=2 + SP through the interpreter (the GPU configuration: the kernels' bf16 inputs, fp32 logits,
    bf16 dlogits), on-policy (old log-probs from the same weights, advantage 1: every ratio 1, loss -1, no
    clipping). The one-pass step's log-probs are the same bf16 logits summed in another fp32 order than
    Actor.logprobs' fused head: each ratio within 64 terms x |z| <= 20 x 2^-24 = 7.6e-5 of 1; the logged
    statistics equal the separate fused step's within that; the grad norm within two bf16 roundings of dlogits
    (2^-8 relative)."""
    hf_dir = tiny_dirs["llama_v301_tied"]
    samples = make_samples(6, seed=1)
    m_one, _ = rank_pool(2).run(_bf16_rank, hf_dir, samples, "one_pass")
    m_sep, _ = rank_pool(2).run(_bf16_rank, hf_dir, samples, "separate")
    bound = 64 * 20 * 2.0**-24
    assert m_sep["loss"] == -1.0 and m_sep["ratio_max"] == 1.0  # the separate fused step is on-policy bit for bit
    assert abs(m_one["loss"] + 1.0) <= bound and abs(m_one["ratio_max"] - 1.0) <= bound
    assert abs(m_one["ratio_mean"] - 1.0) <= bound and m_one["approx_kl"] <= bound**2 / 2
    assert m_one["entropy"] == pytest.approx(m_sep["entropy"], rel=bound)
    for key in ("clipfrac_low", "clipfrac_high", "dualclip_frac", "num_tokens", "update_skipped"):
        assert m_one[key] == m_sep[key], key
    assert m_one["grad_norm"] == pytest.approx(m_sep["grad_norm"], rel=2.0**-8) and m_one["grad_norm"] > 0
    print(
        f"\n[one_pass bf16 tp2 sp] loss {m_one['loss']!r}, ratio_max - 1 {m_one['ratio_max'] - 1:.2e} (bound "
        f"{bound:.1e}), grad norm {m_one['grad_norm']:.6f} vs {m_sep['grad_norm']:.6f}"
    )


@pytest.fixture(scope="module")
def tiny4_dirs(tmp_path_factory):
    """The step comparison's two models with 4 layers: PP=2 x VPP=2 gives each virtual stage one layer."""
    from helpers_tiny import save_tiny_hf

    root = tmp_path_factory.mktemp("head_loss_vpp")
    llama_shape = dict(vocab_size=301, num_attention_heads=8)
    return {
        "qwen2": str(save_tiny_hf(root / "qwen2", arch="qwen2", tied=False, num_layers=4)),
        "llama_v301_tied": str(
            save_tiny_hf(root / "llama", arch="llama", tied=True, seed=3, num_layers=4, shape=llama_shape)
        ),
    }


# (model, samples, budget): 8 samples in 4 micro-batches (2 groups of pp)
VPP_CASES = {
    "qwen2": ("qwen2", 8, 40),
    "llama_v301_tied": ("llama_v301_tied", 8, 40),
}


@pytest.mark.parametrize("case", list(VPP_CASES))
def test_one_pass_step_equals_separate_step_under_virtual_pipeline_stages(rank_pool, tiny4_dirs, case):
    """PP=2 x VPP=2 on 2 ranks (megatron's interleaved schedule): the head runs in the last rank's second model
    chunk, the micro-batches come in whole groups of pp, and the gradient of the tied embeddings reaches the
    first rank's first chunk. The one-pass step equals the separate step (assert_same_step: both within fp32
    rounding of the float64 step)."""
    model, num_samples, budget = VPP_CASES[case]
    hf_dir = tiny4_dirs[model]
    samples = make_samples(num_samples, seed=11)
    samples = fill_rl_fields(samples, hf_logprobs(hf_dir, samples)[0], seed=4)
    exact, tokens, before = references(hf_dir, samples)
    pool = rank_pool(2)
    layout = dict(tp=1, sp=False, pp=2, vpp=2)
    separate = pool.run(step_rank, hf_dir, samples, budget=budget, **layout, **SEPARATE)
    one_pass = pool.run(step_rank, hf_dir, samples, budget=budget, **layout, **ONE_PASS)
    assert one_pass[1][2] == one_pass[0][2] and set(one_pass[0][2]) == set(separate[0][2])
    _same_logprob_pass(separate[0], one_pass[0])
    micro = separate[0][2]["num_micro_batches"]
    assert micro == 4 and one_pass[0][2]["num_micro_batches"] == micro
    worst = assert_same_step(separate[0], one_pass[0], exact, tokens, samples, before, label=f"one_pass vpp {case}")
    assert not any(torch.equal(g, separate[0][3][name]) for name, g in one_pass[0][3].items())  # one_pass ran
    m_sep, m_one = separate[0][2], one_pass[0][2]
    print(
        f"\n[one_pass actor, PP=2 x VPP=2] {case}: {micro:.0f} micro-batches, worst error / fp32 bound {worst:.2f}; "
        f"loss {m_one['loss']:.9f} vs {m_sep['loss']:.9f}, grad norm {m_one['grad_norm']:.9f} vs "
        f"{m_sep['grad_norm']:.9f}"
    )
