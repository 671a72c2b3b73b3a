"""When an actor rank fails, `dapo-megatron train` says the first failing rank's cause in one line and
keeps its whole traceback in <output_dir>/logs/ranks_error.txt.

Rank 0 fails first here (its only rollout engine, rollout.engine_urls, is a closed port); rank 1 then
dies in its next collective with gloo's "Connection closed by peer". Both tracebacks used to reach the
terminal interleaved, rank 1's last, and torchrun's report repeated them, so a user read the symptom and
lost the cause. A failing rank now records its exception in torchrun's per-rank error file before its
clean-up (trainer/train.py: first_cause_recorded) and prints nothing; launch/local/ranks.py names the rank that
recorded first. Real launcher, real torchrun, 2 gloo ranks; ~20 s.
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
    console = proc.stdout + proc.stderr
    cause_file = tmp_path / "run" / "logs" / "ranks_error.txt"
    named = [line for line in console.splitlines() if "the run failed on rank" in line]
    assert len(named) == 1, console[-4000:]
    assert named[0].startswith("[train] the run failed on rank 0: EngineUnreachable: "), named
    assert named[0].endswith(f"(traceback: {cause_file})")
    assert "Traceback" not in console and "Connection closed by peer" not in console, console[-4000:]
    assert "To enable traceback see" not in console  # torchrun's text when a rank left no error file
    # the whole traceback: from the rank's loop (trainer/train.py) down to the raising frame and its message
    traceback = cause_file.read_text()
    assert "Traceback (most recent call last):" in traceback and "dapo_megatron/trainer/train.py" in traceback
    raised = [line.strip() for line in traceback.splitlines() if re.match(r"\s*(\w+\.)*[A-Z]\w*: ", line)]
    assert raised and raised[-1].startswith("dapo_megatron."), raised  # the exception and its message
