"""The objective's registries (algo/registry.py): GSPO against hand-computed values, GRPO's symmetric clip
equal to DAPO's arithmetic, Dr. GRPO's advantages, the errors for unknown names, and the config keys
that select them (algorithm.policy_loss / algorithm.advantage) with their cross-key checks."""

from __future__ import annotations

import math
import typing
from pathlib import Path

import pytest
import torch

from dapo_megatron import config as config_module
from dapo_megatron.algo import (
    ADVANTAGES,
    POLICY_LOSSES,
    ClipSettings,
    LossTokens,
    ObjectiveSettings,
    PackedTokens,
    objective,
)
from dapo_megatron.config import load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "runs" / "tiny_cpu.yaml"
CLIP = ClipSettings(eps_low=0.2, eps_high=0.28, clip_ratio_c=None)

# algo/gspo.py's example: three packed sequences (ids 0, 1, 2), the last token of sequence 2 not trained
LOG_RATIO = [0.3, 0.1, -0.6, -0.4, -0.2, 0.5, 3.0]
SEQ_IDS = [0, 0, 1, 1, 1, 2, 2]
MASK = [1, 1, 1, 1, 1, 1, 0]
ADV = [1.0, 1.0, -1.0, -1.0, -1.0, 2.0, 2.0]


def _gspo_tokens():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.7, -1.5, -2.5], dtype=torch.float64)
    logp = (old + torch.tensor(LOG_RATIO, dtype=torch.float64)).requires_grad_(True)
    mask = torch.tensor(MASK, dtype=torch.float64)
    seq = torch.tensor(SEQ_IDS)
    n_seq = torch.tensor([2.0, 2.0, 3.0, 3.0, 3.0, 1.0, 1.0], dtype=torch.float64)  # trained tokens of t's sequence
    tokens = LossTokens(
        logprob=logp,
        old_logprob=old,
        advantages=torch.tensor(ADV, dtype=torch.float64),
        mask=mask,
        weight=mask / n_seq,
        seq_ids=seq,
        num_sequences=3,
        loss_denominator=3.0,
    )
    return tokens, logp


def test_gspo_matches_the_hand_computed_sequence_level_loss():
    tokens, logp = _gspo_tokens()
    loss, stats = POLICY_LOSSES.get("gspo")(tokens, CLIP)
    loss.backward()
    s0, s1, s2 = math.exp(0.2), math.exp(-0.4), math.exp(0.5)  # 1.2214 (in range), 0.6703 (< 0.8), 1.6487 (> 1.28)
    per_sequence = [-1.0 * s0, max(s1, 0.8), max(-2.0 * s2, -2.0 * 1.28)]
    assert per_sequence == pytest.approx([-1.221403, 0.8, -2.56], abs=1e-6)
    assert loss.item() == pytest.approx(sum(per_sequence) / 3, abs=1e-12)
    assert loss.item() == pytest.approx(-0.993801, abs=1e-6)
    # every token of sequence 0 gets -A * s0 / |y_0| / D; the clipped sequences and the untrained token none
    g0 = -1.0 * s0 / 2 / 3
    assert logp.grad.tolist() == pytest.approx([g0, g0, 0, 0, 0, 0, 0], abs=1e-12)
    assert g0 == pytest.approx(-0.203567, abs=1e-6)
    # stats over tokens, each with its sequence's ratio, weighted by w (each sequence weighs 1 of 3)
    assert stats["clipfrac_low"].item() == pytest.approx(1 / 3, abs=1e-6)  # sequence 1: A < 0, s < 0.8
    assert stats["clipfrac_high"].item() == pytest.approx(1 / 3, abs=1e-6)  # sequence 2: A > 0, s > 1.28
    assert stats["ratio_max"].item() == pytest.approx(s2, rel=1e-6)  # the untrained token's e^3 does not count
    assert stats["num_tokens"].item() == pytest.approx(3.0)


def test_gspo_differs_from_the_token_level_loss_on_the_same_tokens():
    """Sequence 0's tokens have ratios e^0.3 = 1.35 and e^0.1: token-level clip-higher clips the first
    (no gradient), GSPO's sequence ratio e^0.2 = 1.22 is in range, so both tokens get one."""
    tokens, logp = _gspo_tokens()
    loss, _ = POLICY_LOSSES.get("dapo")(tokens, CLIP)
    loss.backward()
    assert logp.grad[0].item() == 0.0 and logp.grad[1].item() != 0.0


def test_gspo_refuses_what_it_does_not_define():
    tokens, _ = _gspo_tokens()
    with pytest.raises(ValueError, match="actor.fused_policy_loss=false"):
        POLICY_LOSSES.get("gspo")(tokens, ClipSettings(eps_low=0.2, eps_high=0.28, clip_ratio_c=None, fused=True))
    with pytest.raises(ValueError, match="algorithm.clip_ratio_c=null"):
        POLICY_LOSSES.get("gspo")(tokens, ClipSettings(eps_low=0.2, eps_high=0.28, clip_ratio_c=10.0))


