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

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# guarded_step is looked up at each call (actor_optimizer.guarded_step): tests replace it to read the gradients
# just before the step (tests/helpers_actor.py grads_rank)
import dapo_megatron.actor.optimizer as actor_optimizer
from dapo_megatron.actor.attention import HOST_BOUNDS_ATTR
from dapo_megatron.actor.checkpoint import load_checkpoint, restore_rng, rng_sharded_object, save_checkpoint
from dapo_megatron.actor.context_parallel import merge_from_cp, split_for_cp
from dapo_megatron.actor.fake_quant import apply_weight_fake_quant, cast_like_engines
from dapo_megatron.actor.lm_head import (
    full_sequence_hidden,
    output_weight,
    require_fused_kernels,
    return_hidden_states,
    token_logprobs_entropy,
)
from dapo_megatron.actor.model import build_model_chunks
from dapo_megatron.actor.moe import moe_shape_of
from dapo_megatron.actor.offload import DeviceMemory, actor_tensors
from dapo_megatron.actor.optimizer import (
    adam_step,
    build_lr_schedule,
    build_optimizer,
    init_empty_optimizer_state,
    set_adam_step,
    set_lr_for_step,
)
from dapo_megatron.actor.packing import MicroBatch, PackedShare, pack_batch_micro_batch
from dapo_megatron.actor.routing_replay import (
    make_routing_replay,
    pack_batch_routed_experts,
    validate_batch_routed_experts,
)
from dapo_megatron.actor.settings import ActorSettings
from dapo_megatron.actor.staging import to_device
from dapo_megatron.algo.aggregation import count_loss_units_packed, sequence_token_counts
from dapo_megatron.algo.objective import METRIC_SUMS, PackedTokens, objective, objective_metrics
from dapo_megatron.dataplane.batch import RolloutBatch, exclusive_cumsum, ranges_index
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.dataplane.share import BatchShare, PackSettings, share_of_samples
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.quant.engine_checkpoint import fp8_converter
from dapo_megatron.weights import iter_hf_weights, load_hf_into_model


@dataclass
class LogProbs:
    """Per-sample fp32 tensors over the response tokens (len = len(sample.response_ids)): what
    logprobs() returns for a list of Samples, on every rank."""

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor]
    routing: dict[str, float] = field(default_factory=dict)  # MoE: routing agreement with the engine


@dataclass
class TokenLogProbs:
    """What logprobs() returns for a BatchShare: fp32 [response tokens of the share], in the share's
    order, on the ranks that computed them (the last pipeline stage: every TP and CP rank there);
    None on the other stages."""

    logprobs: torch.Tensor | None
    entropies: torch.Tensor | None
    routing: dict[str, float] = field(default_factory=dict)  # MoE: routing agreement, on every rank


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


