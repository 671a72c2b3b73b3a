"""Render the sbatch files of slurm/ from a Config: pure functions, text in, text out.

    from dapo_megatron.launch.slurm.render import render_train
    text = render_train(cfg, config_file="/runs/x/slurm/config.yaml")

A template in slurm/ is a working bash script with four kinds of markers, each on its own line:
  #{{SBATCH}}           -> `#SBATCH` resource lines from cfg.slurm (validated by config.validate:
                           only Slurm's own syntax, so nothing can end the line and start a command)
  #{{VALUES}}           -> NAME='value' assignments, every value through shlex.quote (lists become
                           bash arrays); the body uses them only as "$NAME" / "${NAME[@]}"
  #{{SETUP}}            -> cfg.slurm.setup, the site's shell lines (module load, venv): code by design
  #{{INCLUDE file}}     -> another file of slurm/ inlined (the trainer launch shared by train and sweep)
Paths that name this run's files (--output, --job-name, --array, --dependency) are not in the file:
submit.py passes them to sbatch as arguments (an argv list, no shell), so a run directory may hold
any character at all. A value like `; rm -rf /` or `$(reboot)` therefore stays a string.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from dapo_megatron.config import Config
from dapo_megatron.quant.engine_checkpoint import fp8_rollout_dir
from dapo_megatron.rollout.auth import run_secret_path

SLURM_DIR = Path(__file__).resolve().parents[3] / "slurm"
# what torchrun starts on every rank (after its own flags): `python -m dapo_megatron.cli train CONFIG`
TRAIN_ENTRY = ("--module", "dapo_megatron.cli", "train")
# what an eval array task runs (after the interpreter): `python -m dapo_megatron.cli eval CONFIG --checkpoint DIR`
EVAL_ENTRY = ("-m", "dapo_megatron.cli", "eval")

Value = str | int | float | Sequence[str]
_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def template_text(name: str) -> str:
    path = SLURM_DIR / name
    if not path.is_file():
        raise ValueError(f"sbatch template not found: {path}")
    return path.read_text()


def shell_assignments(values: dict[str, Value]) -> str:
    """NAME='value' lines; a list or tuple becomes a bash array NAME=('a' 'b')."""
    lines = []
    for name, value in values.items():
        if not _NAME.fullmatch(name):
            raise ValueError(f"shell variable name {name!r}: use upper-case letters, digits and _")
        if isinstance(value, (list, tuple)):
            lines.append(f"{name}=({' '.join(shlex.quote(str(v)) for v in value)})")
        else:
            lines.append(f"{name}={shlex.quote(str(value))}")
    return "\n".join(lines)


def sbatch_resource_lines(
    cfg: Config, *, nodes: int | None = None, gpus_per_node: int | None = None, cpus_per_task: int | None = None
) -> list[str]:
    """`#SBATCH` lines for partition, account, qos, nodes, GPUs, CPUs, memory, time, constraint, extras."""
    s = cfg.slurm
    nodes = s.nodes if nodes is None else nodes
    gpus = s.gpus_per_node if gpus_per_node is None else gpus_per_node
    cpus = s.cpus_per_task if cpus_per_task is None else cpus_per_task
    opts = [f"--nodes={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}"]
    if gpus > 0:  # CPU runs (tests) ask for no GPUs at all: a --gpus flag would need a GRES config
        opts.append(f"--gpus-per-node={gpus}")
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(s, key):
            opts.append(f"--{key}={getattr(s, key)}")
    if s.mem:
        opts.append(f"--mem={s.mem}")
    if s.time:
        opts.append(f"--time={s.time}")
    opts.extend(s.extra_sbatch)
    return [f"#SBATCH {opt}" for opt in opts]


def fill(template: str, *, sbatch: Sequence[str], values: dict[str, Value], setup: Sequence[str]) -> str:
    """Replace the marker lines of one template (see the module docstring); every marker must be used."""
    out: list[str] = []
    for line in template.splitlines():
        marker = line.strip()
        if marker == "#{{SBATCH}}":
            out.extend(sbatch)
        elif marker == "#{{VALUES}}":
            out.append(shell_assignments(values))
        elif marker == "#{{SETUP}}":
            out.extend(setup if setup else [":  # (none)"])
        elif marker.startswith("#{{INCLUDE ") and marker.endswith("}}"):
            out.append(template_text(marker[len("#{{INCLUDE ") : -2].strip()).rstrip("\n"))
        else:
            out.append(line)
    text = "\n".join(out) + "\n"
    left = re.findall(r"#\{\{[^}]*\}\}", text)
    if left:
        raise ValueError(f"template left markers unfilled: {left}")
    return text


def python_of(cfg: Config, role: str = "trainer") -> str:
    """The interpreter the jobs run: slurm.python if set; else `python` as the slurm.setup lines leave
    it on PATH (they activate the cluster's environment, which the submitter's interpreter path may
    not even exist in); with no setup lines, the interpreter running `slurm submit` (same machine
    image, e.g. the local test cluster). role "engines": slurm.engine_python, else `python` after
    slurm.engine_setup, else the trainer's."""
    s = cfg.slurm
    if role == "engines" and s.engine_python:
        return s.engine_python
    if role == "engines" and s.engine_setup:
        return "python"
    if s.python:
        return s.python
    return "python" if s.setup else sys.executable


