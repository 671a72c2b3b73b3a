"""The one-pass LM head + DAPO loss kernels (kernels/head_loss.py, kernels/head_loss_tma.py) compiled for
Hopper (sm_90) WITHOUT a GPU, and what their SASS says: wgmma (HGMMA) in the logits GEMM, TMA tensor loads
(UTMALDG) and cp.async (LDGSTS) for its operands, spills (LDL/STL), registers, shared memory.

    env -u TRITON_INTERPRET python -m dapo_kernels.bench.compile_check_head_loss [--json out.json]

Triton's bundled ptxas / cuobjdump (compile_check.py's `_compile` and `sass_facts`), with the
specializations a real launch gets (16-byte aligned pointers; V, H and the row strides divisible by 16,
as at Qwen's shapes). tests/kernels/test_head_loss_sass.py asserts on these rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Callable

from dapo_kernels import head_loss, head_loss_tma, logprob
from dapo_kernels.bench.common import print_table
from dapo_kernels.bench.compile_check import _compile, sass_facts

_STATS_DIV = {"h_ptr", "w_ptr", "tgt_ptr", "ws_ptr", "stats_ptr", "V", "H", "stride_hn", "stride_wv", "stride_ws"}
_DZ_DIV = {"ws_ptr", "dz_ptr", "tgt_ptr", "max_ptr", "logs_ptr", "lp_ptr", "old_ptr", "adv_ptr", "lw_ptr"}
_DZ_DIV |= {"V", "stride_ws", "stride_dz"}
_TMA_DIV = {"tgt_ptr", "ws_ptr", "stats_ptr", "V", "H", "stride_ws"}


def compile_logits_stats(dtype: str, config, *, split: bool = True):
    """head_loss._logits_stats_kernel with a Hopper configuration (head_loss.hopper_configs: its autotune list);
    split: the epilogue folds the tile as two halves (head_loss.SPLIT_EPILOGUE)."""
    sig = {"h_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "tgt_ptr": "*i64", "ws_ptr": "*fp32", "stats_ptr": "*fp32"}
    sig |= dict.fromkeys(("N", "V", "H", "stride_hn", "stride_wv", "stride_ws", "num_splits"), "i32")
    sig |= {"inv_temp": "fp32"}
    consts = {**config.kwargs, "CAST_F32": False, "IEEE": dtype == "fp32", "SPLIT_EPILOGUE": split}
    return _compile(
        head_loss._logits_stats_kernel,
        sig,
        consts,
        _STATS_DIV,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def compile_logits_stats_tma(dtype: str, config, *, split: bool = True):
    """head_loss_tma._logits_stats_tma_kernel with one of its Hopper configurations (head_loss_tma.hopper_configs);
    the descriptors are `tensordesc<dtype[box]>` arguments (host TensorDescriptor, boxes = the tiles)."""
    bn, bv, bk = (config.kwargs[k] for k in ("BLOCK_N", "BLOCK_V", "BLOCK_K"))
    sig = {"h_desc": f"tensordesc<{dtype}[{bn},{bk}]>", "w_desc": f"tensordesc<{dtype}[{bv},{bk}]>"}
    sig |= {"tgt_ptr": "*i64", "ws_ptr": "*fp32", "stats_ptr": "*fp32"}
    sig |= dict.fromkeys(("N", "V", "H", "stride_ws", "num_splits"), "i32")
    sig |= {"inv_temp": "fp32"}
    consts = {**config.kwargs, "CAST_F32": False, "IEEE": dtype == "fp32", "SPLIT_EPILOGUE": split}
    return _compile(
        head_loss_tma._logits_stats_tma_kernel,
        sig,
        consts,
        _TMA_DIV,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def compile_dz(dtype: str):
    """head_loss._dz_kernel at its compiled tile (head_loss._DZ_TILE's GPU value, 64 x 256, 8 warps)."""
    sig = {"ws_ptr": "*fp32", "dz_ptr": f"*{dtype}", "tgt_ptr": "*i64"}
    sig |= dict.fromkeys(("max_ptr", "logs_ptr", "lp_ptr", "old_ptr", "adv_ptr", "lw_ptr"), "*fp32")
    sig |= dict.fromkeys(("N", "V", "stride_ws", "stride_dz"), "i32")
    sig |= dict.fromkeys(("eps_low", "eps_high", "clip_c", "inv_denom", "inv_temp"), "fp32")
    consts = {"HAS_DUAL": True, "BLOCK_N": 64, "BLOCK_V": 256}
    return _compile(head_loss._dz_kernel, sig, consts, _DZ_DIV, num_warps=8, num_stages=2)


def variants(quick: bool = False):
    """(label, compile thunk): every logits-stats configuration in bf16, the first in fp16 / fp32; the
    128x256 tile logprob.py tunes first, folded in halves and whole (for the record: it spills); dz."""
    configs = head_loss.hopper_configs()
    jobs: list[tuple[str, Callable]] = []
    for dtype in ("bf16", "fp16", "fp32"):
        for cfg in configs[: 1 if quick or dtype != "bf16" else None]:
            bn, bv, bk = cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_V"], cfg.kwargs["BLOCK_K"]
            label = f"logits+stats {dtype} {bn}x{bv}x{bk} w{cfg.num_warps} s{cfg.num_stages}"
            jobs.append((label, functools.partial(compile_logits_stats, dtype, cfg)))
    wide = logprob._hopper_configs(False)[0]  # 128x256x64, 8 warps, 3 stages
    for split in (True, False):
        label = f"logits+stats bf16 128x256x64 w8 s3 {'halves' if split else 'whole'} (not tuned)"
        jobs.append((label, functools.partial(compile_logits_stats, "bf16", wide, split=split)))
    for dtype in ("bf16", "fp32"):
        jobs.append((f"dz {dtype} 64x256 w8", functools.partial(compile_dz, dtype)))
    # the TMA build (logits="tma"): every configuration in bf16, the first in fp16, its fp32 tile; the 128x256
    # tile for the record (TMA frees the K loop's address registers, not enough for the wide epilogue)
    tma = head_loss_tma.hopper_configs()
    tma_jobs = [
        (dtype, cfg) for dtype in ("bf16", "fp16") for cfg in (tma if dtype == "bf16" and not quick else tma[:1])
    ]
    tma_jobs.append(("fp32", head_loss_tma.hopper_configs(fp32=True)[0]))
    for dtype, cfg in tma_jobs:
        bn, bv, bk = cfg.kwargs["BLOCK_N"], cfg.kwargs["BLOCK_V"], cfg.kwargs["BLOCK_K"]
        label = f"tma logits+stats {dtype} {bn}x{bv}x{bk} w{cfg.num_warps} s{cfg.num_stages}"
        jobs.append((label, functools.partial(compile_logits_stats_tma, dtype, cfg)))
    jobs.append(
        (
            "tma logits+stats bf16 128x256x64 w8 s3 halves (not tuned)",
            functools.partial(compile_logits_stats_tma, "bf16", wide),
        )
    )
    return jobs


def report(kernel) -> dict:
    facts = sass_facts(kernel.asm["cubin"])
    return {
        "HGMMA": facts["HGMMA"],
        "UTMALDG": facts["UTMALDG"],
        "LDGSTS": facts["LDGSTS"],
        "LDL": facts["LDL"],
        "STL": facts["STL"],
        "regs": facts["regs"],
        "stack": facts["stack"],
        "shared_KiB": kernel.metadata.shared // 1024,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one tile configuration per dtype")
    parser.add_argument("--json", default=None, help="also write the rows to this file (the SASS test reads it)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter decorates kernels that cannot be compiled")
        return 2
    rows = [{"kernel": label, **report(build())} for label, build in variants(args.quick)]
    print_table(rows, list(rows[0]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
