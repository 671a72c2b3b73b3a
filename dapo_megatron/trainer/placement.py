"""Where the rollout engines live relative to the actor, and what moves between a step's phases.

    placement = make_placement(cfg, roles=roles, driver=driver)
    placement.before_rollout(actor)             # engines generate next
    log.update(placement.ledger("rollout", actor, ref))   # who holds what while the engines generate
    placement.before_train(actor)               # the actor computes next
    log.update(placement.ledger("train", actor, ref))
    stats = placement.transfer_weights(actor, step=3)   # the engines get weight version "step_3"
    with placement.actor_on_device(actor, step=3): ckpt.save_step(...)

The loop (trainer/train.py) calls these hooks between its phases and knows nothing else about placement.
Both placements are chosen here, by rollout.placement, with their transport and phase order.

Disaggregated: the engines have their own GPUs (Slurm array jobs, or the CPU engines of the embedded
default), so nothing moves between phases, and the weights leave by the per-stage export
(transfer/stage_export.py): each pipeline stage gathers its parameters over TP onto its exporter,
bucket by bucket, and the driver broadcasts them through its weight group with the engines
(transfer/weight_sync.py, update_weights_from_distributed).

Colocated: the engines share the trainer's GPUs, so the two take turns (the design slime, verl and
NeMo-RL use; NeMo-RL's megatron_policy_worker.py names the two actor offloads used here):
  before_rollout   actor.offload(): parameters, gradients, optimizer state off the device
  (engines generate)
  before_train     engines release weights and KV cache; actor.onload()
  (old log-probs, reference log-probs, training)
  transfer_weights actor.offload("grads", "optimizer"); engines resume their weights' memory;
                   every tensor by CUDA IPC, each engine TP rank from the trainer rank on its own GPU
                   (transfer/colocated_sync.py, update_weights_from_tensor inside a weight-update
                   session); actor.offload("params"); engines resume their KV cache
A checkpoint needs the actor's state on the device: actor_on_device releases the engines, onloads,
and afterwards offloads and sends the weights again (the engines' released weights lost their
content). The reference model is offloaded between its calls in both placements (reference.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol, cast

from dapo_megatron.actor.offload import trainer_memory_gb
from dapo_megatron.config import Config
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.driver_decides import driver_decides
from dapo_megatron.distributed.roles import RankRoles
from dapo_megatron.quant.engine_checkpoint import fp8_converter, fp8_rollout_dir
from dapo_megatron.transfer import engine_release as engine_memory
from dapo_megatron.transfer.colocated_sync import ColocatedTransfer, assign_engine_slots, trainer_device
from dapo_megatron.transfer.stage_export import (
    actor_exporter,
    covers_layout,
    gather_manifests,
    weights_for_driver,
)
from dapo_megatron.weights.export import bucketize


class Placement(Protocol):
    def before_rollout(self, actor) -> None: ...

    def before_train(self, actor) -> None: ...

    def transfer_weights(self, actor, *, step: int) -> dict[str, float]: ...

    def ledger(self, phase: str, actor, ref=None) -> dict[str, float]: ...

    def actor_on_device(self, actor, *, step: int) -> contextlib.AbstractContextManager: ...


class _EngineSide:
    """The driver's calls to the engines for a placement, each one collective: every rank waits for
    the driver's outcome (an error is raised on every rank alike, so none is left in a collective)."""

    def __init__(self, driver) -> None:
        self.driver = driver
        self.released: set[str] = set()  # tags released on every engine now (driver only)

    def run(self, fn, *args) -> None:
        def on_engines() -> None:
            try:
                self.driver.run(fn(self.driver.pool.weight_targets(), *args))
            except Exception as err:  # noqa: BLE001 - named as the engines' error on every rank
                raise RuntimeError(f"rollout engines: {type(err).__name__}: {err}") from err

        driver_decides(on_engines)

    def release(self, tags: list[str]) -> None:
        todo = [t for t in tags if t not in self.released]
        if todo:
            self.run(engine_memory.release, todo)
            self.released.update(todo)

    def resume(self, tags: list[str]) -> None:
        todo = [t for t in tags if t in self.released]
        if todo:
            self.run(engine_memory.resume, todo)
            self.released.difference_update(todo)

    def resident_gb(self) -> float:
        return self.driver.run(engine_memory.resident_gb(self.driver.pool.weight_targets(), released=self.released))


def _ledger(phase: str, actor, ref, engines: _EngineSide) -> dict[str, float]:
    """Collective: the trainer's side (actor/offload.py) and, on the driver, the engines' side."""
    out = trainer_memory_gb(phase=phase, actor=actor, ref=ref)
    if engines.driver is not None:
        out[f"memory/engine_gb_during_{phase}"] = engines.resident_gb()
    return out


