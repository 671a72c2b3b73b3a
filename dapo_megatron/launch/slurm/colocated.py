"""Start this node's share of the colocated rollout engines inside the trainer's Slurm allocation.

    srun --overlap --ntasks-per-node=1 python -m dapo_megatron.launch.slurm.colocated CONFIG  # slurm/_trainer_launch.sh

With rollout.placement=colocated (and no fixed rollout.engine_urls) the engines share the trainer's
nodes: rollout.num_engines / slurm.nodes engines per node, registering in <run_dir>/engines/ where
the driver's engine pool finds them, exactly as disaggregated engines do.
  sglang: engine i of a node uses GPUs [i*engine_tp, (i+1)*engine_tp) with --colocate (SGLang's
          memory saver: it releases its memory while the actor trains), on a free port;
  cpu:    `dapo-megatron serve-rollout` on the node's Slurm address, port chosen by the server.
Every engine requires the run's key (<run_dir>/secrets/engine_auth.yaml, rollout/auth.py): SGLang's
--api-key and --admin-api-key, read from that file by its --config. A config without colocated engines makes this a
no-op (exit 0). Registrations this node left from an
earlier incarnation of the job (a requeue) are removed first: those servers are gone. The process
waits for its engines and stops them all on SIGTERM (the batch script sends it when training ends).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from dapo_megatron.config import Config, RolloutConfig, load_config
from dapo_megatron.launch.engine_env import engine_environment
from dapo_megatron.launch.script_entry import run_as_script
from dapo_megatron.quant.engine_checkpoint import fp8_rollout_dir
from dapo_megatron.rollout.auth import ensure_secret_file, run_secret_path
from dapo_megatron.rollout.routing import sglang_routing_args


def node_address() -> str:
    """The address other nodes reach this one by: Slurm's NodeAddr for it, else the host name."""
    name = os.environ.get("SLURMD_NODENAME", "")
    if name:
        try:
            out = subprocess.run(
                ["scontrol", "show", "node", name, "-o"], capture_output=True, text=True, timeout=30
            ).stdout
            for part in out.split():
                if part.startswith("NodeAddr="):
                    return part.split("=", 1)[1]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return socket.getfqdn()


