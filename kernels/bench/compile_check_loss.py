"""The policy-loss kernels compiled for Hopper (sm_90) WITHOUT a GPU, and what their SASS says: the
16-byte loads of the streamed inputs (LDG.E.128), the scalar loads left (LDG.E), local-memory spills
(LDL/STL), barriers, registers and shared memory.

    env -u TRITON_INTERPRET python -m dapo_kernels.bench.compile_check_loss

Triton's bundled ptxas / cuobjdump (kernels/bench/compile_check.py's `_compile`, with the JIT's
16-byte pointer specialization). The old kernel (`fused`) is compiled twice: with N divisible by 16
(what the JIT gives a benchmark's 65,536 or 16M tokens) and without (what a packed micro-batch of any
length gets); the persistent kernel's integers are never specialized, so one compile covers every N.
tests/kernels/test_policy_loss_sass.py asserts on these counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

from dapo_kernels import policy_loss_persistent as mod
from dapo_kernels.bench.common import print_table
from dapo_kernels.bench.compile_check import _compile

_POINTERS = ("lp_ptr", "old_ptr", "adv_ptr", "mask_ptr", "grad_ptr", "part_ptr", "counter_ptr", "out_ptr")


def persistent_signature(*, mask_dtype: str = "u8", logprob_dtype: str = "fp32") -> dict:
    """_persistent_kernel's runtime arguments as Triton types (a bool mask is "*u1" to the JIT)."""
    sig = dict.fromkeys(_POINTERS, "*fp32")
    sig.update(lp_ptr=f"*{logprob_dtype}", grad_ptr=f"*{logprob_dtype}", mask_ptr=f"*{mask_dtype}", counter_ptr="*i32")
    sig.update(dict.fromkeys(("N", "adv_cols", "group_tiles", "num_groups"), "i32"))
    sig.update(dict.fromkeys(("eps_low", "eps_high", "clip_c", "inv_denom", "loss_denominator"), "fp32"))
    return sig


def fused_signature() -> dict:
    """kernels/policy_loss.py's _fused_kernel (today's `fused`)."""
    names = ("lp_ptr", "old_ptr", "adv_ptr", "mask_ptr", "grad_ptr", "part_ptr")
    sig = dict.fromkeys(names, "*fp32")
    sig.update(mask_ptr="*u8", T="i32", num_blocks="i32", eps_low="fp32", eps_high="fp32", clip_c="fp32")
    sig.update(inv_denom="fp32", adv_cols="i32", counter_ptr="*i32", out_ptr="*fp32", loss_denominator="fp32")
    return sig


def sass_counts(sass: str) -> collections.Counter:
    """Opcode counts of the memory and synchronisation instructions of a SASS listing."""
    ops = re.findall(r"\b((?:LDG|STG|LDL|STL|LDS|STS|ATOMG|RED|BAR|MEMBAR)(?:\.[A-Z0-9_]+)*)\b", sass)
    return collections.Counter(ops)


def resource_usage(cubin: bytes) -> dict:
    """{"REG": registers per thread, "STACK": bytes, "LOCAL": bytes, "SHARED": bytes} from cuobjdump."""
    from triton import knobs

    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with open(fd, "wb") as f:
            f.write(cubin)
        text = subprocess.check_output([knobs.nvidia.cuobjdump.path, "-res-usage", path], text=True)
    finally:
        os.remove(path)
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def compile_persistent(
    *, adv_per_row: bool = False, mask_dtype: str = "u8", logprob_dtype: str = "fp32", tile=None, num_warps=None
):
    tile, num_warps = tile or 512, num_warps or 4
    consts = {"HAS_DUAL": True, "ADV_PER_ROW": adv_per_row, "TILE": tile, "ROW": max(1, tile // (32 * num_warps))}
    consts["REDUCE_BLOCK"] = 256
    sig = persistent_signature(mask_dtype=mask_dtype, logprob_dtype=logprob_dtype)
    return _compile(mod._persistent_kernel, sig, consts, set(_POINTERS), num_warps=num_warps, num_stages=3)


def compile_fused(*, n_divisible_by_16: bool):
    module = sys.modules["dapo_kernels.policy_loss"]  # the package attribute is the function
    consts = {"HAS_DUAL": True, "BLOCK": 2048, "ADV_PER_ROW": False, "ONE_PASS": True, "REDUCE_BLOCK": 512}
    div = {"lp_ptr", "old_ptr", "adv_ptr", "mask_ptr", "grad_ptr", "part_ptr", "counter_ptr", "out_ptr"}
    if n_divisible_by_16:
        div.add("T")
    return _compile(module._fused_kernel, fused_signature(), consts, div, num_warps=4, num_stages=3)


def report(kernel) -> dict:
    counts = sass_counts(kernel.asm["sass"])
    usage = resource_usage(kernel.asm["cubin"])
    return {
        "LDG.E.128": counts["LDG.E.128"],
        "LDG.E": counts["LDG.E"],
        "LDG.E.U8": counts["LDG.E.U8"],
        "STG.E.128": counts["STG.E.128"],
        "LDL+STL": sum(n for op, n in counts.items() if op.startswith(("LDL", "STL"))),
        "BAR": sum(n for op, n in counts.items() if op.startswith("BAR")),
        "regs": usage.get("REG"),
        "shared_B": kernel.metadata.shared,
    }


def variants():
    """(label, compile thunk) for every loss kernel configuration the benchmark runs."""
    return [
        ("fused, N % 16 == 0", lambda: compile_fused(n_divisible_by_16=True)),
        ("fused, any N", lambda: compile_fused(n_divisible_by_16=False)),
        ("persistent u8 mask", lambda: compile_persistent()),
        ("persistent bool mask", lambda: compile_persistent(mask_dtype="u1")),
        ("persistent fp32 weights", lambda: compile_persistent(mask_dtype="fp32")),
        ("persistent adv[B,1]", lambda: compile_persistent(adv_per_row=True)),
        ("persistent bf16 logprob", lambda: compile_persistent(logprob_dtype="bf16")),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="also write the rows to this file (the SASS test reads it)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter decorates kernels that cannot be compiled")
        return 2
    rows = [{"kernel": label, **report(build())} for label, build in variants()]
    print_table(rows, list(rows[0]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
