"""The policy-loss kernels compiled for sm_90 on the CPU (kernels/bench/compile_check_loss.py: Triton's
bundled ptxas and cuobjdump, no GPU): what the persistent kernel's design claims, read from its SASS.

- every fp32 input streamed token by token (logprob, old_logprob, per-token advantages, float weights) is
  read with 16-byte loads (LDG.E.128: one per thread per tile, 4 tokens) and the fp32 gradient written with
  16-byte stores, for ANY token count (the full tiles carry no bounds mask);
- the 1-byte mask is one 4-byte load per thread (LDG.E, 128 contiguous bytes per warp): the 16-byte load
  would need 16 tokens per thread, a layout the fp32 streams do not share, and the compiler then shuffles
  the gradient through shared memory (2048-token tiles: 2 KiB of shared memory, 200 registers);
- nothing spills to local memory (no LDL / STL).
Today's `fused` kernel is compiled beside it: 16-byte loads only when the JIT sees N divisible by 16 (a
benchmark's 65,536 or 16M tokens), none for a packed micro-batch of any other length.

Run: pytest tests/kernels/test_policy_loss_sass.py -q     (about 15 s of compiling on the CPU)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("sass") / "loss.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "dapo_kernels.bench.compile_check_loss", "--json", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {row["kernel"]: row for row in json.loads(path.read_text())}


# fp32 streams per variant (inputs read with 16-byte loads), and whether the gradient is fp32
STREAMS = {
    "persistent u8 mask": (3, True),  # logprob, old_logprob, advantages
    "persistent bool mask": (3, True),
    "persistent fp32 weights": (4, True),  # + the weights
    "persistent adv[B,1]": (2, True),  # advantages are per row: a gather, not a stream
    "persistent bf16 logprob": (2, False),  # logprob and its gradient are bf16: 8 bytes per thread
}


@pytest.mark.parametrize("variant", sorted(STREAMS))
def test_persistent_kernel_streams_with_16_byte_loads_and_does_not_spill(rows, variant):
    row = rows[variant]
    fp32_streams, fp32_grad = STREAMS[variant]
    # the full-tile path: one LDG.E.128 per fp32 stream (the masked partial tile's loads are 4-byte ones)
    assert row["LDG.E.128"] == fp32_streams, row
    assert row["STG.E.128"] == (1 if fp32_grad else 0), row
    assert row["LDL+STL"] == 0, row
    assert row["shared_B"] <= 128, row  # only the per-group reduction: no layout shuffle through shared memory


def test_todays_kernel_vectorizes_only_when_n_is_divisible_by_16(rows):
    assert rows["fused, N % 16 == 0"]["LDG.E.128"] == 13  # 3 fp32 streams x 4 + the 16-byte mask load
    assert rows["fused, any N"]["LDG.E.128"] == 0 and rows["fused, any N"]["LDG.E"] == 48
