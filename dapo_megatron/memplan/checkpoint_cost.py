"""What one actor checkpoint costs, and what a resume on another layout costs (actor/checkpoint.py,
"Resharding"): bytes on disk, each rank's host memory at a save and at a load, and the seconds of both at
a stated shared-file-system rate. `dapo-megatron plan` prints it under the weight-sync lines.

    disk       = P * (w + 12)                 w = bytes of a model weight (2 bf16, 4 fp32); the optimizer
                                              keeps an fp32 master copy and Adam's two moments: 12 bytes
    shard      = 12 * (P_dense / (tp * pp) + P_experts / (ep * etp * pp))
                                              the optimizer state of one rank's TP x PP (x EP) position
    save host  = HOST_PEAK_FACTOR * shard     fully_reshardable: every DP rank gathers its position's whole
                                              state before the write (megatron's DistributedOptimizer)
    load read  = disk                         every rank needs its position's whole state (then keeps its
                                              slice), but the DP x CP ranks of a position read it once between
                                              them (megatron's fully parallel load, actor/checkpoint.py) ...
    exchange   = (shard + model shard) * (1 - 1 / (dp * cp))   ... and each receives the rest from its peers
    seconds    = bytes / FS_BYTES_PER_S       writes once (disk), reads `load read`

With actor.checkpoint_format=dp_reshardable a save gathers nothing (each DP rank writes its own slice:
host ~ shard / dp) and a load reads the disk bytes once, but only the same TP, PP and EP can resume.
HOST_PEAK_FACTOR is measured, not derived: `bench reshard --shape 100m` (94.1M parameters, TP=1 x DP=2,
fp32 on CPU, 2026-11-28) peaked at 2,692 MiB over its start on a rank whose position's state is
12 * 94.1M = 1,077 MiB: 2.5x (the gathered flat buffers, their per-parameter copies and the writer's).
FS_BYTES_PER_S is a stated assumption (a parallel file system's aggregate read rate seen by one job),
not a measurement: the line names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dapo_megatron.memplan.arch import ModelDims
from dapo_megatron.memplan.static import Layout, expert_params, total_params

OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master + exp_avg + exp_avg_sq
HOST_PEAK_FACTOR = 2.5  # measured (module docstring)
FS_BYTES_PER_S = 10e9  # stated: 10 GB/s aggregate from a shared parallel file system


@dataclass(frozen=True)
class CheckpointCost:
    disk_bytes: float
    shard_state_bytes: float  # one rank's TP x PP (x EP) position's optimizer state
    save_host_bytes: float  # per rank, at a fully_reshardable save
    load_read_bytes: float  # all ranks together from the file system, at a load (any layout)
    exchange_bytes: float  # per rank, received from its DP x CP peers at a fully_reshardable load
    fs_bytes_per_s: float
    fully_reshardable: bool

    @property
    def save_s(self) -> float:
        return self.disk_bytes / self.fs_bytes_per_s

    @property
    def load_s(self) -> float:
        return self.load_read_bytes / self.fs_bytes_per_s

    @property
    def checkpoint_format_name(self) -> str:
        return "fully_reshardable" if self.fully_reshardable else "dp_reshardable"

    def lines(self) -> list[str]:
        fs = f"{self.fs_bytes_per_s / 1e9:g} GB/s shared file system (assumed)"
        if not self.fully_reshardable:
            return [
                f"checkpoint (dp_reshardable): {_gb(self.disk_bytes)} on disk, save {self.save_s:.0f} s and load "
                f"{self.load_s:.0f} s at {fs}; resumes only under the same TP, PP and EP"
            ]
        return [
            f"checkpoint (fully_reshardable): {_gb(self.disk_bytes)} on disk; save {self.save_s:.0f} s at {fs}, "
            f"host memory per rank ~{_gb(self.save_host_bytes)} (gathers its position's {_gb(self.shard_state_bytes)} "
            f"of optimizer state x{HOST_PEAK_FACTOR:g} measured)",
            f"  resume on any layout: the ranks read {_gb(self.load_read_bytes)} in all, {self.load_s:.0f} s at {fs}; "
            f"each receives {_gb(self.exchange_bytes)} of its position's state from its data-parallel peers",
        ]


def host_memory_problems(cost: CheckpointCost, *, ranks_per_node: int, host_memory_gb: float) -> list[str]:
    """A save that would exhaust a node's host memory, said before the run starts (hours before its first
    save): every actor rank on a node gathers its position's optimizer state at the same time."""
    need = ranks_per_node * cost.save_host_bytes
    have = host_memory_gb * 2**30
    if need <= have:
        return []
    return [
        f"checkpoint save: {ranks_per_node} actor ranks per node x {_gb(cost.save_host_bytes)} of host memory each "
        f"({cost.checkpoint_format_name} gathers a position's {_gb(cost.shard_state_bytes)} of optimizer state) = "
        f"{_gb(need)} > slurm.host_memory_gb={host_memory_gb:g} ({_gb(have)}): raise actor.tp / actor.pp, or set "
        "actor.checkpoint_format=dp_reshardable (resumes only under the same TP, PP and EP), or slurm.host_memory_gb "
        "to the nodes' memory"
    ]


def checkpoint_cost(
    dims: ModelDims,
    layout: Layout,
    *,
    weight_bytes: int,
    checkpoint_format: str = "fully_reshardable",
    fs_bytes_per_s: float = FS_BYTES_PER_S,
) -> CheckpointCost:
    """checkpoint_format: actor.checkpoint_format ("fully_reshardable" or "dp_reshardable")."""
    fully_reshardable = checkpoint_format == "fully_reshardable"
    total = total_params(dims)
    experts = expert_params(dims)
    dense = total - experts
    etp = layout.etp or layout.tp
    position = dense / (layout.tp * layout.pp) + experts / (layout.ep * etp * layout.pp)
    shard = OPTIMIZER_BYTES_PER_PARAM * position
    disk = total * (weight_bytes + OPTIMIZER_BYTES_PER_PARAM)
    replicas = layout.dp * layout.cp
    if fully_reshardable:
        save_host = HOST_PEAK_FACTOR * shard
        exchange = (shard + weight_bytes * position) * (1 - 1 / replicas)
    else:
        save_host = HOST_PEAK_FACTOR * shard / replicas
        exchange = 0.0
    return CheckpointCost(disk, shard, save_host, disk, exchange, fs_bytes_per_s, fully_reshardable)


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"
