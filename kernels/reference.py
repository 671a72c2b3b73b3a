"""Plain-torch references for the fused kernels (materialized logits): the semantics, the test
oracle, and the fallback the actor uses where Triton cannot run.

    from dapo_kernels import linear_logprob_entropy_reference, policy_loss_reference
    logprob, entropy = linear_logprob_entropy_reference(hidden_NH, weight_VH, targets_N)

Both take the same arguments as their fused twins in logprob.py / policy_loss.py. Both run in the
dtype they are given for the matmul and do the softmax maths in fp32 (float64 inputs stay float64,
which is how the tests build their oracle).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._runtime import debug_checks

# Gradient-free metadata shared by both implementations of the policy loss.
POLICY_LOSS_STAT_KEYS = (
    "clipfrac_low",
    "clipfrac_high",
    "dualclip_frac",
    "approx_kl",
    "ratio_mean",
    "ratio_max",
    "num_tokens",
)


def check_logprob_args(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    """ValueError for inputs the kernels cannot honour (shared by the fused op and the reference)."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [N, H] and weight [V_local, H]; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden has H={hidden.shape[1]}, weight has H={weight.shape[1]}")
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets must be [N={hidden.shape[0]}]; got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"targets must be int32/int64 token ids; got {targets.dtype}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")


def vocab_shard(weight: torch.Tensor, tp_group) -> tuple[int, int, int]:
    """(vocab_start, vocab_local, vocab_total): rank r holds rows [r*V_local, (r+1)*V_local)."""
    vocab_local = weight.shape[0]
    if tp_group is None:
        return 0, vocab_local, vocab_local
    rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    return rank * vocab_local, vocab_local, vocab_local * world


def check_vocab_size(vocab_size, vocab_rows: int) -> int:
    """The real vocabulary: vocab_size, or every row (vocab_rows = V_local * tp) when None."""
    if vocab_size is None:
        return vocab_rows
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= vocab_rows:
        raise ValueError(
            f"vocab_size must be an int in [1, {vocab_rows}] (the weight's rows over all TP ranks; "
            f"the rest is padding); got {vocab_size!r}"
        )
    return vocab_size


def check_targets_in_vocab(targets: torch.Tensor, vocab_total: int):
    """ValueError for token ids outside [0, vocab_total), in debug mode only (DAPO_KERNELS_DEBUG=1,
    _runtime.debug_checks): reading min and max is a device-to-host sync on every call."""
    if targets.numel() == 0 or not debug_checks():
        return
    lo, hi = int(targets.min()), int(targets.max())
    if lo < 0 or hi >= vocab_total:
        raise ValueError(
            f"targets must be token ids in [0, {vocab_total}); got min {lo}, max {hi} "
            "(mask padding positions with the loss mask, not with -100)"
        )


class _AllReduceSumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (for the reference's hidden)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _AllReduceMaxNoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group in forward; identity backward (the loss is replicated over the group)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        # The loss is replicated on every rank of the group (it is one loss, computed TP times), so
        # dL/dx_r = dL/dout on each rank: identity, as in Megatron's vocab-parallel cross entropy.
        return grad, None


def linear_logprob_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    tp_group=None,
    return_entropy: bool = True,
    vocab_size: int | None = None,
):
    """logprob[N] and entropy[N] of softmax(hidden @ weight.T / temperature), fp32 (float64 in,
    float64 out). Materializes [N, V_local] logits: the oracle, not the fast path.

    With tp_group the vocab is sharded (rank r holds rows [r*V_local, (r+1)*V_local)); the
    per-token max, sum-exp, sum p*z and target logit are all-reduced, and the hidden gradient is
    summed over the group (the weight gradient stays local), exactly like the fused op.
    vocab_size: the real vocabulary (default: every row); global rows at or past it are padding,
    excluded from the softmax (zero probability, zero gradient).
    """
    check_logprob_args(hidden, weight, targets, temperature)
    vocab_start, vocab_local, vocab_rows = vocab_shard(weight, tp_group)
    vocab_size = check_vocab_size(vocab_size, vocab_rows)
    check_targets_in_vocab(targets, vocab_size)
    math_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    if tp_group is not None:
        hidden = _AllReduceSumGrad.apply(hidden, tp_group)
    logits_NV = (hidden @ weight.t()).to(math_dtype) / temperature
    local_t = targets.long() - vocab_start
    owns = (local_t >= 0) & (local_t < vocab_local)
    target_logit = torch.where(owns, logits_NV.gather(1, local_t.clamp(0, vocab_local - 1)[:, None])[:, 0], 0.0)
    real_rows = max(0, min(vocab_local, vocab_size - vocab_start))
    if real_rows < vocab_local:
        return _padded_vocab_reference(
            logits_NV, target_logit, real_rows=real_rows, tp_group=tp_group, return_entropy=return_entropy
        )
    if tp_group is None:
        lse = torch.logsumexp(logits_NV, dim=1)
        logp_NV = logits_NV - lse[:, None]
        logprob = target_logit - lse
        entropy = -(logp_NV.exp() * logp_NV).sum(1) if return_entropy else None
        return logprob, entropy
    # Vocab-parallel: global max (no gradient: lse does not depend on the shift), then sums.
    gmax = _AllReduceMaxNoGrad.apply(logits_NV.max(dim=1).values, tp_group)
    shifted = logits_NV - gmax[:, None]
    exp = shifted.exp()
    sum_exp = _AllReduceSum.apply(exp.sum(1), tp_group)
    target_logit = _AllReduceSum.apply(target_logit, tp_group)
    lse = gmax + sum_exp.log()
    logprob = target_logit - lse
    if not return_entropy:
        return logprob, None
    # H = lse - E[z] = log(sum_exp) - sum(exp * shifted) / sum_exp  (shifted keeps it cancellation-free)
    sum_pz = _AllReduceSum.apply((exp * shifted).sum(1), tp_group)
    entropy = sum_exp.log() - sum_pz / sum_exp
    return logprob, entropy


