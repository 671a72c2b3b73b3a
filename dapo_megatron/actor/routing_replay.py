"""Routing replay (R3) and routing agreement in the actor's forward passes (Qwen3-MoE).

The problem: the rollout engine and the trainer compute the router logits with different kernels,
batch shapes and precisions, so near-ties between experts go different ways, the two policies send
the same token through different experts, and pi_old / pi_rollout and the importance ratios drift.
R3 ("rollout routing replay", arXiv 2510.11370; slime's --use-rollout-routing-replay,
slime/utils/routing_replay.py; verl's router_replay mode "R3", verl/utils/megatron/router_replay_patch.py)
makes the trainer route every token to the experts the engine used: the router still computes its
scores, but the top-k indices are the engine's, and the gate weights are the trainer's scores
gathered at those experts (so gradients still reach the router).

Here: megatron-core 0.16.1's own hook. With config.moe_enable_routing_replay (set by actor/moe.py)
every TopKRouter owns a RouterReplay (transformer/moe/router_replay.py); with the action
REPLAY_FORWARD, topk_routing_with_score_function takes `target_topk_idx` instead of computing
top-k. Before each chunk's forward of each micro-batch (Actor._forward_step) this module sets,
for every router of that chunk, the engine's experts of that micro-batch's local tokens (after the
context-parallel split and the sequence-parallel split, in the order the router sees them). It is
set right before the call that uses it, so any pipeline schedule works; with full recompute the
backward's recomputation runs right after the forward at pp=1 and finds the same targets (pp>1 is
refused by the config). Tokens without engine data (the last token of each sequence, which the
engine never fed to its model, and padding) get experts 0..k-1: their outputs feed no log-prob.

Agreement (logged every step, replay on or off): a forward hook on each router recomputes the
router's own top-k from its input (one [T, H] x [H, E] matmul per layer, in the old-log-prob pass
only) and compares it with the engine's for every token the engine reported:
  routing/agreement    mean over tokens and MoE layers of |top-k_trainer ∩ top-k_engine| / k
  routing/exact_match  fraction of (token, layer) pairs whose k experts are the same set
With replay on, the trainer's own choice at layer l is made on hidden states that replayed layers
< l, so the numbers measure the routers' disagreement layer by layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from dapo_megatron.actor.moe import moe_shape_of
from dapo_megatron.actor.staging import to_device
from dapo_megatron.dataplane.batch import RolloutBatch, exclusive_cumsum, ranges_index
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.layout import ParallelLayout

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router import TopKRouter
    from transformers import PretrainedConfig


def validate_batch_routed_experts(batch: RolloutBatch, *, num_layers: int, topk: int) -> None:
    """ValueError naming the sequence of a RolloutBatch (dataplane/batch.py) whose tokens carry no
    engine experts, or a width the model does not have (each sample's rows were checked against its
    tokens when the batch was built: RolloutBatch.from_samples)."""
    experts = batch.token_fields.get("routed_experts")
    if experts is None:
        raise ValueError(
            "the batch carries no routed_experts but actor.routing_replay=true needs the engine's experts "
            "(rollout.return_routed_experts=true; SGLang: --enable-return-routed-experts)"
        )
    if experts.shape[-1] != num_layers * topk:
        raise ValueError(
            f"routed_experts has {experts.shape[-1]} ids per token, the model needs {num_layers * topk} "
            f"(layers {num_layers} x top-k {topk})"
        )
    first_rows = batch.seq_offsets[:-1]
    missing = (experts[first_rows, 0] < 0).nonzero()[:, 0] if batch.num_sequences else torch.zeros(0)
    if missing.numel():
        raise ValueError(
            f"sequence {int(missing[0])} of the batch: routed_experts is None but "
            "actor.routing_replay=true needs the engine's experts of every sequence "
            "(rollout.return_routed_experts=true)"
        )


def pack_batch_routed_experts(
    batch: RolloutBatch,
    sample_indices: Sequence[int],
    seq_lengths_padded: Sequence[int],
    *,
    length: int,
    num_layers: int,
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's experts of one packed micro-batch, aligned with its tokens (packing.py layout):
    ([length, num_layers, topk] int64, [length] bool: the engine reported this token), for
    sequences `sample_indices` (a consecutive run) of a RolloutBatch whose
    token_fields["routed_experts"] holds the engine's experts per token (-1: none reported)."""
    experts = torch.arange(topk, dtype=torch.int64).expand(length, num_layers, topk).clone()
    valid = torch.zeros(length, dtype=torch.bool)
    if not len(sample_indices):
        return experts, valid
    first, count = int(sample_indices[0]), len(sample_indices)
    if list(sample_indices) != list(range(first, first + count)):  # pack_batch_micro_batch's contract
        raise AssertionError(f"micro-batch sequences are not consecutive: {list(sample_indices)}")
    part = batch.narrow(first, count)
    lens = part.seq_lengths.to(torch.int64)
    dst = ranges_index(exclusive_cumsum(torch.tensor(list(seq_lengths_padded), dtype=torch.int64))[:-1], lens)
    rows = part.token_fields["routed_experts"].to(torch.int64)
    reported = rows[:, 0] >= 0
    experts[dst[reported]] = rows[reported].view(-1, num_layers, topk)
    valid[dst[reported]] = True
    return experts, valid


def _moe_routers(chunk: GPTModel) -> list[tuple[int, TopKRouter]]:
    """(global layer index, TopKRouter) of every MoE layer of one unwrapped GPTModel chunk."""
    out = []
    for layer in chunk.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            out.append((layer.layer_number - 1, router))  # megatron numbers layers from 1
    return out