def setup_of(cfg: Config, role: str = "trainer") -> list[str]:
    """slurm.setup, or for the engine array slurm.engine_setup when it has lines (its own environment)."""
    return list(cfg.slurm.engine_setup) if role == "engines" and cfg.slurm.engine_setup else list(cfg.slurm.setup)


def container_args(cfg: Config, role: str = "trainer") -> list[str]:
    """pyxis options for the role's srun lines (none without an image): --container-image and
    --container-mounts; the engine array's own engine_container_* win over the trainer's."""
    s = cfg.slurm
    image, mounts = s.container_image, s.container_mounts
    if role == "engines" and s.engine_container_image:
        image, mounts = s.engine_container_image, s.engine_container_mounts
    elif role == "engines" and s.engine_container_mounts:
        mounts = s.engine_container_mounts
    if not image:
        return []
    return [f"--container-image={image}", *([f"--container-mounts={mounts}"] if mounts else [])]


def trainer_procs_per_node(cfg: Config) -> int:
    """Ranks per node: one per GPU; on CPU (gpus_per_node 0) actor.world_size spread over the nodes."""
    s, world = cfg.slurm, cfg.actor.world_size
    per_node = s.gpus_per_node if s.gpus_per_node > 0 else world // s.nodes
    if per_node < 1 or per_node * s.nodes != world:
        raise ValueError(
            f"config key 'actor.world_size': {world} ranks do not fill slurm.nodes={s.nodes} x "
            f"{'slurm.gpus_per_node' if s.gpus_per_node else 'ranks per node'}={per_node}; "
            f"make actor.world_size = nodes x gpus_per_node"
        )
    return per_node


def _trainer_values(cfg: Config, *, engine_job: str, entry: Sequence[str], resume: bool) -> dict[str, Value]:
    return {
        "PYTHON": python_of(cfg),
        "NNODES": cfg.slurm.nodes,
        "NPROC_PER_NODE": trainer_procs_per_node(cfg),
        "SIGNAL_SECONDS": cfg.slurm.signal_seconds,
        "TRAIN_ENTRY": list(entry),
        "ENGINE_JOB": engine_job,
        # `slurm submit --resume`: the first start continues from the newest checkpoint (launch/slurm/job_start.py)
        "RESUME_REQUESTED": int(resume),
        # pyxis: the srun steps (ranks, colocated engines) run in slurm.container_image (empty: none)
        "CONTAINER_ARGS": container_args(cfg),
    }


def _signal_lines(cfg: Config) -> list[str]:
    # B: signals only the batch shell; its trap forwards to srun (see slurm/_trainer_launch.sh)
    return [f"#SBATCH --signal=B:USR1@{cfg.slurm.signal_seconds}"] if cfg.slurm.signal_seconds > 0 else []