def _padded_vocab_reference(logits_NV, target_logit, *, real_rows: int, tp_group, return_entropy: bool):
    """The vocab-parallel formulas below with the padding columns' exp() set to 0 (the logits stay
    finite, so no 0 * -inf appears; a shard of padding only contributes nothing)."""
    real = torch.arange(logits_NV.shape[1], device=logits_NV.device) < real_rows
    local_max = logits_NV.masked_fill(~real, float("-inf")).max(dim=1).values
    gmax = local_max if tp_group is None else _AllReduceMaxNoGrad.apply(local_max, tp_group)
    shifted = (logits_NV - gmax.detach()[:, None]).masked_fill(~real, 0.0)
    exp = shifted.exp().masked_fill(~real, 0.0)

    def total(x):
        return x if tp_group is None else _AllReduceSum.apply(x, tp_group)

    sum_exp = total(exp.sum(1))
    lse = gmax.detach() + sum_exp.log()
    logprob = total(target_logit) - lse
    if not return_entropy:
        return logprob, None
    entropy = sum_exp.log() - total((exp * shifted).sum(1)) / sum_exp
    return logprob, entropy


def policy_loss_terms(logprob, old_logprob, advantages, *, eps_low, eps_high, clip_ratio_c):
    """Per-token DAPO loss l and ratio (docs/algorithm.md s5), differentiable in logprob."""
    log_ratio = logprob - old_logprob
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(l1, l2)
    if clip_ratio_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_ratio_c), loss)
    return loss, ratio, log_ratio


def policy_loss_stats(log_ratio, ratio, advantages, weight, *, eps_low, eps_high, clip_ratio_c):
    """The POLICY_LOSS_STAT_KEYS over the tokens `weight` counts, in weight's dtype: means over
    sum(weight) (0 when nothing counts), the largest counted ratio, and sum(weight) itself."""
    num = weight.sum()
    safe = num.clamp(min=1.0)

    def mean(x):
        return (x.to(weight.dtype) * weight).sum() / safe

    if clip_ratio_c is None:
        dual = torch.zeros((), dtype=weight.dtype, device=weight.device)
    else:
        dual = mean((advantages < 0) & (ratio > clip_ratio_c))
    # ratios are > 0, so filling uncounted tokens with 0 gives the counted max (0 when nothing counts)
    if ratio.numel():
        ratio_max = torch.where(weight != 0, ratio, torch.zeros_like(ratio)).max()
    else:
        ratio_max = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    return {
        "clipfrac_low": mean((advantages < 0) & (ratio < 1.0 - eps_low)),
        "clipfrac_high": mean((advantages > 0) & (ratio > 1.0 + eps_high)),
        "dualclip_frac": dual,
        "approx_kl": mean(0.5 * log_ratio.square()),
        "ratio_mean": mean(ratio),
        "ratio_max": ratio_max,
        "num_tokens": num,
    }


def check_policy_loss_args(logprob, old_logprob, advantages, mask, eps_low, eps_high, clip_ratio_c, loss_denominator):
    for name, t in (("old_logprob", old_logprob), ("mask", mask)):
        if t.shape != logprob.shape:
            raise ValueError(f"{name} must have the shape of logprob {tuple(logprob.shape)}; got {tuple(t.shape)}")
    # per-token advantages, or per-sequence ones as [B, 1] (the two the trainer passes: checked without
    # torch.broadcast_shapes, which costs more host time than the rest of this function together)
    if advantages.shape != logprob.shape and not (logprob.dim() == 2 and advantages.shape == (logprob.shape[0], 1)):
        try:
            if torch.broadcast_shapes(advantages.shape, logprob.shape) != logprob.shape:
                raise RuntimeError
        except RuntimeError:
            raise ValueError(
                f"advantages {tuple(advantages.shape)} must have the shape of logprob "
                f"{tuple(logprob.shape)} or broadcast to it (e.g. [B, 1])"
            ) from None
    if not (0.0 <= eps_low < 1.0) or eps_high < 0.0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0; got eps_low={eps_low}, eps_high={eps_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (or None to disable the dual clip); got {clip_ratio_c}")
    if not float(loss_denominator) > 0:
        raise ValueError(f"loss_denominator must be > 0 (the global token count); got {loss_denominator}")


def policy_loss_reference(
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
    """loss = sum(mask * l) / loss_denominator with l from docs/algorithm.md s5, and stats (means over the
    masked tokens of this call; 0 when none is masked). Differentiable in logprob."""
    check_policy_loss_args(logprob, old_logprob, advantages, mask, eps_low, eps_high, clip_ratio_c, loss_denominator)
    math_dtype = torch.float64 if logprob.dtype == torch.float64 else torch.float32
    logprob_m = logprob.to(math_dtype)
    old = old_logprob.to(math_dtype)
    adv = advantages.to(math_dtype)
    maskf = mask.to(math_dtype)
    per_token, ratio, log_ratio = policy_loss_terms(
        logprob_m, old, adv, eps_low=eps_low, eps_high=eps_high, clip_ratio_c=clip_ratio_c
    )
    loss = (maskf * per_token).sum() / loss_denominator
    with torch.no_grad():
        stats = policy_loss_stats(
            log_ratio.detach(),
            ratio.detach(),
            adv,
            maskf,
            eps_low=eps_low,
            eps_high=eps_high,
            clip_ratio_c=clip_ratio_c,
        )
    return loss, stats
