"""Atomic Megatron distributed checkpoints: model + optimizer + RNG (dist_checkpointing) + a JSON.

    save_checkpoint(path, sharded_state_dict=sd, meta={"num_updates": 12})
    state, meta = load_checkpoint(path, sharded_state_dict=sd_for_loading)

Layout of a finished checkpoint `<path>/`: megatron's dist_checkpointing files (every rank writes
its shards) plus `actor_state.json` (written last, by global rank 0). Atomicity: everything is
written to `<path>.tmp`; only when every rank has finished does rank 0 move an existing `<path>`
to `<path>.old`, rename `<path>.tmp` to `<path>` and delete `<path>.old`. A save that dies at any
point before that leaves `<path>` as it was (and a stale `<path>.tmp`, removed by the next save);
a crash between the two renames leaves `<path>.old`, which `load_checkpoint` falls back to.

Resharding (docs/architecture.md, "Resume on another layout"): the model's tensors are megatron
ShardedTensors with global shapes and offsets, so any TP / PP / VPP / CP / EP / DP layout reads the
slices it needs; the distributed optimizer is saved in megatron's `fully_reshardable` format
(OPTIMIZER_FORMAT, the default of actor.checkpoint_format: the fp32 master parameters and both Adam
moments stored in the model's own shapes and keys, not as DP-ordered flat buffers), so it follows the
model. The RNG state is one object per
TP x PP x EP position: it is restored when those sizes are unchanged, else re-derived from the run's
seed and the step (reseed_rng).
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.checkpoint_record import (
    META_FILE,
    changed_sizes,
    finished_actor_dir,
)
from dapo_megatron.distributed.layout import ParallelLayout

# megatron-core's distributed-optimizer checkpoint formats (DistributedOptimizer.sharded_state_dict), chosen by
# actor.checkpoint_format: "fully_reshardable" (the default) loads under any layout; "dp_reshardable" (the
# only format before 2026-11-28, assumed when actor_state.json names none) only under the TP x PP x EP it was
# saved with
OPTIMIZER_FORMAT = "fully_reshardable"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _publish(tmp: Path, final: Path) -> None:
    """The only step that touches `final` (rank 0)."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def save_checkpoint(path: str | Path, *, sharded_state_dict: dict, meta: dict) -> Path:
    """Collective: every rank calls it with its sharded state dict; returns the final path."""
    from megatron.core import dist_checkpointing

    final = Path(path).absolute()
    tmp = final.with_name(final.name + ".tmp")
    if _is_rank0():
        if tmp.exists():
            shutil.rmtree(tmp)  # left by an interrupted save
        tmp.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(sharded_state_dict, str(tmp))
    _barrier()
    error = None
    if _is_rank0():
        try:
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
            _publish(tmp, final)
        except Exception as err:  # noqa: BLE001 - re-raised below, after telling the other ranks
            error = err
    # every rank learns whether rank 0 published (instead of waiting forever in a barrier)
    ok = torch.tensor([0 if error else 1], dtype=torch.int32)
    if dist.is_initialized():
        coll.broadcast(ok, src=0)
    if error is not None:
        raise error
    if not int(ok.item()):
        raise RuntimeError(f"checkpoint {final}: rank 0 failed to publish {tmp}; the previous checkpoint is kept")
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """`path` if it is a finished checkpoint, else `<path>.old` (crash between the renames)."""
    found = finished_actor_dir(path)
    if found is None:
        raise ValueError(f"checkpoint {Path(path).absolute()}: no {META_FILE} there (not a finished actor checkpoint)")
    return found


def read_checkpoint_meta(path: str | Path) -> dict:
    """actor_state.json of a finished checkpoint (what was saved: step, layout, optimizer format)."""
    return json.loads((resolve_checkpoint(path) / META_FILE).read_text())


