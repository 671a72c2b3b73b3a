"""actor.head_loss (dapo_megatron/actor/head_loss.py) without megatron: one_pass_objective (dapo_kernels'
linear_dapo_loss in the Triton interpreter, fp32) against algo.objective on the float64 reference log-prob
and entropy (autograd through both): every value objective() logs, the loss and the gradients of hidden and
weight, for each aggregation mode and rollout correction the one-pass path takes. And the refusals: config
validation and Actor construction name actor.head_loss and the key that conflicts.
"""

from __future__ import annotations

import pytest
import torch

from dapo_kernels import linear_logprob_entropy_reference
from dapo_megatron.actor.head_loss import one_pass_objective, uses_one_pass
from dapo_megatron.actor.settings import ActorSettings, OptimizerSettings
from dapo_megatron.algo.aggregation import count_loss_units_packed, sequence_token_counts
from dapo_megatron.algo.objective import ObjectiveSettings, PackedTokens, objective
from dapo_megatron.algo.policy_loss import ClipSettings
from dapo_megatron.config import Config, one_pass_conflicts, validate

# ratios far (>= 5 %) from the clip edges 0.8 / 1.28 / 3.0: fp32 and float64 take the same branch
RATIOS = (0.3, 0.7, 0.95, 1.1, 1.5, 2.5, 5.0)
SEQS, LEN, H, V = 4, 7, 32, 150