def render_train(
    cfg: Config, *, config_file: str, engine_job: str = "", entry: Sequence[str] = TRAIN_ENTRY, resume: bool = False
) -> str:
    """slurm/train.sbatch: the trainer on slurm.nodes nodes, requeued after a checkpoint on USR1.

    config_file: the resolved config the ranks load (submit writes it to <run_dir>/slurm/config.yaml).
    engine_job: job id of a rollout array to cancel when training ends ("" = none).
    entry: what torchrun starts on each rank, before CONFIG [--resume].
    resume: submitted with --resume (a requeue resumes in any case).
    """
    values = {"CONFIG": config_file, **_trainer_values(cfg, engine_job=engine_job, entry=entry, resume=resume)}
    return fill(
        template_text("train.sbatch"),
        sbatch=sbatch_resource_lines(cfg) + _signal_lines(cfg),
        values=values,
        setup=cfg.slurm.setup,
    )


def render_sweep_array(
    cfg: Config, *, configs_dir: str, entry: Sequence[str] = TRAIN_ENTRY, resume: bool = False
) -> str:
    """slurm/sweep_array.sbatch: array task i trains the i-th *.yaml of configs_dir (sorted by name).

    cfg: any config of the sweep (they share one slurm section); the array range and its %K throttle
    are sbatch arguments (submit.py).
    """
    values = {"CONFIGS_DIR": configs_dir, **_trainer_values(cfg, engine_job="", entry=entry, resume=resume)}
    return fill(
        template_text("sweep_array.sbatch"),
        sbatch=sbatch_resource_lines(cfg) + _signal_lines(cfg),
        values=values,
        setup=cfg.slurm.setup,
    )


