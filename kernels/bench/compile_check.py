"""Compile every dapo_kernels Triton kernel for Hopper (sm_90) WITHOUT a GPU, and report what the
compiler did: shared memory, whether the K loop is software-pipelined (multi-buffered cp.async
tiles), whether wgmma is used, and whether anything spilled to local memory.

    env -u TRITON_INTERPRET python -m dapo_kernels.bench.compile_check            # all configs
    env -u TRITON_INTERPRET python -m dapo_kernels.bench.compile_check --quick    # one config each

Uses triton's bundled ptxas, so it runs on the CPU machines: a compile-mode error (the
interpreter accepts some programs the compiler rejects) shows up here before a GPU is lent.
Arguments get the specializations the JIT gives real launches (16-byte aligned pointers; H, V and
row strides divisible by 16, as for Qwen shapes); without them no load is vectorized and the
pipeliner leaves the loop alone.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

# dapo_kernels is imported (its kernels decorated) before this module runs anyway: it is this module's
# package; main() refuses to compile under TRITON_INTERPRET
from dapo_kernels import logprob, logprob_cublas
from dapo_kernels import logprob_persistent as persistent
from dapo_kernels.bench.common import print_table


def _compile(fn, signature: dict, constexprs: dict, divisible: set, *, num_warps: int, num_stages: int):
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in divisible}
    signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    return triton_compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


# SASS instructions counted per kernel (cuobjdump -sass of the cubin): HGMMA = wgmma, UTMALDG = a TMA
# tensor load, LDGSTS = cp.async, LDL/STL = local-memory loads/stores (register spills: ptxas spills
# show up only here, never in the PTX, whose `.local` the first version of this check read).
SASS_OPS = ("HGMMA", "UTMALDG", "LDGSTS", "LDL", "STL")


def sass_facts(cubin: bytes) -> dict:
    """{op: count} for SASS_OPS, plus registers and stack bytes per thread, from triton's bundled cuobjdump."""
    import subprocess
    import tempfile

    from triton import knobs

    tool = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    facts = {op: len(re.findall(rf"\b{op}\b", sass)) for op in SASS_OPS}
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    facts["regs"] = int(regs.group(1)) if regs else -1
    facts["stack"] = int(stack.group(1)) if stack else -1
    return facts


def _report(kernel) -> dict:
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    buffers = [int(s) for s in re.findall(r"memdesc<(\d+)x\d+x\d+x(?:bf16|f16|f32)", ttgir)]
    facts = sass_facts(kernel.asm["cubin"])
    return {
        "shared_KiB": kernel.metadata.shared // 1024,
        "stages": max(buffers) if buffers else 1,
        "wgmma": "wgmma.mma_async" in ptx,
        "cp_async": len(re.findall(r"cp\.async", ptx)),
        **facts,
    }


