"""policy_loss against hand-computed values (docs/algorithm.md 5): clip low, clip high, dual clip, agg modes,
and micro-batch accumulation with a global denominator equal to one big batch."""

import math

import pytest
import torch

from dapo_megatron.algo import STAT_KEYS, count_loss_units, policy_loss

EPS_LOW, EPS_HIGH, C = 0.2, 0.28, 3.0

# Two sequences of 4 tokens; sequence 0 has A = +1, sequence 1 has A = -1. Ratios r per token:
RATIOS = [[1.5, 1.0, 0.5, 5.0], [0.5, 4.0, 2.0, 1.1]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]  # the last token of sequence 0 is padding (its r = 5 must not count)
ADV = [[1.0], [-1.0]]
# Per-token loss l and gradient dl/dlogp (= dl/dr * r), clip range [0.8, 1.28], c = 3:
#  seq 0, A=+1: r=1.5 -> max(-1.5, -1.28) = -1.28, grad 0  (clipped high)
#               r=1.0 -> -1.0,                   grad -A*r = -1.0
#               r=0.5 -> max(-0.5, -0.8) = -0.5,  grad -0.5 (A > 0 and r < 0.8 is NOT clipped)
#  seq 1, A=-1: r=0.5 -> max(0.5, 0.8) = 0.8,     grad 0    (clipped low)
#               r=4.0 -> min(max(4, 1.28), 3) = 3, grad 0   (dual clip)
#               r=2.0 -> min(max(2, 1.28), 3) = 2, grad 2
#               r=1.1 -> 1.1,                     grad 1.1
LOSS_TOK = [[-1.28, -1.0, -0.5, 0.0], [0.8, 3.0, 2.0, 1.1]]
GRAD_TOK = [[0.0, -1.0, -0.5, 0.0], [0.0, 0.0, 2.0, 1.1]]


def _inputs(ratios=RATIOS):
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.7, -4.0, -1.5, -2.5]], dtype=torch.float64)
    logp = (old + torch.tensor(ratios, dtype=torch.float64).log()).requires_grad_(True)
    return logp, old, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)


def _run(**kw):
    logp, old, adv, mask = _inputs()
    loss, stats = policy_loss(logp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, **kw)
    loss.backward()
    return loss, logp.grad, stats


def test_token_mean_loss_and_gradient_hand_computed():
    loss, grad, stats = _run(clip_ratio_c=C)
    # sum of masked l = -1.28 - 1 - 0.5 + 0.8 + 3 + 2 + 1.1 = 4.12 over 7 tokens
    assert loss.item() == pytest.approx(4.12 / 7, abs=1e-12)
    assert torch.allclose(grad, torch.tensor(GRAD_TOK, dtype=torch.float64) / 7, atol=1e-12)
    assert set(stats) == set(STAT_KEYS)
    assert stats["clipfrac_low"].item() == pytest.approx(1 / 7)
    assert stats["clipfrac_high"].item() == pytest.approx(1 / 7)
    assert stats["dualclip_frac"].item() == pytest.approx(1 / 7)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 1 + 0.5 + 0.5 + 4 + 2 + 1.1) / 7, rel=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(4.0, rel=1e-6)  # the padded r = 5 is excluded
    kl = sum(0.5 * math.log(r) ** 2 for r in (1.5, 1.0, 0.5, 0.5, 4.0, 2.0, 1.1)) / 7
    assert stats["approx_kl"].item() == pytest.approx(kl, rel=1e-6)
    assert stats["num_tokens"].item() == 7
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_without_dual_clip_the_ratio_4_token_is_unbounded():
    loss, grad, stats = _run(clip_ratio_c=None)
    # the r = 4 token now costs -A*r = 4 (instead of 3) with gradient 4: sum = 4.12 + 1 = 5.12
    assert loss.item() == pytest.approx(5.12 / 7, abs=1e-12)
    expected = torch.tensor(GRAD_TOK, dtype=torch.float64)
    expected[1, 1] = 4.0
    assert torch.allclose(grad, expected / 7, atol=1e-12)
    assert stats["dualclip_frac"].item() == 0.0


def test_seq_mean_token_mean_hand_computed():
    loss, grad, _ = _run(clip_ratio_c=C, agg_mode="seq-mean-token-mean")
    # seq 0: (-1.28 - 1 - 0.5) / 3 = -0.92667; seq 1: (0.8 + 3 + 2 + 1.1) / 4 = 1.725; mean over 2
    assert loss.item() == pytest.approx((-2.78 / 3 + 6.9 / 4) / 2, abs=1e-12)
    expected = torch.tensor(GRAD_TOK, dtype=torch.float64)
    expected[0] /= 3 * 2
    expected[1] /= 4 * 2
    assert torch.allclose(grad, expected, atol=1e-12)


