"""SGLang 0.5.21's own block-FP8 linear (activation quantization + GEMM) run on CPU by Triton's interpreter
(tests/conformance/test_fp8_gemm_sglang.py compares our CPU engine's numerics with what this writes).

    TRITON_INTERPRET=1 python tests/conformance/sglang_fp8_gemm.py CASES.safetensors OUT.safetensors OUT.json

CASES holds, per case c: `c.x` (the activations), and for GEMM cases `c.weight` (float8_e4m3fn [N, K]),
`c.weight_scale_inv` (fp32 [ceil(N/128), K/128]) and optionally `c.bias`. For every case this runs, from the
installed sglang (imported, not copied):
  - srt/layers/quantization/fp8_utils.py per_token_group_quant_fp8(x, 128, column_major_scales=False): the
    call triton_w8a8_block_fp8_linear makes; off CUDA it is sglang/kernels/ops/quantization/fp8_kernel.py
    _per_token_group_quant_8bit_raw, the Triton kernel _per_token_group_quant_8bit -> `c.q`, `c.scale`;
  - for GEMM cases, triton_w8a8_block_fp8_linear(x, weight, [128, 128], weight_scale_inv, None, bias), the
    whole function Fp8LinearMethod.apply calls (quantization, w8a8_block_fp8_matmul_triton's kernel
    _w8a8_block_fp8_matmul, the cast, `output += bias`) -> `c.out`.
OUT.json records which functions ran (dispatch_w8a8_block_fp8_linear's choice here, the matmul kernel) and
what sglang_per_token_group_quant_fp8 does off CUDA.

Stand-ins, named:
  - two float conversions the interpreter emulates unlike the GPU (triton/runtime/interpreter.py
    _convert_float, numpy bit manipulation), both round-to-nearest-even on the GPU:
    fp32 -> float8_e4m3fn (`.to(tl.float8e4nv)`, the hardware's cvt.rn.satfinite): the interpreter truncates
    the mantissa and adds the first cut-off bit, so ties round away from zero and a mantissa carry that meets
    an odd exponent is lost (124.3 -> 64.0 instead of 128.0; 691 of 32768 random values differed);
    fp32 -> bfloat16 (the GEMM's `accumulator.to(tl.bfloat16)`, arith.truncf -> cvt.rn.bf16.f32): the
    interpreter truncates (rounding mode None). Both are replaced by round-to-nearest-even in numpy
    (`_e4m3_rne`, `_bf16_rne` below, independent of torch's casts). Every other operation of both kernels
    (loads and upcasts, absmax, eps, the division and the reciprocal, clamp, the tile dots, the scale
    products, the accumulator, masking) is the interpreter's numpy execution of SGLang's kernels;
  - get_device_name (fp8_kernel.py looks up tuned GEMM configs by GPU name, None off GPU): "cpu", so the default
    config runs (BLOCK_SIZE_K = 128, one tile per group: what every H100 config shipped in
    kernels/ops/gemm/configs uses too).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("run with TRITON_INTERPRET=1 (Triton reads it when imported)")


def _e4m3_rne(values):
    """float32 array -> float8_e4m3fn bytes, round to nearest, ties to even (|values| <= 448 here: the
    kernels clamp first). The 127 non-negative finite codes are enumerated from the format's definition."""
    import numpy as np

    codes = np.arange(127, dtype=np.int64)  # 0x00..0x7e; 0x7f is NaN
    exp, man = codes >> 3, codes & 7
    mags = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    v = np.asarray(values, dtype=np.float64)
    a = np.abs(v)
    hi = np.clip(np.searchsorted(mags, a, side="left"), 0, 126)  # first magnitude >= a
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = a - mags[lo], mags[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(codes[lo] % 2 == 0, lo, hi)))
    pick = np.where(mags[hi] == a, hi, pick)
    sign = np.signbit(v).astype(np.int64) << 7  # IEEE: a negative value that rounds to zero is -0 (0x80)
    return (pick | sign).astype(np.uint8)


def _bf16_rne(values):
    """float32 array -> bfloat16 bits, round to nearest, ties to even (finite values)."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _install_stand_ins() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            flat = np.frombuffer(np.ascontiguousarray(input).tobytes(), dtype=np.float32)
            return _e4m3_rne(flat).reshape(input.shape)
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            return _bf16_rne(input).reshape(input.shape)
        return real(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert
    from sglang.kernels.ops.gemm import fp8_kernel as gemm_kernels

    gemm_kernels.get_device_name = lambda device_id=0: "cpu"


def _name(fn) -> str:
    return getattr(getattr(fn, "fn", fn), "__name__", repr(fn))


def main() -> None:
    cases_path, out_path, report_path = sys.argv[1:4]
    from sglang_oracle import install_stubs

    install_stubs()  # torchvision and friends, which sglang.srt imports and nothing here uses
    import torch
    from safetensors.torch import load_file, save_file

    _install_stand_ins()
    from sglang.kernels.ops.gemm import fp8_kernel as gemm_kernels
    from sglang.kernels.ops.quantization import fp8_kernel as quant_kernels
    from sglang.srt.layers.quantization import fp8_utils

    torch.set_num_threads(1)
    cases = load_file(cases_path)
    out, names = {}, sorted({k.split(".")[0] for k in cases})
    for c in names:
        x = cases[f"{c}.x"]
        q, s = fp8_utils.per_token_group_quant_fp8(
            x.reshape(-1, x.shape[-1]).contiguous(), 128, column_major_scales=False
        )
        out[f"{c}.q"], out[f"{c}.scale"] = q.view(torch.uint8).contiguous(), s.contiguous()
        if f"{c}.weight" in cases:
            out[f"{c}.out"] = fp8_utils.triton_w8a8_block_fp8_linear(
                x, cases[f"{c}.weight"], [128, 128], cases[f"{c}.weight_scale_inv"], None, cases.get(f"{c}.bias")
            ).contiguous()
    save_file(out, out_path)
    try:
        quant_kernels.sglang_per_token_group_quant_fp8(torch.ones(1, 256), 128)
        cuda_quant = "ran"
    except Exception as e:  # noqa: BLE001 - what happens is the finding
        cuda_quant = f"{type(e).__name__}: {e}"
    dispatched = fp8_utils.dispatch_w8a8_block_fp8_linear([128, 128])
    report = {
        "per_token_group_quant_fp8": fp8_utils.per_token_group_quant_fp8.__name__,
        "dispatch": getattr(dispatched, "__name__", repr(dispatched)),
        "matmul_kernel": _name(gemm_kernels.select_w8a8_block_fp8_matmul_kernel(1, 128, {})),
        "sglang_per_token_group_quant_fp8_off_cuda": cuda_quant,
        "interpreter": os.environ.get("TRITON_INTERPRET"),
    }
    Path(report_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