class RoutingReplay:
    """Drives the routers of one Actor's model chunks: replay (R3) and the agreement counters."""

    def __init__(
        self, chunks: Sequence[GPTModel], layout: ParallelLayout, *, num_layers: int, topk: int, sequence_parallel: bool
    ) -> None:
        self.layout = layout
        self.num_layers, self.topk = num_layers, topk
        self.sequence_parallel = sequence_parallel
        self.routers = {id(chunk): _moe_routers(chunk) for chunk in chunks}
        # TP ranks without SP see the same tokens: only TP rank 0 counts them
        self.counts_tokens = sequence_parallel or layout.tp_rank == 0
        self._current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # router id -> (engine [t, k], valid [t])
        self._measure = False
        # overlap, exact, tokens: summed on the routers' device over the pass, read once in end()
        self._counts: torch.Tensor | None = None
        for routers in self.routers.values():
            for _, router in routers:
                router.register_forward_hook(self._compare)

    # --- one pass (old log-probs or one train step) ---------------------------------------------------

    def begin(self, *, replay: bool, measure: bool) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._measure = measure
        self._replay = replay
        self._counts = None
        action = RouterReplayAction.REPLAY_FORWARD if replay else None
        for routers in self.routers.values():
            for _, router in routers:
                router.router_replay.clear_indices()
                if action is None:
                    router.router_replay.clear_router_replay_action()
                else:
                    router.router_replay.set_router_replay_action(action)

    def before_forward(
        self,
        chunk: torch.nn.Module,
        experts: torch.Tensor,
        valid: torch.Tensor,
        local: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Targets of this chunk's routers for one micro-batch: experts [T, L, k] and valid [T] of the
        packed tokens; `local` cuts a [T, ...] tensor to this CP rank's tokens."""
        if not (self._replay or self._measure):
            return
        routers = self.routers.get(id(chunk), [])
        if not routers:
            return
        experts, valid = local(experts), local(valid)
        if self.sequence_parallel:  # the MoE layer sees this TP rank's contiguous slice of the sequence
            tp, rank = self.layout.tp_size, self.layout.tp_rank
            experts, valid = experts.chunk(tp)[rank], valid.chunk(tp)[rank]
        # once per micro-batch to the routers' device (pinned, non-blocking): megatron's replay and the
        # agreement counters then find them there, no copy per router in either direction
        device = next(routers[0][1].parameters()).device
        experts, valid = to_device(experts.contiguous(), device), to_device(valid.contiguous(), device)
        for layer, router in routers:
            target = experts[:, layer].contiguous()
            if self._replay:
                router.router_replay.target_topk_idx = None
                router.router_replay.replay_backward_list.clear()  # set_target_indices appends to it
                router.router_replay.set_target_indices(target)
            self._current[id(router)] = (target, valid)

    def _compare(self, router: TopKRouter, args: tuple[torch.Tensor, ...], output: object) -> None:
        if not self._measure or id(router) not in self._current:
            return
        engine, valid = self._current[id(router)]
        with torch.no_grad():
            logits = router.gating(args[0]).view(-1, router.config.num_moe_experts)
            own = torch.topk(logits, k=self.topk, dim=-1).indices
        if own.shape[0] != engine.shape[0]:  # internal invariant: the split above matches the router's input
            raise AssertionError(f"routing replay: router saw {own.shape[0]} tokens, targets hold {engine.shape[0]}")
        if self.counts_tokens:
            counts = agreement_counts(own, engine, valid, topk=self.topk)
            self._counts = counts if self._counts is None else self._counts + counts

    def end(self, *, collect: bool = True) -> dict[str, float]:
        """Clear every router (no replay outside a pass); the pass's agreement metrics, summed over
        all ranks (a collective when it measured and `collect`), or {}."""
        for routers in self.routers.values():
            for _, router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
        self._current.clear()
        measured, self._measure = self._measure, False
        if not (measured and collect):
            return {}
        counts = self._counts if self._counts is not None else torch.zeros(3, dtype=torch.float64)
        self._counts = None
        coll.all_reduce(counts)  # staged to the backend's device by the helper
        overlap, exact, tokens = counts.tolist()  # the pass's one host read
        if tokens == 0:
            return {}
        return {
            "routing/agreement": overlap / (tokens * self.topk),
            "routing/exact_match": exact / tokens,
            "routing/token_layers": tokens,
        }


def agreement_counts(own: torch.Tensor, engine: torch.Tensor, valid: torch.Tensor, *, topk: int) -> torch.Tensor:
    """[overlap, exact, tokens] float64 on own's device: over the tokens with valid [t], the experts own
    [t, k] has in common with engine [t, k], the tokens where all k agree, and the token count. Masks
    multiply instead of indexing (boolean indexing is a nonzero(): a device-to-host sync)."""
    overlap = (own[:, :, None] == engine.to(own.dtype)[:, None, :]).any(-1).sum(-1)
    valid = valid.to(torch.bool)
    return torch.stack([(overlap * valid).sum(), ((overlap == topk) & valid).sum(), valid.sum()]).to(torch.float64)


def make_routing_replay(
    chunks: Sequence[GPTModel], hf_config: PretrainedConfig, layout: ParallelLayout, *, sequence_parallel: bool
) -> RoutingReplay | None:
    """A RoutingReplay for a MoE model's chunks, None for a dense model."""
    shape = moe_shape_of(hf_config)
    if shape is None:
        return None
    return RoutingReplay(
        chunks, layout, num_layers=hf_config.num_hidden_layers, topk=shape.topk, sequence_parallel=sequence_parallel
    )
