"""Fused DAPO policy loss (Triton: interpreted on CPU, compiled on a GPU) against float64,
kernels/reference.py and dapo_megatron.algo.policy_loss: value, gradient and stats; hand-computed
tokens; bit-identical reruns.

Run: pytest tests/kernels/test_policy_loss.py -q        (any device: see tests/kernels/conftest.py)
"""

from __future__ import annotations

import sys

import pytest
import torch
from kernels_device import DEVICE
from kernels_device import AtenOps as _AtenOps

import dapo_kernels._runtime as runtime
from dapo_kernels import policy_loss, policy_loss_reference
from dapo_kernels.reference import POLICY_LOSS_STAT_KEYS

KW = dict(eps_low=0.2, eps_high=0.28, clip_ratio_c=3.0)


def make_inputs(shape, *, seed, spread=0.6):
    """Ratios spanning every branch: below 1-eps_low, inside, above 1+eps_high, above c (drawn on
    the CPU, then moved: the same numbers on every device)."""
    gen = torch.Generator().manual_seed(seed)
    logprob = -torch.rand(shape, generator=gen) * 3
    old = logprob + torch.randn(shape, generator=gen) * spread
    adv = torch.randn(shape, generator=gen)
    mask = torch.rand(shape, generator=gen) > 0.25
    return tuple(t.to(DEVICE) for t in (logprob, old, adv, mask))


def on_device(*tensors):
    return tuple(t.to(DEVICE) for t in tensors)


def fused(logprob, old, adv, mask, **kw):
    logprob = logprob.clone().requires_grad_()
    loss, stats = policy_loss(logprob, old, adv, mask, **kw)
    loss.backward()
    return loss.detach(), logprob.grad, stats


def oracle(fn, logprob, old, adv, mask, *, dtype=torch.float64, **kw):
    logprob = logprob.to(dtype).requires_grad_()
    loss, stats = fn(logprob, old.to(dtype), adv.to(dtype), mask, **kw)
    loss.backward()
    return loss.detach(), logprob.grad, stats


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("clip_ratio_c", [3.0, None])
def test_matches_float64_reference(clip_ratio_c, one_pass, device):
    """606 tokens: 10 blocks in the interpreter (64 tokens each), so the one-pass launch's last
    program reduces 10 partials; one_pass=False is the first design (a second reduce launch)."""
    inputs = make_inputs((6, 101), seed=1)
    kw = dict(KW, clip_ratio_c=clip_ratio_c, loss_denominator=500.0, one_pass=one_pass)
    loss, grad, stats = fused(*inputs, **kw)
    kw.pop("one_pass")
    loss64, grad64, stats64 = oracle(policy_loss_reference, *inputs, **kw)
    assert stats64["dualclip_frac"].item() > (0.01 if clip_ratio_c else -1.0)  # every branch is hit
    assert stats64["clipfrac_low"].item() > 0.01 and stats64["clipfrac_high"].item() > 0.01
    assert abs(loss.item() - loss64.item()) < 1e-6 * max(1.0, abs(loss64.item()))
    assert grad.dtype == torch.float32 and grad.shape == inputs[0].shape
    assert (grad.double() - grad64).abs().max().item() < 1e-7  # |grad| <= ~e^1.5/500: fp32 rounding
    assert list(stats) == list(POLICY_LOSS_STAT_KEYS)
    for key in POLICY_LOSS_STAT_KEYS:
        assert abs(stats[key].item() - stats64[key].item()) < 1e-6 * max(1.0, abs(stats64[key].item())), key


def test_matches_algo_policy_loss(device):
    algo = pytest.importorskip("dapo_megatron.algo.policy_loss")
    inputs = make_inputs((4, 300), seed=2)
    kw = dict(KW, loss_denominator=4321.0)
    loss, grad, stats = fused(*inputs, **kw)
    loss_a, grad_a, stats_a = oracle(algo.policy_loss, *inputs, dtype=torch.float32, agg_mode="token-mean", **kw)
    assert set(stats) == set(stats_a) == set(algo.STAT_KEYS)
    assert abs(loss.item() - loss_a.item()) < 1e-6
    assert (grad - grad_a).abs().max().item() < 1e-8
    for key in stats:
        assert abs(stats[key].item() - stats_a[key].item()) < 1e-6 * max(1.0, abs(stats_a[key].item())), key