def engine_resources(cfg: Config) -> tuple[int, int]:
    """(gpus, cpus) of one engine task: rollout.engine_tp GPUs and the matching share of a node's CPUs."""
    s, tp = cfg.slurm, cfg.rollout.engine_tp
    if s.gpus_per_node == 0:
        return 0, s.cpus_per_task
    if tp > s.gpus_per_node:
        raise ValueError(
            f"config key 'rollout.engine_tp': {tp} GPUs per engine but slurm.gpus_per_node is "
            f"{s.gpus_per_node}; one engine must fit on one node"
        )
    return tp, max(1, s.cpus_per_task * tp // s.gpus_per_node)


def render_rollout_array(cfg: Config, *, register_dir: str) -> str:
    """slurm/rollout_array.sbatch: one engine per array task, registering in register_dir."""
    from dapo_megatron.rollout.routing import sglang_routing_args

    fp8 = cfg.rollout.quantization == "fp8"
    gpus, cpus = engine_resources(cfg)
    image_args = container_args(cfg, "engines")
    values: dict[str, Value] = {
        "PYTHON": python_of(cfg, "engines"),
        # pyxis: the engine runs as one srun step in the engines' container (empty: directly)
        "ENGINE_SRUN": ["srun", "--ntasks=1", *image_args] if image_args else [],
        # rollout.quantization=fp8: the block-FP8 export the fp8_export job writes before the array starts
        "MODEL": str(fp8_rollout_dir(cfg.trainer.output_dir)) if fp8 else cfg.model.path,
        "QUANTIZATION": "fp8" if fp8 and cfg.rollout.engine == "sglang" else "",
        "ENGINE_KIND": cfg.rollout.engine,
        "ENGINE_TP": cfg.rollout.engine_tp,
        "MEM_FRACTION": cfg.rollout.mem_fraction_static,
        "CONTEXT_LENGTH": cfg.rollout.max_prompt_length + cfg.rollout.max_response_length,
        "BASE_SEED": cfg.trainer.seed,
        "REGISTER_DIR": register_dir,
        # the run's engine key (rollout/auth.py): `slurm submit` writes it before the array starts
        "AUTH_FILE": str(run_secret_path(cfg.trainer.output_dir)),
        "SGLANG_ARGS": sglang_routing_args(return_routed_experts=cfg.rollout.return_routed_experts),
    }
    return fill(
        template_text("rollout_array.sbatch"),
        sbatch=sbatch_resource_lines(cfg, nodes=1, gpus_per_node=gpus, cpus_per_task=cpus),
        values=values,
        setup=setup_of(cfg, "engines"),
    )


def render_fp8_export(cfg: Config, *, config_file: str) -> str:
    """slurm/fp8_export.sbatch: the engines' block-FP8 export of the base model (rollout.quantization=fp8
    with an engine array, which starts after it: --dependency=afterok), on one node's CPUs."""
    values: dict[str, Value] = {"PYTHON": python_of(cfg), "CONFIG": config_file}
    return fill(
        template_text("fp8_export.sbatch"),
        sbatch=sbatch_resource_lines(cfg, nodes=1, gpus_per_node=0),
        values=values,
        setup=cfg.slurm.setup,
    )


def render_eval_array(
    cfg: Config, *, config_file: str, checkpoints_file: str, results_dir: str, entry: Sequence[str] = EVAL_ENTRY
) -> str:
    """slurm/eval_array.sbatch: array task i evaluates line i+1 of checkpoints_file into results_dir.

    entry: what the interpreter runs, before CONFIG --checkpoint DIR --output FILE.
    """
    gpus = min(cfg.slurm.gpus_per_node, max(cfg.rollout.engine_tp, 1))
    values: dict[str, Value] = {
        "PYTHON": python_of(cfg),
        "EVAL_ENTRY": list(entry),
        "CONFIG": config_file,
        "CHECKPOINTS_FILE": checkpoints_file,
        "RESULTS_DIR": results_dir,
    }
    return fill(
        template_text("eval_array.sbatch"),
        sbatch=sbatch_resource_lines(cfg, nodes=1, gpus_per_node=gpus),
        values=values,
        setup=cfg.slurm.setup,
    )


def render_eval_gather(cfg: Config, *, results_dir: str) -> str:
    """slurm/eval_gather.sbatch: one small CPU task that writes results.md and results.csv."""
    values: dict[str, Value] = {"PYTHON": python_of(cfg), "RESULTS_DIR": results_dir}
    return fill(
        template_text("eval_gather.sbatch"),
        sbatch=sbatch_resource_lines(cfg, nodes=1, gpus_per_node=0, cpus_per_task=1),
        values=values,
        setup=cfg.slurm.setup,
    )


def render_bench_kernels(cfg: Config, *, bench_args: Sequence[str] = ()) -> str:
    """slurm/bench_kernels.sbatch: `dapo-megatron bench kernels` on one GPU."""
    values: dict[str, Value] = {"PYTHON": python_of(cfg), "BENCH_ARGS": list(bench_args)}
    return fill(
        template_text("bench_kernels.sbatch"),
        sbatch=sbatch_resource_lines(cfg, nodes=1, gpus_per_node=min(cfg.slurm.gpus_per_node, 1)),
        values=values,
        setup=cfg.slurm.setup,
    )


# the preflight's job (launch/preflight/command.py runs it; `slurm submit --preflight` submits it first)
PREFLIGHT_BYTES = 64 << 20  # bytes per measured collective of `dapo-megatron preflight`
PREFLIGHT_TIME = "00:15:00"  # the job's own time limit, whatever slurm.time the run asks for


def engine_nodes(cfg: Config, engines: int) -> int:
    """Nodes an engine array of `engines` takes: gpus_per_node // engine_tp engines per GPU node, one
    per node on CPU nodes (the CPU engine takes a node's cpus_per_task); 0 for colocated engines."""
    if engines <= 0:
        return 0
    per_node = max(1, cfg.slurm.gpus_per_node // max(cfg.rollout.engine_tp, 1)) if cfg.slurm.gpus_per_node else 1
    return -(-engines // per_node)


def render_preflight(cfg: Config, *, config_file: str, engine_node_count: int, nbytes: int = PREFLIGHT_BYTES) -> str:
    """slurm/preflight.sbatch on slurm.nodes + engine_node_count nodes of the run's partition, 15 minutes."""
    lines = [
        line if not line.startswith("#SBATCH --time=") else f"#SBATCH --time={PREFLIGHT_TIME}"
        for line in sbatch_resource_lines(cfg, nodes=cfg.slurm.nodes + engine_node_count)
    ]
    values: dict[str, Value] = {
        "PYTHON": python_of(cfg),
        "CONFIG": config_file,
        "ENGINE_NODES": engine_node_count,
        "BYTES": nbytes,
    }
    return fill(template_text("preflight.sbatch"), sbatch=lines, values=values, setup=cfg.slurm.setup)
