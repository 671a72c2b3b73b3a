"""STAND-IN for `dapo-megatron train` in the Slurm tests, named as such: a real torchrun job with
real gloo ranks that counts steps instead of training, checkpoints the counter after every step
(checkpoints/step_N/trainer_state.json, the trainer's layout),
resumes from it with --resume, and handles preemption through the trainer's own
dapo_megatron.trainer.preemption. It lets the launch path (sbatch -> srun -> torchrun -> ranks, the
USR1 trap, requeue, --resume, arrays, the engine registry) be tested in seconds; the real trainer
runs under the same scripts in tests/integration/test_slurm_e2e.py.

    torchrun --nproc-per-node 2 tests/integration/slurm_counter_trainer.py CONFIG [--resume]

Per step, rank 0 appends to <trainer.output_dir>/metrics.jsonl:
  {"step", "world_size", "rank_sum" (all-reduce of rank+1: proves the ranks rendezvoused),
   "restart" (SLURM_RESTART_COUNT), "engines" (with rollout.placement=disaggregated: the number of
   registered engines that answered /health)}
Environment: COUNTER_STEP_SECONDS (default 0.5) = time one step takes; COUNTER_HOLD_FILE = before its
last step, rank 0 waits until this file exists (a test releases the run when it has seen what it needs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist

from dapo_megatron.config import load_config
from dapo_megatron.rollout.auth import engine_keys
from dapo_megatron.rollout.registry import read_registrations
from dapo_megatron.trainer.checkpoint import files as checkpointing
from dapo_megatron.trainer.preemption import PreemptionSignal


def _wait_engines(register_dir: Path, count: int, timeout_s: float = 600.0) -> list[dict]:
    """Wait until `count` registered engines answer /health (the trainer's pool does this for real)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        healthy = []
        for rec in read_registrations(str(register_dir)) if register_dir.is_dir() else []:
            try:
                with urllib.request.urlopen(rec["url"] + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        healthy.append(rec)
            except OSError:
                pass
        if len(healthy) >= count:
            return healthy
        time.sleep(0.5)
    raise TimeoutError(f"{count} engines did not register in {register_dir} within {timeout_s}s")


def _generate(url: str, keys) -> list[int]:
    body = json.dumps(
        {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "sampling_seed": 0}}
    ).encode()
    # the engines require the run's key (`slurm submit` wrote it; rollout/auth.py), as the real trainer sends it
    req = urllib.request.Request(
        url + "/generate",
        data=body,
        headers={"Content-Type": "application/json", **keys.header_for("POST", "/generate")},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["output_ids"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    cfg = load_config(args.config)
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stop = PreemptionSignal().install()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start = 0
    latest = checkpointing.latest_checkpoint(out) if args.resume else None
    if latest is not None:
        start = checkpointing.read_state(latest)["step"]
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    engines = 0
    if cfg.rollout.placement == "disaggregated" and rank == 0:
        records = _wait_engines(out / "engines", cfg.rollout.num_engines)
        for rec in records:
            tokens = _generate(rec["url"], engine_keys(cfg.rollout, out))
            print(f"engine {rec['url']} generated {tokens}", flush=True)
            assert len(tokens) == 3
        engines = len(records)
    step_seconds = float(os.environ.get("COUNTER_STEP_SECONDS", "0.5"))
    hold = os.environ.get("COUNTER_HOLD_FILE", "")
    for step in range(start + 1, cfg.trainer.total_steps + 1):
        time.sleep(step_seconds)
        while rank == 0 and hold and step == cfg.trainer.total_steps and not Path(hold).exists():
            time.sleep(0.2)
        value = torch.tensor([rank + 1])
        dist.all_reduce(value)
        if rank == 0:
            record = {
                "step": step,
                "world_size": world,
                "rank_sum": int(value.item()),
                "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                "engines": engines,
            }
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            final = checkpointing.step_dir(out, step)  # the trainer's layout: launch/slurm/progress.py reads it
            tmp = final.with_name(final.name + ".tmp")
            tmp.mkdir(parents=True, exist_ok=True)
            checkpointing.write_state(tmp, {"step": step})
            checkpointing.commit(tmp, final, keep=2)
        dist.barrier()
        if stop.should_stop():
            if rank == 0:
                print(f"preempted by {stop.reason}: checkpoint at step {step}, exiting", flush=True)
            dist.destroy_process_group()
            return 0
    if rank == 0:
        (out / "DONE").write_text(str(cfg.trainer.total_steps))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
