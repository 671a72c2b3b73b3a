"""Inputs, the fused call and the float64 oracle shared by the LM-head kernel tests (test_logprob.py,
test_logprob_tma.py)."""

from __future__ import annotations

import torch
from kernels_device import DEVICE

from dapo_kernels import linear_logprob_entropy, linear_logprob_entropy_reference


def make_inputs(n, h, v, *, dtype, seed, offset=0.0, scale=0.3, device=DEVICE, vocab_size=None):
    """hidden, weight, targets, and upstream grads for logprob and entropy (drawn on the CPU, then
    moved: the same numbers on every device). Targets are < vocab_size (default v).

    offset shifts EVERY logit by the same amount: column 0 of hidden is 100 and of weight offset/100,
    so z_j = offset + (random part); the log-softmax is unchanged, fp32 has to cope with it. The
    random parts are then multiples of 2^-5, so every product is a multiple of 2^-10 and every
    partial sum of the dot product (|z| < 16384, fp32 spacing 2^-10) is exact in any summation
    order: the test measures the kernel's softmax at +-1e4, not the BLAS's order of additions
    (with unrounded inputs a 32-term fp32 dot at 1e4 is off by up to ~4 spacings on its own)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * scale
    if offset:
        hidden, weight = (torch.round(t * 32) / 32 for t in (hidden, weight))
        hidden[:, 0] = 100.0
        weight[:, 0] = offset / 100.0
    targets = torch.randint(0, vocab_size or v, (n,), generator=gen)
    g_lp = torch.randn(n, generator=gen)
    g_ent = torch.randn(n, generator=gen)
    return tuple(t.to(device) for t in (hidden.to(dtype), weight.to(dtype), targets, g_lp, g_ent))


def run_fused(
    hidden, weight, targets, g_lp, g_ent, *, temperature=1.0, return_entropy=True, impl=linear_logprob_entropy, **kw
):
    hidden = hidden.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    lp, ent = impl(hidden, weight, targets, temperature=temperature, return_entropy=return_entropy, **kw)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if return_entropy else 0.0)
    loss.backward()
    return lp.detach(), (ent.detach() if ent is not None else None), hidden.grad, weight.grad


def run_oracle(hidden, weight, targets, g_lp, g_ent, *, temperature=1.0, return_entropy=True):
    """float64 on the same (upcast) inputs: the exact answer the fp32 accumulation approximates."""
    hidden = hidden.double().requires_grad_()
    weight = weight.double().requires_grad_()
    lp, ent = linear_logprob_entropy_reference(hidden, weight, targets, temperature=temperature)
    loss = (lp * g_lp.double()).sum() + ((ent * g_ent.double()).sum() if return_entropy else 0.0)
    loss.backward()
    return lp.detach(), ent.detach(), hidden.grad, weight.grad


def rel_err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def grad_tol(dtype):
    # The fused backward rounds dL/dlogits and the returned grads to the input dtype: one or two
    # roundings of relative size eps (fp16 2^-10, bf16 2^-7). fp32 sums ~V*N products in fp32: 1e-5.
    return max(2 * torch.finfo(dtype).eps, 1e-5)
