"""Rollout correction (algo/rollout_correction.py) and the mismatch metrics (algo/mismatch.py): each mode
against hand-computed values and a per-response float64 loop, the edge cases (a one-token response,
every token masked, ratios at exp(+-20) and beyond, an empty micro-batch), the objective's numerator
and denominator with a correction, the metrics' sums adding over shards, and the config keys."""

from __future__ import annotations

import math
import typing
from pathlib import Path

import pytest
import torch

from dapo_megatron import config as config_module
from dapo_megatron.algo import ClipSettings, ObjectiveSettings, PackedTokens, objective, policy_loss
from dapo_megatron.algo.mismatch import group_counts, masked_group_metrics, mismatch_metrics, mismatch_sums
from dapo_megatron.algo.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    CorrectionBounds,
    MismatchTokens,
    RolloutCorrection,
)
from dapo_megatron.config import load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "runs" / "tiny_cpu.yaml"
F64 = torch.float64

# response A: d = 0.1, -0.3, 0.5 and an untrained -15.0; response B: d = 2.0, -12.0; one padding token
D = [0.1, -0.3, 0.5, -15.0, 2.0, -12.0, 0.0]
MASK = [1, 1, 1, 0, 1, 1, 0]
SEQ = [0, 0, 0, 0, 1, 1, -1]


def _tokens(d=D, mask=MASK, seq=SEQ, num_sequences=2) -> MismatchTokens:
    return MismatchTokens(
        log_ratio=torch.tensor(d, dtype=F64),
        mask=torch.tensor(mask, dtype=F64),
        seq_ids=torch.tensor(seq),
        num_sequences=num_sequences,
    )


def _run(name: str, bounds: CorrectionBounds, tokens: MismatchTokens | None = None) -> list[float]:
    return ROLLOUT_CORRECTIONS.get(name)(tokens or _tokens(), bounds).tolist()


E = math.exp
S_A, S_B = 0.3, -10.0  # trained tokens only: A's untrained -15 is not in its sum
HAND = {
    # min(exp(d_t), 2); the untrained token and the padding get a value the loss multiplies by 0
    ("token_is", 2.0, 0.0): [E(0.1), E(-0.3), E(0.5), E(-15.0), 2.0, E(-12.0), 1.0],
    ("sequence_is", 2.0, 0.0): [E(S_A)] * 4 + [E(S_B)] * 2 + [1.0],
    ("token_reject", 2.0, 0.5): [1, 1, 1, 0, 0, 0, 1],
    ("sequence_reject", 1.5, 1 / 1.5): [1, 1, 1, 1, 0, 0, 1],
    # exp(mean) of A = exp(0.1) = 1.105 > 1.1: rejected here, where the sequence bound 1.5 kept it
    ("geometric_reject", 1.1, 1 / 1.1): [0, 0, 0, 0, 0, 0, 1],
    ("geometric_reject", 1.2, 1 / 1.2): [1, 1, 1, 1, 0, 0, 1],
    ("icepop", 2.0, 0.5): [E(0.1), E(-0.3), E(0.5), 0.0, 0.0, 0.0, 1.0],
    # B holds exp(-12) < 1e-4; A's exp(-15) is not trained, so A stays
    ("veto", math.inf, 1e-4): [1, 1, 1, 1, 0, 0, 1],
}


@pytest.mark.parametrize("name, upper, lower", list(HAND))
def test_each_correction_matches_the_hand_computed_factors(name, upper, lower):
    got = _run(name, CorrectionBounds(upper=upper, lower=lower))
    assert got == pytest.approx(HAND[(name, upper, lower)], rel=1e-15, abs=0)


