"""When an actor rank fails, the end of what `dapo-megatron train` prints is that rank's whole error.

Rank 0 fails first here (its only rollout engine, rollout.engine_urls, is a closed port); rank 1 then
dies in its next collective with gloo's "Connection closed by peer", and torchrun SIGTERMs it. Both
tracebacks reach the terminal interleaved, rank 1's last, so a user (or a test printing the tail of
stderr) read the symptom and lost the cause. trainer/train.py records the exception in torchrun's per-rank
error file, so torchrun's closing "Root Cause" block holds the first failing rank's traceback, and
the launcher's last line points at it. Real launcher, real torchrun, 2 gloo ranks; ~20 s.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as sock:  # bound then closed: nothing listens there during the test
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_first_failing_ranks_whole_traceback_ends_the_output(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "train",
        str(ROOT / "configs/runs/tiny_cpu.yaml"),
        f"trainer.output_dir={tmp_path / 'run'}",
        f"tiny.cache_dir={tmp_path / 'cache'}",
        "tiny.warm_start_steps=1",
        "trainer.total_steps=1",
        "trainer.wandb_mode=disabled",
        f"rollout.engine_urls=[http://127.0.0.1:{_closed_port()}]",
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-4000:]
    stderr = proc.stderr
    assert "[rank1]" in stderr and "Connection closed by peer" in stderr  # the symptom that buried the cause
    root = stderr[stderr.rindex("Root Cause (first observed failure):") :]
    assert "rank      : 0 (local_rank: 0)" in root
    assert "To enable traceback see" not in root  # torchrun's text when the rank left no error file
    # the whole traceback: from the rank's entry (trainer/train.py) down to the raising frame and its message
    assert "Traceback (most recent call last):" in root and "dapo_megatron/trainer/train.py" in root
    # exception lines: a dotted class name and its message (EngineUnreachable names no "Error")
    raised = [line.strip() for line in root.splitlines() if re.match(r"\s*(\w+\.)*[A-Z]\w*: ", line)]
    assert raised and raised[-1].startswith("dapo_megatron."), raised  # the exception and its message
    assert "Connection closed by peer" not in root  # rank 1's error is not the one named as the cause
    assert stderr.rstrip().splitlines()[-1].startswith("[train] the actor ranks failed (torchrun exit code 1)")
