"""Per-GPU memory of every phase of a DAPO step, in both placements, against the GPU's memory.

    plan = build_plan(cfg)
    plan.peak, plan.limit, plan.fits, plan.problems       # configured placement (rollout.placement)
    plan.tables["colocated"], plan.tables["disaggregated"]  # GpuTable: rows x phases, bytes

Phases of one step (trainer/train.py; docs/architecture.md, "One training step") and what is on a GPU in each:
  rollout         engines generate. colocated: the actor is offloaded (parameters, gradients and
                  optimizer state on the host); the engine holds mem_fraction_static of the GPU
                  (weights + KV cache) plus its runtime reserve. disaggregated: trainer GPUs idle with
                  the actor resident; engines on their own GPUs.
  log-prob        old (and reference) log-probs, forward only. colocated: the engine has released its
                  weights, KV cache and CUDA graphs; the actor is onloaded (all of it, once, before this
                  phase); the frozen reference model is onloaded for its pass and offloaded after.
  train           forward/backward of every micro-batch: activations of the micro-batches in flight
                  on the pipeline stage (1F1B: pp - stage; interleaved: megatron's warm-up count + 1).
  optimizer step  activations freed; the optimizer's temporaries (torch AdamW's foreach sqrt copy,
                  only without TE's FusedAdam).
  transfer        weights to the engines. colocated: the actor keeps only its weights (gradients and
                  optimizer state offloaded), the engine has resumed its weights (not yet its KV cache),
                  buckets of full HF tensors move by CUDA IPC. disaggregated: broadcast buckets.
The peak per GPU is the largest phase total over pipeline stages (and DP ranks, which differ by
padding); `fits` compares it with slurm.gpu_memory_gb.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from dapo_megatron.memplan.activations import ActivationModel
from dapo_megatron.memplan.arch import ModelDims, model_dims_for
from dapo_megatron.memplan.checkpoint_cost import CheckpointCost, checkpoint_cost, host_memory_problems
from dapo_megatron.memplan.engine import ENGINE_CONTEXT_BYTES, GIB, EngineMemory, engine_memory
from dapo_megatron.memplan.static import (
    PARAM_BYTES,
    Layout,
    frozen_weight_bytes,
    layers_per_chunk,
    total_params,
    worst_static,
)
from dapo_megatron.memplan.sync_time import Engines, Links, SyncTime, copy_device_for, sync_time

PHASES = ("rollout", "log-prob", "train", "optimizer step", "transfer")
# CUDA context (~0.5 GiB) + NCCL communicator buffers of the trainer's TP/PP/DP/CP groups: an allowance,
# not a measurement (no GPU in this project's CI); see docs/memory.md.
TRAINER_RUNTIME_BYTES = 2 * GIB
# Mixture of experts: the token-expert pairs the most loaded EP rank receives in a micro-batch, as a multiple
# of the balanced share (routing is data-dependent; megatron drops nothing without a capacity factor, and RL
# trains without the load-balancing loss): an allowance, not a measurement (docs/memory.md)
MOE_EXPERT_LOAD_ALLOWANCE = 2.0


# display order of the rows (by prefix): actor state, activations, transients, runtime, engine
ROW_ORDER = (
    "actor weights",
    "actor gradients",
    "actor fp32 master",
    "actor Adam",
    "reference model",
    "activations saved",
    "logits path",
    "working set",
    "log-prob outputs",
    "optimizer step",
    "weight transfer",
    "RoPE table",
    "trainer runtime",
    "engine weights",
    "engine KV",
    "engine runtime",
    "engine process",
    "engine weight receive",
)


def _row_rank(name: str) -> int:
    return next((i for i, prefix in enumerate(ROW_ORDER) if name.startswith(prefix)), len(ROW_ORDER))


@dataclass
class GpuTable:
    title: str
    rows: dict[str, dict[str, float]] = field(default_factory=dict)  # component -> phase -> bytes
    stages: dict[str, int] = field(default_factory=dict)  # phase -> pipeline stage shown (trainer tables)
    notes: list[str] = field(default_factory=list)

    def add(self, phase: str, parts: dict[str, float]) -> None:
        for name, value in parts.items():
            if value:
                self.rows.setdefault(name, {})[phase] = self.rows.get(name, {}).get(phase, 0.0) + value

    def ordered_rows(self) -> list[tuple[str, dict[str, float]]]:
        return sorted(self.rows.items(), key=lambda item: _row_rank(item[0]))

    def total(self, phase: str) -> float:
        return sum(values.get(phase, 0.0) for values in self.rows.values())

    def peak(self) -> tuple[float, str]:
        phase = max(PHASES, key=self.total)
        return self.total(phase), phase

    def largest(self, phase: str, k: int = 3) -> list[tuple[str, float]]:
        items = [(name, values.get(phase, 0.0)) for name, values in self.rows.items()]
        return sorted((i for i in items if i[1] > 0), key=lambda i: -i[1])[:k]


@dataclass
class MemoryPlan:
    header: list[str]
    tables: dict[str, list[GpuTable]]
    placement: str
    limit: int
    problems: list[str]
    sync: dict[str, SyncTime] = field(default_factory=dict)  # placement -> predicted seconds of one weight sync
    checkpoint: CheckpointCost | None = None  # one checkpoint's bytes, host memory and seconds (checkpoint_cost.py)

    @property
    def peak(self) -> float:
        return max(t.peak()[0] for t in self.tables[self.placement])

    @property
    def fits(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class _Inputs:
    """Everything the phases need, derived from the config once."""

    dims: ModelDims
    layout: Layout
    act: ActivationModel
    precision: str
    distributed: bool
    tokens: int  # one packed micro-batch (padded)
    max_sequence: int
    use_kl: bool
    logprob_flat: int  # fp32 [2, all response tokens of the step], every rank
    logprob_share: int  # fp32 [2, T] per micro-batch of this rank's share, last stage
    bucket: int
    largest_full: int
    engine: EngineMemory | None
    engines_per_gpu: int


def _engines_per_gpu(cfg, dims: ModelDims) -> tuple[EngineMemory | None, int]:
    """SGLang engine memory of one TP rank, and how many engine TP ranks share a trainer GPU when colocated."""
    ro = cfg.rollout
    if ro.engine != "sglang":
        return None, 0
    engine = engine_memory(
        dims,
        engine_tp=ro.engine_tp,
        mem_fraction_static=ro.mem_fraction_static,
        gpu_bytes=int(cfg.slurm.gpu_memory_gb * GIB),
        fp8=ro.quantization == "fp8",
    )
    return engine, max(1, math.ceil(ro.num_engines * ro.engine_tp / cfg.actor.world_size))


def _inputs(cfg, dims: ModelDims) -> _Inputs:
    ac, ro, tr = cfg.actor, cfg.rollout, cfg.trainer
    mp = ac.tp * ac.pp * ac.cp
    layout = Layout(
        tp=ac.tp,
        pp=ac.pp,
        cp=ac.cp,
        dp=ac.world_size // mp,
        vpp=ac.vpp,
        sequence_parallel=ac.sequence_parallel,
        ep=ac.ep,
        etp=ac.etp,
    )
    pad = (ac.tp if ac.sequence_parallel else 1) * (2 * ac.cp if ac.cp > 1 else 1)
    tokens = -(-ac.micro_batch_tokens // pad) * pad
    max_sequence = ro.max_prompt_length + ro.max_response_length
    responses = tr.train_batch_size * ro.n
    share_tokens = -(-responses * max_sequence // layout.dp)  # every CP rank of a DP rank holds full-length rows
    # the yielded full HF tensors: embedding / LM head [V, h], fc1 halves [F, h], QKV pieces
    largest_full = max(dims.vocab, dims.ffn, dims.q_width) * dims.hidden * PARAM_BYTES[ac.precision]
    engine, per_gpu = _engines_per_gpu(cfg, dims)
    return _Inputs(
        dims=dims,
        layout=layout,
        act=ActivationModel(
            dims,
            tp=ac.tp,
            sequence_parallel=ac.sequence_parallel,
            cp=ac.cp,
            backend=ac.attention_backend,
            recompute=ac.recompute,
            precision=ac.precision,
            fused_logprob=ac.fused_logprob,
            head_loss=ac.head_loss,
            ep=ac.ep,
            etp=layout.expert_tp,
            expert_load=MOE_EXPERT_LOAD_ALLOWANCE if dims.is_moe else 1.0,
            quantization_aware=ac.quantization_aware,
        ),
        precision=ac.precision,
        distributed=ac.use_distributed_optimizer,
        tokens=tokens,
        max_sequence=max_sequence,
        use_kl=cfg.algorithm.use_kl,
        logprob_flat=8 * responses * ro.max_response_length,
        logprob_share=8 * share_tokens,
        # a bucket holds up to weight_bucket_mb of full tensors (one larger tensor travels alone), never more
        # than the whole model
        bucket=min(max(ro.weight_bucket_mb << 20, largest_full), total_params(dims) * PARAM_BYTES[ac.precision]),
        largest_full=largest_full,
        engine=engine,
        engines_per_gpu=per_gpu,
    )


def _sparse_per_chunk(dims: ModelDims, layout: Layout) -> int:
    """MoE layers in the chunk that has the most (every chunk is charged that many: an upper bound)."""
    per = layers_per_chunk(dims, layout)
    return max(
        (sum(dims.is_sparse(c * per + i) for i in range(per)) for c in range(layout.pp * layout.chunks)), default=0
    )


def _in_flight(layout: Layout, stage: int) -> int:
    """Micro-batch chunks whose activations a stage holds at once (megatron's warm-up count + 1)."""
    if layout.vpp is None:
        return layout.pp - stage
    return (layout.pp - stage - 1) * 2 + (layout.vpp - 1) * layout.pp + 1


def _split_head(parts: dict[str, float]) -> tuple[float, dict[str, float]]:
    head = {k: v for k, v in parts.items() if k.startswith("logits path")}
    return sum(parts.values()) - sum(head.values()), head


def _train_rows(
    x: _Inputs, stage: int, *, largest_param_numel: int, working: str
) -> tuple[dict[str, float], dict[str, float]]:
    """(rows of the train phase's activations, its LM-head rows) for pipeline stage `stage`: the layers'
    saved activations times the micro-batches in flight, the ends (embedding, head), the backward's working set."""
    lay, act = x.layout, x.act
    first, last = stage == 0, stage == lay.pp - 1
    layers = layers_per_chunk(x.dims, lay)
    chunk = act.saved(
        tokens=x.tokens,
        response_tokens=x.tokens,
        layers=layers,
        first=False,
        last=False,
        max_sequence=x.max_sequence,
        sparse_layers=_sparse_per_chunk(x.dims, lay),
    )
    saved = sum(chunk.values()) * _in_flight(lay, stage)
    ends = act.saved(tokens=x.tokens, response_tokens=x.tokens, layers=0, first=first, last=last)
    ends_body, head = _split_head(ends)
    if first:
        ends_body += act.local_tokens(x.tokens) * 8 * (min(_in_flight(lay, stage), lay.pp) - 1)  # ids in flight
    train = {
        "activations saved for backward": saved + ends_body,
        **head,
        working: sum(
            act.backward_working_set(
                tokens=x.tokens, response_tokens=x.tokens, last=last, largest_param_numel=largest_param_numel
            ).values()
        ),
    }
    return train, head


def _trainer_phases(x: _Inputs, stage: int, *, colocated: bool) -> dict[str, dict[str, float]]:
    """Rows of every phase for the worst DP rank of pipeline stage `stage` (trainer side only)."""
    lay, act = x.layout, x.act
    last = stage == lay.pp - 1
    st = worst_static(x.dims, lay, precision=x.precision, distributed_optimizer=x.distributed, pp_rank=stage)
    weights = {f"actor weights ({x.precision})": st.weights}
    state = {
        "actor gradients (fp32 main_grad buffer)": st.grads,
        "actor fp32 master params": st.main_params,
        "actor Adam exp_avg + exp_avg_sq (fp32)": st.adam,
    }
    ref = {
        "reference model weights (frozen)": frozen_weight_bytes(x.dims, lay, precision=x.precision, pp_rank=stage)
        if x.use_kl
        else 0
    }
    runtime = {
        "trainer runtime (CUDA context, NCCL; allowance)": TRAINER_RUNTIME_BYTES,
        "RoPE table cache (megatron lru_cache)": act.rope_cache(max_sequence=min(x.max_sequence, x.tokens)),
    }
    working = "working set (estimate)"
    train, head = _train_rows(x, stage, largest_param_numel=st.largest_param_numel, working=working)
    fwd = act.forward_only_working_set(tokens=x.tokens, response_tokens=x.tokens, last=last)
    logprob = {
        working: sum(v for k, v in fwd.items() if k != "logits path"),
        "log-prob outputs (fp32, step's responses)": x.logprob_flat + (x.logprob_share if last else 0),
    }
    if last:  # the forward-only head, on the same row as the train phase's logits path
        logprob[next(iter(head))] = fwd["logits path"]
    step_tmp = {
        "optimizer step temporaries (torch AdamW foreach)": 4 * (st.adam // 8) if x.act.backend == "torch" else 0
    }
    transfer = {"weight transfer buckets (full HF tensors)": x.bucket + x.largest_full + (0 if colocated else x.bucket)}
    resident = {**weights, **state, **runtime}
    if colocated:
        return {
            "rollout": dict(runtime),
            "log-prob": {**resident, **ref, **logprob},
            "train": {**resident, **train},
            "optimizer step": {**resident, **step_tmp},
            "transfer": {**weights, **runtime, **transfer},
        }
    return {
        "rollout": {**resident, **ref},
        "log-prob": {**resident, **ref, **logprob},
        "train": {**resident, **ref, **train},
        "optimizer step": {**resident, **ref, **step_tmp},
        "transfer": {**resident, **ref, **transfer},
    }


def _engine_rows(x: _Inputs, phase: str, *, colocated: bool) -> dict[str, float]:
    e, k = x.engine, x.engines_per_gpu
    if e is None:
        return {}
    generating: dict[str, float] = {
        "engine weights": k * e.weights,
        "engine KV cache": k * e.kv_cache,
        "engine runtime (SGLang's reserve: activations, CUDA graphs)": k * e.runtime,
    }
    if not colocated:
        return {**generating, **({"engine weight receive bucket": x.bucket} if phase == "transfer" else {})}
    if phase == "rollout":
        return generating
    released: dict[str, float] = {"engine process (released: CUDA context)": k * ENGINE_CONTEXT_BYTES}
    if phase == "transfer":
        return {"engine weights": k * e.weights, **released}
    return released


def _trainer_table(x: _Inputs, title: str, *, colocated: bool, with_engine: bool) -> GpuTable:
    table = GpuTable(title)
    stages = [_trainer_phases(x, s, colocated=colocated) for s in range(x.layout.pp)]
    for phase in PHASES:
        engine = _engine_rows(x, phase, colocated=True) if with_engine else {}
        best = max(range(len(stages)), key=lambda s: sum(stages[s][phase].values()))
        table.stages[phase] = best
        table.add(phase, stages[best][phase])
        table.add(phase, engine)
    return table


def _what_if(x: _Inputs) -> list[str]:
    """The actor's train-phase peak per GPU (alone, worst stage) under the alternatives of its memory knobs."""

    def peak(inputs: _Inputs) -> str:
        worst = max(sum(_trainer_phases(inputs, s, colocated=False)["train"].values()) for s in range(inputs.layout.pp))
        return f"{worst / GIB:.2f}"

    def act(**changes) -> _Inputs:
        return dataclasses.replace(x, act=dataclasses.replace(x.act, **changes))

    return [
        "what-if: the actor's train-phase peak per GPU (GiB, trainer GPU without engine or reference model)",
        f"  optimizer: distributed {peak(dataclasses.replace(x, distributed=True, use_kl=False))} / "
        f"replicated {peak(dataclasses.replace(x, distributed=False, use_kl=False))}",
        "  recompute: " + " / ".join(f"{r} {peak(act(recompute=r))}" for r in ("none", "selective", "full")),
        f"  logits path: fused kernel {peak(act(fused_logprob=True, head_loss='separate'))} / unfused fp32 "
        f"{peak(act(fused_logprob=False, head_loss='separate'))} / head + loss in one pass "
        f"{peak(act(head_loss='one_pass'))}",
    ]


def _old_logprob_line(recompute: str, *, bypass: bool) -> str:
    """The old-log-prob pass's share of the actor's FLOPs in a step: one forward of every token, against the
    updates' forward + backward (two forwards' worth) + the forward that full recompute redoes (selective
    recompute redoes the attention core only: counted as none). What algorithm.bypass_old_logprobs saves;
    the tiny CPU run measured 27% of the actor's seconds (docs/benchmarks.md)."""
    updates = 3 + (1 if recompute == "full" else 0)
    state = "skipped (algorithm.bypass_old_logprobs=true)" if bypass else "algorithm.bypass_old_logprobs=true skips it"
    return (
        f"  old-log-prob pass: ~{1 / (1 + updates):.0%} of the actor's FLOPs per step (1 forward of every token vs "
        f"{updates} for the updates, recompute {recompute}); {state}"
    )


def _engine_header(cfg, x: _Inputs) -> tuple[str, list[str]]:
    """The engines' line of the header, and what cannot fit in their static pool."""
    ro, e, seq = cfg.rollout, x.engine, x.max_sequence
    if e is None:
        return "engines: rollout.engine=cpu: the engines run on the host CPU (no GPU memory)", []
    line = (
        f"engines: {ro.num_engines} x sglang tp {ro.engine_tp}; static pool {ro.mem_fraction_static:g} x "
        f"{cfg.slurm.gpu_memory_gb:g} GiB = {e.static_pool / GIB:.2f} GiB per GPU: weights "
        f"{e.weights / GIB:.2f} + KV cache {e.kv_cache / GIB:.2f} GiB = {e.kv_tokens} tokens "
        f"({e.kv_tokens // seq} full {seq}-token sequences)"
    )
    if e.weights >= e.static_pool:
        return line, [
            f"rollout / engine weights: {e.weights / GIB:.2f} GiB per GPU do not fit in the static pool "
            f"rollout.mem_fraction_static x slurm.gpu_memory_gb = {e.static_pool / GIB:.2f} GiB "
            "(no room for a KV cache): raise rollout.engine_tp or rollout.mem_fraction_static"
        ]
    if e.kv_tokens < seq:
        return line, [
            f"rollout / engine KV cache: {e.kv_tokens} tokens per engine, less than one sequence "
            f"(rollout.max_prompt_length + rollout.max_response_length = {seq}): raise "
            "rollout.mem_fraction_static or rollout.engine_tp"
        ]
    return line, []


def _over_limit(tables: list[GpuTable], *, placement: str, limit: int, pp: int) -> list[str]:
    """Each phase of the configured placement's tables that exceeds the GPU, with its largest rows."""
    problems = []
    for table in tables:
        for phase in PHASES:
            total = table.total(phase)
            if total > limit:
                where = f" on pipeline stage {table.stages[phase]}" if phase in table.stages and pp > 1 else ""
                top = ", ".join(f"{name} {value / GIB:.2f}" for name, value in table.largest(phase))
                digits = 2 if f"{total / GIB:.2f}" != f"{limit / GIB:.2f}" else 4  # never "2.00 GiB > 2 GiB"
                problems.append(
                    f"{placement} / {phase}{where} ({table.title.split(': ', 1)[-1]}): "
                    f"{total / GIB:.{digits}f} GiB > {limit / GIB:g} GiB; largest: {top} GiB"
                )
    return problems


def _sync_times(cfg, dims, x: _Inputs, links: Links) -> dict[str, SyncTime]:
    """One weight sync's predicted seconds in each placement (memplan/sync_time.py)."""
    ro = cfg.rollout
    return {
        placement: sync_time(
            dims,
            x.layout,
            placement=placement,
            engines=Engines(ro.num_engines, ro.engine_tp),
            links=links,
            gpus_per_node=max(1, cfg.slurm.gpus_per_node),
            bucket_bytes=ro.weight_bucket_mb << 20,
            fp8=ro.quantization == "fp8",
            backend="nccl" if ro.engine == "sglang" else "gloo",
            copy_source=copy_device_for(cfg.slurm.gpu_memory_gb),
        )
        for placement in ("colocated", "disaggregated")
    }


def build_plan(cfg, *, links: Links | None = None) -> MemoryPlan:
    dims = model_dims_for(cfg)
    x = _inputs(cfg, dims)
    limit = int(cfg.slurm.gpu_memory_gb * GIB)
    ro, ac = cfg.rollout, cfg.actor
    header = [
        f"model: {dims.describe()}",
        f"  from {dims.source}",
        f"actor: {ac.world_size} ranks = tp {ac.tp} x pp {ac.pp}{f' x vpp {ac.vpp}' if ac.vpp else ''} x cp {ac.cp}"
        f" x dp {x.layout.dp}"
        + (
            f" (experts: ep {ac.ep} x etp {x.layout.expert_tp} x expert-dp {x.layout.expert_dp}; routed-token "
            f"allowance {MOE_EXPERT_LOAD_ALLOWANCE:g}x the balanced share)"
            if dims.is_moe
            else ""
        )
        + f"; sequence parallel {'on' if ac.sequence_parallel else 'off'}; {ac.precision}; "
        f"recompute {ac.recompute}; {'distributed' if ac.use_distributed_optimizer else 'replicated'} optimizer; "
        f"{ac.attention_backend} attention; logits "
        + (
            "head + loss in one pass"
            if ac.head_loss == "one_pass"
            else "fused kernel"
            if ac.fused_logprob
            else "unfused fp32"
        ),
        f"  micro-batch {x.tokens} tokens; reference model {'yes (algorithm.use_kl)' if x.use_kl else 'no'}",
        _old_logprob_line(ac.recompute, bypass=cfg.algorithm.bypass_old_logprobs),
    ]
    engine_line, problems = _engine_header(cfg, x)
    header.append(engine_line)
    header += _what_if(dataclasses.replace(x, use_kl=False))
    colocated = _trainer_table(
        x, "colocated: one GPU = one trainer rank + its engine TP rank", colocated=True, with_engine=True
    )
    disagg = [_trainer_table(x, "disaggregated: trainer GPUs", colocated=False, with_engine=False)]
    if x.engine is not None:
        engine_table = GpuTable(f"disaggregated: engine GPUs ({ro.num_engines} x {ro.engine_tp} more GPUs)")
        for phase in PHASES:
            engine_table.add(phase, _engine_rows(x, phase, colocated=False))
        disagg.append(engine_table)
    if x.engines_per_gpu > 1:
        colocated.notes.append(
            f"{x.engines_per_gpu} engine TP ranks share each GPU (rollout.num_engines x "
            f"rollout.engine_tp > actor.world_size)"
        )
    tables = {"colocated": [colocated], "disaggregated": disagg}
    problems += _over_limit(tables[ro.placement], placement=ro.placement, limit=limit, pp=ac.pp)
    links = links or Links(cfg.slurm.network_gbps, cfg.slurm.intra_node_gbps)
    header.append(
        f"weight sync links: network {links.network_gbps:g} Gbit/s, intra-node {links.intra_node_gbps:g} Gbit/s"
        f" ({links.source})"
    )
    sync = _sync_times(cfg, dims, x, links)
    checkpoint = checkpoint_cost(
        dims, x.layout, weight_bytes=PARAM_BYTES[ac.precision], checkpoint_format=ac.checkpoint_format
    )
    nodes_ranks = min(ac.world_size, cfg.slurm.gpus_per_node) if cfg.slurm.gpus_per_node else ac.world_size
    problems += host_memory_problems(checkpoint, ranks_per_node=nodes_ranks, host_memory_gb=cfg.slurm.host_memory_gb)
    return MemoryPlan(header, tables, ro.placement, limit, problems, sync=sync, checkpoint=checkpoint)
