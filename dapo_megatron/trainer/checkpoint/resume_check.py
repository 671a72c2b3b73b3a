"""What `--resume` may change, decided before any process starts (docs/architecture.md, "Resume on another
layout"): the parallel layout and the allocation may change, the model may not.

    line = check_resume_layout(cfg, checkpoint_dir)   # before anything starts; "" when the layout is the same
    # "[train] resuming step 71 saved at TP=1 PP=1 CP=1 DP=2 under TP=2 PP=1 CP=1 DP=1: resharding (...)"
    check_resume_model(checkpoint_dir, model_dir=model_dir)   # once the model directory is known
    # each: a ValueError naming the key and the checkpoint's value for what cannot change

May change: actor.tp / pp / vpp / cp / ep / etp and actor.world_size (so DP, nodes, GPUs per node), and the
engines' layout (rollout.engine_tp, num_engines, placement: they hold no checkpointed state; the first sync
after the resume gives them the loaded weights). The model and optimizer reshard through megatron-core's
global-shape checkpoints (actor/checkpoint.py); the RNG states are re-derived where they cannot map.
May not change: the architecture (ARCHITECTURE_KEYS of config.json), actor.precision and
actor.use_distributed_optimizer (the optimizer's saved state has another structure). A checkpoint written in
the earlier dp_reshardable optimizer format loads only under its own TP, PP and EP.
"""

from __future__ import annotations

import json
from pathlib import Path

from dapo_megatron.config import Config
from dapo_megatron.distributed.checkpoint_record import (
    ARCHITECTURE_KEYS,
    LEGACY_OPTIMIZER_FORMAT,
    META_FILE,
    architecture_record,
    changed_sizes,
    describe_sizes,
    finished_actor_dir,
)

TRAINER_STATE = "trainer_state.json"  # trainer/checkpoint/files.py STATE_FILE (the same: files.py imports torch)


def planned_layout(cfg: Config) -> dict[str, int]:
    """The sizes the config's ranks will have (actor/checkpoint.py layout_record's keys)."""
    ac = cfg.actor
    return {
        "tp": ac.tp,
        "pp": ac.pp,
        "cp": ac.cp,
        "dp": ac.world_size // (ac.tp * ac.pp * ac.cp),
        "vpp": ac.vpp or 1,
        "ep": ac.ep,
        "etp": ac.etp or ac.tp,
        "world": ac.world_size,
    }


def read_actor_meta(checkpoint_dir: Path) -> dict | None:
    """The actor's actor_state.json of a run checkpoint (step_<N>/actor, or its .old after a crash
    between the two renames); None when there is none (a damaged checkpoint: the ranks verify it against
    its manifest, set it aside and take an earlier one, trainer/checkpoint/files.py)."""
    actor = finished_actor_dir(checkpoint_dir / "actor")
    return json.loads((actor / META_FILE).read_text()) if actor is not None else None


def check_resume_model(checkpoint_dir: str | Path, *, model_dir: str | Path) -> None:
    """A ValueError when model_dir's config.json differs from the checkpoint's model in an ARCHITECTURE_KEYS
    key. Nothing to compare (a checkpoint older than the record, a model_dir not on this machine): no check
    here, and the ranks' load finds a mismatch of shapes."""
    checkpoint_dir, model_dir = Path(checkpoint_dir), Path(model_dir)
    saved_model = (read_actor_meta(checkpoint_dir) or {}).get("model")
    if not saved_model or not (model_dir / "config.json").is_file():
        return
    current = architecture_record(json.loads((model_dir / "config.json").read_text()))
    for key in ARCHITECTURE_KEYS:
        if key in saved_model and key in current and saved_model[key] != current[key]:
            raise ValueError(
                f"--resume: model.path {model_dir} has {key}={current[key]!r} but checkpoint {checkpoint_dir} was "
                f"saved with {key}={saved_model[key]!r}: the model's architecture cannot change at --resume "
                "(point model.path at the run's base model)"
            )


def check_resume_layout(cfg: Config, checkpoint_dir: str | Path, *, prefix: str = "[train]") -> str:
    """The line to print about the layout ('' when unchanged), or a ValueError naming the key and the
    checkpoint's value for what cannot change with it (precision, the distributed optimizer, and the
    layout of a checkpoint in the earlier optimizer format)."""
    checkpoint_dir = Path(checkpoint_dir)
    meta = read_actor_meta(checkpoint_dir)
    if meta is None:
        return ""
    where = f"checkpoint {checkpoint_dir}"
    saved_keys = (
        ("precision", meta.get("precision")),
        ("use_distributed_optimizer", meta.get("distributed_optimizer")),
    )
    for key, saved in saved_keys:
        current = getattr(cfg.actor, key)
        if saved is not None and saved != current:
            raise ValueError(
                f"--resume: actor.{key}={current!r} but {where} was saved with actor.{key}={saved!r}; "
                f"the optimizer's saved state has another structure: keep actor.{key}={saved!r}"
            )
    saved_layout = meta.get("layout") or {}
    layout = planned_layout(cfg)
    moved = changed_sizes(saved_layout, layout)
    if meta.get("optimizer_format", LEGACY_OPTIMIZER_FORMAT) == LEGACY_OPTIMIZER_FORMAT:
        pinned = [k for k in ("tp", "pp", "ep", "vpp") if k in moved]
        if pinned:
            keep = " ".join(f"actor.{k}={int(saved_layout.get(k) or 1)}" for k in pinned)
            raise ValueError(
                f"--resume: {where} was written in the {LEGACY_OPTIMIZER_FORMAT} optimizer format (before 2026-11-28), "
                "which loads only under the TP, PP, VPP and EP it was saved with "
                f"({describe_sizes(saved_layout)}): resume with {keep}, then its next checkpoint loads under any layout"
            )
    if not moved:
        return ""
    rng = ", RNG states re-derived from trainer.seed" if any(k in moved for k in ("tp", "pp", "ep")) else ""
    state = checkpoint_dir / TRAINER_STATE
    step = json.loads(state.read_text())["step"] if state.is_file() else int(meta.get("last_step", -1)) + 1
    return (
        f"{prefix} resuming step {step} saved at {describe_sizes(saved_layout)} under "
        f"{describe_sizes(layout)}: resharding (model and optimizer through megatron's global-shape checkpoint{rng})"
    )
