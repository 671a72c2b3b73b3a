"""The one-pass LM head + DAPO loss kernels (kernels/head_loss.py, head_loss_tma.py) compiled for sm_90 on the CPU
(kernels/bench/compile_check_head_loss.py: Triton's bundled ptxas and cuobjdump, no GPU):

- the logits GEMM of every configuration the compiled launch tunes over runs on wgmma (HGMMA in the
  SASS) in bf16 and fp16, and nothing spills to local memory (no LDL / STL) although each fp32 logits
  tile is also stored to the workspace;
- the dlogits kernel (the clipped loss's dL/dlogp and onehot - softmax, no GEMM) spills nothing;
- for the record, the 128x256 tile (logprob.py's first choice) DOES spill here: the reason it is not tuned;
- the TMA build (logits="tma", head_loss_tma.py): every tuned configuration loads its operands by TMA
  (UTMALDG, no cp.async LDGSTS), runs wgmma in bf16 / fp16 and spills nothing, fp32 included; the tl.dot
  build reads them with cp.async and no TMA.

Run: pytest tests/kernels/test_head_loss_sass.py -q     (about 15 s of compiling on the CPU)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("sass") / "head_loss.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "dapo_kernels.bench.compile_check_head_loss", "--json", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {row["kernel"]: row for row in json.loads(path.read_text())}


def test_tuned_logits_kernels_use_wgmma_and_do_not_spill(rows):
    tuned = [row for label, row in rows.items() if label.startswith("logits+stats") and "not tuned" not in label]
    half = [row for row in tuned if " bf16 " in row["kernel"] or " fp16 " in row["kernel"]]
    assert len(half) == 4, sorted(rows)  # 3 bf16 configurations + the first in fp16
    for row in half:
        assert row["HGMMA"] > 0, row
        assert row["LDL"] == 0 and row["STL"] == 0 and row["stack"] == 0, row


def test_dlogits_kernel_does_not_spill(rows):
    for dtype in ("bf16", "fp32"):
        row = rows[f"dz {dtype} 64x256 w8"]
        assert row["LDL"] == 0 and row["STL"] == 0 and row["HGMMA"] == 0, row


def test_the_wide_tile_spills(rows):
    """Why hopper_configs leaves out 128x256: folding it in halves halves nothing like enough."""
    halves = rows["logits+stats bf16 128x256x64 w8 s3 halves (not tuned)"]
    whole = rows["logits+stats bf16 128x256x64 w8 s3 whole (not tuned)"]
    assert 0 < halves["LDL"] < whole["LDL"], (halves, whole)


def test_tma_logits_kernels_load_by_tma_use_wgmma_and_do_not_spill(rows):
    tma = {
        label: row for label, row in rows.items() if label.startswith("tma logits+stats") and "not tuned" not in label
    }
    assert len(tma) == 5, sorted(rows)  # 3 bf16 configurations + the first in fp16 + the fp32 tile
    for label, row in tma.items():
        assert row["UTMALDG"] > 0 and row["LDGSTS"] == 0, row
        assert row["LDL"] == 0 and row["STL"] == 0 and row["stack"] == 0, row
        assert row["shared_KiB"] <= 227, row
        assert (row["HGMMA"] > 0) == (" fp32 " not in label), row  # fp32: the exact FMA dot, no wgmma


def test_the_tl_dot_build_uses_cp_async_not_tma(rows):
    """What the TMA build changes: the operands of today's kernel arrive by cp.async (LDGSTS), not TMA."""
    row = rows["logits+stats bf16 128x128x64 w8 s4"]
    assert row["LDGSTS"] > 0 and row["UTMALDG"] == 0, row