def _reference(name: str, d: list[float], mask: list[int], seq: list[int], upper: float, lower: float) -> list[float]:
    """The factor of each token, one response at a time in Python floats (float64)."""
    out = []
    for dt, s in zip(d, seq):
        if s < 0:
            out.append(1.0)
            continue
        mine = [d[u] for u in range(len(d)) if seq[u] == s and mask[u]]
        total = sum(mine)
        mean = total / max(len(mine), 1)

        def ratio(x):
            return math.exp(min(max(x, -20.0), 20.0))

        value = {
            "token_is": min(ratio(dt), upper),
            "sequence_is": min(ratio(total), upper),
            "token_reject": float(lower <= math.exp(dt) <= upper),
            "sequence_reject": float(lower <= math.exp(total) <= upper),
            "geometric_reject": float(lower <= math.exp(mean) <= upper),
            "icepop": ratio(dt) if lower <= math.exp(dt) <= upper else 0.0,
            "veto": float(all(x >= math.log(lower) for x in mine)),
        }[name]
        out.append(value)
    return out


@pytest.mark.parametrize("name", ROLLOUT_CORRECTIONS.names())
def test_each_correction_equals_a_per_response_float64_loop(name):
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 7, 3, 12, 5, 1, 9, 4]
    seq = [i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * 3
    d = (0.4 * torch.randn(len(seq), generator=gen, dtype=F64)).tolist()
    d[5] = -11.0  # a catastrophic token in response 1
    mask = (torch.rand(len(seq), generator=gen) > 0.15).long().tolist()
    mask[-3:] = [0, 0, 0]
    upper, lower = (1.3, 1 / 1.3) if name != "veto" else (math.inf, 1e-4)
    mask[5] = 1
    got = _run(name, CorrectionBounds(upper=upper, lower=lower), _tokens(d, mask, seq, len(lengths)))
    want = _reference(name, d, mask, seq, upper, lower)
    trained = [m == 1 for m in mask]
    assert [g for g, t in zip(got, trained) if t] == pytest.approx([w for w, t in zip(want, trained) if t], rel=1e-13)
    if name.endswith(("_reject", "veto", "icepop")):
        kept = sum(1 for g, t in zip(got, trained) if t and g > 0)
        assert 0 < kept < sum(trained)  # the case is not vacuous: it keeps some tokens and masks others


def test_a_one_token_response_has_one_ratio_at_every_level():
    tokens = _tokens([0.4], [1], [0], 1)
    bounds = CorrectionBounds(upper=10.0, lower=0.1)
    values = {name: _run(name, bounds, tokens)[0] for name in ("token_is", "sequence_is", "icepop")}
    assert values == pytest.approx({"token_is": E(0.4), "sequence_is": E(0.4), "icepop": E(0.4)}, rel=1e-15)
    narrow = CorrectionBounds(upper=1.4, lower=0.9)  # e^0.4 = 1.49 leaves it at every level
    assert [_run(n, narrow, tokens)[0] for n in ("token_reject", "sequence_reject", "geometric_reject")] == [0, 0, 0]


def test_ratios_at_and_beyond_exp_20_stay_finite_and_compare_exactly():
    d = [20.0, 25.0, 1000.0, -20.0, -25.0, -1000.0]
    tokens = _tokens(d, [1] * 6, [0, 1, 2, 3, 4, 5], 6)
    token_is = _run("token_is", CorrectionBounds(upper=1e12), tokens)
    assert token_is == pytest.approx([E(20.0)] * 3 + [E(-20.0)] * 3, rel=1e-15)  # exponentiated from +-20
    assert _run("sequence_is", CorrectionBounds(upper=1e12), tokens) == token_is  # one token a response
    # the bounds compare the unclamped log ratio: exp(25) > 1e10 and exp(-25) < 1e-10 are outside
    icepop = _run("icepop", CorrectionBounds(upper=1e10, lower=1e-10), tokens)
    assert icepop == pytest.approx([E(20.0), 0.0, 0.0, E(-20.0), 0.0, 0.0], rel=1e-15)
    assert _run("veto", CorrectionBounds(lower=1e-10), tokens) == [1, 1, 1, 1, 0, 0]
    # a sequence of 100 tokens at d = 1: S = 100, truncated at the cap; exp(S) never formed unclamped
    long = _tokens([1.0] * 100, [1] * 100, [0] * 100, 1)
    assert set(_run("sequence_is", CorrectionBounds(upper=5.0), long)) == {5.0}
    sums, extremes = mismatch_sums(tokens, RolloutCorrection.from_keys(tis_cap=1e12))
    assert torch.isfinite(sums).all() and torch.isfinite(extremes).all()


def test_an_empty_micro_batch_gets_factor_one_and_metrics_of_nothing():
    padding = _tokens([0.0] * 4, [0] * 4, [-1] * 4, 0)
    every = RolloutCorrection.from_keys(seq_is_cap=2.0, rejection="geometric", rejection_upper=1.5, veto_threshold=1e-4)
    assert every.factor(padding).tolist() == [1.0] * 4
    nothing = _tokens([], [], [], 0)
    assert every.factor(nothing).shape == (0,)
    sums, extremes = mismatch_sums(nothing, every)
    assert sums.abs().sum() == 0 and (extremes == -math.inf).all()
    assert mismatch_metrics(sums.tolist(), extremes.tolist(), every) == {}


def test_corrections_multiply_in_the_order_of_the_keys():
    both = RolloutCorrection.from_keys(tis_cap=2.0, rejection="sequence", rejection_upper=1.5, veto_threshold=1e-4)
    assert [name for name, _ in both.steps] == ["token_is", "sequence_reject", "veto"]
    assert both.steps[1][1] == CorrectionBounds(upper=1.5, lower=1 / 1.5)  # the lower bound defaults to 1 / U
    want = [E(0.1), E(-0.3), E(0.5), E(-15.0), 0.0, 0.0, 1.0]  # B: rejected and vetoed
    assert both.factor(_tokens()).tolist() == pytest.approx(want, rel=1e-15)
    with pytest.raises(ValueError, match="algorithm.rejection='token' needs algorithm.rejection_upper"):
        RolloutCorrection.from_keys(rejection="token")


# --- the objective with a correction ----------------------------------------------------------------


def _packed(correction_settings: dict, *, agg: str = "token-mean"):
    """Two responses of 3 and 2 trained tokens; the engine's log-probs make A's second token 3x less likely
    to the trainer (d = -ln 3) and B's tokens d = +0.05."""
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7], dtype=F64)
    rollout = old - torch.tensor([0.0, -math.log(3.0), 0.0, 0.05, 0.05], dtype=F64)
    logp = (old + torch.tensor([0.1, -0.1, 0.05, 0.2, -0.3], dtype=F64)).requires_grad_(True)
    seq = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.ones(5, dtype=F64)
    settings = ObjectiveSettings(
        loss_agg_mode=agg, clip=ClipSettings(eps_low=0.2, eps_high=0.28, clip_ratio_c=None), **correction_settings
    )
    tokens = PackedTokens(
        logprob=logp,
        entropy=torch.zeros(5, dtype=F64),
        old_logprob=old,
        advantages=torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0], dtype=F64),
        loss_mask=mask,
        seq_ids=seq,
        num_sequences=2,
        sequence_tokens=torch.tensor([3.0, 3.0, 3.0, 2.0, 2.0], dtype=F64),
        rollout_logprobs=rollout,
    )
    return tokens, settings, logp


