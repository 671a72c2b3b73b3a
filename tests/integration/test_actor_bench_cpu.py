"""The actor benchmark runs on CPU for a tiny shape (python -m dapo_megatron.benchmarks.actor --shape tiny): a
row with tokens/s and the peak resident memory, no MFU (no CPU peak is assumed), and
actor.attention_kernel=flex refused without CUDA, naming the key. Rows are on disk as they are measured, a
row that runs out of memory is an `oom` row and the next row runs, and each row's model is freed before the
next (issue 33)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rank_pool import _free_port

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path, *extra, env_extra=None):
    env = dict(os.environ, MASTER_PORT=str(_free_port()), **(env_extra or {}))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_megatron.benchmarks.actor",
            "--shape",
            "tiny",
            "--steps",
            "1",
            "--micro-batches",
            "1",
            "--results-dir",
            str(tmp_path),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


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
        assert row["status"] == "ok" and row["recompute"] == "none" and row["model_freed"] == "yes"
    proc = _bench(tmp_path, "--tokens", "256", "--attention-kernel", "flex")
    assert proc.returncode != 0 and "actor.attention_kernel=flex needs a CUDA GPU" in proc.stderr
    proc = _bench(tmp_path, "--tokens", "4096", "512", "--seqs-per-mb", "2", "--prompt-tokens", "256")
    assert (
        proc.returncode == 2
        and "--prompt-tokens 256: must be at least 1 and below the sequence length 256 (--tokens 512 / --seqs-per-mb 2)"
        in proc.stderr
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_an_oom_row_is_recorded_and_the_rows_are_on_disk_as_they_come(tmp_path):
    """Row 512 allocates 1e6 GiB for real once its actor is built (the CPU allocator refuses it: the bench's
    OOM); the bench writes it as `oom`, frees that actor too and measures 1024. Then a run whose second row
    dies of another error (a negative allocation: not an OOM, so it propagates) still leaves its first row."""
    from dapo_megatron.benchmarks.actor import EXTRA_ALLOC_ENV

    proc = _bench(
        tmp_path, "--tokens", "256", "512", "1024", "--recompute", "full", env_extra={EXTRA_ALLOC_ENV: "512=1e6"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens_per_micro_batch=512: out of memory" in proc.stdout
    with (tmp_path / "actor.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [(int(r["tokens_per_micro_batch"]), r["status"], r["recompute"]) for r in rows] == [
        (256, "ok", "full"),
        (512, "oom", "full"),
        (1024, "ok", "full"),
    ]
    assert rows[1]["tokens_per_s"] == "" and float(rows[1]["peak_mem_gib"]) > 0
    assert float(rows[2]["tokens_per_s"]) > 0
    # the weak references to each row's actor and model chunks are dead after the row, the oom row's too
    assert [r["model_freed"] for r in rows] == ["yes", "yes", "yes"]

    dead = tmp_path / "dead"
    proc = _bench(dead, "--tokens", "256", "512", env_extra={EXTRA_ALLOC_ENV: "512=-1"})
    assert proc.returncode != 0 and "Trying to create tensor with negative dimension" in proc.stderr
    with (dead / "actor.csv").open() as fh:
        assert [(r["tokens_per_micro_batch"], r["status"]) for r in csv.DictReader(fh)] == [("256", "ok")]
