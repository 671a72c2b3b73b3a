"""The Megatron-Core actor: per-token log-probs, the DAPO train step, checkpoints, HF weights out.

    init_distributed()                                   # torchrun / srun environment
    with model_parallel(tp=cfg.actor.tp, pp=cfg.actor.pp, cp=cfg.actor.cp, vpp=cfg.actor.vpp,
                        seed=cfg.trainer.seed) as layout:  # this rank's ParallelLayout (distributed/layout.py)
        actor = Actor(actor_settings(cfg), hf_dir, layout)  # on EVERY rank (trainer/settings.py)
        share, _ = scatter_batch(..., layout=layout)     # this DP rank's share (dataplane/scatter.py)
        old = actor.logprobs(share)                      # fp32 [response tokens of the share], last stage
        share.batch.old_logprobs = old.logprobs
        for mini in share.mini_batches():
            metrics = actor.train(mini, step=rollout_step)
        actor.save(run_dir / "ckpt" / f"step_{rollout_step}")

The Actor is a Policy (policy.py: the model chunks, loaded, packed and scored) that trains: its
chunks wrapped in megatron DDP, the optimizer and its lr schedule, the schedule's hooks, the train step
and checkpoints. Each is built by a named function below; the KL reference (ref_policy.py) is a bare
Policy, with none of them.

Contract: each DP rank passes its own BatchShare (dataplane/share.py); its TP/CP/PP peers pass the
same one. The rank packs it into its token-budget micro-batches (packing.py) and runs megatron's
forward/backward schedule (pipeline-parallel aware). Log-probs stay on the ranks that computed
them (the last pipeline stage); train metrics are identical on every rank. Tests and tools may
instead pass the same list of Samples to every rank: each rank then takes its share itself
(share.share_of_samples) and logprobs() returns every sample's values on every rank.

The gradient is exactly the one of a single big batch: each micro-batch loss is
sum(per-token terms) / D with D the GLOBAL count of the mini-batch (masked tokens for token-mean,
sequences for the seq modes; summed over all DP ranks before the first forward), the model config
has calculate_per_token_loss=True so that megatron neither divides by the number of micro-batches
nor averages over DP (DDP sums gradients: gradient_scaling_factor 1), and finalize_model_grads is
called without a token count. Sum over micro-batches and DP ranks of grad(local sum / D) =
grad(global sum / D).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

# guarded_step is looked up at each call (actor_optimizer.guarded_step): tests replace it to read the gradients
# just before the step (tests/helpers_actor.py grads_rank)
import dapo_megatron.actor.optimizer as actor_optimizer
from dapo_megatron.actor.checkpoint import (
    layout_record,
    load_checkpoint,
    optimizer_count,
    read_checkpoint_meta,
    regroup_optimizer_state,
    reseed_rng,
    restore_rng,
    rng_sharded_object,
    rng_state_restorable,
    save_checkpoint,
)
from dapo_megatron.actor.head_loss import one_pass_objective, uses_one_pass
from dapo_megatron.actor.offload import DeviceMemory, actor_tensors
from dapo_megatron.actor.optimizer import (
    adam_step,
    build_lr_schedule,
    build_optimizer,
    init_empty_optimizer_state,
    set_adam_step,
    set_lr_for_step,
    torch_adam_step_kept,
)
from dapo_megatron.actor.packing import MicroBatch
from dapo_megatron.actor.policy import LogProbs, Policy, TokenLogProbs
from dapo_megatron.actor.settings import ActorSettings, OptimizerSettings
from dapo_megatron.actor.staging import to_device
from dapo_megatron.algo.aggregation import count_loss_units_packed, sequence_token_counts
from dapo_megatron.algo.objective import METRIC_SUMS, PackedTokens, objective, objective_metrics
from dapo_megatron.dataplane.batch import RolloutBatch
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.dataplane.share import BatchShare
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.checkpoint_record import LEGACY_OPTIMIZER_FORMAT, architecture_record, describe_sizes
from dapo_megatron.distributed.layout import ParallelLayout

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = ["Actor", "LogProbs", "TokenLogProbs"]


def wrap_in_ddp(chunks: list[GPTModel], *, use_distributed_optimizer: bool) -> list[DistributedDataParallel]:
    """megatron's DistributedDataParallel around each chunk: fp32 gradient buffers, reduced in one
    collective at the end of the step without averaging (the loss is already divided by the global count)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False,
    )
    return [
        DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]