def test_a_rejected_token_leaves_the_numerator_and_stays_in_the_token_mean_denominator():
    tokens, settings, logp = _packed({"rejection": "token", "rejection_upper": 2.0})
    loss, values = objective(tokens, settings, loss_denominator=5.0)
    kept = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0], dtype=F64)  # pi_old / pi_rollout = 1/3 < 1/2
    want, _ = policy_loss(
        logp, tokens.old_logprob, tokens.advantages, kept, eps_low=0.2, eps_high=0.28, loss_denominator=5.0
    )
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-15)
    assert float(values["masked_tokens"]) == 1.0 and float(values["num_tokens"]) == 5.0
    loss.backward()
    plain, _, plain_logp = _packed({})
    objective(plain, _, loss_denominator=5.0)[0].backward()
    # token 1 (r = e^-0.1, A = +1: unclipped) has a gradient unless rejected; token 4 is clipped low either way
    assert plain_logp.grad is not None and logp.grad is not None
    assert (
        plain_logp.grad[1] != 0 and logp.grad[1] == 0 and torch.equal(logp.grad[[0, 2, 3]], plain_logp.grad[[0, 2, 3]])
    )


def test_a_rejected_response_stays_in_the_sequence_mean_denominator():
    # seq-mean-token-mean: A (S = -ln 3, ratio 1/3) is rejected by L = 0.5, B (S = 0.1) kept; A leaves
    # the numerator and D still counts both sequences
    bounds = {"rejection": "sequence", "rejection_upper": 4.0, "rejection_lower": 0.5}
    tokens, settings, logp = _packed(bounds, agg="seq-mean-token-mean")
    loss, values = objective(tokens, settings, loss_denominator=2.0)
    # B: A = -1, r = e^0.2, e^-0.3 -> l = max(r, clip(r, 0.8, 1.28)) = e^0.2, 0.8
    assert float(loss.detach()) == pytest.approx((E(0.2) + 0.8) / 2 / 2, rel=1e-14)
    assert float(values["masked_tokens"]) == 3.0


