"""Dynamic FP8 activations and the block-FP8 linear (dapo_megatron/quant/fp8_activation.py, fp8_gemm.py) on
hand-computed values. SGLang's own kernels are compared in tests/conformance/test_fp8_gemm_sglang.py.

    python -m pytest -q tests/unit/test_fp8_activation.py
"""

from __future__ import annotations

import pytest
import torch

from dapo_megatron.cpu_engine.fp8_gemm import block_fp8_linear
from dapo_megatron.quant.fp8_activation import fake_quant_activation_fp8, per_token_group_quant_fp8


def test_per_token_group_quant_hand_computed():
    x = torch.zeros(2, 256)
    # token 0, group 0: absmax 3.5 -> scale 3.5 / 448 = 2**-7 exactly, 1/scale = 128
    x[0, :4] = torch.tensor([3.5, -1.0, 0.3, 0.265625])
    # token 0, group 1: all zero -> the eps floor, q = 0
    # token 1, group 0: absmax 1 -> scale fl(1/448); group 1: absmax 0.5
    x[1, :2] = torch.tensor([1.0, 0.1])
    x[1, 128] = -0.5
    q, s = per_token_group_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (2, 2)
    assert s[0, 0].item() == 2.0**-7
    assert s[0, 1] == torch.tensor(1e-10, dtype=torch.float32) / 448
    assert s[1, 0] == torch.tensor(1.0) / 448 and s[1, 1] == torch.tensor(0.5) / 448
    # 3.5 * 128 = 448 (the largest e4m3); -1 * 128 = -128; 0.3 * 128 = 38.4 -> 40 (steps of 4 in [32, 64));
    # 0.265625 * 128 = 34, the tie of 32 (mantissa 000) and 36 (001) -> 32, to even
    assert q[0, :5].float().tolist() == [448.0, -128.0, 40.0, 32.0, 0.0]
    assert q[0, 128:].float().abs().sum() == 0
    # 0.1 * 448 = 44.8 -> 44 (1.011b * 2**5), nearer than 48; -0.5 -> -448
    assert q[1, :2].float().tolist() == [448.0, 44.0] and q[1, 128].item() == -448.0
    deq = fake_quant_activation_fp8(x)
    assert deq[0, :4].tolist() == [3.5, -1.0, 40 / 128, 0.25]
    assert deq[1, 1] == torch.tensor(44.0) * (torch.tensor(1.0) / 448)


def test_fake_quant_keeps_dtype_and_passes_the_gradient_straight_through():
    x = (torch.randn(3, 5, 256) * 4).to(torch.bfloat16).requires_grad_()
    y = fake_quant_activation_fp8(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert not torch.equal(y, x)  # rounding really happened
    g = torch.randn(3, 5, 256).to(torch.bfloat16)
    (y * g).sum().backward()
    assert torch.equal(x.grad, g)  # d(fake_quant)/dx = identity


def test_input_dims_not_a_multiple_of_the_group_are_refused():
    with pytest.raises(
        ValueError,
        match=r"input dimension 320 is not a multiple of the group size 128 .*"
        r"x.shape\[-1\] % group_size == 0",
    ):
        per_token_group_quant_fp8(torch.ones(2, 320))
    with pytest.raises(ValueError, match=r"input dimension 160 is not a multiple of the group size 128"):
        fake_quant_activation_fp8(torch.ones(160))
    w = torch.zeros(8, 160).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"input dimension 160 is not a multiple"):
        block_fp8_linear(torch.ones(1, 160), w, torch.ones(1, 2))


def test_block_fp8_linear_hand_computed_with_a_partial_block_of_rows():
    """x = 448 e_0 + 16 e_1 (scale 1, q = x); 130 output rows: rows 128-129 are a partial block reading
    weight_scale_inv[1, 0]."""
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1] = 448.0, 16.0
    w = torch.zeros(130, 128)
    w[0, :2] = torch.tensor([1.0, 0.5])
    w[1, :2] = torch.tensor([-2.0, 0.25])
    w[129, :2] = torch.tensor([0.125, 1.0])
    scales = torch.tensor([[0.5], [0.25]])
    out = block_fp8_linear(x, w.to(torch.float8_e4m3fn), scales, torch.full((130,), 2.0))
    # (448 * 1 + 16 * 0.5) * 0.5 + 2 = 230; (-896 + 4) * 0.5 + 2 = -444; (56 + 16) * 0.25 + 2 = 20
    assert out[0, 0].item() == 230.0 and out[0, 1].item() == -444.0 and out[0, 129].item() == 20.0
    assert out[0, 2:129].eq(2.0).all()
    # bf16 in, bf16 out; the leading dims are kept
    y = block_fp8_linear(x.to(torch.bfloat16).reshape(1, 1, 128), w.to(torch.float8_e4m3fn), scales)
    assert y.dtype == torch.bfloat16 and y.shape == (1, 1, 130) and y[0, 0, 0].item() == 228.0


def test_block_fp8_linear_is_quantized_activations_times_dequantized_weights():
    """Up to fp32 rounding, the GEMM is fake-quantized x times the block-dequantized weight (float64 here)."""
    from dapo_megatron.quant.fp8_format import dequantize_block_fp8

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 256, generator=gen)
    w = (torch.randn(200, 256, generator=gen) * 50).to(torch.float8_e4m3fn)
    ws = torch.rand(2, 2, generator=gen) / 100
    want = fake_quant_activation_fp8(x).double() @ dequantize_block_fp8(w, ws, dtype=torch.float64).T
    got = block_fp8_linear(x, w, ws).double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    weight_only = x.double() @ dequantize_block_fp8(w, ws, dtype=torch.float64).T
    assert (weight_only - want).abs().max() > 1e-3 * want.abs().max()  # the activations were quantized
