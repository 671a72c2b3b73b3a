"""The CPU engine's FP8 GEMM against SGLang 0.5.21's own kernels, run by Triton's interpreter in a separate
process (sglang_fp8_gemm.py: what runs, and its one stand-in, the fp32 -> fp8 rounding the interpreter
emulates wrongly).

1. Activation quantization, bit for bit: our per_token_group_quant_fp8 against SGLang's
   per_token_group_quant_fp8 (the Triton kernel _per_token_group_quant_8bit) on odd inputs: an all-zero
   group, groups below the eps floor, huge and fp32-denormal values, all-negative tokens, exact ties of
   the fp8 rounding, one token, bf16 and fp32.
2. The linear layer: our block_fp8_linear (what Fp8Linear runs) against SGLang's triton_w8a8_block_fp8_linear
   (quantization + _w8a8_block_fp8_matmul + cast + bias). Bit for bit where the summation order cannot
   matter (operands whose products and partial sums are exact in fp32: integer activations with a 448
   per group, so the scale is 1, and weights in eighths), with a partial block of output rows, bias and
   bf16 output. On random operands the tile dots round differently (ours sums each tile exactly and rounds
   once, the interpreter sums in fp32 in numpy's order), so there the bound is the fp32 summation bound,
   not a tolerance: every term p * a_s * b_s passes at most n = 127 + 2 + G roundings (127 additions in a
   tile's dot, two scale products, G tile additions), so each result is within gamma_n * T of the exact
   sum, T = sum of |p| * a_s * b_s, gamma_n = n u / (1 - n u), u = 2^-24; the two differ by <= 2 gamma_n T.

SGLang's sglang_per_token_group_quant_fp8 (the CUDA path's quantizer) cannot run here: it calls the JIT CUDA
kernel per_token_group_quant, which fp8_kernel.py imports only on CUDA; the report records the error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_megatron.cpu_engine.fp8_gemm import block_fp8_linear
from dapo_megatron.quant.fp8_activation import per_token_group_quant_fp8

SCRIPT = Path(__file__).with_name("sglang_fp8_gemm.py")
U = 2.0**-24


def _quant_cases(gen: torch.Generator) -> dict[str, torch.Tensor]:
    mags = torch.logspace(-3, 3, 5)[:, None]
    zero = torch.randn(2, 256, generator=gen)
    zero[0, :128] = 0.0  # an all-zero group: absmax -> eps, q = 0
    zero[1, 128:] = 0.0
    huge = torch.randn(3, 128, generator=gen)
    huge[0] *= 1e30
    huge[0, 5] = 3.0e38  # near fp32's max: the scale stays finite
    huge[1] *= 1e-12  # below the eps floor: scale = eps / 448, q = x / that
    huge[2] = torch.randn(128, generator=gen) * 1e-39  # fp32 denormals
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2  # every tie of the rounding (scale 1: each group holds a 448)
    ties = torch.cat([torch.tensor([448.0]), mids, torch.tensor([0.0])])  # 1 + 126 + 1: one group
    ties = torch.cat([ties, -ties])
    return {
        "rand32": torch.randn(5, 384, generator=gen) * mags,
        "randbf16": (torch.randn(3, 256, generator=gen) * 7).to(torch.bfloat16),
        "zero_group": zero,
        "huge": huge,
        "negative": -(torch.rand(4, 128, generator=gen) * torch.logspace(-2, 2, 4)[:, None]),
        "ties": ties[None, :],
        "one_token": torch.randn(1, 128, generator=gen),
        "many": torch.randn(64, 1024, generator=gen).to(torch.bfloat16),
    }  # enough values to see x * (1/s) != x / s


def _exact_operands(gen, m: int, n: int, k: int, dtype: torch.dtype):
    """Activations: integers in [-16, 16] with a 448 in every group (scale exactly 1, q = x); weights:
    eighths in [-2, 2]. Every product is a multiple of 1/8 and every partial sum below 2^13: exact in fp32."""
    x = torch.randint(-16, 17, (m, k), generator=gen).float()
    x[:, ::128] = 448.0
    w = (torch.randint(-16, 17, (n, k), generator=gen).float() / 8).to(torch.float8_e4m3fn)
    return x.to(dtype), w


@pytest.fixture(scope="module")
def sglang_run(sglang_installed, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(0)
    cases = {f"{c}.x": x.contiguous() for c, x in _quant_cases(gen).items()}
    x, w = _exact_operands(gen, 3, 192, 256, torch.bfloat16)  # 192 rows: the second block of rows is partial
    cases.update(
        {
            "exactbf16.x": x,
            "exactbf16.weight": w,
            "exactbf16.weight_scale_inv": torch.rand(2, 2, generator=gen),
            "exactbf16.bias": torch.randn(192, generator=gen).to(torch.bfloat16),
        }
    )
    x, w = _exact_operands(gen, 1, 256, 384, torch.float32)
    cases.update(
        {"exact32.x": x, "exact32.weight": w, "exact32.weight_scale_inv": torch.rand(2, 3, generator=gen) / 100}
    )
    w = (torch.randn(320, 384, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    cases.update(
        {
            "rand.x": torch.randn(4, 384, generator=gen),
            "rand.weight": w,
            "rand.weight_scale_inv": torch.rand(3, 3, generator=gen) / 1000,
        }
    )
    root = tmp_path_factory.mktemp("fp8_gemm")
    save_file(cases, str(root / "cases.safetensors"))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(root / "cases.safetensors"),
            str(root / "out.safetensors"),
            str(root / "report.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cases, load_file(str(root / "out.safetensors")), json.loads((root / "report.json").read_text())


def test_sglang_functions_that_ran(sglang_run):
    _, _, report = sglang_run
    assert report["interpreter"] == "1"
    # off CUDA: the Triton quantizer and the Triton GEMM (no DeepGEMM); the kernel Hopper's default config runs
    assert report["per_token_group_quant_fp8"] == "_per_token_group_quant_8bit_raw"
    assert report["dispatch"] == "triton_w8a8_block_fp8_linear"
    assert report["matmul_kernel"] == "_w8a8_block_fp8_matmul"
    assert report["sglang_per_token_group_quant_fp8_off_cuda"].startswith("NameError"), report


def test_activation_quantization_bit_equal_to_sglangs_kernel(sglang_run):
    cases, got, _ = sglang_run
    names = sorted({k.split(".")[0] for k in cases})
    for c in names:
        x = cases[f"{c}.x"]
        q, s = per_token_group_quant_fp8(x.reshape(-1, x.shape[-1]))
        assert torch.equal(q.view(torch.uint8), got[f"{c}.q"]), c
        assert torch.equal(s, got[f"{c}.scale"]), c
    # the cases are what they claim: an eps scale, a finite huge scale, exact ties present
    assert got["zero_group.scale"][0, 0] == torch.tensor(1e-10) / 448
    assert torch.isfinite(got["huge.scale"]).all() and got["huge.scale"][0].item() > 6e35
    assert got["ties.scale"].eq(1.0).all()
    # and they tell the kernel's reciprocal from a division: x / s (the column-major kernel's arithmetic)
    # rounds some of "many" differently
    x = cases["many.x"].float().reshape(64, 8, 128)
    by_division = (x / got["many.scale"][..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(64, 1024)
    assert not torch.equal(by_division.view(torch.uint8), got["many.q"])


def test_linear_bit_equal_where_summation_order_cannot_matter(sglang_run):
    cases, got, _ = sglang_run
    for c in ("exactbf16", "exact32"):
        ours = block_fp8_linear(
            cases[f"{c}.x"], cases[f"{c}.weight"], cases[f"{c}.weight_scale_inv"], cases.get(f"{c}.bias")
        )
        assert ours.dtype == got[f"{c}.out"].dtype == cases[f"{c}.x"].dtype
        assert torch.equal(ours, got[f"{c}.out"]), c


def test_linear_within_the_fp32_summation_bound_on_random_operands(sglang_run):
    cases, got, _ = sglang_run
    x, w, ws = cases["rand.x"], cases["rand.weight"], cases["rand.weight_scale_inv"]
    ours, theirs = block_fp8_linear(x, w, ws), got["rand.out"]
    q, s = per_token_group_quant_fp8(x)
    groups = x.shape[-1] // 128
    prods = (q.double().reshape(-1, 1, groups, 128) * w.double().reshape(1, -1, groups, 128)).abs().sum(-1)
    t = (prods * s.double()[:, None, :] * ws.double().repeat_interleave(128, 0)[:320][None]).sum(-1)
    n = 127 + 2 + groups
    bound = 2 * (n * U / (1 - n * U)) * t
    diff = (ours.double() - theirs.double()).abs()
    assert (diff <= bound).all(), (diff / bound).max()
    assert bound.max() < 1e-4 * theirs.abs().max()  # the bound is fp32 noise, far below the fp8 error