def test_grpo_is_dapos_arithmetic_with_one_symmetric_clip():
    """Rung 0 of the ladder: policy_loss=grpo computes, bit for bit, what dapo's function computes with
    eps_high = eps_low (what rung 0 ran before the registry), dual clip included."""
    tokens, _ = _gspo_tokens()
    symmetric = ClipSettings(eps_low=0.2, eps_high=0.2, clip_ratio_c=3.0)
    grpo_loss, grpo_stats = POLICY_LOSSES.get("grpo")(tokens, symmetric)
    dapo_loss, dapo_stats = POLICY_LOSSES.get("dapo")(tokens, symmetric)
    assert torch.equal(grpo_loss, dapo_loss)
    assert all(torch.equal(grpo_stats[k], dapo_stats[k]) for k in dapo_stats)
    with pytest.raises(ValueError, match=r"algorithm.eps_high=0.28 must equal algorithm.eps_low=0.2"):
        POLICY_LOSSES.get("grpo")(tokens, ClipSettings(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0))


def test_objective_with_gspo_under_seq_mean_token_mean_is_the_sequence_mean():
    """The actor's entry point: the aggregation weight m / n_seq makes GSPO's token form the mean of l_i."""
    tokens, logp = _gspo_tokens()
    packed = PackedTokens(
        logprob=logp,
        entropy=torch.zeros(7, dtype=torch.float64),
        old_logprob=tokens.old_logprob,
        advantages=tokens.advantages,
        loss_mask=tokens.mask,
        seq_ids=tokens.seq_ids,
        num_sequences=3,
        sequence_tokens=torch.tensor([2.0, 2.0, 3.0, 3.0, 3.0, 1.0, 1.0], dtype=torch.float64),
    )
    settings = ObjectiveSettings(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", clip=CLIP)
    loss, values = objective(packed, settings, loss_denominator=3.0)
    assert loss.item() == pytest.approx(-0.993801, abs=1e-6)
    assert values["num_tokens"].item() == 6.0 and values["kl_loss"].item() == 0.0


def test_drgrpo_advantages_center_without_the_std():
    # rewards [1, -1, -1, 1, -2] in groups [7, 7, 7, 3, 3]: means -1/3 and -1/2
    adv = ADVANTAGES.get("drgrpo")(torch.tensor([1.0, -1.0, -1.0, 1.0, -2.0]), torch.tensor([7, 7, 7, 3, 3]), eps=1e-6)
    assert adv.tolist() == pytest.approx([4 / 3, -2 / 3, -2 / 3, 1.5, -1.5], abs=1e-6)
    grpo = ADVANTAGES.get("grpo")(torch.tensor([1.0, -1.0, -1.0, 1.0, -2.0]), torch.tensor([7, 7, 7, 3, 3]), eps=1e-6)
    assert grpo.tolist() == pytest.approx([1.1547, -0.5774, -0.5774, 0.7071, -0.7071], abs=1e-4)


def test_an_unknown_name_is_refused_naming_the_key_and_the_registered_names():
    with pytest.raises(
        ValueError,
        match=r"algorithm.policy_loss='ppo' is not registered; registered: "
        r"\['dapo', 'grpo', 'gspo'\]",
    ):
        POLICY_LOSSES.get("ppo")
    with pytest.raises(
        ValueError, match=r"algorithm.advantage='rloo' is not registered; registered: \['drgrpo', 'grpo'\]"
    ):
        ADVANTAGES.get("rloo")
    with pytest.raises(ValueError, match="algorithm.policy_loss='ppo'"):
        ObjectiveSettings(policy_loss="ppo")


def test_the_config_keys_allow_exactly_the_registered_names():
    hints = typing.get_type_hints(config_module.AlgorithmConfig)
    assert sorted(typing.get_args(hints["policy_loss"])) == POLICY_LOSSES.names()
    assert sorted(typing.get_args(hints["advantage"])) == ADVANTAGES.names()
    with pytest.raises(ValueError, match="algorithm.policy_loss") as err:
        load_config(TINY, ["algorithm.policy_loss=ppo"])
    assert "gspo" in str(err.value)  # the allowed values are named


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["algorithm.policy_loss=grpo", "algorithm.loss_agg_mode=seq-mean-token-mean"], "algorithm.eps_high"),
        (["algorithm.policy_loss=grpo", "algorithm.eps_high=0.2"], "algorithm.loss_agg_mode"),
        (["algorithm.policy_loss=gspo"], "algorithm.loss_agg_mode"),
        (["algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-mean"], "algorithm.clip_ratio_c"),
        (
            [
                "algorithm.policy_loss=gspo",
                "algorithm.loss_agg_mode=seq-mean-token-mean",
                "algorithm.clip_ratio_c=null",
                "actor.fused_policy_loss=true",
            ],
            "actor.fused_policy_loss",
        ),
    ],
)
def test_each_loss_names_the_key_it_cannot_run_with(overrides, key):
    with pytest.raises(ValueError, match=f"config key '{key}'"):
        load_config(TINY, overrides)


def test_gspo_config_loads_with_its_keys():
    cfg = load_config(
        TINY,
        [
            "algorithm.policy_loss=gspo",
            "algorithm.loss_agg_mode=seq-mean-token-mean",
            "algorithm.clip_ratio_c=null",
            "algorithm.advantage=drgrpo",
        ],
    )
    assert (cfg.algorithm.policy_loss, cfg.algorithm.advantage) == ("gspo", "drgrpo")