def test_every_token_masked_gives_a_zero_loss_and_gradient():
    # both sequence ratios (1/3 and 1.105) leave [1/1.01, 1.01]
    tokens, settings, logp = _packed({"seq_is_cap": 2.0, "rejection": "sequence", "rejection_upper": 1.01})
    loss, values = objective(tokens, settings, loss_denominator=5.0)
    loss.backward()
    assert float(loss) == 0.0 and logp.grad is not None and (logp.grad == 0).all()
    assert float(values["masked_tokens"]) == 5.0


def test_tis_cap_keeps_todays_weight_bit_for_bit_and_a_given_correction_is_used_as_is():
    tokens, settings, _ = _packed({"tis_cap": 2.0})
    assert settings.rollout_correction.steps == (("token_is", CorrectionBounds(upper=2.0)),)
    _, values = objective(tokens, settings, loss_denominator=5.0)
    today = torch.clamp(torch.exp(tokens.old_logprob - tokens.rollout_logprobs), max=2.0)
    assert float(values["tis_weight"]) == float(today.sum())
    given = PackedTokens(**{**tokens.__dict__, "correction": torch.full((5,), 0.5, dtype=F64)})
    _, halved = objective(given, settings, loss_denominator=5.0)
    assert float(halved["tis_weight"]) == 2.5


# --- the mismatch metrics ---------------------------------------------------------------------------


def test_mismatch_metrics_by_hand():
    tokens = _tokens()
    correction = RolloutCorrection.from_keys(tis_cap=2.0, veto_threshold=1e-4)
    sums, extremes = mismatch_sums(tokens, correction)
    m = mismatch_metrics(sums.tolist(), extremes.tolist(), correction)
    d = [0.1, -0.3, 0.5, 2.0, -12.0]  # the trained tokens
    rho = [E(x) for x in d]
    w = [E(0.1), E(-0.3), E(0.5), 0.0, 0.0]  # B vetoed: A's weights under the cap 2
    want = {
        "mismatch/k1": -sum(d) / 5,
        "mismatch/k3": sum(r - 1 - x for r, x in zip(rho, d)) / 5,
        "mismatch/log_ppl_diff": (-S_A / 3 - S_B / 2) / 2,
        "mismatch/chi2_token": sum(r * r for r in rho) / 5 - 1,
        "mismatch/chi2_seq": (E(S_A) ** 2 + E(S_B) ** 2) / 2 - 1,
        "mismatch/ess_token": sum(rho) ** 2 / (5 * sum(r * r for r in rho)),
        "mismatch/ratio_max": E(2.0),
        "mismatch/ratio_min": E(-12.0),
        "correction/weight_mean": sum(w) / 5,
        "correction/ess": sum(w) ** 2 / (5 * sum(x * x for x in w)),
        "correction/masked_token_frac": 2 / 5,
        "correction/masked_response_frac": 1 / 2,
        "correction/vetoed_response_frac": 1 / 2,
        "correction/weight_max": E(0.5),
        "correction/weight_min": E(-0.3),
    }
    assert m == pytest.approx(want, rel=1e-13)
    assert mismatch_metrics(sums.tolist(), extremes.tolist(), RolloutCorrection()).keys() == {
        k for k in want if k.startswith("mismatch/")
    }


