"""Actor.logprobs on gloo ranks (fp32, tiny Qwen2) equals transformers' log-probs, packed or not,
for TP=1 x DP=2, TP=2 and PP=2, and with context parallelism (CP=2, TP=2 x CP=2 with sequence
parallel, CP=2 x PP=2) equals CP=1; every rank returns the same values."""

import pytest
import torch

from helpers_actor import hf_logprobs, make_cfg, make_samples
from helpers_fp32 import token_bounds


def _logprobs_rank(hf_dir, samples, tp, pp, micro_batch_tokens, sp=False, cp=1):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(tp=tp, pp=pp, cp=cp, seed=7) as layout:
        actor = Actor(
            actor_settings(make_cfg(tp=tp, pp=pp, cp=cp, micro_batch_tokens=micro_batch_tokens, sequence_parallel=sp)),
            hf_dir,
            layout,
        )
        out = actor.logprobs(samples)
    return out.logprobs, out.entropies


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return {tied: str(save_tiny_hf(tmp_path_factory.mktemp("qwen"), arch="qwen2", tied=tied)) for tied in (False, True)}


# budget 256: all 7 samples in one packed micro-batch per DP rank; 18 = the longest sample: mostly
# one sample per micro-batch (the "unpacked" case); PP=2 pads every micro-batch to one length.
@pytest.mark.parametrize(
    "tp,pp,budget,tied,sp",
    [
        (1, 1, 256, False, False),
        (1, 1, 18, False, False),
        (2, 1, 64, False, False),
        (1, 2, 40, False, False),
        (2, 1, 40, True, False),
        (2, 1, 40, False, True),
    ],
)
def test_logprobs_match_transformers(rank_pool, tiny_dirs, tp, pp, budget, tied, sp):
    tiny_dir = tiny_dirs[tied]
    samples = make_samples(7)
    want, want_ent = hf_logprobs(tiny_dir, samples)
    results = rank_pool(2).run(_logprobs_rank, tiny_dir, samples, tp, pp, budget, sp)
    (logps, ents) = results[0]
    for other in results[1:]:  # identical on every rank
        assert all(torch.equal(a, b) for a, b in zip(other[0], logps))
        assert all(torch.equal(a, b) for a, b in zip(other[1], ents))
    assert max(len(s.prompt_ids) + len(s.response_ids) for s in samples) == 18
    for got, ref, ent, ref_ent, s in zip(logps, want, ents, want_ent, samples):
        assert got.shape == ent.shape == (len(s.response_ids),)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


# (world, tp, pp, cp, sp, budget): the 2-rank layout is CP=2 alone (DP=1); the 4-rank ones add TP=2 with
# sequence parallel (rows padded to 2*cp*tp) and PP=2 (every micro-batch padded to one length).
CP_LAYOUTS = [(2, 1, 1, 2, False, 48), (4, 2, 1, 2, True, 48), (4, 1, 2, 2, False, 48)]
# The same maths in another order: CP changes the matmul shapes (T/cp rows), the attention tiling and the
# number of masked (exactly zero) keys, so values may differ by fp32 rounding only. Both layouts are held to
# transformers' float64 log-probs within fp32 rounding measured from the transformers model run in fp32
# (tests/helpers_fp32.py; ~1e-5 here), not to each other within a fixed 4 ulps (a bet on one CPU's order).
# A real error (a RoPE position off by one chunk, a padding token in a real token's context) moves log-probs
# by 1e-2 to 1.


@pytest.mark.parametrize("world,tp,pp,cp,sp,budget", CP_LAYOUTS, ids=lambda v: str(v))
def test_context_parallel_logprobs_equal_cp1(rank_pool, tiny_dirs, world, tp, pp, cp, sp, budget):
    """Sequences of odd lengths, none a multiple of 2*cp = 4, so packing pads every one of them
    (and the split puts real and padding tokens on both ranks): the log-probs and entropies the
    actor returns at CP=2 and at CP=1 (DP=2 on the same 2 ranks) are transformers' float64 ones
    within fp32 rounding."""
    tiny_dir = tiny_dirs[False]
    samples = make_samples(9, seed=11)
    for s in samples:  # make every sequence odd-length
        if s.num_tokens % 2 == 0:
            s.response_ids = s.response_ids + [7]
    assert all(s.num_tokens % 4 for s in samples)
    pool = rank_pool(world)
    (base, base_ent) = pool.run(_logprobs_rank, tiny_dir, samples, tp, pp, budget, sp, 1)[0]  # DP=cp instead
    results = pool.run(_logprobs_rank, tiny_dir, samples, tp, pp, budget, sp, cp)
    logps, ents = results[0]
    for other in results[1:]:  # identical on every rank
        assert all(torch.equal(a, b) for a, b in zip(other[0], logps))
        assert all(torch.equal(a, b) for a, b in zip(other[1], ents))
    exact = token_bounds(tiny_dir, samples)
    worst_cp1 = exact.check(base, base_ent, "cp=1")
    worst = exact.check(logps, ents, f"cp={cp}")
    print(
        f"actor cp layout world={world} tp={tp} pp={pp} cp={cp} sp={sp}: worst error / fp32 bound cp=1 "
        f"{worst_cp1:.2f}, cp={cp} {worst:.2f} (log-prob bound {exact.logprob_bound:.2e})"
    )
    for got, ent, s in zip(logps, ents, samples):
        assert got.shape == ent.shape == (len(s.response_ids),)


def _bf16_rank(hf_dir, samples):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    cfg = make_cfg(tp=2, micro_batch_tokens=64, lr=1e-3, warmup_steps=0)
    cfg.actor.precision = "bf16"
    with model_parallel(tp=2, seed=7) as layout:
        actor = Actor(actor_settings(cfg), hf_dir, layout)
        out = actor.logprobs(samples)
        for s, lp in zip(samples, out.logprobs):
            s.old_logprobs = lp.tolist()
            s.advantage = 1.0
        metrics = actor.train(samples, step=0)
    return out.logprobs, metrics


def test_bf16_tp2_logprobs_and_an_on_policy_step(rank_pool, tiny_dirs):
    """bf16 weights (megatron's mixed-precision distributed optimizer, fp32 main params) on CPU: the
    path the GPU runs. The train forward reproduces logprobs() bit for bit, so on-policy ratios are
    exactly 1 and the token-mean loss of advantage +1 is exactly -1."""
    samples = make_samples(6, seed=1)
    want, _ = hf_logprobs(tiny_dirs[False], samples)
    (logps, metrics), _ = rank_pool(2).run(_bf16_rank, tiny_dirs[False], samples)
    for got, ref in zip(logps, want):
        torch.testing.assert_close(got, ref, atol=0.15, rtol=0)  # bf16: measured max 0.078 here
    assert max(float((a - b).abs().max()) for a, b in zip(logps, want)) > 1e-4  # really ran in bf16
    assert metrics["loss"] == -1.0 and metrics["ratio_max"] == 1.0 and metrics["clipfrac_high"] == 0.0
    assert metrics["update_skipped"] == 0 and metrics["grad_norm"] > 0