class Actor:
    # megatron-core's optimizer and scheduler (untyped: Any to mypy); None on a reference model, whose
    # methods that need them are refused first by _require(..., trains=True)
    optimizer: Any
    lr_schedule: Any

    def __init__(
        self, settings: ActorSettings, hf_dir: str | Path, layout: ParallelLayout, *, frozen: bool = False
    ) -> None:
        """Build the model for this rank's place in the (already initialized) parallel layout, load
        the HF checkpoint into it, wrap it in megatron DDP and build the optimizer. `layout`: what
        model_parallel() yields (distributed/layout.py); it must match the settings' actor.tp, pp, ...

        frozen=True (the KL reference, reference.py): log-probs only; no DDP wrapper (so no
        param/grad buffers, no main_grad), no optimizer; train/save/load refuse."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from transformers import AutoConfig

        self.settings = settings
        self.layout = layout
        self.objective = settings.objective()  # the loss (algo/objective.py); an unknown policy_loss fails here
        ac, opt = settings.actor, settings.optimizer
        wanted = dict(tp=ac.tp, pp=ac.pp, cp=ac.cp, vpp=ac.vpp, ep=ac.ep, etp=ac.tp if ac.etp is None else ac.etp)
        if layout.sizes != wanted:
            raise ValueError(
                f"actor: megatron parallel state {layout.sizes} does not match the config's actor.{wanted} "
                "(pass the layout of parallel.model_parallel(tp=cfg.actor.tp, ...))"
            )
        for key in ("fused_logprob", "fused_policy_loss"):  # fail here, not in the middle of a step
            if getattr(ac, key):
                require_fused_kernels(f"actor.{key}", device_type=coll.compute_device().type)
        self.hf_dir = Path(hf_dir)
        self.hf_config = AutoConfig.from_pretrained(self.hf_dir)

        self.moe = moe_shape_of(self.hf_config)
        if self.moe is not None and ac.tp > 1 and not ac.sequence_parallel:
            raise ValueError(
                f"actor.sequence_parallel must be true for the mixture-of-experts model {self.hf_dir} "
                f"at actor.tp={ac.tp} (megatron-core's MoELayer refuses to train TP without it)"
            )
        if self.moe is None and ac.routing_replay:
            raise ValueError(
                f"actor.routing_replay=true needs a mixture-of-experts model; {self.hf_dir}/config.json "
                f"model_type {self.hf_config.model_type!r} has no router"
            )
        # vocab_divisible_by=1: the vocabulary is padded only up to a multiple of tp (< tp zero rows);
        # the head excludes rows >= vocab_size from the softmax (token_logprobs_entropy(vocab_size=)).
        chunks = build_model_chunks(
            self.hf_config,
            attention_backend=ac.attention_backend,
            precision=ac.precision,
            sequence_parallel=ac.sequence_parallel,
            recompute=ac.recompute,
            vocab_divisible_by=1,
            attention_kernel=ac.attention_kernel,
        )
        load_hf_into_model(chunks, self.hf_dir, layout=layout)
        self._engine_dtype: torch.dtype | None = None
        if ac.quantization_aware:  # every forward multiplies by the FP8 engines' weights (actor/fake_quant.py)
            # which modules are fp8, block and dtype: the engines' checkpoint says
            # trainer/settings.py sets fp8_checkpoint exactly when actor.quantization_aware is on
            assert settings.fp8_checkpoint is not None
            conv = fp8_converter(settings.fp8_checkpoint)
            apply_weight_fake_quant(
                chunks,
                self.hf_config,
                layout,
                quantized_modules=conv.quantized_modules,
                block=conv.block,
                dtype=conv.dtype,
                quantize_inputs=True,
                cast_unquantized=True,
            )
            self._engine_dtype = conv.dtype  # the LM head weight, read outside the model's forward: _head
        self._chunks = chunks

        self.routing = make_routing_replay(chunks, self.hf_config, layout, sequence_parallel=ac.sequence_parallel)
        self._routed_batch: RolloutBatch | None = None  # the batch the current pass's micro-batches index
        for chunk in chunks:
            chunk.config.calculate_per_token_loss = True  # see the module docstring
            return_hidden_states(chunk)
        self.frozen = frozen
        self.num_updates = 0
        self.last_step = -1
        if frozen:
            # Parameters keep requires_grad=True although nothing ever trains them (logprobs runs
            # under no_grad, so no .grad is made): ATen's matmul picks its kernel by the weight's
            # requires_grad flag (LinearAlgebra.cpp should_fold: fold to one mm if the 2-D operand
            # requires grad, else bmm for megatron's [S, 1, H] input strides), and a frozen flag made
            # the reference's log-probs differ from the actor's in the last bits at TP=2 (measured).
            self.model, self.optimizer, self.lr_schedule = chunks, None, None  # reference model: nothing trains
            # a partial, not a lambda over self: no Actor -> memory -> self cycle (the actor frees by refcount)
            self.memory = DeviceMemory(functools.partial(actor_tensors, chunks, None), frozen=True)
            return
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=ac.use_distributed_optimizer,
            average_in_collective=False,
        )
        self.model = [
            DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)
        ]
        self.optimizer = build_optimizer(
            self.model,
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            adam_beta1=opt.adam_beta1,
            adam_beta2=opt.adam_beta2,
            grad_clip=opt.grad_clip,
            precision=ac.precision,
            use_distributed_optimizer=ac.use_distributed_optimizer,
        )
        self.lr_schedule = build_lr_schedule(
            self.optimizer,
            lr=opt.lr,
            warmup_steps=opt.warmup_steps,
            weight_decay=opt.weight_decay,
            decay_style=opt.lr_decay_style,
            min_lr=opt.min_lr,
            total_steps=opt.total_steps,
        )
        config = chunks[0].config
        config.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        config.grad_scale_func = self.optimizer.scale_loss
        # The loss is already divided by the global count: finalize without megatron's token count.
        config.finalize_model_grads_func = lambda model, num_tokens, **kw: finalize_model_grads(model, None, **kw)
        for chunk in chunks[1:]:
            chunk.config.no_sync_func = config.no_sync_func
            chunk.config.grad_scale_func = config.grad_scale_func
            chunk.config.finalize_model_grads_func = config.finalize_model_grads_func
        # chunks and optimizer are never rebound; a lambda over self made a reference cycle that kept the model's
        # device memory until the next garbage collection (benchmarks/actor.py builds one actor per row)
        self.memory = DeviceMemory(functools.partial(actor_tensors, chunks, self.optimizer))

    def close(self) -> None:
        """Unhook this actor from its chunks' TransformerConfig, for a process that builds one actor after
        another (benchmarks/actor.py): no_sync_func, grad_scale_func and finalize_model_grads_func reference
        the DDP wrappers and the optimizer, and with them set the model survived `del actor` and
        gc.collect() (measured on CPU, megatron-core 0.16.1). Then: drop the references, gc.collect(),
        torch.cuda.empty_cache(). The actor is unusable afterwards."""
        for chunk in self._chunks:
            for key in ("no_sync_func", "grad_scale_func", "finalize_model_grads_func"):
                setattr(chunk.config, key, None)

    # --- device memory (offload.py) ------------------------------------------------------------------

    def offload(self, *what: str, keep_grads: bool = False) -> None:
        """Free the device memory of "params", "grads", "optimizer" (all without arguments) into a host
        backup; gradients are dropped (zeros on onload) unless keep_grads. Local to this rank."""
        self.memory.offload(*what, keep_grads=keep_grads)

    def onload(self, *what: str) -> None:
        """Bring back what offload freed (all without arguments), bit for bit."""
        self.memory.onload(*what)

    def resident_bytes(self) -> dict[str, int]:
        """{"params", "grads", "optimizer": bytes of device storage held now} on this rank."""
        return self.memory.resident_bytes()

    def _require(self, *what: str, action: str, trains: bool = False) -> None:
        """Refuse an action whose tensors are offloaded (or, with trains, a frozen actor) clearly,
        rather than letting megatron touch a freed storage."""
        if self.frozen and trains:
            raise RuntimeError(f"Actor.{action}: this actor is frozen (the reference model): log-probs only")
        missing = [c for c in what if c in self.memory.offloaded()]
        if missing:
            raise RuntimeError(f"Actor.{action}: {', '.join(missing)} offloaded; call actor.onload() first")

    # --- accessors ---------------------------------------------------------------------------------

    @property
    def model_chunks(self) -> list:
        """This rank's GPTModel chunks (unwrapped; one per virtual pipeline stage)."""
        return self._chunks

    def export_chunks(self) -> list:
        """The model chunks the per-stage weight export reads (transfer/stage_export.py:
        actor_exporter); refused while the parameters are offloaded."""
        self._require("params", action="export_chunks")
        return self._chunks

    def iter_hf_weights(self):
        """Every full HF-named tensor on EVERY rank (collective; the weights layer's iter_hf_weights):
        for tests and tools that compare weights; the training loop uses transfer/stage_export.py."""
        self._require("params", action="iter_hf_weights")
        return iter_hf_weights(self._chunks, self.hf_config, layout=self.layout)

    # --- packing and the forward ---------------------------------------------------------------------

    @property
    def pack_settings(self) -> PackSettings:
        """How this actor packs sequences (the driver plans every DP rank's share with the same)."""
        return PackSettings.for_layout(
            micro_batch_tokens=self.settings.actor.micro_batch_tokens,
            tp=self.layout.tp_size,
            pp=self.layout.pp_size,
            cp=self.layout.cp_size,
            vpp=self.layout.vpp_size,
            sequence_parallel=self.settings.actor.sequence_parallel,
        )

    def _share_of(self, data: BatchShare | list[Sample]) -> BatchShare:
        if isinstance(data, BatchShare):
            return data
        return share_of_samples(
            list(data), settings=self.pack_settings, dp_size=self.layout.dp_size, dp_rank=self.layout.dp_rank
        )

    def _pack(self, mini: BatchShare, *, mask_truncated: bool) -> PackedShare:
        """The micro-batches of one mini-batch of this rank's share."""
        settings = self.pack_settings
        pad_token = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        micro_batches = [
            pack_batch_micro_batch(
                mini.batch,
                a,
                b,
                length=length,
                seq_pad_multiple=settings.seq_pad_multiple,
                pad_token_id=pad_token,
                mask_truncated=mask_truncated,
            )
            for a, b, length in mini.micro_batch_spans(settings)
        ]
        shared = int(mini.mini_batch_lengths[0])
        return PackedShare(micro_batches=micro_batches, num_micro_batches=len(micro_batches), length=shared or None)

    def _holds_results(self) -> bool:
        return self.layout.is_last_stage

    def _local(self, tensor: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """This CP rank's tokens of a packed [T] tensor (identity without CP)."""
        return split_for_cp(tensor, mb.cu_seqlens_padded, cp_size=self.layout.cp_size, cp_rank=self.layout.cp_rank)

    def _forward_step(self, data_iterator, model, *, head):
        from megatron.core.packed_seq_params import PackedSeqParams

        mb = next(data_iterator)
        device = coll.compute_device()
        # Every padded segment (padding tail included) is one THD sequence; padding sits after the
        # real tokens of its sequence, so causal attention keeps it out of every real token's context.
        # No host sync per micro-batch: the lengths are read from the host tensor, the copies are pinned and
        # non-blocking (staging.py), and the attention reads the boundaries from the host copy attached here
        host_cu = mb.cu_seqlens_padded
        max_len = int((host_cu[1:] - host_cu[:-1]).max())
        cu = to_device(host_cu, device)
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
        )
        setattr(packed, HOST_BOUNDS_ATTR, host_cu)
        tokens = to_device(self._local(mb.tokens, mb), device)[None]
        positions = to_device(self._local(mb.position_ids, mb), device)[None]
        if self._routed_batch is not None:
            self._set_routing(_unwrap(model), mb)
        output = model(tokens, positions, None, packed_seq_params=packed)
        return output, functools.partial(head, mb, _unwrap(model))

    def _set_routing(self, chunk, mb: MicroBatch) -> None:
        """The engine's experts of this micro-batch for the chunk's routers (routing_replay.py)."""
        routing, batch = self.routing, self._routed_batch
        assert routing is not None and batch is not None  # set together by _begin_routing
        experts, valid = pack_batch_routed_experts(
            batch,
            mb.sample_indices,
            mb.seq_lengths_padded,
            length=mb.length,
            num_layers=routing.num_layers,
            topk=routing.topk,
        )
        routing.before_forward(chunk, experts, valid, lambda t: self._local(t, mb))

    def _begin_routing(self, batch: RolloutBatch, *, measure: bool) -> None:
        """Before a pass: replay the engine's experts (actor.routing_replay) and/or measure agreement.
        The engine's experts travel with the batch (token_fields["routed_experts"], dataplane/sample.py)."""
        replay = self.settings.actor.routing_replay
        measure = measure and self.routing is not None and "routed_experts" in batch.token_fields
        if replay:
            assert self.routing is not None, "actor.routing_replay on a model without routers (config.py rejects it)"
            validate_batch_routed_experts(batch, num_layers=self.routing.num_layers, topk=self.routing.topk)
        if self.routing is None or not (replay or measure):
            self._routed_batch = None
            return
        self.routing.begin(replay=replay, measure=measure)
        self._routed_batch = batch

    def _end_routing(self, *, collect: bool = True) -> dict[str, float]:
        """After a pass: routers back to normal routing; the agreement metrics (collective) unless
        the pass failed (collect=False: no collective on an error path)."""
        if self._routed_batch is None:
            return {}
        self._routed_batch = None
        assert self.routing is not None  # a routed batch is only kept with routers (_begin_routing)
        return self.routing.end(collect=collect)

    def _head(self, mb: MicroBatch, gpt, output: torch.Tensor, *, positions: torch.Tensor):
        """Log-prob and entropy at the local response positions `positions` (last stage only)."""
        hidden_SH = full_sequence_hidden(
            output, sequence_parallel=self.settings.actor.sequence_parallel, tp_group=self.layout.tp_group
        )[0]  # [1, S, H] -> [S, H]
        targets = to_device(self._local(mb.targets, mb), hidden_SH.device)
        pos = to_device(positions, hidden_SH.device)
        weight = output_weight(gpt)
        if self._engine_dtype is not None:  # actor.quantization_aware: the engines' bf16 LM head
            weight = cast_like_engines(weight, self._engine_dtype)
        return token_logprobs_entropy(
            hidden_SH[pos],
            weight,
            targets[pos],
            temperature=self.settings.temperature,
            tp_group=self.layout.tp_group,
            vocab_size=self.hf_config.vocab_size,
            fused=self.settings.actor.fused_logprob,
        )

    def _run(self, micro_batches: list[MicroBatch], *, head, length: int | None, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        iterators = [iter(micro_batches) for _ in self.model]
        return get_forward_backward_func()(
            forward_step_func=functools.partial(self._forward_step, head=head),
            data_iterator=iterators if len(self.model) > 1 else iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(micro_batches),
            seq_length=length or max(mb.length for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _owns_results(self) -> bool:
        """The ranks whose loss-function outputs are summed into results: last pipeline stage,
        TP rank 0 (TP ranks hold identical copies), every DP and CP rank (disjoint tokens)."""
        return self.layout.is_last_stage and self.layout.tp_rank == 0

    def _merge_cp(self, local_outputs: list[torch.Tensor], micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Per-micro-batch [C, T/cp] outputs of this CP rank -> [C, T] in packed token order, on every
        rank of the CP group (a last-stage call: the CP group lies inside one pipeline stage).

        One all-gather over the CP group for all micro-batches together; the values stay within
        the group that computed them (issue 12: results are reduced only within the groups that
        hold them). Identity without CP."""
        cp = self.layout.cp_size
        if cp == 1:
            return local_outputs
        flat = torch.cat(local_outputs, dim=1).contiguous()
        parts = [torch.empty_like(flat) for _ in range(cp)]
        coll.all_gather(parts, flat, group=self.layout.cp_group)
        widths = [out.size(1) for out in local_outputs]
        per_rank = [part.split(widths, dim=1) for part in parts]
        return [
            merge_from_cp([per_rank[r][i] for r in range(cp)], mb.cu_seqlens_padded, dim=1)
            for i, mb in enumerate(micro_batches)
        ]

    # --- log-probs -----------------------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, data: BatchShare | list[Sample]) -> TokenLogProbs | LogProbs:
        """pi_theta log-probs and entropies of every response token (at rollout.temperature), fp32.

        Collective over the model's ranks. A BatchShare: TokenLogProbs of this DP rank's share, on
        the last pipeline stage (with CP, each CP rank scores its chunks and the CP group merges
        them: _merge_cp); nothing is reduced beyond the groups that computed the values. A list of
        Samples (the same on every rank; tests and tools): LogProbs of every sample on every rank.
        """
        if isinstance(data, BatchShare):
            return self._share_logprobs(data)
        return self._gathered_logprobs(list(data))

    def _share_logprobs(self, share: BatchShare) -> TokenLogProbs:
        """Over the same micro-batches as the updates (one schedule per mini-batch), so that the
        first update of a step reproduces these values bit for bit."""
        self._require("params", action="logprobs")
        for m in self.model:
            m.eval()

        def head(mb, gpt, output):
            pos = self._local(mb.response_mask, mb).nonzero()[:, 0]
            logprob, entropy = self._head(mb, gpt, output, positions=pos)
            # this rank's tokens (its CP chunks, in local order); _merge_cp restores packed positions
            local = torch.zeros(2, mb.length // self.layout.cp_size, dtype=torch.float32, device=logprob.device)
            index = to_device(pos, logprob.device)
            local[0, index] = logprob.float()
            local[1, index] = entropy.float()
            return torch.zeros((), device=logprob.device), torch.tensor(0, dtype=torch.int), local

        holds = self._holds_results()
        values = []
        self._begin_routing(share.batch, measure=True)
        try:
            for mini in share.mini_batches():
                if self._routed_batch is not None:  # the micro-batches of this pass index the mini-batch
                    self._routed_batch = mini.batch
                packed = self._pack(mini, mask_truncated=False)
                outputs = self._run(packed.micro_batches, head=head, length=packed.length, forward_only=True)
                if holds:
                    outputs = self._merge_cp(outputs, packed.micro_batches)
                    # response positions in packed order = the share's response-token order
                    # (host-side positions: a boolean mask on the device would be a nonzero(), a sync)
                    values += [
                        full[:, to_device(mb.response_mask.nonzero()[:, 0], full.device)]
                        for mb, full in zip(packed.micro_batches, outputs)
                    ]
        except BaseException:
            self._end_routing(collect=False)
            raise
        routing = self._end_routing()  # a world collective (every rank measured its own tokens)
        if not holds:
            return TokenLogProbs(logprobs=None, entropies=None, routing=routing)
        flat = torch.cat(values, dim=1).cpu() if values else torch.zeros(2, 0)
        return TokenLogProbs(logprobs=flat[0].contiguous(), entropies=flat[1].contiguous(), routing=routing)

    def _gathered_logprobs(self, samples: list[Sample]) -> LogProbs:
        """Every sample's values on every rank: this rank's share scored, then one world all-reduce of
        a [2, response tokens of the list] buffer that only the reporting ranks (last stage, TP and
        CP rank 0) fill (adding zeros is exact: the values are bit for bit those computed). For
        tests and tools; the training loop keeps log-probs where they were computed."""
        share = self._share_of(samples)
        out = self._share_logprobs(share)
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.int64)
        offsets = exclusive_cumsum(lengths)
        device = coll.compute_device()
        flat = torch.zeros(2, int(offsets[-1]), dtype=torch.float32, device=device)
        if self._holds_results() and self.layout.tp_rank == 0 and self.layout.cp_rank == 0 and share.num_mini_batches:
            index = ranges_index(offsets[share.source_indices], share.batch.response_lengths).to(flat.device)
            assert out.logprobs is not None and out.entropies is not None  # this rank holds results
            flat[0, index] = out.logprobs.to(flat.device)
            flat[1, index] = out.entropies.to(flat.device)
        coll.all_reduce(flat)
        flat = flat.cpu()
        bounds = offsets.tolist()
        return LogProbs(
            logprobs=[flat[0, a:b].clone() for a, b in zip(bounds, bounds[1:])],
            entropies=[flat[1, a:b].clone() for a, b in zip(bounds, bounds[1:])],
            routing=out.routing,
        )

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
        al = self.settings.algorithm
        self._require("params", "grads", "optimizer", action="train", trains=True)
        mini = self._share_of(mini_batch)
        if mini.num_mini_batches != 1:
            raise ValueError(
                f"Actor.train: one mini-batch per update, got {mini.num_mini_batches} "
                "(iterate BatchShare.mini_batches())"
            )
        self._check_train_inputs(mini.batch)
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        share = self._pack(mini, mask_truncated=al.overlong_filter)
        denom = self._global_denominator(share.micro_batches)
        device = coll.compute_device()
        sums = torch.zeros(len(METRIC_SUMS), dtype=torch.float64, device=device)
        ratio_max = torch.zeros((), dtype=torch.float64, device=device)

        def head(mb, gpt, output):
            nonlocal ratio_max
            pos = self._local(mb.response_mask, mb).nonzero()[:, 0]
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
        loss_is_finite = bool(torch.isfinite(sums[0]))
        if denom == 0:
            self.optimizer.zero_grad()
            updated, grad_norm = False, 0.0
        else:
            updated, grad_norm = actor_optimizer.guarded_step(
                self.optimizer, grad_clip=self.settings.optimizer.grad_clip, loss_is_finite=loss_is_finite
            )
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

    def _check_train_inputs(self, batch: RolloutBatch) -> None:
        """The loss runs on the last pipeline stage: the per-token inputs it reads must be there."""
        al = self.settings.algorithm
        if not self._holds_results() or batch.num_sequences == 0:
            return
        if batch.old_logprobs is None:
            raise ValueError("Actor.train: old_logprobs missing (fill them from Actor.logprobs before train)")
        if al.tis_cap is not None and batch.rollout_logprobs is None:
            raise ValueError(f"Actor.train: rollout_logprobs missing but algorithm.tis_cap={al.tis_cap} needs them")
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
        dev = logprob.device

        def take(t: torch.Tensor) -> torch.Tensor:
            return to_device(self._local(t, mb)[pos.cpu()], dev)

        def take_optional(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else take(t)

        assert mb.old_logprobs is not None  # _check_train_inputs: the loss's stage has them

        wants = self.objective
        # n_seq(t) over the whole micro-batch, before the CP split (seq-mean-token-mean's weight)
        sequence_tokens = (
            sequence_token_counts(mb.loss_mask, mb.seq_ids, mb.num_sequences) if wants.reads_sequence_tokens else None
        )
        tokens = PackedTokens(
            logprob=logprob,
            entropy=entropy,
            old_logprob=take(mb.old_logprobs),
            advantages=take(mb.advantages),
            loss_mask=take(mb.loss_mask),
            seq_ids=take(mb.seq_ids),
            num_sequences=mb.num_sequences,
            sequence_tokens=take_optional(sequence_tokens),
            rollout_logprobs=take_optional(mb.rollout_logprobs) if wants.reads_rollout_logprobs else None,
            ref_logprobs=take_optional(mb.ref_logprobs) if wants.reads_ref_logprobs else None,
        )
        return objective(tokens, self.objective, loss_denominator=denom)

    # --- checkpoints ---------------------------------------------------------------------------------

    def _sharded_state_dict(self, *, is_loading: bool) -> dict:
        state = {}
        for index, chunk in enumerate(self._chunks):
            state["model" if len(self._chunks) == 1 else f"model{index}"] = chunk.sharded_state_dict()
        # dp_reshardable: every rank writes its own optimizer shard (megatron 0.16's default
        # "fully_sharded_model_space" needs ShardedTensor.flattened_range, which 0.16.1 rejects);
        # a checkpoint can be resumed with another DP size but the same TP x PP.
        state["optimizer"] = self.optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
        )
        state["rng_state"] = rng_sharded_object(self.layout)
        return state

    def save(self, path: str | Path) -> Path:
        """Collective: model + optimizer + RNG (megatron dist_checkpointing) + actor_state.json,
        written to `<path>.tmp` and renamed (checkpoint.py)."""
        self._require("params", "optimizer", action="save", trains=True)
        meta = {
            "num_updates": self.num_updates,
            "last_step": self.last_step,
            "adam_step": adam_step(self.optimizer),
            "lr_schedule": self.lr_schedule.state_dict(),
            "layout": {
                "tp": self.layout.tp_size,
                "pp": self.layout.pp_size,
                "cp": self.layout.cp_size,
                "dp": self.layout.dp_size,
                "vpp": self.layout.vpp_size,
            },
        }
        return save_checkpoint(path, sharded_state_dict=self._sharded_state_dict(is_loading=False), meta=meta)

    def load(self, path: str | Path) -> dict:
        """Collective: restore what save() wrote; returns its actor_state.json."""
        self._require("params", "optimizer", action="load", trains=True)
        init_empty_optimizer_state(self.optimizer)
        state, meta = load_checkpoint(path, sharded_state_dict=self._sharded_state_dict(is_loading=True))
        for index, chunk in enumerate(self._chunks):
            chunk.load_state_dict(state["model" if len(self._chunks) == 1 else f"model{index}"], strict=False)
        with torch.no_grad():  # megatron copies into fp32 main-param views that require grad
            self.optimizer.load_state_dict(state["optimizer"])
        set_adam_step(self.optimizer, int(meta["adam_step"]))
        restore_rng(state["rng_state"])
        self.num_updates = int(meta["num_updates"])
        self.last_step = int(meta["last_step"])
        return meta