def test_mismatch_sums_of_shards_add_up_to_the_whole():
    """Two data-parallel shares holding whole responses: their sums added (and extremes maxed) give the
    metrics of the whole batch, not a mean of the shares' metrics."""
    gen = torch.Generator().manual_seed(4)
    lengths = [3, 9, 1, 6, 2]
    seq = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths))
    d = 0.5 * torch.randn(int(seq.numel()), generator=gen, dtype=F64)
    mask = torch.ones_like(d)
    correction = RolloutCorrection.from_keys(rejection="geometric", rejection_upper=1.2)
    whole = mismatch_sums(MismatchTokens(d, mask, seq, 5), correction)
    cut = sum(lengths[:2])
    first = mismatch_sums(MismatchTokens(d[:cut], mask[:cut], seq[:cut], 2), correction)
    second = mismatch_sums(MismatchTokens(d[cut:], mask[cut:], seq[cut:] - 2, 3), correction)
    assert torch.allclose(first[0] + second[0], whole[0], rtol=1e-14, atol=0)
    assert torch.equal(torch.maximum(first[1], second[1]), whole[1])
    metrics = mismatch_metrics((first[0] + second[0]).tolist(), whole[1].tolist(), correction)
    assert 0 < metrics["correction/masked_response_frac"] < 1
    assert metrics["mismatch/k3"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-13)


def test_a_group_counts_as_masked_only_when_every_response_of_it_is_masked_across_shards():
    """Groups 0 (A, B) and 1 (C): B is vetoed, so group 0 keeps A; C is vetoed, so group 1 trains nothing.
    Split over two shards (A | B, C), the summed counts say the same."""
    d = [0.1, 0.0, -12.0, 0.2, -11.0]
    seq = [0, 1, 1, 2, 2]
    tokens = _tokens(d, [1] * 5, seq, 3)
    veto = RolloutCorrection.from_keys(veto_threshold=1e-4)
    whole = group_counts(tokens, veto, group_index=torch.tensor([0, 0, 1]), num_groups=2)
    assert whole.tolist() == [[2.0, 1.0], [1.0, 1.0]]
    first = group_counts(_tokens(d[:1], [1], seq[:1], 1), veto, group_index=torch.tensor([0]), num_groups=2)
    rest = _tokens(d[1:], [1] * 4, [0, 0, 1, 1], 2)
    second = group_counts(rest, veto, group_index=torch.tensor([0, 1]), num_groups=2)
    assert torch.equal(first + second, whole)
    assert masked_group_metrics(whole) == {"correction/masked_groups": 1.0, "correction/masked_group_frac": 0.5}
    assert masked_group_metrics(second) == {"correction/masked_groups": 2.0, "correction/masked_group_frac": 1.0}


# --- configuration ----------------------------------------------------------------------------------


def test_the_config_keys_allow_exactly_the_registered_corrections():
    hints = typing.get_type_hints(config_module.AlgorithmConfig)
    levels = typing.get_args(typing.get_args(hints["rejection"])[0])
    names = {"icepop" if level == "icepop" else f"{level}_reject" for level in levels}
    assert sorted(names | {"token_is", "sequence_is", "veto"}) == ROLLOUT_CORRECTIONS.names()


