"""Process groups for the actor: torch.distributed from the launcher's environment, then Megatron's
tensor / pipeline / context / data parallel groups.

    torchrun --nproc-per-node 4 -m dapo_megatron.cli train cfg.yaml actor.tp=2 actor.pp=2
    srun --ntasks-per-node 8 python -m dapo_megatron.cli train cfg.yaml ...

    init_distributed()                      # reads RANK/WORLD_SIZE/... or SLURM_PROCID/...
    with model_parallel(tp=2, pp=2, seed=42) as layout:    # this rank's ParallelLayout, passed in
        actor = Actor(settings, hf_dir, layout)

Rank order is Megatron's default "tp-cp-ep-dp-pp": TP neighbours are adjacent global ranks.
The driver (global rank 0) is the only rank that talks to rollout engines.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dapo_megatron.actor.compat import apply_megatron_compat
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.addresses import choose_socket_interfaces
from dapo_megatron.distributed.layout import ParallelLayout


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _first_slurm_host(nodelist: str) -> str:
    """First hostname of a Slurm node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    first = re.split(r",(?![^\[]*\])", nodelist)[0]  # split on commas outside brackets
    match = re.fullmatch(r"([^\[]+)\[([^\]]+)\]", first)
    if not match:
        return first
    prefix, ranges = match.groups()
    return prefix + ranges.split(",")[0].split("-")[0]


def launch_env(environ: dict | None = None) -> LaunchEnv:
    """Rank layout from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or srun (SLURM_PROCID/...).

    torchrun's variables win when both are present (torchrun inside an sbatch job). Under srun,
    MASTER_ADDR defaults to the first node of SLURM_JOB_NODELIST and MASTER_PORT to a port derived
    from the job id, so every task of the job computes the same rendezvous without talking.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", 0))
        master_addr = env.get("MASTER_ADDR", "127.0.0.1")
        master_port = int(env.get("MASTER_PORT", 29500))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world_size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local_rank = int(env.get("SLURM_LOCALID", 0))
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        master_addr = env.get("MASTER_ADDR") or _first_slurm_host(nodelist)
        master_port = int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000)
    else:
        rank, world_size, local_rank = 0, 1, 0
        master_addr = env.get("MASTER_ADDR", "127.0.0.1")
        master_port = int(env.get("MASTER_PORT", 29500))
    if not 0 <= rank < world_size:
        raise ValueError(f"launcher environment: rank {rank} is outside world size {world_size}")
    return LaunchEnv(rank, world_size, local_rank, master_addr, master_port)


def local_world_size(environ: dict | None = None) -> int | None:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else srun's SLURM_NTASKS_PER_NODE (one number, or
    SLURM_TASKS_PER_NODE's first count, "4(x2),3" -> 4); None when the launcher says neither."""
    env = os.environ if environ is None else environ
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        value = env.get(key)
        if value:
            match = re.match(r"\d+", value)
            if match:
                return int(match.group(0))
    return None


