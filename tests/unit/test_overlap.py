"""Overlapped steps (rollout.max_staleness): the off-policy maths against float64 references, the
staleness bookkeeping (versions, histogram, the filter that never lets a sample staler than k
through), the timeline's hidden fraction on hand-made stamps, and the config rules."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_megatron.algo import policy_loss
from dapo_megatron.algo.off_policy import behaviour_weight, staleness_histogram
from dapo_megatron.config import load_config
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.rollout.async_rollout import accepted_versions, filter_stale, sample_staleness, version_number
from dapo_megatron.trainer.timeline import hidden_fraction, step_wall_times


def test_behaviour_weight_by_hand():
    prox = torch.tensor([-1.0, -0.5, -2.0, -0.1])
    mu = torch.tensor([-1.0, -1.5, -1.0, -0.1 - math.log(1.5)])
    # exp(0) = 1; exp(1) = 2.718 -> cap 2; exp(-1) = 0.3679; exp(log 1.5) = 1.5
    w = behaviour_weight(prox, mu, 2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, math.exp(-1.0), 1.5], rel=1e-6)


def _decoupled_loss_f64(logp, prox, mu, adv, mask, *, eps_low, eps_high, c, cap):
    """The decoupled objective written out token by token in float64 (docs/architecture.md)."""
    total, count = 0.0, 0.0
    for lp, px, m, a, k in zip(logp.tolist(), prox.tolist(), mu.tolist(), adv.tolist(), mask.tolist()):
        r = math.exp(lp - px)
        loss = max(-a * r, -a * min(max(r, 1 - eps_low), 1 + eps_high))
        if a < 0:
            loss = min(loss, -a * c)
        total += k * min(math.exp(px - m), cap) * loss
        count += k
    return total / count


def test_decoupled_loss_matches_float64_reference():
    g = torch.Generator().manual_seed(3)
    n = 64
    prox = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    mu = prox + torch.randn(n, generator=g, dtype=torch.float64) * 0.7  # stale weights: far from pi_prox
    logp = (prox + torch.randn(n, generator=g, dtype=torch.float64) * 0.4).requires_grad_(True)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.2).double()
    w = behaviour_weight(prox, mu, 2.0)
    assert (w == 2.0).any() and (w < 1).any()  # both the truncation and down-weighting are exercised
    loss, _ = policy_loss(
        logp, prox, adv, mask * w, eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0, loss_denominator=mask.sum()
    )
    ref = _decoupled_loss_f64(logp.detach(), prox, mu, adv, mask, eps_low=0.2, eps_high=0.28, c=3.0, cap=2.0)
    assert loss.item() == pytest.approx(ref, rel=1e-12, abs=1e-14)
    # no gradient flows through the weight: only pi_theta is differentiated
    loss.backward()
    eps = 1e-6
    i = int(torch.nonzero(mask)[0])
    bumped = logp.detach().clone()
    bumped[i] += eps
    num = (_decoupled_loss_f64(bumped, prox, mu, adv, mask, eps_low=0.2, eps_high=0.28, c=3.0, cap=2.0) - ref) / eps
    assert logp.grad[i].item() == pytest.approx(num, rel=1e-4, abs=1e-8)


def test_staleness_histogram():
    hist = staleness_histogram(torch.tensor([0, 1, 1, 3, 2, 0, 1]), 1)
    assert hist.tolist() == [2, 3, 2]  # 0, 1, and '> 1' (the 3 and the 2)
    with pytest.raises(ValueError, match="negative staleness"):
        staleness_histogram(torch.tensor([0, -1]), 1)


def test_versions():
    assert version_number("default") == 0 and version_number("step_17") == 17
    with pytest.raises(ValueError, match="weight_version 'v3'"):
        version_number("v3")
    assert accepted_versions(0, 1) == {"default", "step_0"}
    assert accepted_versions(1, 1) == {"default", "step_0", "step_1"}
    assert accepted_versions(5, 2) == {"step_3", "step_4", "step_5"}


def _sample(*versions: str) -> Sample:
    return Sample(prompt_ids=[1], response_ids=[2], group_index=-1, extra={"weight_versions": list(versions)})


def test_filter_never_passes_a_sample_staler_than_k():
    groups = [
        [_sample("step_4"), _sample("step_5")],  # staleness 1 and 0 at step 5
        [_sample("step_3", "step_4"), _sample("step_5")],  # a partial rollout begun under step_3: 2 > k
        [_sample("step_5"), _sample("step_5")],
    ]
    kept, stats = filter_stale(groups, step=5, max_staleness=1)
    assert [[sample_staleness(x, 5) for x in g] for g in kept] == [[1, 0], [0, 0]]
    assert [x.group_index for g in kept for x in g] == [0, 0, 1, 1]  # renumbered for the advantages
    assert stats["overlap/staleness_0"] == 4 and stats["overlap/staleness_1"] == 1
    assert stats["overlap/staleness_gt1"] == 1 and stats["overlap/groups_dropped_stale"] == 1
    assert stats["overlap/staleness_mean"] == pytest.approx(1 / 4)


def test_hidden_fraction_by_hand():
    timeline = [
        ("generate", 0, 0.0, 4.0),
        ("train", 0, 4.0, 6.0),
        ("sync", 0, 6.0, 6.5),
        ("generate", 1, 4.0, 8.0),  # under train 0 (2 s) and sync 0 (0.5 s)
        ("train", 1, 8.0, 10.0),
        ("sync", 1, 10.0, 10.5),
        ("generate", 2, 9.0, 12.0),  # under 1 s of train 1 and the 0.5 s sync; 8..9 idle
    ]
    h = hidden_fraction(timeline)
    assert h["generate_s"] == 11.0 and h["train_s"] == 5.0 and h["overlap_s"] == 4.0
    assert h["hidden_fraction"] == pytest.approx(4.0 / 5.0)
    assert step_wall_times(timeline) == [4.0]
    assert h["engine_s"] == 0.0 and h["engine_hidden_fraction"] == 0.0  # no engine stamps: nothing claimed


def test_engine_stamps_by_hand():
    from dapo_megatron.rollout.async_rollout import engine_phases
    from dapo_megatron.rollout.sampler import engine_span

    # request_received_ts + e2e_latency (SGLang with --enable-metrics, and the CPU engine) ...
    assert engine_span({"meta_info": {"request_received_ts": 100.0, "e2e_latency": 2.5}}, received=103.0) == (
        100.0,
        102.5,
    )
    # ... else the span ends when the reply arrived; no latency, no span
    assert engine_span({"meta_info": {"e2e_latency": 2.0}}, received=103.0) == (101.0, 103.0)
    assert engine_span({"meta_info": {}}, received=103.0) is None
    # a batch's replies: overlapping spans merge, a gap stays a gap
    spans = [(1.0, 3.0), (2.0, 4.0), (6.0, 7.0), (3.5, 4.5)]
    assert engine_phases(spans, 5) == [("engine", 5, 1.0, 4.5), ("engine", 5, 6.0, 7.0)]
    timeline = [*engine_phases(spans, 0), ("train", 0, 4.0, 6.5), ("sync", 0, 6.5, 7.0)]
    h = hidden_fraction(timeline)
    # engines busy 4.5 s, trainer 3 s; both at once: 4.0..4.5 and 6.0..7.0 = 1.5 s of the shorter 3 s
    assert h["engine_s"] == 4.5 and h["engine_overlap_s"] == 1.5 and h["engine_hidden_fraction"] == 0.5


def test_config_rules(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rollout: {engine: cpu}\n")
    with pytest.raises(ValueError, match=r"rollout.max_staleness.*rollout.placement='colocated'"):
        load_config(str(cfg), ["rollout.max_staleness=1", "algorithm.tis_cap=2"])
    with pytest.raises(ValueError, match=r"rollout.max_staleness.*algorithm.tis_cap"):
        load_config(str(cfg), ["rollout.max_staleness=1", "rollout.placement=disaggregated"])
    ok = load_config(str(cfg), ["rollout.max_staleness=2", "rollout.placement=disaggregated", "algorithm.tis_cap=2"])
    assert ok.rollout.max_staleness == 2
    assert load_config(str(cfg), []).rollout.max_staleness == 0


def test_sampler_accepts_only_the_versions_it_is_given():
    from dapo_megatron.rollout.sampler import RolloutSampler, RolloutSettings

    settings = RolloutSettings(n=1, max_new_tokens=4, gen_batch_size=1)
    sampler = RolloutSampler(pool=None, tokenizer=None, settings=settings, rid_prefix="s")

    def reply(*versions):
        return [{"meta_info": {"weight_version": versions[-1], "weight_versions": [{"version": v} for v in versions]}}]

    sampler.weight_version = "step_3"
    assert not sampler.is_stale(reply("step_3")) and sampler.is_stale(reply("step_2", "step_3"))  # synchronous
    sampler.accepted_versions = accepted_versions(4, 1)  # batch 4 at staleness 1: step_3, step_4
    assert not sampler.is_stale(reply("step_3", "step_4"))  # a partial rollout across the push
    assert sampler.is_stale(reply("step_2", "step_3")) and sampler.is_stale(reply("step_5"))


def test_an_eval_between_steps_has_its_own_labelled_lane(tmp_path):
    """The held-out eval between steps 2 and 3 is an "eval" bar (step 3), not an unlabelled gap."""
    from dapo_megatron.trainer.timeline import plot_timeline, read_timeline, write_timeline

    timeline = [
        ("generate", 2, 0.0, 1.0),
        ("train", 2, 1.0, 2.0),
        ("sync", 2, 2.0, 2.1),
        ("eval", 3, 2.1, 4.0),
        ("generate", 3, 4.0, 5.0),
    ]
    path = write_timeline(timeline, tmp_path)
    assert ("eval", 3, 2.1, 4.0) in read_timeline(path)
    rows = [{"phase": p, "step": s, "start": a, "end": b} for p, s, a, b in timeline]
    assert plot_timeline(rows, tmp_path / "t.png") == ["generate", "train", "sync", "eval"]
    assert (tmp_path / "timeline.png").stat().st_size > 0