def test_the_default_config_corrects_nothing():
    from dapo_megatron.actor.settings import ActorSettings, OptimizerSettings

    cfg = load_config(TINY)
    settings = ActorSettings(
        actor=cfg.actor,
        algorithm=cfg.algorithm,
        optimizer=OptimizerSettings.from_trainer(cfg.trainer),
        temperature=1.0,
    )
    assert not settings.objective().rollout_correction.active and not settings.objective().reads_rollout_logprobs


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["algorithm.tis_cap=2", "algorithm.seq_is_cap=3"], "algorithm.seq_is_cap"),
        (["algorithm.seq_is_cap=0.5"], "algorithm.seq_is_cap"),
        (["algorithm.rejection=token"], "algorithm.rejection_upper"),
        (["algorithm.rejection=token", "algorithm.rejection_upper=0.9"], "algorithm.rejection_upper"),
        (["algorithm.rejection_upper=2"], "algorithm.rejection_upper"),
        (["algorithm.rejection_lower=0.5"], "algorithm.rejection_lower"),
        (
            ["algorithm.rejection=sequence", "algorithm.rejection_upper=2", "algorithm.rejection_lower=1.5"],
            "algorithm.rejection_lower",
        ),
        (["algorithm.rejection=icepop", "algorithm.rejection_upper=2", "algorithm.tis_cap=2"], "algorithm.rejection"),
        (
            [
                "algorithm.policy_loss=gspo",
                "algorithm.loss_agg_mode=seq-mean-token-mean",
                "algorithm.clip_ratio_c=null",
                "algorithm.rejection=token",
                "algorithm.rejection_upper=2",
            ],
            "algorithm.rejection",
        ),
        (["algorithm.veto_threshold=1.5"], "algorithm.veto_threshold"),
        (["algorithm.veto_threshold=0"], "algorithm.veto_threshold"),
    ],
)
def test_combinations_that_make_no_sense_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ValueError, match=f"config key '{key}'"):
        load_config(TINY, overrides)


def test_sensible_combinations_load():
    cfg = load_config(
        TINY,
        [
            "algorithm.seq_is_cap=2",
            "algorithm.rejection=geometric",
            "algorithm.rejection_upper=1.001",
            "algorithm.veto_threshold=1e-4",
        ],
    )
    a = cfg.algorithm
    assert (a.seq_is_cap, a.rejection, a.rejection_upper, a.rejection_lower, a.veto_threshold) == (
        2.0,
        "geometric",
        1.001,
        None,
        1e-4,
    )


# --- the bypass: the engine's log-probs as pi_old -----------------------------------------------------


def test_the_bypass_is_refused_where_it_cannot_be_right_naming_the_keys():
    assert load_config(TINY, ["algorithm.bypass_old_logprobs=true"]).algorithm.bypass_old_logprobs
    with pytest.raises(ValueError, match="config key 'algorithm.tis_cap'.*bypass_old_logprobs"):
        load_config(TINY, ["algorithm.bypass_old_logprobs=true", "algorithm.tis_cap=2"])
    with pytest.raises(ValueError, match="config key 'algorithm.rejection'.*bypass_old_logprobs"):
        icepop = ["algorithm.rejection=icepop", "algorithm.rejection_upper=2"]
        load_config(TINY, ["algorithm.bypass_old_logprobs=true", *icepop])
    masks = ["algorithm.bypass_old_logprobs=true", "algorithm.rejection=geometric", "algorithm.rejection_upper=1.05"]
    assert load_config(TINY, [*masks, "algorithm.veto_threshold=1e-4"]).algorithm.veto_threshold == 1e-4
    with pytest.raises(ValueError, match="config key 'actor.cp'.*sequence-level rejection or the veto"):
        load_config(TINY, [*masks, "actor.cp=2", "actor.micro_batch_tokens=64"])
    token = ["algorithm.bypass_old_logprobs=true", "algorithm.rejection=token", "algorithm.rejection_upper=2"]
    assert load_config(TINY, [*token, "actor.cp=2", "actor.micro_batch_tokens=64"]).actor.cp == 2
    with pytest.raises(ValueError, match="config key 'algorithm.bypass_old_logprobs'.*rollout.max_staleness=1"):
        load_config(TINY, ["algorithm.bypass_old_logprobs=true", "rollout.max_staleness=1"])


