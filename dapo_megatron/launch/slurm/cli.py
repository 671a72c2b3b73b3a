"""`dapo-megatron slurm submit | status | render`: launch runs on a Slurm cluster.

    dapo-megatron slurm submit configs/runs/qwen2.5-32b_dapo.yaml slurm.partition=h100 slurm.account=rl
    dapo-megatron slurm submit configs/runs/qwen2.5-7b_dapo.yaml --engines 8        # disaggregated engines
    dapo-megatron slurm submit --sweep configs/ablations slurm.partition=h100      # the ablation ladder
    dapo-megatron slurm submit configs/runs/qwen2.5-32b_dapo.yaml --eval /shared/runs/qwen2.5-32b_dapo
    dapo-megatron slurm submit configs/runs/qwen2.5-32b_dapo.yaml --bench-kernels
    dapo-megatron slurm submit configs/runs/qwen2.5-7b_dapo.yaml --engines 8 --preflight   # checks first
    dapo-megatron slurm submit CONFIG --resume    # continue the run in trainer.output_dir (--overwrite: clear it)
    # run the checks, print the scripts and sbatch commands; submit nothing
    dapo-megatron slurm submit ... --dry-run
    dapo-megatron slurm status /shared/runs/qwen2.5-32b_dapo
    dapo-megatron slurm render train CONFIG [overrides]    # one rendered sbatch file on stdout

`submit` prints `<role>: <job id>` per job and records them in <run_dir>/slurm/jobs.json. Before it
writes or submits a training run (or a sweep's runs) it checks, as `train` does (launch/slurm/submit_guard.py):
the directory is not in use (a recorded job still pending or running, a held .run.lock), the run
directory decision (a directory holding a run needs --resume or --overwrite), and every prompt row.
--eval and --bench-kernels take none of these: evaluating a live run's checkpoints is legitimate.
"""

from __future__ import annotations

import argparse
import sys

from dapo_megatron.config import load_config
from dapo_megatron.launch.slurm import status
from dapo_megatron.launch.slurm.render import python_of

_RENDERERS = ("train", "engines", "bench_kernels")


def _split(positional: list[str]) -> tuple[list[str], list[str]]:
    """Config files and key=value overrides, in any order."""
    configs = [p for p in positional if "=" not in p]
    overrides = [p for p in positional if "=" in p]
    return configs, overrides


def _one_config(configs: list[str], what: str) -> str:
    if len(configs) != 1:
        raise ValueError(f"{what} takes one CONFIG file (got {configs or 'none'}); overrides are key=value")
    return configs[0]


def _submit_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dapo-megatron slurm submit", description="render the sbatch files of a run and submit them"
    )
    ap.add_argument("args", nargs="*", metavar="CONFIG|key=value", help="a config file and dotted overrides")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--sweep", metavar="DIR", help="one array task per *.yaml of DIR (no CONFIG)")
    mode.add_argument("--eval", metavar="RUN_DIR", help="one array task per checkpoint of RUN_DIR, then a table")
    mode.add_argument("--bench-kernels", action="store_true", help="the kernel benchmarks on one GPU")
    ap.add_argument(
        "--engines",
        type=int,
        default=0,
        metavar="K",
        help="K disaggregated rollout engines (an array job) for the trainer",
    )
    ap.add_argument(
        "--preflight",
        action="store_true",
        help="a short preflight job first (`dapo-megatron preflight`); the run's jobs wait for it: afterok",
    )
    ap.add_argument("--preflight-mb", type=int, default=64, metavar="MB", help="MiB per measured collective")
    ap.add_argument("--dry-run", action="store_true", help="print the scripts and sbatch commands only")
    ap.add_argument("--skip-plan", action="store_true", help="submit training runs without checking the memory plan")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in trainer.output_dir from its newest checkpoint (sweeps: each run)",
    )
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="clear a previous run in trainer.output_dir at submission (its checkpoints, metrics, logs)",
    )
    ap.add_argument(
        "--skip-data-check",
        action="store_true",
        help="do not read the prompt files here (they exist only where the jobs run; the job checks them)",
    )
    return ap