def test_hand_computed_tokens(device):
    """eps 0.2 / 0.28, c = 3, denominator 5 (one token of 5 is masked out), logp_old = 0:
    A=+1 r=1.5 -> l=-1.28 (clipped high, grad 0);  A=-1 r=0.5 -> l=0.8 (clipped low, grad 0);
    A=-1 r=4 -> l=3 (dual clip, grad 0);  A=-1 r=2 -> l=2, dl/dlogp = -A*r = 2;
    masked A=+1 r=1.1 -> nothing.  loss = (-1.28 + 0.8 + 3 + 2) / 5 = 0.904."""
    ratio = torch.tensor([1.5, 0.5, 4.0, 2.0, 1.1])
    logprob, adv, mask, old = on_device(
        ratio.log(),
        torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0]),
        torch.tensor([True, True, True, True, False]),
        torch.zeros(5),
    )
    loss, grad, stats = fused(logprob, old, adv, mask, **KW, loss_denominator=5)
    assert loss.item() == pytest.approx(0.904, abs=1e-6)
    assert grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 2.0 / 5, 0.0], abs=1e-7)
    assert stats["clipfrac_low"].item() == 0.25 and stats["clipfrac_high"].item() == 0.25
    assert stats["dualclip_frac"].item() == 0.25 and stats["num_tokens"].item() == 4
    assert stats["ratio_max"].item() == pytest.approx(4.0) and stats["ratio_mean"].item() == pytest.approx(2.0)
    assert stats["approx_kl"].item() == pytest.approx(sum(0.5 * r.log().item() ** 2 for r in ratio[:4]) / 4, abs=1e-6)


def test_log_ratio_clamp_stops_the_gradient(device):
    # |d| > 20: r = e^20 (A=+1: l1 < l2 anyway) or e^-20; the clamp passes no gradient.
    logprob, old, adv, mask = on_device(
        torch.tensor([-1.0, -30.0, -1.0]),
        torch.tensor([-30.0, -1.0, -1.0]),
        torch.tensor([-1.0, -1.0, 2.0]),
        torch.ones(3, dtype=torch.bool),
    )
    loss, grad, stats = fused(
        logprob, old, adv, mask, eps_low=0.2, eps_high=0.28, clip_ratio_c=None, loss_denominator=3
    )
    # token 0: A<0, r=e^20: l = max(e^20, 1.28) with grad 0 from the clamp; token 1: r=e^-20 clipped
    # low (grad 0); token 2: r = 1 inside the range: dl/dlogp = -A * r = -2, over 3.
    assert grad.tolist() == pytest.approx([0.0, 0.0, -2.0 / 3], abs=1e-7)
    assert loss.item() == pytest.approx((torch.exp(torch.tensor(20.0)).item() + 0.8 - 2.0) / 3, rel=1e-6)


def test_nothing_masked_gives_zero_stats_and_grad(device):
    logprob, old, adv, _ = make_inputs((3, 40), seed=3)
    nothing = torch.zeros(3, 40, dtype=torch.bool, device=device)
    loss, grad, stats = fused(logprob, old, adv, nothing, **KW, loss_denominator=7)
    assert loss.item() == 0.0 and not grad.any()
    assert all(stats[k].item() == 0.0 for k in POLICY_LOSS_STAT_KEYS)


def test_per_sequence_advantages_broadcast(device):
    logprob, old, adv, mask = make_inputs((3, 50), seed=7)
    per_seq = adv[:, :1]
    loss, grad, stats = fused(logprob, old, per_seq, mask, **KW, loss_denominator=99.0)
    loss_t, grad_t, stats_t = fused(logprob, old, per_seq.expand(3, 50).contiguous(), mask, **KW, loss_denominator=99.0)
    assert torch.equal(loss, loss_t) and torch.equal(grad, grad_t)
    loss64, _, _ = oracle(policy_loss_reference, logprob, old, per_seq, mask, **KW, loss_denominator=99.0)
    assert abs(loss.item() - loss64.item()) < 1e-6


