"""The block-FP8 linear layer as SGLang 0.5.21 computes it, in plain torch (the CPU engine's Fp8Linear).

    y = block_fp8_linear(x, weight_fp8, weight_scale_inv, bias)    # x [..., K], K % 128 == 0

SGLang's Fp8LinearMethod.apply -> triton_w8a8_block_fp8_linear (srt/layers/quantization/fp8_utils.py):
  1. the activations are quantized per token and 128 input channels (fp8_activation.py);
  2. w8a8_block_fp8_matmul_triton's kernel (_w8a8_block_fp8_matmul, sglang/kernels/ops/gemm/fp8_kernel.py) walks K
     in tiles of one group: per tile `acc += dot(q_x, q_w) * x_scale[:, None] * w_scale[None, :]`, an fp32
     accumulator, w_scale the block scale of the output column's block (n // 128: the last block of rows
     may be partial, its columns read the same scale);
  3. the fp32 accumulator is cast to x's dtype, then `output += bias` in that dtype.
Here each tile's dot is summed exactly (float64 holds every sum of 128 fp8 x fp8 products: they are
multiples of 2^-18 below 2^25) and rounded to fp32 once; the GPU's tensor cores and Triton's interpreter
sum in fp32 in their own order, so they can differ from it in the last bits of a tile's dot
(tests/conformance/test_fp8_gemm_sglang.py states the bound and checks bit equality where no order matters).
"""

from __future__ import annotations

import torch

from dapo_megatron.quant.fp8_activation import per_token_group_quant_fp8
from dapo_megatron.quant.fp8_format import BLOCK, block_scale_shape


def block_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block: int = BLOCK,
) -> torch.Tensor:
    """x [..., K] times the block-FP8 weight [N, K] (scales [ceil(N/block), K/block]), SGLang's numerics;
    output [..., N] in x's dtype. ValueError when K is not a multiple of `block`."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block_fp8_linear: weight dtype {weight.dtype}, expected torch.float8_e4m3fn")
    if x.shape[-1] != k:
        raise ValueError(f"block_fp8_linear: input dimension {x.shape[-1]}, the weight takes {k}")
    if tuple(weight_scale_inv.shape) != block_scale_shape(weight.shape, block):
        raise ValueError(
            f"block_fp8_linear: weight {tuple(weight.shape)} needs scales of shape "
            f"{block_scale_shape(weight.shape, block)}, got {tuple(weight_scale_inv.shape)}"
        )
    x2d = x.reshape(-1, k)
    q, x_scale = per_token_group_quant_fp8(x2d, group=block)  # ValueError unless k % block == 0
    groups = k // block
    # the exact per-tile dot products, [groups, M, N], each rounded to fp32 once
    dots = torch.einsum(
        "mgk,ngk->gmn", q.double().reshape(-1, groups, block), weight.double().reshape(n, groups, block)
    ).float()
    # the block scale each output column reads in tile g: weight_scale_inv[n // block, g]
    w_scale = weight_scale_inv.float().repeat_interleave(block, dim=0)[:n]  # [N, groups]
    acc = torch.zeros(x2d.shape[0], n, dtype=torch.float32)
    for g in range(groups):  # the kernel's order: tile by tile, (dot * x_scale) * w_scale, then +=
        acc = acc + dots[g] * x_scale[:, g, None] * w_scale[None, :, g]
    out = acc.to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)  # `output += bias` after the cast (triton_w8a8_block_fp8_linear)
    return out.reshape(*x.shape[:-1], n)
