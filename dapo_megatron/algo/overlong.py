"""Overlong reward shaping (docs/algorithm.md section 3) and overlong filtering (the ablation's simpler variant).

Soft overlong punishment, with L the response length in tokens, L_max the generation cap and L_cache
the buffer (L_max - L_cache is the expected maximum length):

    R_length(L) = 0                                   L <= L_max - L_cache
                = ((L_max - L_cache) - L) / L_cache   L_max - L_cache < L <= L_max
                = -1                                  L > L_max

and the reward is R + factor * R_length. With L_max = 20480, L_cache = 4096: L = 16384 -> 0,
L = 18432 -> -0.5, L = 20480 -> -1 (a truncated response), so a correct but truncated answer gets 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["overlong_penalty", "overlong_filter_mask"]


def overlong_penalty(
    lengths: torch.Tensor | Sequence[int],
    *,
    max_length: int,
    buffer_length: int,
    factor: float = 1.0,
) -> torch.Tensor:
    """factor * R_length(L) for every response length: 0, a linear ramp down to -factor, then -factor.

    Returns a float tensor (the default dtype, or the dtype of floating-point `lengths`) of the shape
    of `lengths`; add it to the correctness reward.
    """
    if max_length < 1:
        raise ValueError(f"overlong_penalty: max_length={max_length} must be >= 1")
    if not 0 <= buffer_length <= max_length:
        raise ValueError(f"overlong_penalty: buffer_length={buffer_length} must be in [0, max_length={max_length}]")
    if factor < 0:
        raise ValueError(f"overlong_penalty: factor={factor} must be >= 0 (it is subtracted from the reward)")
    lengths_t = torch.as_tensor(lengths)
    dtype = lengths_t.dtype if lengths_t.is_floating_point() else torch.get_default_dtype()
    length = lengths_t.to(dtype)
    expected = max_length - buffer_length
    if buffer_length > 0:
        ramp = (expected - length) / buffer_length  # 0 at L = expected, -1 at L = max_length
    else:
        ramp = torch.zeros_like(length)  # no buffer: only L > max_length is punished
    penalty = torch.where(length <= expected, torch.zeros_like(length), ramp)
    penalty = torch.where(length > max_length, torch.full_like(length, -1.0), penalty)
    return penalty * factor


def overlong_filter_mask(truncated: torch.Tensor | Sequence[bool]) -> torch.Tensor:
    """Per-sequence loss weight for overlong filtering: 0.0 for truncated responses, 1.0 otherwise.

    Multiply it into the token mask (`mask * overlong_filter_mask(truncated)[:, None]`) so a truncated
    response contributes neither loss nor tokens to the denominator.
    """
    truncated_t = torch.as_tensor(truncated, dtype=torch.bool)
    return (~truncated_t).to(torch.get_default_dtype())
