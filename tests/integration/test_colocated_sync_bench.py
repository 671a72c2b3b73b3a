"""The colocated-sync benchmark (dapo_megatron/benchmarks/colocated_sync.py) on CPU at the tiny shape: the
trainer process feeds the project's CPU engine server through shared-memory payloads (the colocated
transport's CPU form). Checks the row's arithmetic and fields, never its speed: the bytes are the shape's
parameters (counted here from the shape by hand), GB/s is bytes / sync_s_p50, the phases add up to their
total, one 512 MB bucket holds the whole tiny model, and the engine's tensors equal the trainer's. The
engine's output goes to --engine-log, and an engine that does not start says why (issue 49)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo_megatron.benchmarks.engine_abuse import served_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (shared memory)")
def test_colocated_sync_bench_row_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dapo_megatron.benchmarks.colocated_sync", "--shape", "tiny", "--repeats", "2",
         "--csv", str(tmp_path / "sync.csv"), "--checkpoint-dir", str(tmp_path / "ckpt"),
         "--engine-log", str(tmp_path / "engine.log")],
        cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (tmp_path / "sync.csv").open() as fh:
        (row,) = list(csv.DictReader(fh))
    # tiny shape (benchmarks/actor.TINY): hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads of 16,
    # vocab 512, tied embeddings. Per layer: q 64x64 + 64, k and v 32x64 + 32 each, o 64x64, gate / up / down
    # 3 x 128x64, two norms of 64; plus the embedding 512x64 and the final norm
    layer = (64 * 64 + 64) + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 128 * 64 + 2 * 64
    params = 2 * layer + 512 * 64 + 64
    assert int(row["bytes"]) == 4 * params  # float32 on the CPU engine
    assert int(row["tensors"]) == 2 * 12 + 2 and int(row["buckets"]) == 1 and int(row["repeats"]) == 2
    # gb_per_s is bytes / the unrounded median: within what the median's rounding to 1e-4 s allows
    gb, p50 = int(row["bytes"]) / 1e9, float(row["sync_s_p50"])
    assert gb / (p50 + 5e-5) - 5e-5 <= float(row["gb_per_s"]) <= gb / (p50 - 5e-5) + 5e-5
    phases = [float(row[k]) for k in ("export_s", "ipc_s", "engine_s", "session_s")]
    assert abs(sum(phases) - float(row["phases_total_s"])) <= 2e-4  # each rounded to 1e-4
    assert float(row["sync_s_min"]) <= float(row["sync_s_p50"])
    assert row["read_back"] == "equal" and row["dtype"] == "float32" and row["device"].startswith("CPU")
    assert (tmp_path / "engine.log").stat().st_size > 0  # the engine's output, not DEVNULL


def test_an_engine_that_does_not_start_says_why_from_its_log(tmp_path):
    missing = tmp_path / "no_such_model"
    log = tmp_path / "engine.log"
    with pytest.raises(RuntimeError) as err, served_engine(str(missing), tmp_path / "engines", log_path=log):
        pass
    text = str(err.value)
    assert text.startswith("serve-rollout did not start (exited with ")
    assert "the last " in text and str(log) in text
    # the engine's own words about the model it could not load reach the error
    assert "no_such_model" in text.split(str(log), 1)[1], text


def test_a_checkpoint_cut_off_mid_write_is_not_left_for_the_next_step(tmp_path, monkeypatch):
    """sync_bench and attention_rows share one random checkpoint and reuse it when model.safetensors exists
    (issue 49): a write that dies part-way leaves no model.safetensors; a whole one has every tensor."""
    import safetensors.torch
    from safetensors import safe_open

    from dapo_megatron.benchmarks.actor import TINY, write_random_checkpoint

    real_save = safetensors.torch.save_file

    def dies_after_writing(tensors, path, metadata=None):
        real_save(dict(list(tensors.items())[:2]), path, metadata=metadata)  # part of it on disk
        raise KeyboardInterrupt("the step's budget ran out")

    monkeypatch.setattr(safetensors.torch, "save_file", dies_after_writing)
    with pytest.raises(KeyboardInterrupt):
        write_random_checkpoint(tmp_path / "cut", num_layers=2, shape=TINY)
    assert not (tmp_path / "cut" / "model.safetensors").exists()
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    out = write_random_checkpoint(tmp_path / "whole", num_layers=2, shape=TINY)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert len(list(f.keys())) == 2 * 12 + 2  # 12 per layer, the embedding and the final norm (tied head)