def load_checkpoint(
    path: str | Path, *, sharded_state_dict: dict, parallel_group: dist.ProcessGroup | None = None
) -> tuple[dict, dict]:
    """Collective: (loaded state dict, meta JSON).

    parallel_group (the DP x CP group): its ranks need the same tensors (the model's replicas, and in
    the fully_reshardable format each rank's whole TP x PP position's optimizer state), so each reads a
    1/|group| share of them from the file system and they exchange the rest (megatron-core's
    FullyParallelLoadStrategyWrapper, broadcast): the checkpoint's bytes are read once per position,
    not once per rank."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    where = resolve_checkpoint(path)
    meta = json.loads((where / META_FILE).read_text())
    with warnings.catch_warnings():
        # megatron-core 0.16.1's torch_dist loader (strategies/torch.py) calls torch.distributed.checkpoint's
        # deprecated `load_state_dict` and builds torch ShardedTensors, and torch 2.13 answers each with a
        # FutureWarning on every rank at every resume: four lines about megatron's internals that the user
        # can do nothing about. Exactly these two messages are ignored, only for this call.
        warnings.filterwarnings(
            "ignore", message=r"`load_state_dict` is deprecated and will be removed", category=FutureWarning
        )
        warnings.filterwarnings(
            "ignore", message=r"Please use DTensor instead and we are deprecating ShardedTensor", category=FutureWarning
        )
        strategy = None
        if parallel_group is not None and parallel_group.size() > 1:
            strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(where)), parallel_group)
        state = dist_checkpointing.load(sharded_state_dict, str(where), sharded_strategy=strategy)
    return state, meta


# --- the layout a checkpoint was saved under ---------------------------------------------------------


def layout_record(layout: ParallelLayout) -> dict[str, int]:
    """The sizes actor_state.json keeps (what a resume compares against its own layout)."""
    return {
        "tp": layout.tp_size,
        "pp": layout.pp_size,
        "cp": layout.cp_size,
        "dp": layout.dp_size,
        "vpp": layout.vpp_size or 1,
        "ep": layout.ep_size,
        "etp": layout.etp_size,
        "world": layout.world_size,
    }


def rng_state_restorable(saved: dict | None, layout: ParallelLayout) -> bool:
    """The saved RNG objects map one-to-one onto this layout's ranks (same TP, PP and EP sizes)."""
    return saved is not None and not changed_sizes(saved, layout_record(layout), ("tp", "pp", "ep"))


# --- RNG state (one ShardedObject per TP x PP position; DP/CP ranks are replicas) --------------------


def rng_sharded_object(layout: ParallelLayout):
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject(
        "rng_state",
        state,
        (layout.pp_size, layout.tp_size),
        (layout.pp_rank, layout.tp_rank),
        replica_id=layout.dp_cp_rank,
    )


def restore_rng(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def reseed_rng(*, seed: int, step: int) -> None:
    """RNG states for a layout the saved ones cannot map to: megatron's seeding of a fresh run
    (model_parallel_cuda_manual_seed: per TP / EP rank tracker states) from a seed derived from the
    run's seed and the step, so two resumes of one checkpoint under one layout draw the same numbers."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    derived = (seed * 1_000_003 + step + 1) % (2**31 - 1)
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)
    model_parallel_cuda_manual_seed(derived)


# --- the optimizer's structure (one optimizer, or megatron's chain of dense + expert optimizers) ------


def optimizer_count(optimizer) -> int:
    """1, or the length of megatron's ChainedOptimizer (a MoE model at EP > 1: the dense parameters' and
    the experts' optimizers, over different data-parallel groups)."""
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def regroup_optimizer_state(optimizer, loaded: dict, *, saved_count: int | None, optimizer_format: str) -> dict:
    """The loaded optimizer state in the structure `optimizer` loads. A checkpoint of another chain length
    (EP=2's two optimizers loaded at EP=1, or back) has its tensors where this layout asked for them (keys
    without the chain prefix), but its non-tensor part (param groups) in the saved chain's structure: each
    optimizer here takes its own param groups (the config's hyperparameters; the lr is set every step and
    the Adam step restored by set_adam_step) with the loaded tensors."""
    parts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    if saved_count is None or saved_count == len(parts):
        return loaded
    tensors = [loaded[index] for index in range(len(parts))] if len(parts) > 1 else [loaded]
    rebuilt = [
        {**part.state_dict(), "param_state": t["param_state"], "param_state_sharding_type": optimizer_format}
        for part, t in zip(parts, tensors)
    ]
    return dict(enumerate(rebuilt)) if len(parts) > 1 else rebuilt[0]
