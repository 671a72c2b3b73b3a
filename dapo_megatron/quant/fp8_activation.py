"""Dynamic FP8 activations as SGLang's block-FP8 GEMM makes them: one fp32 scale per token and per
group of 128 input channels, computed from the activations themselves at every call.

    q, s = per_token_group_quant_fp8(x)        # q float8_e4m3fn like x, s fp32 [..., K / 128]
    x8 = fake_quant_activation_fp8(x)          # q * s in x's dtype; the gradient passes straight through

The arithmetic is the Triton kernel SGLang 0.5.21's triton_w8a8_block_fp8_linear quantizes with
(sglang/kernels/ops/quantization/fp8_kernel.py, _per_token_group_quant_8bit, launched by
_per_token_group_quant_8bit_raw = per_token_group_quant_fp8 off CUDA), in fp32:
    absmax = max(max|x_group|, eps)      eps = 1e-10: an all-zero group gets a tiny scale, q = 0
    s      = absmax / 448                448 = the largest finite float8_e4m3fn
    q      = clamp(x * (1 / s), -448, 448) -> float8_e4m3fn, rounded to nearest even
Note the reciprocal: x * (1/s) is not always x / s (the column-major variant of the same kernel divides).
tests/conformance/test_fp8_gemm_sglang.py checks bit equality with that kernel run by Triton's
interpreter. On CUDA SGLang swaps in a JIT CUDA kernel (per_token_group_quant.cuh: s = absmax * (1/448),
q = x * (448/absmax) under --use_fast_math); docs/fp8.md says what that changes (last-bit differences).
"""

from __future__ import annotations

import torch

from dapo_megatron.quant.fp8_format import BLOCK, E4M3_MAX

EPS = 1e-10  # the absmax floor SGLang passes (and its CUDA kernel bakes in)


def _check_groups(x: torch.Tensor, group: int) -> None:
    if x.dim() < 1 or x.shape[-1] % group:
        raise ValueError(
            f"per-token-group FP8 activations: the input dimension {x.shape[-1] if x.dim() else None} "
            f"is not a multiple of the group size {group} (SGLang's per_token_group_quant_fp8 asserts "
            "x.shape[-1] % group_size == 0)"
        )


def per_token_group_quant_fp8(
    x: torch.Tensor, *, group: int = BLOCK, eps: float = EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn of x's shape, scale fp32 [..., K / group]); x ~= q * scale per group.
    ValueError when the last dimension K is not a multiple of `group`."""
    _check_groups(x, group)
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    q, scale = quant_with_absmax(groups, groups.abs().amax(dim=-1)[..., None], eps=eps)
    return q.reshape(x.shape), scale[..., 0]


def quant_with_absmax(x: torch.Tensor, absmax: torch.Tensor, *, eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic given each element's group maximum: x fp32, absmax fp32 broadcastable to x
    (max |x| over the element's group, which a caller may have reduced across ranks: actor/fake_quant.py).
    Returns (q float8_e4m3fn like x, scale fp32 shaped like absmax)."""
    eps32 = torch.tensor(eps, dtype=torch.float32)  # a kernel argument: fp32, as Triton passes it
    scale = torch.maximum(absmax, eps32) / E4M3_MAX
    inv = torch.reciprocal(scale)  # 1.0 / y_s, then a multiply: the kernel's order, not a division
    q = (x * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_activation_fp8(
    q: torch.Tensor, scale: torch.Tensor, *, group: int = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q * scale per group (fp32 product), in `dtype`."""
    groups = q.float().reshape(*q.shape[:-1], q.shape[-1] // group, group)
    return (groups * scale[..., None]).reshape(q.shape).to(dtype)


class _FakeQuantFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: int) -> torch.Tensor:
        q, s = per_token_group_quant_fp8(x, group=group)
        return dequantize_activation_fp8(q, s, group=group, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # straight-through: rounding has zero derivative almost everywhere, so a trainer that wants to
        # see the engine's activations in its forward keeps the unquantized gradient (as QAT does)
        return grad, None


def fake_quant_activation_fp8(x: torch.Tensor, *, group: int = BLOCK) -> torch.Tensor:
    """x quantized to FP8 per token and `group` channels and dequantized again, in x's dtype; the
    backward passes the gradient through unchanged. ValueError when K % group != 0."""
    _check_groups(x, group)
    return _FakeQuantFp8.apply(x, group)
