"""The memory plan: per-GPU memory of every phase of a DAPO step, before anything starts.

    from dapo_megatron.memplan.plan import build_plan
    from dapo_megatron.memplan.report import check_before_launch, format_plan
    plan = build_plan(load_config("configs/runs/qwen2.5-32b_dapo.yaml"))
    print(format_plan(plan)); plan.fits

arch.py (model dimensions and their source), static.py (parameters, DDP buffers, optimizer state:
exact), activations.py (what a micro-batch keeps for backward), engine.py (SGLang's static pool and
reserve), plan.py (phases x placements), report.py (the table and `dapo-megatron plan`).
Formulas and their sources: docs/memory.md. The package itself imports nothing, so that arch.py
stays light for the modules that only read model dimensions.
"""