def _persistent_jobs(quick: bool) -> list:
    """The TMA-fed persistent kernels (logprob_persistent.py): every Hopper config in bf16, the first in
    fp16, FP32_HOPPER_TILES in fp32. Descriptors are `tensordesc<dtype[box]>` arguments (host TensorDescriptor)."""
    per_row = ("tgt_ptr", "max_ptr", "logs_ptr", "meanc_ptr", "glp_ptr", "gent_ptr")
    div = {"tgt_ptr", "stats_ptr", "dz_ptr", "V", "H", "stride_dzn", *per_row}
    configs = persistent.hopper_configs()[: 1 if quick else None]
    jobs = []
    for dtype in ("bf16", "fp16", "fp32"):
        for cfg in {"bf16": configs, "fp16": configs[:1], "fp32": [persistent.FP32_HOPPER_TILES]}[dtype]:
            bn, bv, bk = cfg["BLOCK_N"], cfg["BLOCK_V"], cfg["BLOCK_K"]
            descs = {"h_desc": f"tensordesc<{dtype}[{bn},{bk}]>", "w_desc": f"tensordesc<{dtype}[{bv},{bk}]>"}
            meta = {"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk, "SPLIT_EPILOGUE": cfg["SPLIT_EPILOGUE"]}
            meta |= {"CAST_F32": False, "IEEE": dtype == "fp32"}
            fwd_sig = {**descs, "tgt_ptr": "*i64", "stats_ptr": "*fp32", **dict.fromkeys(("N", "V", "H"), "i32")}
            fwd_sig |= {"num_splits": "i32", "inv_temp": "fp32"}
            bwd_sig = {**descs, "tgt_ptr": "*i64", **dict.fromkeys(per_row[1:], "*fp32"), "dz_ptr": f"*{dtype}"}
            bwd_sig |= {**dict.fromkeys(("N", "V", "H", "stride_dzn"), "i32"), "inv_temp": "fp32", "col0": "i32"}
            split = "halves" if cfg["SPLIT_EPILOGUE"] else "whole"
            name = f"{dtype} {bn}x{bv}x{bk} w{cfg['num_warps']} s{cfg['num_stages']} {split}"
            launch = (cfg["num_warps"], cfg["num_stages"])
            fwd_meta = {**meta, "GROUP_N": 8}
            jobs.append((f"tma fwd {name}", persistent._fwd_persistent_kernel, fwd_sig, fwd_meta, div, *launch))
            bwd_meta = {**meta, "HAS_ENT": True}
            jobs.append((f"tma dlogits {name}", persistent._dlogits_persistent_kernel, bwd_sig, bwd_meta, div, *launch))
    return jobs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one tile configuration per kernel")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter decorates kernels that cannot be compiled")
        return 2
    policy_loss = sys.modules["dapo_kernels.policy_loss"]  # the package attribute is the function

    logprob_div = {
        "h_ptr",
        "w_ptr",
        "tgt_ptr",
        "stats_ptr",
        "max_ptr",
        "logs_ptr",
        "meanc_ptr",
        "glp_ptr",
        "gent_ptr",
        "dz_ptr",
        "V",
        "H",
        "stride_hn",
        "stride_wv",
        "stride_dzn",
    }
    shapes = [
        (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_V"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
        for c in logprob._hopper_configs(False)
    ]
    if args.quick:
        shapes = shapes[:1]
    rows, failed = [], 0
    jobs = []
    for dtype in ("bf16", "fp16", "fp32"):
        for bn, bv, bk, warps, stages in shapes if dtype == "bf16" else shapes[:1]:
            tile = {"BLOCK_N": bn, "BLOCK_V": bv, "BLOCK_K": bk, "CAST_F32": False, "IEEE": dtype == "fp32"}
            fwd_sig = {
                "h_ptr": f"*{dtype}",
                "w_ptr": f"*{dtype}",
                "tgt_ptr": "*i64",
                "stats_ptr": "*fp32",
                "N": "i32",
                "V": "i32",
                "H": "i32",
                "stride_hn": "i32",
                "stride_wv": "i32",
                "num_splits": "i32",
                "inv_temp": "fp32",
            }
            bwd_sig = {
                "h_ptr": f"*{dtype}",
                "w_ptr": f"*{dtype}",
                "tgt_ptr": "*i64",
                "max_ptr": "*fp32",
                "logs_ptr": "*fp32",
                "meanc_ptr": "*fp32",
                "glp_ptr": "*fp32",
                "gent_ptr": "*fp32",
                "dz_ptr": f"*{dtype}",
                "N": "i32",
                "V": "i32",
                "H": "i32",
                "stride_hn": "i32",
                "stride_wv": "i32",
                "stride_dzn": "i32",
                "inv_temp": "fp32",
                "col0": "i32",
            }
            name = f"{dtype} {bn}x{bv}x{bk} w{warps} s{stages}"
            jobs.append(
                (
                    f"logprob fwd {name}",
                    logprob._fwd_kernel,
                    fwd_sig,
                    {**tile, "GROUP_N": 8},
                    logprob_div,
                    warps,
                    stages,
                )
            )
            jobs.append(
                (
                    f"logprob dlogits {name}",
                    logprob._dlogits_kernel,
                    bwd_sig,
                    {**tile, "HAS_ENT": True},
                    logprob_div,
                    warps,
                    stages,
                )
            )
    # logits="cublas": the epilogues over an fp32 logits chunk (no tl.dot: memory-bound by design)
    epi = {"BLOCK_N": logprob_cublas.EPILOGUE_BLOCK_N, "BLOCK_V": logprob_cublas.EPILOGUE_BLOCK_V}
    epi_div = {
        "z_ptr",
        "tgt_ptr",
        "stats_ptr",
        "max_ptr",
        "logs_ptr",
        "meanc_ptr",
        "glp_ptr",
        "gent_ptr",
        "dz_ptr",
        "V",
        "stride_zn",
        "stride_dzn",
        "stats_stride",
    }
    jobs.append(
        (
            "cublas-epilogue stats",
            logprob_cublas._stats_epilogue_kernel,
            {
                "z_ptr": "*fp32",
                "tgt_ptr": "*i64",
                "stats_ptr": "*fp32",
                "N": "i32",
                "V": "i32",
                "stride_zn": "i32",
                "stats_stride": "i32",
                "num_splits": "i32",
                "inv_temp": "fp32",
            },
            epi,
            epi_div,
            8,
            2,
        )
    )
    for dtype in ("bf16", "fp32"):
        jobs.append(
            (
                f"cublas-epilogue dlogits {dtype}",
                logprob_cublas._dlogits_epilogue_kernel,
                {
                    "z_ptr": "*fp32",
                    "tgt_ptr": "*i64",
                    "max_ptr": "*fp32",
                    "logs_ptr": "*fp32",
                    "meanc_ptr": "*fp32",
                    "glp_ptr": "*fp32",
                    "gent_ptr": "*fp32",
                    "dz_ptr": f"*{dtype}",
                    "N": "i32",
                    "V": "i32",
                    "stride_zn": "i32",
                    "stride_dzn": "i32",
                    "inv_temp": "fp32",
                    "col0": "i32",
                },
                {**epi, "HAS_ENT": True},
                epi_div,
                8,
                2,
            )
        )
    loss_sig = {
        "lp_ptr": "*fp32",
        "old_ptr": "*fp32",
        "adv_ptr": "*fp32",
        "mask_ptr": "*u8",
        "grad_ptr": "*fp32",
        "part_ptr": "*fp32",
        "T": "i32",
        "num_blocks": "i32",
        "eps_low": "fp32",
        "eps_high": "fp32",
        "clip_c": "fp32",
        "inv_denom": "fp32",
        "adv_cols": "i32",
        "counter_ptr": "*i32",
        "out_ptr": "*fp32",
        "loss_denominator": "fp32",
    }
    loss_div = {"lp_ptr", "old_ptr", "adv_ptr", "mask_ptr", "grad_ptr", "part_ptr", "counter_ptr", "out_ptr"}
    for one_pass in (True, False):
        for per_row in (False, True):
            consts = {
                "HAS_DUAL": True,
                "BLOCK": 2048,
                "ADV_PER_ROW": per_row,
                "ONE_PASS": one_pass,
                "REDUCE_BLOCK": 512,
            }
            label = f"policy_loss fused {'one-pass' if one_pass else 'two-launch'}{' adv[B,1]' if per_row else ''}"
            jobs.append((label, policy_loss._fused_kernel, loss_sig, consts, loss_div, 4, 3))
    jobs.append(
        (
            "policy_loss reduce",
            policy_loss._reduce_kernel,
            {
                "part_ptr": "*fp32",
                "loss_ptr": "*fp32",
                "stats_ptr": "*fp32",
                "num_blocks": "i32",
                "loss_denominator": "fp32",
            },
            {"BLOCK": 512},
            {"part_ptr", "loss_ptr", "stats_ptr"},
            4,
            3,
        )
    )
    jobs += _persistent_jobs(args.quick)
    for label, fn, sig, consts, div, warps, stages in jobs:
        start = time.time()
        try:
            info = _report(_compile(fn, sig, consts, div, num_warps=warps, num_stages=stages))
        except Exception as err:  # noqa: BLE001 - report every kernel, then fail
            failed += 1
            rows.append({"kernel": label, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"})
            continue
        rows.append({"kernel": label, **info, "compile_s": f"{time.time() - start:.1f}"})
    columns = ["kernel", "shared_KiB", "stages", "wgmma", "cp_async", *SASS_OPS, "regs", "stack", "compile_s", "error"]
    print_table(rows, columns)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
