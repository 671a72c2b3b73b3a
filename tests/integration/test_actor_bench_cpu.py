"""The actor benchmark runs on CPU for a tiny shape (python -m dapo_megatron.benchmarks.actor --shape tiny): a
row with tokens/s and the peak resident memory, no MFU (no CPU peak is assumed), and
actor.attention_kernel=flex refused without CUDA, naming the key."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path, *extra):
    env = dict(os.environ, MASTER_PORT=str(29500 + os.getpid() % 1000))
    return subprocess.run([sys.executable, "-m", "dapo_megatron.benchmarks.actor", "--shape", "tiny", "--steps", "1",
                           "--micro-batches", "1", "--results-dir", str(tmp_path),
                           "--checkpoint-dir", str(tmp_path / "ckpt"), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_actor_bench_on_cpu_writes_a_row_per_token_budget(tmp_path):
    proc = _bench(tmp_path, "--tokens", "256", "1024")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (tmp_path / "actor.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["tokens_per_micro_batch"]) for r in rows] == [256, 1024]
    for row in rows:
        assert row["precision"] == "fp32" and row["attention_kernel"] == "sdpa" and row["mfu"] == ""
        assert float(row["tokens_per_s"]) > 0 and float(row["peak_mem_gib"]) > 0
        assert row["device"].startswith("CPU")
    proc = _bench(tmp_path, "--tokens", "256", "--attention-kernel", "flex")
    assert proc.returncode != 0 and "actor.attention_kernel=flex needs a CUDA GPU" in proc.stderr
