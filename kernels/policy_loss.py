"""Fused DAPO policy loss: forward AND backward in one pass over the tokens, deterministic stats.

    from dapo_kernels import policy_loss
    loss, stats = policy_loss(logprob, old_logprob, advantages, mask, eps_low=0.2, eps_high=0.28,
                              clip_ratio_c=3.0, loss_denominator=global_num_tokens)
    loss.backward()   # d loss / d logprob was written by the forward kernel; backward scales it

Per token (docs/algorithm.md s5), with d = logp - old:
    r  = exp(clamp(d, -20, 20)),  l1 = -A r,  l2 = -A clip(r, 1 - eps_low, 1 + eps_high)
    l  = max(l1, l2);  if A < 0 and c is not None: l = min(l, -A c)
    loss = sum(mask * l) / loss_denominator          (token-mean with the global denominator)
Gradient, with torch's conventions (max/min split ties in half, clamp passes its closed range):
    dl/dr = -A if l1 > l2;  -A/2 * (1 + [r in range]) if l1 == l2;  0 if l1 < l2
            times 1 / 0 / 0.5 for l < / > / == -A c under the dual clip,
    dl/dlogp = dl/dr * r * [|d| <= 20],  grad = mask * dl/dlogp / loss_denominator.
`_fused_kernel`: one program per BLOCK tokens writes the gradient and 8 per-block partial sums
[sum mask*l, sum mask, low, high, dual, kl, sum mask*r, max r]; the program that arrives last (an
acq_rel arrival counter, re-armed to 0 by that program) walks the partials in a fixed order and
writes the loss and the 7 stats (`_finish`). No atomics in the sums: bit-identical reruns. ONE launch
per call, no host sync, two allocations (gradient; loss + stats + partials in one buffer); [B, 1]
per-sequence advantages are read in place (token i reads row i // T), not expanded. The arrival
counter is one int32 per device: calls on one device are assumed to be ordered (one stream), as in
the trainer. Backward: one multiply by the upstream gradient.
The first design (one_pass=False, kept for the benchmark) reduced in a second launch (`_reduce_kernel`);
the first H100 run measured it at a fixed ~0.32 ms from 4M to 16M tokens: host-side work (two
launches, four allocations, the expanded advantages copy, Python around them), not bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._runtime import INTERPRET, require_runnable
from .reference import POLICY_LOSS_STAT_KEYS, check_policy_loss_args

_NUM_PARTIALS = 8  # sum_l, num_tokens, clip_low, clip_high, dual, kl, ratio_sum, ratio_max
_BLOCK = 64 if INTERPRET else 2048
_REDUCE_BLOCK = 64 if INTERPRET else 512


@triton.jit
def _clipped_token_loss(
    lp, old, adv, mk, eps_low, eps_high, clip_c, inv_denom, HAS_DUAL: tl.constexpr, SIZE: tl.constexpr
):
    """The per-token maths both loss kernels share (this one and policy_loss_persistent.py): the clipped
    loss, its gradient in logprob (mask and denominator applied), and what the statistics count.
    torch's conventions: max/min split ties in half, clamp passes its closed range; the ratio's exponent is
    clamped to [-20, 20] and its gradient is 0 outside. Returns (loss, grad, d, r, low, high, dual)."""
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
        dual = tl.zeros([SIZE], dtype=tl.float32)
    grad = mk * g_r * tl.where(in_clamp, r, 0.0) * inv_denom
    low = (neg & (r < lo)).to(tl.float32)
    high = ((adv > 0.0) & (r > hi)).to(tl.float32)
    return loss, grad, d, r, low, high, dual


@triton.jit
def _fused_kernel(
    lp_ptr,
    old_ptr,
    adv_ptr,
    mask_ptr,
    grad_ptr,
    part_ptr,
    T,
    num_blocks,
    eps_low,
    eps_high,
    clip_c,
    inv_denom,
    adv_cols,
    counter_ptr,
    out_ptr,
    loss_denominator,
    HAS_DUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ADV_PER_ROW: tl.constexpr,
    ONE_PASS: tl.constexpr,
    REDUCE_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < T
    lp = tl.load(lp_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if ADV_PER_ROW:  # [B, 1] per-sequence advantages of a [B, adv_cols] batch: no expanded copy
        adv = tl.load(adv_ptr + offs // adv_cols, mask=ok, other=0.0).to(tl.float32)
    else:
        adv = tl.load(adv_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    mk = tl.load(mask_ptr + offs, mask=ok, other=0).to(tl.float32)

    loss, grad, d, r, low, high, dual = _clipped_token_loss(
        lp, old, adv, mk, eps_low, eps_high, clip_c, inv_denom, HAS_DUAL, BLOCK
    )
    tl.store(grad_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=ok)

    out = part_ptr + pid
    tl.store(out, tl.sum(mk * loss, axis=0))
    tl.store(out + num_blocks, tl.sum(mk, axis=0))
    tl.store(out + 2 * num_blocks, tl.sum(mk * low, axis=0))
    tl.store(out + 3 * num_blocks, tl.sum(mk * high, axis=0))
    tl.store(out + 4 * num_blocks, tl.sum(mk * dual, axis=0))
    tl.store(out + 5 * num_blocks, tl.sum(mk * 0.5 * d * d, axis=0))
    tl.store(out + 6 * num_blocks, tl.sum(mk * r, axis=0))
    tl.store(out + 7 * num_blocks, tl.max(tl.where(ok & (mk > 0.0), r, 0.0), axis=0))
    if ONE_PASS:
        # The program that arrives last (acq_rel atomic: every other program's partials are visible to
        # it) reduces all partials in block order (bit-identical reruns, no atomics in the sums) and
        # re-arms the counter for the next call: one launch, no memset, no host sync.
        tl.debug_barrier()  # this program's partial stores (whichever threads made them) precede its release
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        if arrived == num_blocks - 1:
            _finish(part_ptr, out_ptr, out_ptr + 1, num_blocks, loss_denominator, REDUCE_BLOCK, True)
            tl.atomic_xchg(counter_ptr, 0)


@triton.jit
def _pick(vec, rows, i):
    return tl.sum(tl.where(rows == i, vec, 0.0), axis=0)  # element i of a small vector (adds zeros: exact)


@triton.jit
def _reduce_kernel(part_ptr, loss_ptr, stats_ptr, num_blocks, loss_denominator, BLOCK: tl.constexpr):
    _finish(part_ptr, loss_ptr, stats_ptr, num_blocks, loss_denominator, BLOCK, False)


@triton.jit
def _finish(part_ptr, loss_ptr, stats_ptr, num_blocks, loss_denominator, BLOCK: tl.constexpr, VOLATILE: tl.constexpr):
    # One program walks the [8, num_blocks] partials in a fixed order (then a fixed tl.sum tree),
    # so reruns are bit-identical, and finishes the statistics here: no extra launches.
    # VOLATILE: partials written by other programs of the same launch (no stale cached lines).
    rows = tl.arange(0, 8)
    offs = tl.arange(0, BLOCK)
    acc_sum = tl.zeros([8, BLOCK], dtype=tl.float32)
    acc_max = tl.zeros([8, BLOCK], dtype=tl.float32)  # ratios are > 0: 0 is a safe identity
    for b0 in range(0, num_blocks, BLOCK):
        ok = b0 + offs < num_blocks
        x = tl.load(
            part_ptr + rows[:, None] * num_blocks + b0 + offs[None, :], mask=ok[None, :], other=0.0, volatile=VOLATILE
        )
        acc_sum += x
        acc_max = tl.maximum(acc_max, x)
    sums = tl.sum(acc_sum, axis=1)
    num = _pick(sums, rows, 1)
    denom = tl.maximum(num, 1.0)  # means are 0 when nothing is masked in
    tl.store(loss_ptr, _pick(sums, rows, 0) / loss_denominator)
    tl.store(stats_ptr + 0, _pick(sums, rows, 2) / denom)  # clipfrac_low
    tl.store(stats_ptr + 1, _pick(sums, rows, 3) / denom)  # clipfrac_high
    tl.store(stats_ptr + 2, _pick(sums, rows, 4) / denom)  # dualclip_frac
    tl.store(stats_ptr + 3, _pick(sums, rows, 5) / denom)  # approx_kl
    tl.store(stats_ptr + 4, _pick(sums, rows, 6) / denom)  # ratio_mean
    tl.store(stats_ptr + 5, _pick(tl.max(acc_max, axis=1), rows, 7))  # ratio_max
    tl.store(stats_ptr + 6, num)  # num_tokens


_COUNTERS: dict = {}  # device -> int32 arrival counter of the one-pass launch (left at 0 by each launch)


def _counter(device: torch.device) -> torch.Tensor:
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def _flat_advantages(advantages: torch.Tensor, logprob: torch.Tensor):
    """(tensor, per_row, cols): per-token advantages flat, or [B, 1] per-sequence ones read in place
    (token i takes row i // cols); other broadcasts are expanded (one copy)."""
    if advantages.shape == logprob.shape:
        return advantages.reshape(-1).contiguous(), False, 1
    if logprob.dim() == 2 and advantages.shape == (logprob.shape[0], 1):
        return advantages.reshape(-1).contiguous(), True, logprob.shape[1]
    return advantages.expand_as(logprob).reshape(-1).contiguous(), False, 1


class _PolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logprob, old_logprob, advantages, mask, eps_low, eps_high, clip_ratio_c, loss_denominator, one_pass
    ):
        lp_flat = logprob.reshape(-1).contiguous()
        old_flat = old_logprob.reshape(-1).contiguous()
        adv_flat, per_row, adv_cols = _flat_advantages(advantages, logprob)
        mask_flat = mask.reshape(-1).contiguous()
        if mask_flat.dtype == torch.bool:
            mask_flat = mask_flat.view(torch.uint8)
        num = lp_flat.numel()
        num_blocks = max(1, triton.cdiv(num, _BLOCK))
        grad = torch.empty_like(lp_flat)
        # one allocation: [loss, 7 stats | 8 x num_blocks partials]
        buf = torch.empty(
            1 + len(POLICY_LOSS_STAT_KEYS) + _NUM_PARTIALS * num_blocks, device=grad.device, dtype=torch.float32
        )
        out, partials = buf[:8], buf[8:]
        has_dual = clip_ratio_c is not None
        counter = _counter(grad.device) if one_pass else buf
        _fused_kernel[(num_blocks,)](
            lp_flat,
            old_flat,
            adv_flat,
            mask_flat,
            grad,
            partials,
            num,
            num_blocks,
            float(eps_low),
            float(eps_high),
            float(clip_ratio_c) if has_dual else 0.0,
            1.0 / loss_denominator,
            adv_cols,
            counter,
            out,
            loss_denominator,
            HAS_DUAL=has_dual,
            BLOCK=_BLOCK,
            ADV_PER_ROW=per_row,
            ONE_PASS=one_pass,
            REDUCE_BLOCK=_REDUCE_BLOCK,
        )
        if not one_pass:  # the first design: a second single-program launch reduces the partials
            _reduce_kernel[(1,)](partials, out, out[1:], num_blocks, loss_denominator, BLOCK=_REDUCE_BLOCK)
        ctx.save_for_backward(grad.view(logprob.shape))
        stats = out[1:]
        ctx.mark_non_differentiable(stats)
        return out[0], stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None, None, None, None, None


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
    one_pass: bool = True,
):
    """(loss, stats): loss = sum(mask * l) / loss_denominator (fp32 scalar, differentiable in
    logprob); stats are detached fp32 scalars keyed POLICY_LOSS_STAT_KEYS, means over the masked
    tokens of this call (0 when none is masked), num_tokens = sum(mask). clip_ratio_c=None disables
    the dual clip. CUDA tensors, or CPU tensors under TRITON_INTERPRET=1; else RuntimeError.
    one_pass=False: the first design (a second launch reduces the partials), kept for the benchmark."""
    check_policy_loss_args(logprob, old_logprob, advantages, mask, eps_low, eps_high, clip_ratio_c, loss_denominator)
    require_runnable(logprob, old_logprob, advantages, mask, op="policy_loss")
    loss, stats = _PolicyLoss.apply(
        logprob, old_logprob, advantages, mask, eps_low, eps_high, clip_ratio_c, float(loss_denominator), bool(one_pass)
    )
    return loss, dict(zip(POLICY_LOSS_STAT_KEYS, stats.unbind(0)))
