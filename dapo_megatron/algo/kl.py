"""KL penalty estimators to a reference policy (naive GRPO baseline; DAPO itself uses none).

Per token, with log_ratio = logprob - ref_logprob (Schulman's "Approximating KL divergence"):
    k1 = log_ratio                                   unbiased, high variance, can be negative
    k2 = 0.5 * log_ratio^2
    k3 = exp(-log_ratio) + log_ratio - 1             = exp(ref - logp) - (ref - logp) - 1 >= 0
k3 follows verl: (ref - logp) is clamped to [-20, 20] before exp and the result to [-10, 10].
"""

from __future__ import annotations

import torch

__all__ = ["kl_penalty", "KL_KINDS"]

KL_KINDS = ("k1", "k2", "k3")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of pi_theta from pi_ref (same shape as the inputs); differentiable in logprob."""
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "k2":
        return 0.5 * (logprob - ref_logprob).square()
    if kind == "k3":
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"kl_penalty: kind={kind!r} is not allowed; choose one of {list(KL_KINDS)}")
