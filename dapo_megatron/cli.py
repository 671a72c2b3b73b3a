"""`dapo-megatron` command line: one sub-command per concern, each implemented in its own module.

    dapo-megatron train configs/runs/tiny_cpu.yaml [key=value ...] [--resume | --overwrite]
    dapo-megatron eval CONFIG [--checkpoint DIR]      (a checkpoint, a HF model or a run directory)
    dapo-megatron config show CONFIG [key=value ...]
    dapo-megatron plan CONFIG [key=value ...]                   (per-GPU memory of every phase)
    dapo-megatron convert hf-to-mcore | mcore-to-hf ...
    dapo-megatron check-parity --model HF_DIR --tp T --pp P      (under torchrun)
    dapo-megatron bench kernels | reward | rollout | actor | dataplane | rollout-quant | overlap [--results-dir DIR]
    dapo-megatron serve-rollout --model DIR --port P
    dapo-megatron slurm submit | status ...
    dapo-megatron preflight CONFIG                               (inside an allocation; `slurm submit --preflight`)
    dapo-megatron plot RUN_DIR
    dapo-megatron ladder configs/ablations_tiny --seeds 3        (an ablation ladder's rungs x seeds, here)
    dapo-megatron status RUN_DIR                                 (a local or Slurm run: step, tokens/s, ETA)
    dapo-megatron --version

`COMMAND --help` prints the command's options before the command imports torch, megatron-core or
transformers (tests/unit/test_cli_help.py runs every one).

Each sub-command module exposes `main(argv: list[str]) -> int`; this file only dispatches, so the
start-up of one command never pays for the imports of another (megatron-core alone takes seconds).
"""

from __future__ import annotations

import importlib
import sys

from dapo_megatron import __version__
from dapo_megatron.benchmarks.run import BENCHES  # standard library only: the help lists every benchmark

# sub-command -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("dapo_megatron.launch.local.commands", "train", "run DAPO training from a config"),
    "eval": ("dapo_megatron.launch.local.commands", "evaluate", "avg@k / pass@k of a checkpoint on the eval set"),
    "config": ("dapo_megatron.config", "main", "show the resolved config (`config show FILE [k=v ...]`)"),
    "plan": (
        "dapo_megatron.memplan.report",
        "main",
        "per-GPU memory of every phase of a step; exit 1 if it does not fit",
    ),
    "convert": ("dapo_megatron.tools.convert", "main", "convert checkpoints: hf-to-mcore | mcore-to-hf"),
    "check-parity": ("dapo_megatron.tools.parity", "main", "Megatron vs transformers log-prob parity"),
    "bench": ("dapo_megatron.benchmarks.run", "main", "benchmarks: " + " | ".join(BENCHES)),
    "serve-rollout": ("dapo_megatron.cpu_engine.serve", "main", "CPU rollout server (SGLang HTTP API)"),
    "slurm": ("dapo_megatron.launch.slurm.cli", "main", "render / submit sbatch jobs, show their status"),
    "preflight": (
        "dapo_megatron.launch.preflight.command",
        "main",
        "check the allocation before a run: GPUs, imports, shared run dir, clocks, ports, routes, links",
    ),
    "plot": ("dapo_megatron.trainer.metrics_log", "plot_main", "PNG of a run's curves"),
    "status": (
        "dapo_megatron.launch.run_status",
        "main",
        "where a run stands (local or Slurm): live, step, tokens/s, time per step, ETA, last eval, engines, errors",
    ),
    "ladder": (
        "dapo_megatron.launch.experiments.ladder",
        "main",
        "run an ablation ladder's rungs over seeds here; summary with paired intervals",
    ),
}


# The commands whose module imports torch at its top: their parser lives in a module of its own, which
# `--help` reaches without the command's module (the help text is the parser's; nothing is copied).
HELP_PARSERS: dict[str, tuple[str, str]] = {
    "convert": ("dapo_megatron.tools.convert_args", "parse"),
    "check-parity": ("dapo_megatron.tools.parity_args", "parse"),
    "serve-rollout": ("dapo_megatron.cpu_engine.serve_args", "parse_help"),
}

# The commands that import megatron-core or transformers: their backends' warnings that cannot matter are
# filtered before the command starts (trainer/console.py: which, and why), as `train` always did. Not the
# others: `config show` or `slurm status` would pay transformers' import for it.
BACKEND_COMMANDS = frozenset({"train", "eval", "plan", "convert", "check-parity", "bench", "serve-rollout"})


def _usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items())
    return f"usage: dapo-megatron [--version] COMMAND [args]   (COMMAND --help: its options)\n\ncommands:\n{rows}\n"


def wants_help(args: list[str]) -> bool:
    """`-h` / `--help` anywhere before a `--`: the command only prints its options."""
    head = args[: args.index("--")] if "--" in args else args
    return "-h" in head or "--help" in head


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"dapo-megatron {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"dapo-megatron: unknown command '{name}'{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name, _ = COMMANDS[name]
    if name in HELP_PARSERS and wants_help(rest):
        help_module, help_func = HELP_PARSERS[name]
        try:
            getattr(importlib.import_module(help_module), help_func)(rest)  # prints the help, exits 0
        except SystemExit as done:
            return int(done.code or 0)
    if name in BACKEND_COMMANDS and not wants_help(rest):  # help imports no backend: nothing to quiet
        from dapo_megatron.trainer import console

        console.quiet_backend_warnings()  # before the command's module imports megatron-core
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(rest) or 0)
    except ValueError as err:  # user mistakes (config keys, bad files) end in one clear line
        print(f"dapo-megatron {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
if __name__ == "__mp_main__":  # a multiprocessing spawn child of a dapo-megatron process (Megatron's checkpoint
    # Manager): it ends with the process that started it
    from dapo_megatron.launch.local.lifeline import die_with_parent

    die_with_parent()
