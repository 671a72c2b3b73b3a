"""One run per output directory (launch/run_lock.py), with real processes: a live holder refuses a
second lock and a second `dapo-megatron train` (naming its pid and host, before anything is written);
a SIGKILLed holder's lock is recognised as stale, reported and taken over; a clean release leaves
nothing to report."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_megatron.launch.run_lock import LOCK_FILE, RunDirInUse, RunLock

REPO = Path(__file__).resolve().parents[2]

_HOLDER = """
import sys, time
from dapo_megatron.launch.run_lock import RunLock
lock = RunLock(sys.argv[1], command="holder test").acquire()
print("held", flush=True)
time.sleep(600)
"""


def _start_holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_refused_then_stale_lock_taken_over(tmp_path):
    run = tmp_path / "run"
    holder = _start_holder(run)
    try:
        with pytest.raises(RunDirInUse) as refused:
            RunLock(run).acquire()
        message = str(refused.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message
        assert "`holder test`" in message and "trainer.output_dir=NEW_DIR" in message
        # the real command line: refused (exit 2) before the model, an engine or a rank; nothing written
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "dapo_megatron.cli",
                "train",
                str(REPO / "configs/runs/tiny_cpu.yaml"),
                f"trainer.output_dir={run}",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert second.returncode == 2, second.stderr
        assert f"is in use by another run: pid {holder.pid} on host {socket.gethostname()}" in second.stderr
        assert [p.name for p in run.iterdir()] == [LOCK_FILE]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder died without releasing: the kernel dropped the flock, its record names it as stale
    with RunLock(run, command="second") as lock:
        assert lock.stale_note.startswith(f"[train] {run / LOCK_FILE}: taking over the stale lock of pid {holder.pid} ")
        assert "no longer running" in lock.stale_note
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert (run / LOCK_FILE).read_text() == ""  # released cleanly: the next run has nothing to report
    with RunLock(run) as lock:
        assert lock.stale_note == ""