class DisaggregatedPlacement:
    def __init__(self, cfg: Config, *, roles: RankRoles, driver=None) -> None:
        if roles.driver and driver is None:
            raise ValueError("DisaggregatedPlacement: the driver rank needs its Driver (engine pool, weight group)")
        self.bucket_bytes = cfg.rollout.weight_bucket_mb << 20
        self.roles = roles
        self.driver = driver
        self.engines = _EngineSide(driver)

    def before_rollout(self, actor) -> None:
        """Nothing to free: the engines do not share the actor's devices."""

    def before_train(self, actor) -> None:
        """Nothing to bring back."""

    def ledger(self, phase: str, actor, ref=None) -> dict[str, float]:
        return _ledger(phase, actor, ref, self.engines)

    def actor_on_device(self, actor, *, step: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def transfer_weights(self, actor, *, step: int) -> dict[str, float]:
        """Collective: every rank takes part in its stage's export; the driver sends to the engines
        (as weight version "step_<step>": the weights after `step` updates)."""
        if not covers_layout(actor.layout):
            return self._transfer_through_every_rank(actor, step=step)
        exporter = actor_exporter(actor, bucket_bytes=self.bucket_bytes)
        buckets = weights_for_driver(exporter, gather_manifests(exporter))
        if self.roles.driver:
            return self.driver.push_weights(buckets, step=step)
        for bucket in buckets:
            del bucket
        return {}

    def _transfer_through_every_rank(self, actor, *, step: int) -> dict[str, float]:
        """Expert-parallel layouts (stage_export.covers_layout): every rank walks iter_hf_weights in
        step (experts gathered over EP, stages broadcast over PP) and the driver sends its buckets."""
        named = actor.iter_hf_weights()
        if self.roles.driver:
            return self.driver.push_weights(bucketize(named, self.bucket_bytes), step=step)
        for _ in named:
            pass
        return {}


class ColocatedPlacement:
    """Engines on the trainer's GPUs: the phases take turns on the memory (module docstring)."""

    def __init__(self, cfg: Config, *, roles: RankRoles, driver=None) -> None:
        import torch.distributed as dist

        if roles.driver and driver is None:
            raise ValueError("ColocatedPlacement: the driver rank needs its Driver (engine pool)")
        if cfg.rollout.engine_urls:
            raise ValueError(
                "config key 'rollout.engine_urls': fixed engine URLs cannot be colocated (the "
                "trainer must know which GPU each engine rank uses: registrations from the "
                "launcher); set rollout.placement=disaggregated or leave engine_urls empty"
            )
        self.roles = roles
        self.driver = driver
        self.engines = _EngineSide(driver)
        devices = [trainer_device()]  # (node, gpu) of every rank
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[object] = [None] * dist.get_world_size()
            coll.all_gather_object(gathered, trainer_device())
            devices = cast(list[tuple[str, int]], gathered)  # all_gather_object put a rank's device in every slot
        self.slots = driver_decides(lambda: assign_engine_slots(driver.pool.registrations(), devices))
        self.transfer = ColocatedTransfer(
            self.slots,
            driver=driver,
            bucket_bytes=cfg.rollout.weight_bucket_mb << 20,
            verify=cfg.rollout.verify_weight_sync,
        )
        self.fp8 = (
            None  # rollout.quantization=fp8: every rank converts what it hands its engine (quant/engine_checkpoint.py)
        )
        if cfg.rollout.quantization == "fp8":
            self.fp8 = fp8_converter(fp8_rollout_dir(cfg.trainer.output_dir))

    def before_rollout(self, actor) -> None:
        actor.offload()  # parameters, gradients (dropped: dead between steps), optimizer state
        self.engines.resume(["weights", "kv_cache"])  # a no-op in a step: transfer_weights resumed them

    def before_train(self, actor) -> None:
        self.engines.release(["weights", "kv_cache"])  # collective: no rank onloads before the engines freed
        actor.onload()

    def ledger(self, phase: str, actor, ref=None) -> dict[str, float]:
        return _ledger(phase, actor, ref, self.engines)

    def transfer_weights(self, actor, *, step: int) -> dict[str, float]:
        """Collective. The engines' weights come back empty and are filled by IPC from the actor's
        parameters (the only actor state left on the device), then the actor leaves entirely."""
        actor.offload("grads", "optimizer")
        self.engines.resume(["weights"])
        named = actor.iter_hf_weights()
        if self.fp8 is not None:
            named = self.fp8.convert(named)
        stats = self.transfer.send(named, weight_version=f"step_{step}")
        actor.offload("params")
        self.engines.resume(["kv_cache"])
        if not self.roles.driver:
            return {}
        self.driver.weights_now(f"step_{step}")
        return {
            "sync/seconds": stats.seconds,
            "sync/gb": stats.bytes / 1e9,
            "sync/gb_per_s": stats.gb_per_s,
            "sync/buckets": float(stats.num_buckets),
            "sync/collectives": 0.0,
            "sync/engines": float(stats.num_engines),
            "sync/verified_tensors": float(stats.num_tensors if self.transfer.verify else 0),
        }

    @contextlib.contextmanager
    def actor_on_device(self, actor, *, step: int) -> Iterator[None]:
        """The actor's whole state on the device (a checkpoint reads it); afterwards the engines get
        the weights again: their released memory lost its content."""
        self.engines.release(["weights", "kv_cache"])
        actor.onload()
        try:
            yield
        finally:
            self.transfer_weights(actor, step=step)


def make_placement(cfg: Config, *, roles: RankRoles, driver=None) -> Placement:
    """The placement of rollout.placement."""
    if cfg.rollout.placement == "colocated":
        return ColocatedPlacement(cfg, roles=roles, driver=driver)
    return DisaggregatedPlacement(cfg, roles=roles, driver=driver)