def gpu_for_local_rank(local_rank: int, local_world_size: int | None, device_count: int) -> int:
    """The GPU index local rank `local_rank` drives: its own, one rank per GPU. More ranks on the node
    than GPUs it sees would put two ranks on one GPU (NCCL then fails much later with "Duplicate GPU
    detected"), so that is refused here, at start-up, naming the three numbers.

    The launchers here (torchrun, one per node) give every rank all of the node's GPUs. A launcher that
    binds one GPU per task (every rank sees one device) is refused too: from these three numbers it looks
    exactly like eight ranks on one GPU.
    """
    if device_count < 1:
        raise ValueError("init_distributed: CUDA is available but no GPU is visible (CUDA_VISIBLE_DEVICES?)")
    ranks = local_world_size if local_world_size is not None else local_rank + 1
    if local_rank >= device_count or ranks > device_count:
        raise ValueError(
            f"{ranks} ranks per node (LOCAL_WORLD_SIZE) but {device_count} GPU(s) visible: "
            f"LOCAL_RANK={local_rank} would share a GPU with another rank (NCCL refuses duplicate "
            "GPUs). Start at most one rank per GPU (torchrun --nproc-per-node, slurm.gpus_per_node, "
            "actor.world_size) or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    return local_rank


def init_distributed(*, timeout_minutes: int = 30) -> LaunchEnv:
    """Initialize torch.distributed once (nccl with one GPU per local rank; gloo on CPU).

    Also applies the CPU compatibility patches when CUDA is unavailable. Returns the layout.
    A no-op (apart from returning the layout) when the process group already exists.
    """
    import datetime

    apply_megatron_compat()
    env = launch_env()
    if dist.is_initialized():
        return LaunchEnv(dist.get_rank(), dist.get_world_size(), env.local_rank, env.master_addr, env.master_port)
    if torch.cuda.is_available():
        device = torch.device("cuda", gpu_for_local_rank(env.local_rank, local_world_size(), torch.cuda.device_count()))
        torch.cuda.set_device(device)
        coll.set_rank_device(device)  # collectives stage here from any thread (collectives.py)
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = datetime.timedelta(minutes=timeout_minutes)
    init_method = f"tcp://{env.master_addr}:{env.master_port}"
    if not spans_hosts():
        dist.init_process_group(
            backend=backend, init_method=init_method, rank=env.rank, world_size=env.world_size, timeout=timeout
        )
        return env
    # Several hosts: each rank's gloo/NCCL interface is the one that routes to the other hosts, chosen
    # before any group exists (distributed/addresses.py; a host name on 127.0.1.1 would be advertised
    # otherwise). The rendezvous store is made first so that ranks on the master's host can learn a
    # peer's address from it; the default group then uses the same store, as init_method would.
    store, _, _ = next(dist.rendezvous(init_method, env.rank, env.world_size, timeout=timeout))
    store.set_timeout(timeout)
    route = choose_socket_interfaces(env.master_addr, spans_hosts=True, store=store, timeout_s=timeout.total_seconds())
    if route is not None:
        print(
            f"[rank {env.rank}] gloo/nccl interface {route.interface} ({route.address}), the route to {route.peer}",
            flush=True,
        )
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore("default_pg", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    return env


def spans_hosts(environ: dict | None = None) -> bool:
    """Whether this job's ranks are on more than one host: torchrun's WORLD_SIZE vs LOCAL_WORLD_SIZE,
    or srun's node count."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"]) > int(env["LOCAL_WORLD_SIZE"])
    for var in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if env.get(var):
            return int(env[var]) > 1
    return False


def initialize_model_parallel(
    *, tp: int = 1, pp: int = 1, cp: int = 1, vpp: int | None = None, ep: int = 1, etp: int | None = None
) -> None:
    """Megatron's parallel_state groups for a TP x CP x DP x PP layout over the whole world, and for
    the experts an ETP x EP x EDP x PP layout over the same ranks (megatron's expert rank generator:
    the expert-parallel group is carved out of the data-parallel ranks; etp None = tp)."""
    from megatron.core import parallel_state

    world_size = dist.get_world_size()
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not a multiple of tp*pp*cp = {tp}*{pp}*{cp}")
    if vpp is not None and pp == 1:
        raise ValueError("virtual pipeline stages (vpp) need pp > 1")
    expert_etp = tp if etp is None else etp
    if ep < 1 or expert_etp < 1:
        raise ValueError(f"actor.ep={ep} and actor.etp={etp} must be >= 1")
    if world_size % (expert_etp * ep * pp):
        raise ValueError(
            f"world size {world_size} is not a multiple of etp*ep*pp = {expert_etp}*{ep}*{pp} "
            "(actor.etp, actor.ep, actor.pp: each pipeline stage's ranks hold etp x ep expert shards)"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def _replica_group(dp_rank: int, dp_size: int) -> dist.ProcessGroup:
    """One group per DP replica: the TP x CP x PP ranks that share a DP index (megatron has tp-pp
    and tp-cp groups but none with all three); this rank's is returned. A replica's batch source
    broadcasts its share over it (dataplane/scatter.py). Membership is read from every rank's DP
    index, not from a rank formula, so it holds for any megatron rank order."""
    mine = torch.tensor([dp_rank], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    coll.all_gather(everyone, mine)
    dp_of = [int(t) for t in everyone]
    own = None
    for replica in range(dp_size):  # every rank creates every group, in the same order
        group = dist.new_group([rank for rank, d in enumerate(dp_of) if d == replica])
        if replica == dp_rank:
            own = group
    assert own is not None
    return own


def layout_from_megatron() -> ParallelLayout:
    """The frozen layout of this rank, read once from megatron's parallel_state (initialized by
    initialize_model_parallel) plus the DP-replica groups made here. Collective (the replica groups)."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        is_first_stage=ps.is_pipeline_first_stage(ignore_virtual=True),
        is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        cp_group=ps.get_context_parallel_group(),
        dp_rank=dp_rank,
        dp_size=dp_size,
        dp_group=ps.get_data_parallel_group(),
        dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
        dp_cp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        replica_group=_replica_group(dp_rank, dp_size),
    )


@contextlib.contextmanager
def model_parallel(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
) -> Iterator[ParallelLayout]:
    """Megatron parallel state + RNG tracker for the body, which receives this rank's ParallelLayout
    (distributed/layout.py) to pass to the actor, the roles and the data plane; destroyed on exit (also
    on errors), and with it the layout's groups.

    torch.distributed must already be initialized (init_distributed() or the test rank pool).
    `seed` feeds model_parallel_cuda_manual_seed: the default RNG gets seed + 100 * pp_rank (+ a
    DP offset on the data-parallel seed), the tensor-parallel tracker seed + 2718 + tp_rank.
    ep / etp: expert parallel and expert tensor parallel sizes (etp None = tp, megatron's default).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    initialize_model_parallel(tp=tp, pp=pp, cp=cp, vpp=vpp, ep=ep, etp=etp)
    try:
        layout = layout_from_megatron()
        model_parallel_cuda_manual_seed(seed)
        yield layout
    finally:
        parallel_state.destroy_model_parallel()
        destroy_subgroups()


def destroy_subgroups() -> None:
    """Destroy every process group but the default one. megatron's destroy_model_parallel only
    forgets most of the groups it made: each leaked gloo group keeps its transport threads polling,
    so a process that sets up parallel state many times (the test rank pool, a sweep in one
    process) would slow down without bound."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not default and group is not c10d.GroupMember.WORLD:
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # already destroyed by megatron (its gloo DP groups)
                pass


def is_driver() -> bool:
    """Global rank 0: the one process that talks to rollout engines and writes run files."""
    return not dist.is_initialized() or dist.get_rank() == 0
