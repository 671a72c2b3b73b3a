"""Colocated engines start without the trainer's CUDA_DEVICE_MAX_CONNECTIONS (launch/slurm/colocated.py).

slurm/_trainer_launch.sh exports CUDA_DEVICE_MAX_CONNECTIONS=1 for the trainer's ranks (Megatron's TP
communication overlap) before it starts `python -m dapo_megatron.launch.slurm.colocated` in the same
allocation; 3eb0efe's engines inherited it. Here the real launcher runs with that environment and starts
the real CPU engine (`dapo-megatron serve-rollout`); the engine's environment is read from /proc while it
starts (it then fails on the empty model directory and exits, which ends the launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    raw = {
        "rollout": {
            "n": 2,
            "max_prompt_length": 16,
            "max_response_length": 16,
            "engine": "cpu",
            "gen_batch_size": 2,
            "placement": "colocated",
            "num_engines": 1,
        },
        "algorithm": {"overlong_buffer_length": 4},
        "actor": {"world_size": 1, "micro_batch_tokens": 64, "attention_backend": "torch", "precision": "fp32"},
        "trainer": {"total_steps": 2, "train_batch_size": 2, "mini_batch_size": 2, "output_dir": str(tmp_path / "run")},
        "slurm": {"nodes": 1, "gpus_per_node": 0, "cpus_per_task": 1, "time": "10:00"},
        "model": {"path": str(tmp_path / "model")},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _launcher_environ(launcher: subprocess.Popen, timeout_s: float = 60.0) -> dict[str, str]:
    """The launcher's environment once it runs the launcher: read right after Popen, /proc can still show
    the forked child before its exec (the parent's environment; seen once on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launcher.poll() is None:
        process = psutil.Process(launcher.pid)
        if "dapo_megatron.launch.slurm.colocated" in process.cmdline():
            return process.environ()
        time.sleep(0.01)
    raise AssertionError("the colocated launcher did not start")


def _engine_environ(launcher: subprocess.Popen, timeout_s: float = 120.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launcher.poll() is None:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if "serve-rollout" in child.cmdline():
                    return child.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        time.sleep(0.02)
    raise AssertionError("the colocated launcher started no serve-rollout engine")


def test_colocated_engine_starts_without_the_trainers_cuda_device_max_connections(tmp_path):
    trainer_env = {
        **os.environ,
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "NCCL_SOCKET_IFNAME": "^lo,docker",
        "PYTHONPATH": str(REPO),
    }
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dapo_megatron.launch.slurm.colocated", str(_config(tmp_path))],
        env=trainer_env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        launcher_env = _launcher_environ(launcher)
        engine_env = _engine_environ(launcher)
    finally:
        out, _ = launcher.communicate(timeout=120)
    assert launcher_env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # the allocation's (the trainer's) environment
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in engine_env, out.decode(errors="replace")[-2000:]
    assert engine_env["NCCL_SOCKET_IFNAME"] == "^lo,docker"  # the rest of the environment is passed on
    assert launcher.returncode == 0