def build_actor_optimizer(
    model: list[DistributedDataParallel], opt: OptimizerSettings, *, precision: str, distributed: bool
):
    """megatron's Adam over the DDP-wrapped chunks (optimizer.py), from the trainer section's keys."""
    return build_optimizer(
        model,
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        grad_clip=opt.grad_clip,
        precision=precision,
        use_distributed_optimizer=distributed,
    )


def build_actor_lr_schedule(optimizer, opt: OptimizerSettings):
    """Warm-up, then constant / linear / cosine decay (optimizer.py), from the trainer section's keys."""
    return build_lr_schedule(
        optimizer,
        lr=opt.lr,
        warmup_steps=opt.warmup_steps,
        weight_decay=opt.weight_decay,
        decay_style=opt.lr_decay_style,
        min_lr=opt.min_lr,
        total_steps=opt.total_steps,
    )


def install_schedule_hooks(chunks: list[GPTModel], model: list[DistributedDataParallel], optimizer) -> None:
    """The hooks megatron's forward/backward schedule calls, on every chunk's TransformerConfig: no_sync
    (gradient reduction deferred to the last micro-batch), the loss scale, and finalize_model_grads."""
    from megatron.core.distributed import finalize_model_grads

    config = chunks[0].config
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    config.grad_scale_func = optimizer.scale_loss
    # The loss is already divided by the global count: finalize without megatron's token count.
    config.finalize_model_grads_func = lambda model, num_tokens, **kw: finalize_model_grads(model, None, **kw)
    for chunk in chunks[1:]:
        chunk.config.no_sync_func = config.no_sync_func
        chunk.config.grad_scale_func = config.grad_scale_func
        chunk.config.finalize_model_grads_func = config.finalize_model_grads_func


