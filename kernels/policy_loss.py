"""Fused DAPO policy loss: forward AND backward in one pass over the tokens, deterministic stats.

    from dapo_kernels import policy_loss
    loss, stats = policy_loss(logprob, old_logprob, advantages, mask, eps_low=0.2, eps_high=0.28,
                              clip_ratio_c=3.0, loss_denominator=global_num_tokens)
    loss.backward()   # d loss / d logprob was written by the forward kernel; backward scales it

Per token (DAPO_SPEC s5), with d = logp - old:
    r  = exp(clamp(d, -20, 20)),  l1 = -A r,  l2 = -A clip(r, 1 - eps_low, 1 + eps_high)
    l  = max(l1, l2);  if A < 0 and c is not None: l = min(l, -A c)
    loss = sum(mask * l) / loss_denominator          (token-mean with the global denominator)
Gradient, with torch's conventions (max/min split ties in half, clamp passes its closed range):
    dl/dr = -A if l1 > l2;  -A/2 * (1 + [r in range]) if l1 == l2;  0 if l1 < l2
            times 1 / 0 / 0.5 for l < / > / == -A c under the dual clip,
    dl/dlogp = dl/dr * r * [|d| <= 20],  grad = mask * dl/dlogp / loss_denominator.
Stage 1 (`_fused_kernel`): one program per BLOCK tokens writes the gradient and 8 per-block partial
sums [sum mask*l, sum mask, low, high, dual, kl, sum mask*r, max r]. Stage 2 (`_reduce_kernel`):
one program per statistic walks the partials in a fixed order. No atomics: bit-identical reruns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import INTERPRET, require_runnable
from .reference import POLICY_LOSS_STAT_KEYS, check_policy_loss_args

_NUM_PARTIALS = 8  # sum_l, num_tokens, clip_low, clip_high, dual, kl, ratio_sum, ratio_max
_BLOCK = 64 if INTERPRET else 2048
_REDUCE_BLOCK = 64 if INTERPRET else 1024


@triton.jit
def _fused_kernel(lp_ptr, old_ptr, adv_ptr, mask_ptr, grad_ptr, part_ptr, T, num_blocks,
                  eps_low, eps_high, clip_c, inv_denom, HAS_DUAL: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < T
    lp = tl.load(lp_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    mk = tl.load(mask_ptr + offs, mask=ok, other=0).to(tl.float32)

    d = lp - old
    in_clamp = (d >= -20.0) & (d <= 20.0)
    r = tl.exp(tl.minimum(tl.maximum(d, -20.0), 20.0))
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high
    in_range = (r >= lo) & (r <= hi)
    l1 = -adv * r
    l2 = -adv * tl.minimum(tl.maximum(r, lo), hi)
    loss = tl.maximum(l1, l2)
    g_r = tl.where(l1 > l2, -adv, tl.where(l1 == l2, -0.5 * adv * (1.0 + in_range.to(tl.float32)), 0.0))
    neg = adv < 0.0
    if HAS_DUAL:
        l3 = -adv * clip_c
        g_r = g_r * tl.where(neg, tl.where(loss < l3, 1.0, tl.where(loss == l3, 0.5, 0.0)), 1.0)
        loss = tl.where(neg, tl.minimum(loss, l3), loss)
        dual = (neg & (r > clip_c)).to(tl.float32)
    else:
        dual = tl.zeros([BLOCK], dtype=tl.float32)
    grad = mk * g_r * tl.where(in_clamp, r, 0.0) * inv_denom
    tl.store(grad_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=ok)

    low = (neg & (r < lo)).to(tl.float32)
    high = ((adv > 0.0) & (r > hi)).to(tl.float32)
    out = part_ptr + pid
    tl.store(out, tl.sum(mk * loss, axis=0))
    tl.store(out + num_blocks, tl.sum(mk, axis=0))
    tl.store(out + 2 * num_blocks, tl.sum(mk * low, axis=0))
    tl.store(out + 3 * num_blocks, tl.sum(mk * high, axis=0))
    tl.store(out + 4 * num_blocks, tl.sum(mk * dual, axis=0))
    tl.store(out + 5 * num_blocks, tl.sum(mk * 0.5 * d * d, axis=0))
    tl.store(out + 6 * num_blocks, tl.sum(mk * r, axis=0))
    tl.store(out + 7 * num_blocks, tl.max(tl.where(ok & (mk > 0.0), r, 0.0), axis=0))


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, num_blocks, BLOCK: tl.constexpr):
    # Program k reduces statistic k; row 7 (ratio max) takes a max, the others a sum. The loop
    # order and the final tl.sum tree are fixed, so the result is the same bit for bit every run.
    k = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for b0 in range(0, num_blocks, BLOCK):
        x = tl.load(part_ptr + k * num_blocks + b0 + offs, mask=b0 + offs < num_blocks, other=0.0)
        acc = tl.where(k == 7, tl.maximum(acc, x), acc + x)
    total = tl.where(k == 7, tl.max(acc, axis=0), tl.sum(acc, axis=0))
    tl.store(out_ptr + k, total)


class _PolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprob, old_logprob, advantages, mask, eps_low, eps_high, clip_ratio_c, loss_denominator):
        advantages = advantages.expand_as(logprob)  # [B, 1] per-sequence advantages -> per token
        flat = [t.reshape(-1).contiguous() for t in (logprob, old_logprob, advantages)]
        mask_flat = mask.reshape(-1).contiguous()
        if mask_flat.dtype == torch.bool:
            mask_flat = mask_flat.view(torch.uint8)
        num = flat[0].numel()
        num_blocks = max(1, triton.cdiv(num, _BLOCK))
        grad = torch.empty_like(flat[0])
        partials = torch.empty((_NUM_PARTIALS, num_blocks), device=grad.device, dtype=torch.float32)
        has_dual = clip_ratio_c is not None
        _fused_kernel[(num_blocks,)](*flat, mask_flat, grad, partials, num, num_blocks, float(eps_low),
                                    float(eps_high), float(clip_ratio_c) if has_dual else 0.0,
                                    1.0 / loss_denominator, HAS_DUAL=has_dual, BLOCK=_BLOCK)
        sums = torch.empty(_NUM_PARTIALS, device=grad.device, dtype=torch.float32)
        _reduce_kernel[(_NUM_PARTIALS,)](partials, sums, num_blocks, BLOCK=_REDUCE_BLOCK)
        ctx.save_for_backward(grad.view(logprob.shape))
        ctx.mark_non_differentiable(sums)
        return sums[0] / loss_denominator, sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None, None, None, None


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None,
    loss_denominator: float,
):
    """(loss, stats): loss = sum(mask * l) / loss_denominator (fp32 scalar, differentiable in
    logprob); stats are detached fp32 scalars keyed POLICY_LOSS_STAT_KEYS, means over the masked
    tokens of this call (0 when none is masked), num_tokens = sum(mask). clip_ratio_c=None disables
    the dual clip. CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; else RuntimeError."""
    check_policy_loss_args(logprob, old_logprob, advantages, mask, eps_low, eps_high, clip_ratio_c, loss_denominator)
    require_runnable(logprob, old_logprob, advantages, mask, op="policy_loss")
    loss, sums = _PolicyLoss.apply(logprob, old_logprob, advantages, mask, eps_low, eps_high, clip_ratio_c,
                                   float(loss_denominator))
    num = sums[1]
    denom = num.clamp(min=1.0)
    values = (sums[2] / denom, sums[3] / denom, sums[4] / denom, sums[5] / denom, sums[6] / denom, sums[7], num)
    return loss, dict(zip(POLICY_LOSS_STAT_KEYS, values))