def test_in_bypass_the_masks_read_the_current_policy_against_the_engine():
    """old_logprob is the engine's in bypass, and logp - old = [0.1, -0.1, 0.05, 0.2, -0.3]: the band
    [0.8, 1.25] keeps tokens 0-3 (e^0.2 = 1.221) and masks token 4 (e^-0.3 = 0.741). Without the bypass the
    same settings read pi_old / pi_rollout and mask token 1 (1/3)."""
    tokens, settings, logp = _packed({"rejection": "token", "rejection_upper": 1.25, "bypass": True})
    assert not settings.reads_rollout_logprobs  # the engine's log-probs are old_logprob itself
    bypassed = PackedTokens(**{**tokens.__dict__, "rollout_logprobs": None})
    _, values = objective(bypassed, settings, loss_denominator=5.0)
    assert float(values["masked_tokens"]) == 1.0 and float(values["tis_weight"]) == 4.0
    decoupled = ObjectiveSettings(
        clip=settings.clip, loss_agg_mode="token-mean", rejection="token", rejection_upper=1.25
    )
    _, values = objective(tokens, decoupled, loss_denominator=5.0)
    assert float(values["masked_tokens"]) == 1.0  # pi_old / pi_rollout: token 1 (1/3) is the one outside


def test_the_bypass_puts_the_engines_logprobs_in_place_of_pi_old():
    from dapo_megatron.dataplane.sample import Sample
    from dapo_megatron.dataplane.share import PackSettings, share_of_samples
    from dapo_megatron.trainer.train import bypass_old_logprobs

    samples = [
        Sample(prompt_ids=[5, 6], response_ids=[7, 8, 9], group_index=0, rollout_logprobs=[-0.5, -1.25, -2.0]),
        Sample(prompt_ids=[5], response_ids=[10], group_index=0, rollout_logprobs=[-0.125]),
    ]
    pack = PackSettings(micro_batch_tokens=64)
    share = share_of_samples(samples, settings=pack, dp_size=1, dp_rank=0)
    assert bypass_old_logprobs(share, None) == {}  # nothing measured: no trainer log-probs
    assert share.batch.old_logprobs is not None and share.batch.rollout_logprobs is not None
    assert torch.equal(share.batch.old_logprobs, share.batch.rollout_logprobs)
    assert sorted(share.batch.old_logprobs.tolist()) == [-2.0, -1.25, -0.5, -0.125]
    bare = share_of_samples(
        [Sample(prompt_ids=[5], response_ids=[7], group_index=0)], settings=pack, dp_size=1, dp_rank=0
    )
    with pytest.raises(ValueError, match="algorithm.bypass_old_logprobs=true needs the engines' log-probs"):
        bypass_old_logprobs(bare, None)


@pytest.mark.parametrize(
    "preset, overrides, share",
    [
        ("qwen3-30b-a3b_dapo.yaml", [], "~20%"),  # full recompute: 1 forward vs 4
        ("qwen2.5-7b_dapo.yaml", [], "~25%"),  # selective recompute: 1 forward vs 3
        ("qwen2.5-7b_dapo.yaml", ["algorithm.bypass_old_logprobs=true"], "~25%"),
    ],
)
def test_plan_predicts_what_the_bypass_saves(preset, overrides, share):
    from dapo_megatron.memplan.plan import build_plan

    cfg = load_config(TINY.parent / preset, overrides)
    (line,) = [h for h in build_plan(cfg).header if "old-log-prob pass" in h]
    assert f"{share} of the actor's FLOPs per step" in line
    assert ("skipped" in line) == bool(overrides)