class Actor(Policy):
    # megatron-core's optimizer and scheduler (megatron is not analysed by mypy: these names are unchecked)
    optimizer: MegatronOptimizer
    lr_schedule: OptimizerParamScheduler

    def __init__(self, settings: ActorSettings, hf_dir: str | Path, layout: ParallelLayout) -> None:
        """The Policy (policy.py: built for this rank's place in the layout, loaded from hf_dir), wrapped
        in megatron DDP, with the optimizer, the lr schedule and the schedule's hooks."""
        self.objective = settings.objective()  # the loss (algo/objective.py); an unknown policy_loss fails here
        # actor.head_loss=one_pass: the last stage's head + loss in one pass (head_loss.py); refused here if it cannot
        self.one_pass = uses_one_pass(settings, device_type=coll.compute_device().type)
        self.num_updates = 0
        self.last_step = -1
        super().__init__(settings, hf_dir, layout)

    def _attach_to_schedule(self) -> None:
        """Replaces Policy's: the schedule runs the DDP wrappers; offload moves gradients and optimizer too."""
        ac, opt = self.settings.actor, self.settings.optimizer
        self.model = wrap_in_ddp(self._chunks, use_distributed_optimizer=ac.use_distributed_optimizer)
        self.optimizer = build_actor_optimizer(
            self.model, opt, precision=ac.precision, distributed=ac.use_distributed_optimizer
        )
        self.lr_schedule = build_actor_lr_schedule(self.optimizer, opt)
        install_schedule_hooks(self._chunks, self.model, self.optimizer)
        # chunks and optimizer are never rebound; a lambda over self made a reference cycle that kept the model's
        # device memory until the next garbage collection (benchmarks/actor.py builds one actor per row)
        self.memory = DeviceMemory(functools.partial(actor_tensors, self._chunks, self.optimizer))

    def close(self) -> None:
        """Unhook this actor from its chunks' TransformerConfig, for a process that builds one actor after
        another (benchmarks/actor.py): no_sync_func, grad_scale_func and finalize_model_grads_func reference
        the DDP wrappers and the optimizer, and with them set the model survived `del actor` and
        gc.collect() (measured on CPU, megatron-core 0.16.1). Then: drop the references, gc.collect(),
        torch.cuda.empty_cache(). The actor is unusable afterwards."""
        for chunk in self._chunks:
            for key in ("no_sync_func", "grad_scale_func", "finalize_model_grads_func"):
                setattr(chunk.config, key, None)

    def _owns_results(self) -> bool:
        """The ranks whose loss-function outputs are summed into results: last pipeline stage,
        TP rank 0 (TP ranks hold identical copies), every DP and CP rank (disjoint tokens)."""
        return self.layout.is_last_stage and self.layout.tp_rank == 0

    # --- the train step ------------------------------------------------------------------------------

    def train(self, mini_batch: BatchShare | list[Sample], *, step: int) -> dict[str, float]:
        """One optimizer update on a mini-batch (collective): this DP rank's share of it (one of
        BatchShare.mini_batches()), or the same list of Samples on every rank.

        step: the rollout step (0-based) this update belongs to; it sets the warm-up lr
        (optimizer.py). The last pipeline stage needs old_logprobs (Actor.logprobs), plus
        rollout_logprobs with algorithm.tis_cap and ref_logprobs with algorithm.use_kl. Returns
        identical metrics on every rank; an update whose loss or grad norm is NaN/inf is skipped
        (nonfinite=1), and so is one with no trained token (update_skipped=1).
        """
        mini = self._train_share(mini_batch)
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        share = self._pack(mini, mask_truncated=self.settings.algorithm.overlong_filter)
        denom = self._global_denominator(share.micro_batches)
        device = coll.compute_device()
        sums = torch.zeros(len(METRIC_SUMS), dtype=torch.float64, device=device)
        ratio_max = torch.zeros((), dtype=torch.float64, device=device)

        def head(mb, gpt, output):
            nonlocal ratio_max
            pos = self._local(mb.response_mask, mb).nonzero()[:, 0]
            if self.one_pass and pos.numel():  # (no response token here: nothing to fuse, the separate path's zero)
                loss, values = self._one_pass_loss(mb, gpt, output, pos, denom=max(denom, 1.0))
            else:
                logprob, entropy = self._head(mb, gpt, output, positions=pos)
                loss, values = self._loss(mb, pos, logprob, entropy, denom=max(denom, 1.0))
            if self._owns_results():
                sums.add_(torch.stack([values[k].double() for k in METRIC_SUMS]).to(device))
                ratio_max = torch.maximum(ratio_max, values["ratio_max"].double().to(device))
            return loss, torch.tensor(0, dtype=torch.int), {}

        self._begin_routing(mini.batch, measure=False)
        try:
            self._run(share.micro_batches, head=head, length=share.length, forward_only=False)
        finally:
            self._end_routing(collect=False)
        coll.all_reduce(sums)
        coll.all_reduce(ratio_max, op=dist.ReduceOp.MAX)
        m = dict(zip(METRIC_SUMS, sums.tolist()))
        lr = set_lr_for_step(self.lr_schedule, step=step)
        updated, grad_norm = self._optimizer_step(denom=denom, loss_is_finite=bool(torch.isfinite(sums[0])))
        self.num_updates += int(updated)
        self.last_step = step
        return {
            **objective_metrics(m, float(ratio_max)),
            "grad_norm": grad_norm,
            "lr": lr,
            "loss_denominator": denom,
            "num_micro_batches": float(share.num_micro_batches),
            "nonfinite": float(denom > 0 and not updated),
            "update_skipped": float(not updated),
        }

    def _train_share(self, mini_batch: BatchShare | list[Sample]) -> BatchShare:
        """This rank's share of one mini-batch, checked: an actor that can train, one mini-batch, the
        per-token inputs the loss reads."""
        self._require("params", "grads", "optimizer", action="train")
        mini = self._share_of(mini_batch)
        if mini.num_mini_batches != 1:
            raise ValueError(
                f"Actor.train: one mini-batch per update, got {mini.num_mini_batches} "
                "(iterate BatchShare.mini_batches())"
            )
        self._check_train_inputs(mini.batch)
        return mini

    def _optimizer_step(self, *, denom: float, loss_is_finite: bool) -> tuple[bool, float]:
        """(updated, grad norm): no trained token (denom 0) clears the gradients and skips the update;
        otherwise the optimizer steps unless the loss or the grad norm is not finite (guarded_step)."""
        if denom == 0:
            self.optimizer.zero_grad()
            return False, 0.0
        return actor_optimizer.guarded_step(
            self.optimizer, grad_clip=self.settings.optimizer.grad_clip, loss_is_finite=loss_is_finite
        )

    def _check_train_inputs(self, batch: RolloutBatch) -> None:
        """The loss runs on the last pipeline stage: the per-token inputs it reads must be there."""
        al = self.settings.algorithm
        if not self._holds_results() or batch.num_sequences == 0:
            return
        if batch.old_logprobs is None:
            raise ValueError("Actor.train: old_logprobs missing (fill them from Actor.logprobs before train)")
        if self.objective.reads_rollout_logprobs and batch.rollout_logprobs is None:
            raise ValueError(
                "Actor.train: rollout_logprobs missing but the rollout correction needs them "
                f"(algorithm.tis_cap={al.tis_cap}, seq_is_cap={al.seq_is_cap}, rejection={al.rejection}, "
                f"veto_threshold={al.veto_threshold})"
            )
        if al.use_kl and batch.ref_logprobs is None:
            raise ValueError("Actor.train: ref_logprobs missing but algorithm.use_kl=true needs them")

    def _global_denominator(self, micro_batches: list[MicroBatch]) -> float:
        """D of the loss (algo/aggregation.py) over the whole mini-batch: this DP rank's share, summed
        over the DP group (CP ranks share a share)."""
        mode = self.settings.algorithm.loss_agg_mode
        local = sum(
            count_loss_units_packed(mb.loss_mask, mb.seq_ids, mb.num_sequences, agg_mode=mode) for mb in micro_batches
        )
        count = torch.tensor([float(local)], dtype=torch.float64, device=coll.compute_device())
        coll.all_reduce(count, group=self.layout.dp_group)
        return float(count.item())

    def _loss(
        self, mb: MicroBatch, pos: torch.Tensor, logprob: torch.Tensor, entropy: torch.Tensor, *, denom: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective (algo/objective.py) on this rank's response tokens of the micro-batch: its
        local positions `pos` of the packed tensors (its CP chunks), moved to the head's device."""
        tokens = PackedTokens(logprob=logprob, entropy=entropy, **self._token_fields(mb, pos, logprob.device))
        return objective(tokens, self.objective, loss_denominator=denom)

    def _one_pass_loss(
        self, mb: MicroBatch, gpt, output: torch.Tensor, pos: torch.Tensor, *, denom: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """_loss's (loss, values) by the one-pass head + loss (actor.head_loss=one_pass, head_loss.py) from the
        last stage's output: the same inputs, the same objective, no separate log-prob tensor."""
        hidden, weight, targets = self._head_inputs(mb, gpt, output, positions=pos)
        return one_pass_objective(
            hidden,
            weight,
            targets,
            self._token_fields(mb, pos, hidden.device),
            self.objective,
            loss_denominator=denom,
            temperature=self.settings.temperature,
            tp_group=self.layout.tp_group,
            vocab_size=self.hf_config.vocab_size,
        )

    def _token_fields(self, mb: MicroBatch, pos: torch.Tensor, dev: torch.device) -> dict[str, Any]:
        """PackedTokens' fields but the log-prob and entropy: the loss's per-token inputs at the local
        positions `pos`, on `dev`."""

        def take(t: torch.Tensor) -> torch.Tensor:
            return to_device(self._local(t, mb)[pos.cpu()], dev)

        def take_optional(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else take(t)

        if mb.num_sequences == 0:  # a padding-only micro-batch completing a group of pp under VPP: nothing trains
            mb = _padding_fields(mb)
        assert mb.old_logprobs is not None  # _check_train_inputs: the loss's stage has them

        wants = self.objective
        # n_seq(t) over the whole micro-batch, before the CP split (seq-mean-token-mean's weight)
        sequence_tokens = (
            sequence_token_counts(mb.loss_mask, mb.seq_ids, mb.num_sequences) if wants.reads_sequence_tokens else None
        )
        # c_t of the rollout corrections, likewise over the whole micro-batch: a sequence-level ratio is the
        # whole response's (a micro-batch holds whole sequences; algo/rollout_correction.py)
        correction = None
        if wants.reads_rollout_logprobs:
            correction = wants.correction_factor(
                old_logprobs=mb.old_logprobs,
                rollout_logprobs=mb.rollout_logprobs,
                loss_mask=mb.loss_mask,
                seq_ids=mb.seq_ids,
                num_sequences=mb.num_sequences,
            )
        return dict(
            old_logprob=take(mb.old_logprobs),
            advantages=take(mb.advantages),
            loss_mask=take(mb.loss_mask),
            seq_ids=take(mb.seq_ids),
            num_sequences=mb.num_sequences,
            sequence_tokens=take_optional(sequence_tokens),
            rollout_logprobs=take_optional(mb.rollout_logprobs) if wants.reads_rollout_logprobs else None,
            ref_logprobs=take_optional(mb.ref_logprobs) if wants.reads_ref_logprobs else None,
            correction=take_optional(correction),
        )

    # --- checkpoints ---------------------------------------------------------------------------------

    def _sharded_state_dict(self, *, is_loading: bool, optimizer_format: str, rng: bool = True) -> dict:
        """Model chunks + optimizer (+ RNG): megatron ShardedTensors keyed by the model's global names.
        optimizer_format: megatron's distributed-optimizer format (actor.checkpoint_format at a save; a load
        asks for the one the checkpoint was written in). rng=False leaves the RNG objects out (a layout they
        do not map to)."""
        state = {}
        for index, chunk in enumerate(self._chunks):
            state["model" if len(self._chunks) == 1 else f"model{index}"] = chunk.sharded_state_dict()
        # chained_optim_avoid_prefix: megatron keys the optimizer state of a MoE model's expert parameters
        # (a second, expert-data-parallel optimizer) "chained_1.<name>" unless told not to; without the prefix
        # the keys are the parameters' own, so a checkpoint of EP=2 (two optimizers) loads under EP=1 (one)
        metadata = {"distrib_optim_sharding_type": optimizer_format, "chained_optim_avoid_prefix": True}
        state["optimizer"] = self.optimizer.sharded_state_dict(dict(state), is_loading=is_loading, metadata=metadata)
        if rng:
            state["rng_state"] = rng_sharded_object(self.layout)
        return state

    def save(self, path: str | Path) -> Path:
        """Collective: model + optimizer + RNG (megatron dist_checkpointing) + actor_state.json,
        written to `<path>.tmp` and renamed (checkpoint.py)."""
        self._require("params", "optimizer", action="save")
        meta = {
            "num_updates": self.num_updates,
            "last_step": self.last_step,
            "adam_step": adam_step(self.optimizer),
            "lr_schedule": self.lr_schedule.state_dict(),
            "layout": layout_record(self.layout),
            "optimizer_format": self.settings.actor.checkpoint_format,
            "optimizers": optimizer_count(self.optimizer),  # a MoE at EP > 1 chains two (regroup_optimizer_state)
            # what a resume may not change (trainer/checkpoint/resume_check.py checks it before anything starts)
            "model": architecture_record(self.hf_config.to_dict()),
            "precision": self.settings.actor.precision,
            "distributed_optimizer": self.settings.actor.use_distributed_optimizer,
        }
        sharded = self._sharded_state_dict(is_loading=False, optimizer_format=self.settings.actor.checkpoint_format)
        return save_checkpoint(path, sharded_state_dict=sharded, meta=meta)

    def load(self, path: str | Path, *, seed: int | None = None) -> dict:
        """Collective: restore what save() wrote, under this actor's layout whatever the saved one
        (checkpoint.py, "Resharding"); returns its actor_state.json. seed: the run's (trainer.seed), from
        which the RNG states are re-derived when the saved ones do not map to this layout."""
        self._require("params", "optimizer", action="load")
        meta = read_checkpoint_meta(path)
        saved_layout = meta.get("layout")
        restore = rng_state_restorable(saved_layout, self.layout)
        if not restore and seed is None:
            raise ValueError(
                f"checkpoint {path}: saved under {describe_sizes(saved_layout or {})}, its RNG states do not map "
                f"to {describe_sizes(layout_record(self.layout))}: pass the run's seed to re-derive them"
            )
        init_empty_optimizer_state(self.optimizer)
        optimizer_format = meta.get("optimizer_format", LEGACY_OPTIMIZER_FORMAT)
        sharded = self._sharded_state_dict(is_loading=True, optimizer_format=optimizer_format, rng=restore)
        state, meta = load_checkpoint(path, sharded_state_dict=sharded, parallel_group=self.layout.dp_cp_group)
        for index, chunk in enumerate(self._chunks):
            chunk.load_state_dict(state["model" if len(self._chunks) == 1 else f"model{index}"], strict=False)
        optimizer_state = regroup_optimizer_state(
            self.optimizer, state["optimizer"], saved_count=meta.get("optimizers"), optimizer_format=optimizer_format
        )
        # megatron copies into fp32 main-param views that require grad
        with torch.no_grad(), torch_adam_step_kept(self.optimizer):
            self.optimizer.load_state_dict(optimizer_state)
        set_adam_step(self.optimizer, int(meta["adam_step"]))
        self.num_updates = int(meta["num_updates"])
        self.last_step = int(meta["last_step"])
        if restore:
            restore_rng(state["rng_state"])
        else:
            assert seed is not None
            step = self.last_step + 1  # the run's step of the checkpoint (the actor counts from 0)
            reseed_rng(seed=seed, step=step)
            if self.layout.rank == 0:
                print(
                    f"[actor] RNG states of {describe_sizes(saved_layout or {})} do not map to "
                    f"{describe_sizes(layout_record(self.layout))}: "
                    f"re-derived from seed {seed} and step {step}",
                    flush=True,
                )
        return meta


def _padding_fields(mb: MicroBatch) -> MicroBatch:
    """An empty micro-batch (dataplane/micro_batches.py: the interleaved schedule takes micro-batches in
    whole groups of pp, so a rank with too few sequences gets one) with zero log-prob fields where it has
    none: the loss reads them at no position (its loss mask is all zero), but the same code runs."""
    zeros = torch.zeros(mb.length, dtype=torch.float32)
    return dataclasses.replace(
        mb,
        old_logprobs=zeros if mb.old_logprobs is None else mb.old_logprobs,
        rollout_logprobs=zeros if mb.rollout_logprobs is None else mb.rollout_logprobs,
        ref_logprobs=zeros if mb.ref_logprobs is None else mb.ref_logprobs,
    )