def engines_per_node(cfg: Config) -> int:
    r, s = cfg.rollout, cfg.slurm
    if r.num_engines % s.nodes:
        raise ValueError(
            f"config key 'rollout.num_engines': {r.num_engines} colocated engines do not spread "
            f"evenly over slurm.nodes={s.nodes}"
        )
    per_node = r.num_engines // s.nodes
    if r.engine == "sglang" and per_node * r.engine_tp > s.gpus_per_node:
        raise ValueError(
            f"config key 'rollout.num_engines': {per_node} engines x engine_tp {r.engine_tp} per node "
            f"need more than slurm.gpus_per_node={s.gpus_per_node} GPUs"
        )
    return per_node


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def engine_commands(cfg: Config, *, host: str, python: str = sys.executable) -> list[list[str]]:
    """The argv of every engine this node starts."""
    r, per_node = cfg.rollout, engines_per_node(cfg)
    # rollout.quantization=fp8: the block-FP8 export _trainer_launch.sh wrote before starting this
    model, quant = cfg.model.path, []
    if r.quantization == "fp8":
        model = str(fp8_rollout_dir(cfg.trainer.output_dir))
        quant = ["--quantization", "fp8"] if r.engine == "sglang" else []
    context_length = r.max_prompt_length + r.max_response_length  # what requests may need, no more
    register_dir = str(Path(cfg.trainer.output_dir) / "engines")
    secret = str(run_secret_path(cfg.trainer.output_dir))  # main() made sure it exists (rollout/auth.py)
    node_id = int(os.environ.get("SLURM_NODEID", "0"))
    cmds = []
    for i in range(per_node):
        seed = str(cfg.trainer.seed + node_id * per_node + i)
        if r.engine == "sglang":
            cmds.append(
                _sglang_argv(
                    r,
                    python=python,
                    model=model,
                    quant=quant,
                    seed=seed,
                    slot=i,
                    host=host,
                    context_length=context_length,
                    register_dir=register_dir,
                    secret=secret,
                )
            )
        else:
            threads = max(1, cfg.slurm.cpus_per_task // max(per_node, 1) // 2)  # the actor needs CPUs too
            cmds.append(
                _cpu_engine_argv(
                    r,
                    python=python,
                    model=model,
                    threads=threads,
                    seed=seed,
                    slot=i,
                    host=host,
                    context_length=context_length,
                    register_dir=register_dir,
                    secret=secret,
                )
            )
    return cmds


def _sglang_argv(
    r: RolloutConfig,
    *,
    python: str,
    model: str,
    quant: list[str],
    seed: str,
    slot: int,
    host: str,
    context_length: int,
    register_dir: str,
    secret: str,
) -> list[str]:
    """SGLang engine `slot` of this node (rollout/sglang_launcher.py): colocated, on GPUs from slot * engine_tp."""
    return [
        python,
        "-m",
        "dapo_megatron.rollout.sglang_launcher",
        "--model",
        model,
        *quant,
        "--tp",
        str(r.engine_tp),
        "--context-length",
        str(context_length),
        "--mem-fraction",
        str(r.mem_fraction_static),
        "--colocate",
        "--seed",
        seed,
        "--host",
        "0.0.0.0",
        "--advertise-host",
        host,
        "--port",
        str(_free_port()),
        "--base-gpu-id",
        str(slot * r.engine_tp),
        "--register-dir",
        register_dir,
        "--auth-file",
        secret,
        *sglang_routing_args(return_routed_experts=r.return_routed_experts),
    ]


def _cpu_engine_argv(
    r: RolloutConfig,
    *,
    python: str,
    model: str,
    threads: int,
    seed: str,
    slot: int,
    host: str,
    context_length: int,
    register_dir: str,
    secret: str,
) -> list[str]:
    """CPU engine `slot` of this node (serve-rollout), on a free port it registers."""
    return [
        python,
        "-m",
        "dapo_megatron.cli",
        "serve-rollout",
        "--model",
        model,
        "--host",
        host,
        "--port",
        "0",
        "--seed",
        seed,
        "--threads",
        str(threads),
        "--context-length",
        str(context_length),
        "--base-gpu-id",
        str(slot * r.engine_tp),
        *(["--device", f"cuda:{slot * r.engine_tp}"] if r.cpu_engine_device == "cuda" else []),
        "--register-dir",
        register_dir,
        "--config",
        secret,
    ]


def remove_stale_registrations(register_dir: Path, host: str) -> list[Path]:
    """This node's registrations from before this job incarnation: their servers no longer exist."""
    removed = []
    for path in sorted(register_dir.glob("*.json")) if register_dir.is_dir() else []:
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if rec.get("host") in (host, socket.getfqdn()):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 1:
        print("usage: python -m dapo_megatron.launch.slurm.colocated CONFIG [key=value ...]", file=sys.stderr)
        return 2
    cfg = load_config(argv[0], argv[1:])
    if cfg.rollout.placement != "colocated" or cfg.rollout.engine_urls:
        return 0
    if not cfg.model.path:
        raise ValueError("config key 'model.path': colocated engines need the model directory they serve")
    host = node_address()
    register_dir = Path(cfg.trainer.output_dir) / "engines"
    ensure_secret_file(run_secret_path(cfg.trainer.output_dir))  # the run's engine key: the trainer reads it too
    for path in remove_stale_registrations(register_dir, host):
        print(f"[colocated] removed stale registration {path.name}", flush=True)
    env = engine_environment(dict(os.environ))
    procs = [subprocess.Popen(cmd, start_new_session=True, env=env) for cmd in engine_commands(cfg, host=host)]
    print(
        f"[colocated] node {os.environ.get('SLURM_NODEID', '0')} ({host}): {len(procs)} "
        f"{cfg.rollout.engine} engine(s) registering in {register_dir}",
        flush=True,
    )
    stopping = []

    def stop(signum, frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return 0


if __name__ == "__main__":
    run_as_script(main, "colocated engines: error:")
