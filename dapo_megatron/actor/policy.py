"""The model of one rank that scores tokens: per-token log-probs and entropies, weights out, offload.

    with model_parallel(tp=2, seed=42) as layout:        # this rank's ParallelLayout (distributed/layout.py)
        policy = Policy(actor_settings(cfg), hf_dir, layout)  # every rank: built, loaded, frozen
        out = policy.logprobs(samples)                   # LogProbs of every sample, on every rank

Policy is the part of the actor that does not train: the model chunks for this rank's place in the
layout, loaded from the HF checkpoint (and made to compute with the FP8 engines' weights with
actor.quantization_aware), packed into micro-batches (packing.py) and run through megatron's schedule
forward only. The KL reference (ref_policy.py) is a Policy; the trained Actor (actor.py) is a Policy
that wraps the chunks in megatron DDP and adds the optimizer, the train step and checkpoints.

A Policy's chunks are not wrapped in DDP (no contiguous param/grad buffers, no main_grad) and no
optimizer exists; it only runs under torch.no_grad, so no gradient is ever made. Its parameters keep
requires_grad=True although nothing trains them: ATen's matmul picks its kernel by the weight's
requires_grad flag (LinearAlgebra.cpp should_fold: fold to one mm if the 2-D operand requires grad,
else bmm for megatron's [S, 1, H] input strides), and a frozen flag made the reference's log-probs
differ from the actor's in the last bits at TP=2 (measured).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, overload

import torch

from dapo_megatron.actor.attention import HOST_BOUNDS_ATTR
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
from dapo_megatron.actor.moe import MoEShape, moe_shape_of
from dapo_megatron.actor.offload import DeviceMemory, actor_tensors
from dapo_megatron.actor.packing import MicroBatch, PackedShare, pack_batch_micro_batch
from dapo_megatron.actor.routing_replay import (
    make_routing_replay,
    pack_batch_routed_experts,
    validate_batch_routed_experts,
)
from dapo_megatron.actor.settings import ActorSettings
from dapo_megatron.actor.staging import to_device
from dapo_megatron.dataplane.batch import RolloutBatch, exclusive_cumsum, ranges_index
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.dataplane.share import BatchShare, PackSettings, share_of_samples
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.quant.engine_checkpoint import fp8_converter
from dapo_megatron.weights import iter_hf_weights, load_hf_into_model

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel


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


def check_settings(settings: ActorSettings, layout: ParallelLayout) -> None:
    """Refuse settings that do not match the layout model_parallel() made, or fused kernels that cannot run
    here: at construction, not in the middle of a step."""
    ac = settings.actor
    wanted = dict(tp=ac.tp, pp=ac.pp, cp=ac.cp, vpp=ac.vpp, ep=ac.ep, etp=ac.expert_tp)
    if layout.sizes != wanted:
        raise ValueError(
            f"actor: megatron parallel state {layout.sizes} does not match the config's actor.{wanted} "
            "(pass the layout of parallel.model_parallel(tp=cfg.actor.tp, ...))"
        )
    for key in ("fused_logprob", "fused_policy_loss"):
        if getattr(ac, key):
            require_fused_kernels(f"actor.{key}", device_type=coll.compute_device().type)


def check_model(settings: ActorSettings, hf_config, *, hf_dir: Path, moe: MoEShape | None) -> None:
    """What the model's config.json must allow of the actor's settings."""
    ac = settings.actor
    if moe is not None and ac.tp > 1 and not ac.sequence_parallel:
        raise ValueError(
            f"actor.sequence_parallel must be true for the mixture-of-experts model {hf_dir} "
            f"at actor.tp={ac.tp} (megatron-core's MoELayer refuses to train TP without it)"
        )
    if moe is None and ac.routing_replay:
        raise ValueError(
            f"actor.routing_replay=true needs a mixture-of-experts model; {hf_dir}/config.json "
            f"model_type {hf_config.model_type!r} has no router"
        )


def build_loaded_chunks(
    settings: ActorSettings, hf_config, *, hf_dir: Path, layout: ParallelLayout
) -> tuple[list[GPTModel], torch.dtype | None]:
    """This rank's model chunks (one per virtual pipeline stage) with the HF checkpoint loaded, and the
    engines' dtype when the forward computes with the FP8 engines' weights (actor.quantization_aware;
    the LM head weight, read outside the model's forward, is cast to it: Policy._head), else None."""
    ac = settings.actor
    # vocab_divisible_by=1: the vocabulary is padded only up to a multiple of tp (< tp zero rows);
    # the head excludes rows >= vocab_size from the softmax (token_logprobs_entropy(vocab_size=)).
    chunks = build_model_chunks(
        hf_config,
        attention_backend=ac.attention_backend,
        precision=ac.precision,
        sequence_parallel=ac.sequence_parallel,
        recompute=ac.recompute,
        vocab_divisible_by=1,
        attention_kernel=ac.attention_kernel,
        uniform_lengths=True,  # under PP the packing pads a schedule call's micro-batches to one length
    )
    load_hf_into_model(chunks, hf_dir, layout=layout)
    if not ac.quantization_aware:
        return chunks, None
    # which modules are fp8, block and dtype: the engines' checkpoint says (actor/fake_quant.py);
    # trainer/settings.py sets fp8_checkpoint exactly when actor.quantization_aware is on
    assert settings.fp8_checkpoint is not None
    conv = fp8_converter(settings.fp8_checkpoint)
    apply_weight_fake_quant(
        chunks,
        hf_config,
        layout,
        quantized_modules=conv.quantized_modules,
        block=conv.block,
        dtype=conv.dtype,
        quantize_inputs=True,
        cast_unquantized=True,
    )
    return chunks, conv.dtype


class Policy:
    # what megatron's schedule runs: the chunks themselves (the Actor: their DDP wrappers)
    model: list[GPTModel] | list[DistributedDataParallel]

    def __init__(self, settings: ActorSettings, hf_dir: str | Path, layout: ParallelLayout) -> None:
        """Build the model for this rank's place in the (already initialized) parallel layout and load
        the HF checkpoint into it. `layout`: what model_parallel() yields (distributed/layout.py); it must
        match the settings' actor.tp, pp, ..."""
        from transformers import AutoConfig

        self.settings = settings
        self.layout = layout
        check_settings(settings, layout)
        self.hf_dir = Path(hf_dir)
        self.hf_config = AutoConfig.from_pretrained(self.hf_dir)
        self.moe = moe_shape_of(self.hf_config)
        check_model(settings, self.hf_config, hf_dir=self.hf_dir, moe=self.moe)
        self._chunks, self._engine_dtype = build_loaded_chunks(
            settings, self.hf_config, hf_dir=self.hf_dir, layout=layout
        )
        self.routing = make_routing_replay(
            self._chunks, self.hf_config, layout, sequence_parallel=settings.actor.sequence_parallel
        )
        self._routed_batch: RolloutBatch | None = None  # the batch the current pass's micro-batches index
        for chunk in self._chunks:
            chunk.config.calculate_per_token_loss = True  # the Actor's loss is already a global mean (actor.py)
            return_hidden_states(chunk)
        self._attach_to_schedule()

    def _attach_to_schedule(self) -> None:
        """What the schedule runs and what offload moves: the bare chunks, whose host backup stays valid
        (frozen: the weights never change, so later offloads only free the device storage)."""
        self.model = self._chunks
        # a partial, not a lambda over self: no Policy -> memory -> self cycle (the model frees by refcount)
        self.memory = DeviceMemory(functools.partial(actor_tensors, self._chunks, None), frozen=True)

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

    def _require(self, *what: str, action: str) -> None:
        """Refuse an action whose tensors are offloaded clearly, rather than letting megatron touch a
        freed storage."""
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

    def _head_inputs(self, mb: MicroBatch, gpt, output: torch.Tensor, *, positions: torch.Tensor):
        """(hidden [N, H], LM-head weight [V_local, H], targets [N]) at the local response positions
        `positions` (last stage only): what the head, or the one-pass head + loss (actor/head_loss.py), reads."""
        hidden_SH = full_sequence_hidden(
            output, sequence_parallel=self.settings.actor.sequence_parallel, tp_group=self.layout.tp_group
        )[0]  # [1, S, H] -> [S, H]
        targets = to_device(self._local(mb.targets, mb), hidden_SH.device)
        pos = to_device(positions, hidden_SH.device)
        weight = output_weight(gpt)
        if self._engine_dtype is not None:  # actor.quantization_aware: the engines' bf16 LM head
            weight = cast_like_engines(weight, self._engine_dtype)
        return hidden_SH[pos], weight, targets[pos]

    def _head(self, mb: MicroBatch, gpt, output: torch.Tensor, *, positions: torch.Tensor):
        """Log-prob and entropy at the local response positions `positions` (last stage only)."""
        hidden, weight, targets = self._head_inputs(mb, gpt, output, positions=positions)
        return token_logprobs_entropy(
            hidden,
            weight,
            targets,
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

    @overload
    def logprobs(self, data: BatchShare) -> TokenLogProbs: ...
    @overload
    def logprobs(self, data: list[Sample]) -> LogProbs: ...
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
