"""No orphans (launch/local/lifeline.py): the real `dapo-megatron train` on the tiny CPU config, rank 0
SIGKILLed once the first checkpoint exists (so Megatron's checkpoint helpers are running: a
multiprocessing Manager, Python's resource_tracker). Every process of the run must end and none may
be left anywhere on the machine; the time it takes is printed (measured bound: docs/architecture.md).
Before the fix the Manager, the tracker and a forked writer stayed with PPID 1 for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from helpers_train import process_alive, run_processes

ROOT = Path(__file__).resolve().parents[2]


def test_sigkill_rank0_leaves_no_process(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "train",
        str(ROOT / "configs/runs/tiny_cpu.yaml"),
        f"trainer.output_dir={out}",
        f"tiny.cache_dir={tmp_path / 'cache'}",
        "tiny.warm_start_steps=0",
        "algorithm.max_num_gen_batches=1",
        "trainer.total_steps=6",
        "trainer.eval_every=0",
        "trainer.save_every=1",
        "trainer.wandb_mode=disabled",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DAPO_TEST_RUN_DIR": str(out)}
    console = tmp_path / "console.txt"
    with open(console, "w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (out / "checkpoints" / "step_000001").is_dir():
            assert launcher.poll() is None, console.read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(0.1)
        family = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
        lines = [" ".join(p.cmdline()) for p in family]
        assert any("spawn_main" in line for line in lines), lines  # Megatron's Manager: the old orphan
        assert any("resource_tracker" in line for line in lines), lines
        rank0 = [
            p
            for p in family
            if p.environ().get("RANK") == "0"
            and "dapo_megatron.cli" in " ".join(p.cmdline())
            and p.ppid() not in {q.pid for q in family if q.environ().get("RANK") == "0"}
        ]
        assert len(rank0) == 1, [(p.pid, p.ppid()) for p in rank0]
        t_kill = time.monotonic()
        rank0[0].send_signal(signal.SIGKILL)
        while any(process_alive(p) for p in family) or run_processes(out):
            for child in psutil.Process(launcher.pid).children(recursive=True) if process_alive(family[0]) else []:
                if child.pid not in {p.pid for p in family}:
                    family.append(child)  # started after the snapshot (a checkpoint writer)
            assert time.monotonic() - t_kill < 300, [
                (p.pid, " ".join(p.cmdline())[:100]) for p in family if process_alive(p)
            ]
            time.sleep(0.1)
        print(f"\n[no orphans] every process of the run ended {time.monotonic() - t_kill:.1f} s after rank 0's SIGKILL")
        assert launcher.wait(timeout=10) == 1
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for proc in run_processes(out):
            proc.kill()
    # one line names the failure (launch/local/ranks.py): rank 0's SIGKILL, or rank 1's gloo error should it
    # have recorded it in an earlier second than torchrun saw rank 0 gone
    named = [line for line in console.read_text().splitlines() if line.startswith("[train] the run failed on rank ")]
    assert len(named) == 1, console.read_text()[-4000:]
