"""Where the rollout engines live relative to the actor, and what moves between a step's phases.

    placement = make_placement(cfg, roles=roles, driver=driver)
    placement.before_rollout(actor)             # engines generate next
    placement.before_train(actor)               # the actor computes next
    stats = placement.transfer_weights(actor, step=3)   # the engines get weight version "step_3"

The loop (train.py) calls these hooks between its phases and knows nothing else about placement.

Disaggregated (today's only implementation, and what rollout.placement=colocated also runs until the
colocated one exists): the engines have their own GPUs (Slurm array jobs, or the CPU engines of the
embedded default), so nothing moves between phases, and the weights leave by the per-stage export
(weights/stage_export.py): each pipeline stage gathers its parameters over TP onto its exporter,
bucket by bucket, and the driver sends the buckets through its weight group with the engines
(rollout/weight_sync.py). Later stages hand their buckets to the driver until each stage sends
its own through its own weight group (the next step once the SGLang weight-update session lands).

Colocated (issue 11 part B, not implemented here): engines share the trainer's GPUs. Its hooks:
before_rollout offloads the actor (actor.offload()) and resumes the engines' memory; before_train
releases the engines' weights and KV cache and onloads the actor; transfer_weights offloads what
the transfer does not need, resumes the engines' weights, hands each engine TP rank CUDA-IPC
handles of the export buckets (rollout/weight_sync.py: serialize_tensors_cuda_ipc) and resumes
their KV cache.
"""

from __future__ import annotations

from typing import Protocol

from dapo_megatron.config import Config
from dapo_megatron.dataplane.roles import RankRoles


class Placement(Protocol):
    def before_rollout(self, actor) -> None: ...

    def before_train(self, actor) -> None: ...

    def transfer_weights(self, actor, *, step: int) -> dict[str, float]: ...


class DisaggregatedPlacement:
    def __init__(self, cfg: Config, *, roles: RankRoles, driver=None) -> None:
        if roles.driver and driver is None:
            raise ValueError("DisaggregatedPlacement: the driver rank needs its Driver (engine pool, weight group)")
        self.bucket_bytes = cfg.rollout.weight_bucket_mb << 20
        self.roles = roles
        self.driver = driver

    def before_rollout(self, actor) -> None:
        """Nothing to free: the engines do not share the actor's devices."""

    def before_train(self, actor) -> None:
        """Nothing to bring back."""

    def transfer_weights(self, actor, *, step: int) -> dict[str, float]:
        """Collective: every rank takes part in its stage's export; the driver sends to the engines
        (as weight version "step_<step>": the weights after `step` updates)."""
        from dapo_megatron.weights.stage_export import covers_layout, gather_manifests, weights_for_driver

        if not covers_layout():
            return self._transfer_through_every_rank(actor, step=step)
        exporter = actor.stage_exporter(bucket_bytes=self.bucket_bytes)
        buckets = weights_for_driver(exporter, gather_manifests(exporter))
        if self.roles.driver:
            return self.driver.push_weights(buckets, step=step)
        for bucket in buckets:
            del bucket
        return {}

    def _transfer_through_every_rank(self, actor, *, step: int) -> dict[str, float]:
        """Expert-parallel layouts (stage_export.covers_layout): every rank walks iter_hf_weights in
        step (experts gathered over EP, stages broadcast over PP) and the driver sends its buckets."""
        from dapo_megatron.weights.export import bucketize

        named = actor.iter_hf_weights()
        if self.roles.driver:
            return self.driver.push_weights(bucketize(named, self.bucket_bytes), step=step)
        for _ in named:
            pass
        return {}


def make_placement(cfg: Config, *, roles: RankRoles, driver=None) -> Placement:
    """The placement of rollout.placement. Both values run the disaggregated hooks today (the colocated
    engines are started on the trainer's nodes but still receive weights over their weight group)."""
    return DisaggregatedPlacement(cfg, roles=roles, driver=driver)
