"""Disk full during a checkpoint, on a real full file system: the real `dapo-megatron train` on the
tiny CPU config writes into a 5 MiB tmpfs (a checkpoint of the tiny model is ~3.1 MiB), so step 1's
checkpoint fits and step 2's does not. The run must stop (exit 1) with a message naming the path,
ENOSPC and the free space; step 1's checkpoint must still verify against its manifest; the partial
step_2.tmp is removed; no process of the run is left. Needs root to mount the tmpfs (skipped
otherwise: tests/unit/test_checkpoint_write_failure.py covers the message without root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_megatron.trainer.checkpoint import files as ckpt
from helpers_train import run_processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_tmpfs(mount_tmpfs):
    return mount_tmpfs("5m", "cannot mount a tmpfs here (not root)")


def test_disk_full_checkpoint_stops_cleanly_and_keeps_the_previous(tmp_path, small_tmpfs):
    out = small_tmpfs / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DAPO_TEST_RUN_DIR": str(out)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_megatron.cli",
            "train",
            str(ROOT / "configs/runs/tiny_cpu.yaml"),
            f"trainer.output_dir={out}",
            f"tiny.cache_dir={tmp_path / 'cache'}",
            "tiny.warm_start_steps=0",
            "algorithm.max_num_gen_batches=1",
            "trainer.total_steps=3",
            "trainer.eval_every=0",
            "trainer.save_every=1",
            "trainer.keep_checkpoints=2",
            "trainer.wandb_mode=disabled",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-4000:]
    tmp = out / "checkpoints" / "step_000002.tmp"
    assert f"checkpoint write to {tmp} failed: [Errno 28] No space left on device (ENOSPC" in text, text[-4000:]
    assert " MiB free of 5.0 MiB on its file system; the previous checkpoint " in text
    assert f"{out / 'checkpoints' / 'step_000001'} is intact" in text
    assert [step for step, _ in ckpt.list_checkpoints(out)] == [1]
    assert ckpt.verify_checkpoint(out / "checkpoints" / "step_000001") == []
    assert not tmp.exists()
    assert not run_processes(out)
    print("\n" + next(line for line in text.splitlines() if "checkpoint write to" in line))
