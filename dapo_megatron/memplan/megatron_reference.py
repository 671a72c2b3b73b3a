"""Megatron-LM's published theoretical-memory formula, next to this plan, for docs/memory.md.

    python -m dapo_megatron.memplan.megatron_reference configs/runs/*.yaml configs/ablations/*.yaml

Megatron-LM's megatron/training/theoretical_memory_usage.py (NVIDIA/Megatron-LM, read at commit
00caa53) estimates, for the most loaded pipeline stage, the weight + optimizer bytes and the
activation bytes of a pre-training step. Re-derived here from its formulas (not its code):

  weights + optimizer = params_on_most_loaded_shard * (18, or 6 + 12 / DP with the distributed optimizer)
      params per layer = 2h(1.5F + 1) + 2h*q_w(1 + kv_heads/heads)   (SwiGLU, RMSNorm, no biases)
      most loaded shard = (L * layer + h) / PP / TP + V h / TP  (+ V h / TP more if untied and PP = 1)
  activations (sequence parallel + selective recompute) = [T h (18 + 4F/h) L + 8 T PP + T h PP
      (+ 4 T h (1 + V/h) at PP = 1)] / TP, times 1 + (PP-1)/(PP*VPP) with interleaving
  activations (any other setting) = 1.05 * [T h (10 + 24/TP) L + 8 T PP + T h PP
      (+ 2 (T V / TP + T h) at PP = 1)]
with T = tokens of one micro-batch (seq_length x micro_batch_size; packed: micro_batch_tokens).
"""

from __future__ import annotations

import sys

from dapo_megatron.config import load_config
from dapo_megatron.memplan.arch import ModelDims, model_dims_for
from dapo_megatron.memplan.engine import GIB
from dapo_megatron.memplan.plan import _inputs, _trainer_phases
from dapo_megatron.memplan.static import Layout, worst_static


def megatron_weights_and_optimizer(dims: ModelDims, layout: Layout, *, distributed_optimizer: bool) -> float:
    h, F = dims.hidden, dims.ffn
    per_layer = 2 * h * (1.5 * F + 1) + 2 * h * dims.q_width * (1 + dims.kv_heads / dims.heads)
    block = dims.layers * per_layer + h
    embedding = dims.vocab * h
    shard = (block / layout.pp + embedding) / layout.tp
    if not dims.tied and layout.pp == 1:
        shard += embedding / layout.tp
    per_param = 6 + 12 / layout.dp if distributed_optimizer else 18
    return shard * per_param


def megatron_activations(dims: ModelDims, layout: Layout, *, tokens: int, selective_sp: bool) -> float:
    h, F, V, L, pp, tp = dims.hidden, dims.ffn, dims.vocab, dims.layers, layout.pp, layout.tp
    embed = 8 * tokens * pp + tokens * h * pp
    penalty = 1 + (pp - 1) / (pp * layout.vpp) if layout.vpp else 1.0
    if selective_sp:
        total = (tokens * h * (18 + 4 * F / h) * L + embed) * penalty
        if pp == 1:
            total += tokens * h * 4 * (1 + V / h)
        return total / tp
    total = (tokens * h * (10 + 24 / tp) * L + embed) * penalty
    if pp == 1:
        total += (tokens * V / tp + tokens * h) * 2
    return total * 1.05


def comparison_row(cfg) -> dict[str, float | str]:
    """GiB per GPU: Megatron's formula vs this plan for the actor alone. Static: the most loaded
    pipeline stage (and DP rank); activations: the first stage (Megatron's formula's stage), train phase."""
    dims = model_dims_for(cfg)
    if dims.is_moe:  # its parameter count has no experts; the MoE terms are checked against the real actor instead
        raise ValueError(
            f"{dims.name}: Megatron-LM's theoretical-memory formula models dense GPT models only "
            "(the plan's MoE terms are compared with the real actor: tests/distributed/test_memplan_moe.py)"
        )
    ac = cfg.actor
    x = _inputs(cfg, dims)
    layout = x.layout
    meg_static = megatron_weights_and_optimizer(dims, layout, distributed_optimizer=ac.use_distributed_optimizer)
    meg_act = megatron_activations(
        dims, layout, tokens=x.tokens // ac.cp, selective_sp=ac.sequence_parallel and ac.recompute == "selective"
    )
    ours_static = max(
        worst_static(
            dims, layout, precision=ac.precision, distributed_optimizer=ac.use_distributed_optimizer, pp_rank=stage
        ).total
        for stage in range(layout.pp)
    )
    train = _trainer_phases(x, 0, colocated=False)["train"]
    ours_act = sum(v for k, v in train.items() if k.startswith(("activations saved", "logits path")))
    return {
        "megatron static": meg_static / GIB,
        "plan static": ours_static / GIB,
        "megatron activations": meg_act / GIB,
        "plan activations": ours_act / GIB,
        "setting": f"tp{ac.tp} pp{ac.pp} dp{layout.dp} sp={'on' if ac.sequence_parallel else 'off'} "
        f"recompute={ac.recompute} T={x.tokens}",
    }


def main(argv: list[str]) -> int:
    print("| config | setting | weights+optimizer: Megatron / plan (GiB) | activations: Megatron / plan (GiB) |")
    print("|---|---|---|---|")
    for path in argv:
        row = comparison_row(load_config(path))
        print(
            f"| {path} | {row['setting']} | {row['megatron static']:.2f} / {row['plan static']:.2f} | "
            f"{row['megatron activations']:.2f} / {row['plan activations']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