def test_one_launch_no_sync_no_copies(monkeypatch, device):
    """The host side of the default call (the fixed ~0.3 ms of the first H100 run), with the Triton
    launches replaced by recorders (the interpreter's own argument copies would hide the wrapper's):
    one launch of the fused kernel, none of the reduce kernel, no .item() (aten._local_scalar_dense),
    and with contiguous inputs and [B, 1] advantages exactly two allocations (the gradient; loss +
    stats + partials in one buffer): no expanded advantages, no copies. Then the real call: values
    against float64, and the arrival counter left at 0 for the next call."""
    policy_loss_mod = sys.modules["dapo_kernels.policy_loss"]  # the package attribute is the function
    logprob, old, adv, mask = make_inputs((4, 300), seed=8)
    per_seq = adv[:, :1].contiguous()
    launches = []

    class _Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, kw.get("ADV_PER_ROW")))

    with monkeypatch.context() as patch:
        patch.setattr(policy_loss_mod, "_fused_kernel", _Recorder("fused"))
        patch.setattr(policy_loss_mod, "_reduce_kernel", _Recorder("reduce"))
        lp = logprob.clone().requires_grad_()
        with _AtenOps() as forward_ops:
            policy_loss(lp, old, per_seq, mask, **KW, loss_denominator=1000.0)
    assert launches == [("fused", True)]
    assert "_local_scalar_dense" not in forward_ops.ops
    allocations = [
        op
        for op in forward_ops.ops
        if op.startswith(("empty", "zeros", "clone", "copy", "expand", "_to_copy", "contiguous", "ones", "full"))
    ]
    assert allocations == ["empty_like", "empty"], forward_ops.ops

    lp = logprob.clone().requires_grad_()
    loss, stats = policy_loss(lp, old, per_seq, mask, **KW, loss_denominator=1000.0)
    assert policy_loss_mod._COUNTERS[lp.device].item() == 0
    with _AtenOps() as backward_ops:
        loss.backward()
    assert "_local_scalar_dense" not in backward_ops.ops
    loss64, grad64, _ = oracle(policy_loss_reference, logprob, old, per_seq, mask, **KW, loss_denominator=1000.0)
    assert abs(loss.item() - loss64.item()) < 1e-6
    assert (lp.grad.double() - grad64).abs().max().item() < 1e-7


def test_float_mask_weights(device):
    logprob, old, adv, mask = make_inputs((2, 90), seed=4)
    weights = mask.float() * 0.5
    loss, grad, stats = fused(logprob, old, adv, weights, **KW, loss_denominator=33.0)
    loss64, grad64, stats64 = oracle(policy_loss_reference, logprob, old, adv, weights, **KW, loss_denominator=33.0)
    assert abs(loss.item() - loss64.item()) < 1e-6
    assert (grad.double() - grad64).abs().max().item() < 1e-7
    assert stats["num_tokens"].item() == pytest.approx(0.5 * mask.sum().item())


def test_bit_identical_reruns(device):
    """Reruns, and the one-launch design against the two-launch one: same partials, same order."""
    inputs = make_inputs((2500,), seed=5)
    first = fused(*inputs, **KW, loss_denominator=2500)
    second = fused(*inputs, **KW, loss_denominator=2500)
    two_launch = fused(*inputs, **KW, loss_denominator=2500, one_pass=False)
    for other in (second, two_launch):
        assert torch.equal(first[0], other[0]) and torch.equal(first[1], other[1])
        assert all(torch.equal(first[2][k], other[2][k]) for k in POLICY_LOSS_STAT_KEYS)


def test_bad_inputs_raise_value_error(device):
    logprob, old, adv, mask = make_inputs((10,), seed=6)
    with pytest.raises(ValueError, match="advantages .* must have the shape"):
        policy_loss(logprob, old, adv[:5], mask, **KW, loss_denominator=1)
    with pytest.raises(ValueError, match="loss_denominator"):
        policy_loss(logprob, old, adv, mask, **KW, loss_denominator=0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logprob, old, adv, mask, eps_low=0.2, eps_high=0.2, clip_ratio_c=0.5, loss_denominator=1)
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss(logprob, old, adv, mask, eps_low=1.2, eps_high=0.2, clip_ratio_c=None, loss_denominator=1)
    # [B, T] tokens: [B, 1] and [1, T] broadcast (accepted; the shapes check skips broadcast_shapes for
    # the first), [B, 2] and a [B, 1] against flat [B] tokens do not
    logprob, old, adv, mask = make_inputs((3, 4), seed=7)
    for ok in (adv[:, :1], adv[:1, :]):
        policy_loss(logprob, old, ok, mask, **KW, loss_denominator=1)
    with pytest.raises(ValueError, match=r"advantages \(3, 2\) must have the shape of logprob \(3, 4\)"):
        policy_loss(logprob, old, adv[:, :2], mask, **KW, loss_denominator=1)
    with pytest.raises(ValueError, match=r"advantages \(3, 1\) must have the shape of logprob \(3,\)"):
        policy_loss(logprob[:, 0], old[:, 0], adv[:, :1], mask[:, 0], **KW, loss_denominator=1)


def test_without_cuda_or_interpreter_the_fused_op_refuses(monkeypatch, device):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="policy_loss.*CUDA"):
        runtime.require_runnable(torch.zeros(2), op="policy_loss")
