"""group_advantages, overlong shaping and KL estimators against hand-computed values."""

import math

import pytest
import torch

from dapo_megatron.algo import group_advantages, kl_penalty, overlong_filter_mask, overlong_penalty


def test_group_advantages_unsorted_ids_and_group_of_one():
    rewards = torch.tensor([1.0, -1.0, 5.0, -1.0, 1.0, -2.0], dtype=torch.float64)
    groups = torch.tensor([7, 3, 100, 7, 7, 3])  # arbitrary ids, interleaved; 100 is a group of one
    adv = group_advantages(rewards, groups, eps=0.0)
    # group 7 = [1, -1, 1]: mean 1/3, unbiased std sqrt(((2/3)^2*2 + (4/3)^2) / 2) = sqrt(4/3)
    s7 = math.sqrt(4 / 3)
    # group 3 = [-1, -2]: mean -1.5, std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    s3 = math.sqrt(0.5)
    # group 100 = [5]: mean 0, std 1 -> A = 5
    expected = [(1 - 1 / 3) / s7, 0.5 / s3, 5.0, (-1 - 1 / 3) / s7, (1 - 1 / 3) / s7, -0.5 / s3]
    assert adv.tolist() == pytest.approx(expected, abs=1e-12)


def test_group_advantages_eps_and_constant_group():
    # constant group: std 0 -> A = 0 / (0 + eps) = 0, not NaN
    adv = group_advantages([1.0, 1.0, 1.0, 1.0], [0, 0, 0, 0])
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    # [1, -1]: mean 0, std sqrt(2); eps = 1e-6 sits in the denominator
    adv = group_advantages(torch.tensor([1.0, -1.0], dtype=torch.float64), [4, 4])
    assert adv[0].item() == pytest.approx(1 / (math.sqrt(2) + 1e-6), abs=1e-15)
    # a group of one: (r - 0) / (1 + eps)
    assert group_advantages(torch.tensor([-1.0], dtype=torch.float64), [9]).item() == pytest.approx(-1 / (1 + 1e-6))


def test_group_advantages_dtype_and_errors():
    assert group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0])).dtype == torch.float32
    assert group_advantages(torch.tensor([], dtype=torch.float64), torch.tensor([], dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError, match="same length"):
        group_advantages([1.0, 2.0], [0])
    with pytest.raises(ValueError, match="integer"):
        group_advantages([1.0, 2.0], [0.0, 1.0])


def test_overlong_ramp_at_its_boundaries():
    # L_max 20480, L_cache 4096: the ramp starts after 16384
    lengths = torch.tensor([0, 16383, 16384, 16385, 18432, 20479, 20480, 20481, 99999])
    got = overlong_penalty(lengths, max_length=20480, buffer_length=4096).double()
    expected = [0.0, 0.0, 0.0, -1 / 4096, -0.5, -4095 / 4096, -1.0, -1.0, -1.0]
    assert got.tolist() == pytest.approx(expected, abs=1e-7)


def test_overlong_factor_and_zero_buffer():
    got = overlong_penalty([6, 8, 10, 11], max_length=10, buffer_length=4, factor=0.5)
    # expected max 6: L=8 -> (6-8)/4 * 0.5 = -0.25; L=10 -> -0.5; beyond -> -0.5
    assert got.tolist() == pytest.approx([0.0, -0.25, -0.5, -0.5])
    assert overlong_penalty([10, 11], max_length=10, buffer_length=0).tolist() == [0.0, -1.0]
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty([1], max_length=10, buffer_length=11)


def test_overlong_filter_mask():
    assert overlong_filter_mask([True, False, True]).tolist() == [0.0, 1.0, 0.0]


def test_kl_estimators_hand_computed():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -2.0, -0.25], dtype=torch.float64)
    d = [0.5, 0.0, -0.25]  # logp - ref
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx(d)
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.5 * x * x for x in d])
    # k3 = exp(ref - logp) - (ref - logp) - 1
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx([math.exp(-x) + x - 1 for x in d])


def test_kl_k3_clamps_and_gradient():
    logp = torch.tensor([0.0, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([50.0, -50.0], dtype=torch.float64)
    k3 = kl_penalty(logp, ref, "k3")
    # ref - logp = 50 -> clamp 20 -> e^20 - 21 -> clamp 10; -50 -> -20 -> e^-20 + 19 -> clamp 10
    assert k3.tolist() == [10.0, 10.0]
    x = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    kl_penalty(x, torch.zeros(1, dtype=torch.float64), "k3").sum().backward()
    # d/dlogp [exp(-logp) + logp - 1] = 1 - exp(-logp)
    assert x.grad.item() == pytest.approx(1 - math.exp(-0.3))
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")