def test_seq_mean_token_sum_hand_computed():
    loss, grad, _ = _run(clip_ratio_c=C, agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx((-2.78 + 6.9) / 2, abs=1e-12)  # = 2.06
    assert torch.allclose(grad, torch.tensor(GRAD_TOK, dtype=torch.float64) / 2, atol=1e-12)


def test_per_token_advantages_equal_broadcast_per_sequence_ones():
    logp, old, adv, mask = _inputs()
    a, _ = policy_loss(logp, old, adv, mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, clip_ratio_c=C)
    b, _ = policy_loss(logp, old, adv.expand(2, 4).clone(), mask, eps_low=EPS_LOW, eps_high=EPS_HIGH, clip_ratio_c=C)
    assert a.item() == b.item()


def test_token_mean_accepts_flat_packed_tensors():
    logp, old, adv, mask = _inputs()
    flat, _ = policy_loss(
        logp.reshape(-1),
        old.reshape(-1),
        adv.expand(2, 4).reshape(-1),
        mask.reshape(-1),
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        clip_ratio_c=C,
    )
    assert flat.item() == pytest.approx(4.12 / 7, abs=1e-12)


def test_log_ratio_is_clamped_at_20():
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[30.0, -30.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[-1.0]], dtype=torch.float64)
    loss, stats = policy_loss(
        logp, old, adv, torch.ones(1, 2), eps_low=0.2, eps_high=0.2, clip_ratio_c=None, agg_mode="seq-mean-token-sum"
    )
    loss.backward()
    # r = e^20 (clamped) -> l = e^20; r = e^-20 -> clipped low -> l = 0.8; gradient 0 through the clamp
    assert loss.item() == pytest.approx(math.exp(20) + 0.8, rel=1e-12)
    assert logp.grad.abs().sum().item() == 0.0
    assert stats["ratio_max"].item() == pytest.approx(math.exp(20), rel=1e-6)


def _random_batch(seed, batch=6, length=5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    logp = old + (torch.rand(batch, length, generator=g, dtype=torch.float64) - 0.5) * 1.5  # r in [0.47, 2.1]
    adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=g) > 0.3).double()
    mask[2] = 0  # a fully padded sequence
    return logp, old, adv, mask


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_three_micro_batches_with_global_denominator_equal_one_batch(agg_mode):
    logp, old, adv, mask = _random_batch(0)
    kw = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0, agg_mode=agg_mode)
    big = logp.clone().requires_grad_(True)
    loss_big, _ = policy_loss(big, old, adv, mask, **kw)
    loss_big.backward()

    denominator = sum(count_loss_units(m, agg_mode=agg_mode) for m in mask.split(2))
    assert denominator == count_loss_units(mask, agg_mode=agg_mode)
    small = logp.clone().requires_grad_(True)
    total = 0.0
    for k, rows in enumerate(torch.arange(6).split(2)):  # 3 micro-batches of 2 sequences
        # the denominator may be a python number or a tensor (an all-reduced count)
        denom = denominator if k % 2 else torch.tensor(float(denominator))
        loss_mb, _ = policy_loss(small[rows], old[rows], adv[rows], mask[rows], loss_denominator=denom, **kw)
        loss_mb.backward()
        total += loss_mb.item()
    assert total == pytest.approx(loss_big.item(), abs=1e-12)
    assert torch.allclose(small.grad, big.grad, atol=1e-14)


def test_per_micro_batch_denominator_would_differ():
    # the reason for loss_denominator: averaging each micro-batch separately is NOT the big-batch loss
    logp, old, adv, mask = _random_batch(1)
    kw = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)
    big, _ = policy_loss(logp, old, adv, mask, **kw)
    local = sum(policy_loss(logp[r], old[r], adv[r], mask[r], **kw)[0].item() for r in torch.arange(6).split(2)) / 3
    assert abs(local - big.item()) > 1e-3


def test_count_loss_units():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert count_loss_units(mask, agg_mode="token-mean") == 3
    assert count_loss_units(mask, agg_mode="seq-mean-token-mean") == 2  # the empty sequence does not count


def test_empty_mask_gives_zero_loss_not_nan():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(2, 3), torch.ones(2, 1), torch.zeros(2, 3), eps_low=0.2, eps_high=0.28)
    assert loss.item() == 0.0 and stats["num_tokens"].item() == 0 and stats["ratio_max"].item() == 0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(agg_mode="seq-mean"), "agg_mode"),
        (dict(eps_low=-0.1), "eps_low"),
        (dict(clip_ratio_c=0.5), "clip_ratio_c"),
        (dict(loss_denominator=0), "loss_denominator"),
    ],
)
def test_bad_arguments_raise(kw, match):
    args = dict(eps_low=0.2, eps_high=0.28)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 1), torch.ones(2, 3), **args)


def test_one_dimensional_advantages_with_2d_logprob_raise():
    with pytest.raises(ValueError, match=r"\[B, 1\]"):
        policy_loss(torch.zeros(3, 3), torch.zeros(3, 3), torch.ones(3), torch.ones(3, 3), eps_low=0.2, eps_high=0.2)
