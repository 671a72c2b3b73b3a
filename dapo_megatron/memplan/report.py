"""`dapo-megatron plan CONFIG [key=value ...]`: print the memory plan; exit 1 when it does not fit.

    dapo-megatron plan configs/runs/qwen2.5-32b_dapo.yaml
    dapo-megatron plan configs/runs/qwen2.5-32b_dapo.yaml actor.tp=1 actor.pp=1      # -> fits=no, exit 1
    dapo-megatron plan configs/runs/qwen2.5-7b_dapo.yaml slurm.gpu_memory_gb=141     # an H200

The last line is machine-readable: `peak_gb_per_gpu=X limit_gb=Y fits=yes|no` (GB = GiB, 2^30 bytes,
as torch.cuda.mem_get_info and nvidia-smi count). `dapo-megatron train` and `dapo-megatron slurm
submit` run the same check first (check_before_launch); `--skip-plan` skips it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from dapo_megatron.config import load_config
from dapo_megatron.memplan.arch import UnsupportedModel
from dapo_megatron.memplan.engine import GIB
from dapo_megatron.memplan.plan import PHASES, GpuTable, MemoryPlan, build_plan
from dapo_megatron.memplan.sync_time import links_from_preflight


def _cell(value: float | None) -> str:
    return "-" if not value else f"{value / GIB:.2f}"


def format_table(table: GpuTable, *, configured: bool) -> list[str]:
    width = max([len(name) for name in table.rows] + [24]) + 2
    title = table.title + ("   [configured: rollout.placement]" if configured else "")
    lines = [title, f"  {'GiB per GPU':<{width}}" + "".join(f"{p:>16}" for p in PHASES)]
    for name, values in table.ordered_rows():
        lines.append(f"  {name:<{width}}" + "".join(f"{_cell(values.get(p)):>16}" for p in PHASES))
    lines.append(f"  {'total':<{width}}" + "".join(f"{table.total(p) / GIB:>16.2f}" for p in PHASES))
    if table.stages and any(table.stages.values()):
        lines.append(f"  {'pipeline stage shown':<{width}}" + "".join(f"{table.stages[p]:>16}" for p in PHASES))
    lines += [f"  note: {n}" for n in table.notes]
    return lines


def format_plan(plan: MemoryPlan) -> str:
    lines = list(plan.header)
    for placement in ("colocated", "disaggregated"):
        for table in plan.tables[placement]:
            lines += ["", *format_table(table, configured=placement == plan.placement)]
    lines.append("")
    for placement, sync in plan.sync.items():
        lines += [line + ("   [configured]" if placement == plan.placement else "") for line in sync.lines()]
    if plan.checkpoint is not None:
        lines += plan.checkpoint.lines()
    lines.append("")
    if plan.problems:
        lines.append("does not fit:")
        lines += [f"  {p}" for p in plan.problems]
    lines.append(summary_line(plan))
    return "\n".join(lines)


def summary_line(plan: MemoryPlan) -> str:
    return f"peak_gb_per_gpu={plan.peak / GIB:.2f} limit_gb={plan.limit / GIB:g} fits={'yes' if plan.fits else 'no'}"


def check_before_launch(cfg, *, out: Callable[[str], None] = print, label: str = "") -> MemoryPlan | None:
    """What `train` / `slurm submit` run first: one line when the plan fits; else the whole plan and a
    ValueError naming what does not fit (the launchers' --skip-plan skips this). An architecture the plan
    does not model is reported and skipped (the actor may support more than the plan does)."""
    tag = f"[plan]{f' {label}:' if label else ''}"
    try:
        plan = build_plan(cfg)
    except UnsupportedModel as err:
        out(f"{tag} not checked: {err}")
        return None
    except ValueError as err:
        raise ValueError(
            f"the memory plan cannot run: {err} (fix it, or pass --skip-plan to launch without the plan)"
        ) from None
    if plan.fits:
        peak, phase = max((t.peak() for t in plan.tables[plan.placement]), key=lambda p: p[0])
        out(
            f"{tag} {plan.placement}: peak {peak / GIB:.2f} GiB per GPU ({phase}) of "
            f"{plan.limit / GIB:g} GiB: fits (`dapo-megatron plan CONFIG` shows every phase)"
        )
        return plan
    out(format_plan(plan))
    raise ValueError(
        f"the memory plan does not fit: {plan.problems[0]}"
        + (f" (and {len(plan.problems) - 1} more above)" if len(plan.problems) > 1 else "")
        + "; change the config, or pass --skip-plan to launch anyway"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dapo-megatron plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument(
        "--links", metavar="PREFLIGHT_JSON", help="predict the weight sync from a preflight.json's measured links"
    )
    args = parser.parse_intermixed_args(argv)  # flags and key=value overrides in any order
    cfg = load_config(args.config, args.overrides)
    links = links_from_preflight(args.links, intra_node_gbps=cfg.slurm.intra_node_gbps) if args.links else None
    plan = build_plan(cfg, links=links)
    print(f"dapo-megatron plan {args.config}" + "".join(f" {o}" for o in args.overrides))
    print(format_plan(plan))
    return 0 if plan.fits else 1
