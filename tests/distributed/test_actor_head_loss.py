"""actor.head_loss=one_pass in the real Actor (megatron on gloo ranks, dapo_kernels.linear_dapo_loss in the
Triton interpreter, fp32): the one-pass head + loss step equals the separate head + loss step.

Each step is checked against the float64 step of transformers' model (tests/helpers_fp32.py: within fp32
rounding of it, the bound measured on this CPU) for the loss, the grad norm, the gradient of every weight and
the updated weights; every count equal, every other logged statistic equal within the log-prob rounding.
At TP=1 x DP=2 and CP=2 (several micro-batches per rank), TP=2 (the vocab-parallel op), TP=2 + sequence
parallelism, the odd-vocabulary tied Llama at TP=2 (a padding row); the one-pass step over 2-3
micro-batches equals the one-pass step over one micro-batch per rank; seq-mean-token-mean + overlong filter +
truncated importance weights (fractional per-token weights) over 3 micro-batches. The old-log-prob pass is
the same computation under both settings (bit for bit).

    pytest tests/distributed/test_actor_head_loss.py -q -s      (-s prints the measured errors / bounds)
"""

import pytest
import torch
from safetensors.torch import load_file

from helpers_actor import fill_rl_fields, hf_logprobs, hf_seq_mean_step, make_samples
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
def test_one_pass_step_equals_separate_step(rank_pool, tiny_dirs, model, tp, sp, cp):
    hf_dir = tiny_dirs[model]
    samples = make_samples(8, seed=11)
    samples = fill_rl_fields(samples, hf_logprobs(hf_dir, samples)[0], seed=4)
    exact, tokens, before = references(hf_dir, samples)
    pool = rank_pool(2)
    separate = pool.run(step_rank, hf_dir, samples, tp=tp, sp=sp, cp=cp, budget=40, **SEPARATE)
    one_pass = pool.run(step_rank, hf_dir, samples, tp=tp, sp=sp, cp=cp, budget=40, **ONE_PASS)
    for rank_result in one_pass[1:]:  # the metrics are identical on every rank
        assert rank_result[2] == one_pass[0][2]
    assert set(one_pass[0][2]) == set(separate[0][2])  # the same logged keys
    _same_logprob_pass(separate[0], one_pass[0])
    assert separate[0][2]["num_micro_batches"] >= 2
    assert separate[0][2]["clipfrac_low"] + separate[0][2]["clipfrac_high"] > 0  # the clip branches are hit
    worst = assert_same_step(
        separate[0], one_pass[0], exact, tokens, samples, before, label=f"one_pass {model} tp={tp} sp={sp} cp={cp}"
    )
    # two different computations (one_pass really ran): no gradient tensor is bit for bit the separate one's
    assert not any(torch.equal(g, separate[0][3][name]) for name, g in one_pass[0][3].items())
    m_sep, m_one = separate[0][2], one_pass[0][2]
    print(
        f"\n[one_pass actor] {model} tp={tp} sp={sp} cp={cp}: worst error / fp32 bound {worst:.2f}; loss "
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