def _submit(argv: list[str]) -> int:
    # per sub-command, as cli.py dispatches: `slurm status` does not load the plans, checks and renderers
    from dapo_megatron.launch.slurm import submit, submit_guard

    args = _submit_parser().parse_intermixed_args(argv)
    configs, overrides = _split(args.args)
    plan_lines: list[str] = []  # the memory plan's verdicts; a plan that does not fit raises before any submission
    _check_flags(args)
    checks = None
    if args.sweep:
        if configs:
            raise ValueError(f"--sweep takes its configs from DIR; drop {configs} (overrides key=value are fine)")
        plan = submit.plan_sweep(args.sweep, overrides, resume=args.resume)
        command = f"dapo-megatron slurm submit --sweep {args.sweep}"
    else:
        cfg = load_config(_one_config(configs, "slurm submit"), overrides)
        if args.eval:
            plan = submit.plan_eval(cfg, args.eval)
        elif args.bench_kernels:
            plan = submit.plan_bench_kernels(cfg)
        else:
            plan = submit.plan_train(cfg, engines=args.engines, resume=args.resume)
            if args.preflight:
                submit.add_preflight(plan, engines=args.engines, nbytes=args.preflight_mb << 20)
        command = f"dapo-megatron slurm submit {configs[0]}"
    if not (args.eval or args.bench_kernels):
        if not args.skip_plan:
            _check_memory(plan, plan_lines)
        # in use, run directory, data: refused here (exit 2) before anything is written or submitted
        checks = submit_guard.check_training_submission(
            plan,
            resume=args.resume,
            overwrite=args.overwrite,
            command=command,
            skip_data_check=args.skip_data_check,
            dry_run=args.dry_run,
        )
    if args.dry_run and not args.sweep:
        plan_lines.append(_interpreter_line(cfg))
    if checks is not None and submit_guard.report(checks, out=plan_lines.append) == 0:
        print("\n".join([*plan_lines, "[slurm submit] nothing to submit"]))  # --resume of finished runs
        return 0
    if checks is not None:  # --overwrite: the old run's files go only now, every check passed
        submit_guard.clear_for_overwrite(checks, dry_run=args.dry_run, out=plan_lines.append)
    if plan_lines and not args.dry_run:
        print("\n".join(plan_lines))
    _warn_cluster_defaults(plan)
    submit.submit(plan, dry_run=args.dry_run)
    if plan_lines and args.dry_run:  # a dry run shows the sbatch lines first (what `head` shows)
        print("\n".join(plan_lines))
    if not args.dry_run:
        print(f"run directory: {plan.run_dir}   (dapo-megatron slurm status {plan.run_dir})")
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """The flags that go with a training run only: a ValueError naming them, before any plan is made."""
    if args.engines and (args.sweep or args.eval or args.bench_kernels):
        raise ValueError("--engines goes with a training run, not with --sweep, --eval or --bench-kernels")
    if (args.resume or args.overwrite or args.skip_data_check) and (args.eval or args.bench_kernels):
        raise ValueError(
            "--resume, --overwrite and --skip-data-check go with a training run or --sweep, "
            "not with --eval or --bench-kernels (which neither write the run nor take its lock)"
        )
    if args.preflight and (args.sweep or args.eval or args.bench_kernels):
        raise ValueError("--preflight goes with a training run, not with --sweep, --eval or --bench-kernels")


def _interpreter_line(cfg) -> str:
    """Which Python the rendered jobs run (render.python_of) and how to name another."""
    s, python = cfg.slurm, python_of(cfg)
    if s.python:
        why = "slurm.python"
    elif s.setup:
        why = "`python` on the PATH once the slurm.setup lines ran"
    else:
        why = "the interpreter of this `slurm submit` (no slurm.setup, no slurm.python): it must exist on the nodes"
    return (
        f"[slurm submit] the jobs run {python} ({why}); another: slurm.python=/path/to/python or "
        "\"slurm.setup=['source /path/to/venv/bin/activate']\""
    )


def _warn_cluster_defaults(plan) -> None:
    """One stderr line when no job names a partition or an account: sbatch then takes the cluster's
    default partition and the user's default account, which is rarely the GPU partition meant."""
    missing = [
        key for key in ("partition", "account") if not any(f"#SBATCH --{key}=" in job.script() for job in plan.jobs)
    ]
    if missing:
        keys = " and ".join(f"slurm.{key}" for key in missing)
        print(
            f"warning: {keys} {'is' if len(missing) == 1 else 'are'} empty: sbatch uses the cluster's default "
            f"{' and '.join(missing)}; set {' '.join(f'slurm.{key}=NAME' for key in missing)} if that is not "
            "what you mean",
            file=sys.stderr,
        )


def _check_memory(plan, lines: list[str]) -> None:
    """The memory plan's verdict lines go into `lines`; a plan that does not fit prints all of it and raises."""
    from dapo_megatron.launch.slurm import submit

    try:
        submit.check_memory(plan, out=lines.append)
    except ValueError:
        print("\n".join(lines))
        raise


def _render(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dapo-megatron slurm render", description="print one rendered sbatch file")
    ap.add_argument("which", choices=_RENDERERS)
    ap.add_argument("args", nargs="*", metavar="CONFIG|key=value")
    args = ap.parse_intermixed_args(argv)
    configs, overrides = _split(args.args)
    cfg = load_config(_one_config(configs, "slurm render"), overrides)
    from dapo_megatron.launch.slurm import submit

    if args.which == "train":
        plan = submit.plan_train(cfg)
    elif args.which == "engines":
        plan = submit.plan_train(cfg, engines=max(cfg.rollout.num_engines, 1))
    else:
        plan = submit.plan_bench_kernels(cfg)
    job = next(j for j in plan.jobs if j.role == args.which)
    sys.stdout.write(job.script())
    return 0


def _status(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="dapo-megatron slurm status",
        description="the jobs of a submitted run (slurm/jobs.json) and their states; "
        "`dapo-megatron status RUN_DIR`: the run's step, tokens/s and ETA too",
    )
    ap.add_argument("run_dir", metavar="RUN_DIR")
    print(status.summarize(ap.parse_args(argv).run_dir))
    return 0


def main(argv: list[str]) -> int:
    commands = {"submit": _submit, "status": _status, "render": _render}
    usage = "usage: dapo-megatron slurm {submit|status|render} ...  (see --help of each)"
    if argv and argv[0] in ("-h", "--help"):  # the usage and the examples, on stdout: asked for
        print(f"{usage}\n\n{__doc__}")
        return 0
    if not argv or argv[0] not in commands:
        print(usage, file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])