def _tokens(seed: int):
    """hidden [N, H], weight [V, H], targets, and the per-token fields of 4 sequences of 7 tokens (every
    5th token masked; ratios crafted into every branch of the clipped loss, advantages of both signs)."""
    gen = torch.Generator().manual_seed(seed)
    n = SEQS * LEN
    hidden = torch.randn(n, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H**0.5
    targets = torch.randint(0, V, (n,), generator=gen)
    lp64, _ = linear_logprob_entropy_reference(hidden.double(), weight.double(), targets, temperature=1.0)
    ratio = torch.tensor([RATIOS[i % len(RATIOS)] for i in range(n)], dtype=torch.float64)
    seq_ids = torch.arange(n) // LEN
    fields = dict(
        old_logprob=(lp64 - ratio.log()).float(),
        advantages=torch.where(seq_ids % 2 == 0, 1.0, -1.0) * (0.5 + torch.rand(n, generator=gen)),
        loss_mask=(torch.arange(n) % 5 != 4).float(),
        seq_ids=seq_ids,
        num_sequences=SEQS,
        rollout_logprobs=(lp64 - ratio.log()).float() + 0.4 * torch.randn(n, generator=gen),
    )
    return hidden, weight, targets, fields


CASES = {
    "token-mean": dict(),
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "seq-mean-token-mean+tis": dict(loss_agg_mode="seq-mean-token-mean", tis_cap=1.5),
    "token-rejection": dict(rejection="token", rejection_upper=1.5),
    "sequence-is+veto": dict(seq_is_cap=2.0, veto_threshold=0.5),
    "grpo-no-dual-clip": dict(policy_loss="grpo", clip=ClipSettings(eps_low=0.2, eps_high=0.2, clip_ratio_c=None)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_pass_objective_equals_objective_on_float64(case):
    kw = dict(clip=ClipSettings(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0))
    settings = ObjectiveSettings(**{**kw, **CASES[case]})
    hidden, weight, targets, f = _tokens(seed=5)
    mask, seq_ids = f["loss_mask"], f["seq_ids"]
    denom = float(count_loss_units_packed(mask, seq_ids, SEQS, agg_mode=settings.loss_agg_mode))
    fields = dict(f, sequence_tokens=sequence_token_counts(mask, seq_ids, SEQS), correction=None, ref_logprobs=None)
    if settings.rollout_correction.active:  # the actor computes c_t over whole responses before the pass
        fields["correction"] = settings.correction_factor(
            old_logprobs=f["old_logprob"],
            rollout_logprobs=f["rollout_logprobs"],
            loss_mask=mask,
            seq_ids=seq_ids,
            num_sequences=SEQS,
        )
        assert float(fields["correction"].std()) > 0.1  # c_t really weights or masks tokens
    h32, w32 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, values = one_pass_objective(
        h32, w32, targets, fields, settings, loss_denominator=denom, temperature=1.0, tp_group=None, vocab_size=V
    )
    loss.backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, ent64 = linear_logprob_entropy_reference(h64, w64, targets, temperature=1.0)
    as64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in fields.items()}
    loss64, values64 = objective(PackedTokens(logprob=lp64, entropy=ent64, **as64), settings, loss_denominator=denom)
    loss64.backward()
    assert set(values) == set(values64)
    # counts and sums of c_t are the same numbers on both sides (the branches are the same: RATIOS)
    for key in ("clipfrac_low", "clipfrac_high", "dualclip_frac", "num_tokens", "num_weight", "tis_weight"):
        assert float(values[key]) == pytest.approx(float(values64[key]), rel=1e-6, abs=0), key
    assert float(values["masked_tokens"]) == float(values64["masked_tokens"])
    assert float(values["kl"]) == 0.0 and float(values["kl_loss"]) == 0.0
    # the rest within the op's measured fp32 accuracy (tests/kernels/test_head_loss.py: log-prob <= 2.2e-6,
    # entropy <= 8.4e-7, gradients <= 1.1e-6 relative to their max): 10x
    scale = float(values64["num_weight"]) or 1.0
    for key in ("loss", "pg_loss"):
        assert abs(float(values[key]) - float(values64[key])) < 2e-5 * max(abs(float(values64[key])), 1.0), key
    for key in ("approx_kl", "ratio_mean", "entropy", "ratio_max"):
        assert float(values[key]) == pytest.approx(float(values64[key]), rel=2e-5, abs=2e-5 * scale), key
    for got, want in ((h32.grad, h64.grad), (w32.grad, w64.grad)):
        assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert float(values64["clipfrac_low"]) > 0 and float(values64["clipfrac_high"]) > 0


def _cfg(**algorithm) -> Config:
    cfg = Config()
    cfg.actor.head_loss = "one_pass"
    for key, value in algorithm.items():
        setattr(cfg.algorithm, key, value)
    return cfg


@pytest.mark.parametrize(
    "algorithm,named",
    [
        (dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_c=None), "policy_loss=gspo"),
        (dict(use_kl=True), "algorithm.use_kl=true"),
        (dict(bypass_old_logprobs=True, rejection="token", rejection_upper=2.0), "algorithm.bypass_old_logprobs"),
    ],
)
def test_one_pass_refuses_what_it_cannot_compute(algorithm, named):
    cfg = _cfg(**algorithm)
    assert len(one_pass_conflicts(cfg.algorithm)) == 1
    with pytest.raises(ValueError, match=f"'actor.head_loss': 'one_pass' is not allowed.*{named}"):
        validate(cfg)
    settings = ActorSettings(
        actor=cfg.actor, algorithm=cfg.algorithm, optimizer=OptimizerSettings.from_trainer(cfg.trainer), temperature=1
    )
    with pytest.raises(ValueError, match=f"actor.head_loss.*{named}"):  # settings built without validate()
        uses_one_pass(settings, device_type="cpu")


def test_one_pass_accepts_the_per_token_objectives_and_says_where_it_cannot_run():
    for algorithm in (dict(), dict(loss_agg_mode="seq-mean-token-mean", tis_cap=2.0), dict(bypass_old_logprobs=True)):
        assert one_pass_conflicts(_cfg(**algorithm).algorithm) == []
    cfg = _cfg()
    settings = ActorSettings(
        actor=cfg.actor, algorithm=cfg.algorithm, optimizer=OptimizerSettings.from_trainer(cfg.trainer), temperature=1
    )
    assert uses_one_pass(settings, device_type="cpu")  # TRITON_INTERPRET=1 (tests/conftest.py)
    with pytest.raises(ValueError, match="actor.head_loss=one_pass cannot run here.*actor.head_loss=separate"):
        uses_one_pass(settings, device_type="cuda")  # the interpreter needs CPU tensors
    cfg.actor.head_loss = "separate"
    assert not uses_one_pass(settings, device_type="cuda")  # the default needs no kernel
