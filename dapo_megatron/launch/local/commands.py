"""The commands that start processes on this machine: `dapo-megatron train` (the local launcher, or one
rank under torchrun/srun) and `dapo-megatron eval` (CPU engines on a checkpoint, or the run's engines).
They sit here, above trainer/, because by hand they start engines (launch/local/launcher.py, launch/local/engines.py).
"""

from __future__ import annotations

import argparse
import os

from dapo_megatron.config import load_config
from dapo_megatron.data.datasets import train_and_eval_sets
from dapo_megatron.launch.local.engines import LocalEngines
from dapo_megatron.launch.local.launcher import launch_training
from dapo_megatron.launch.local.lifeline import die_with_parent
from dapo_megatron.launch.local.stop import stopped_at_once
from dapo_megatron.rollout.auth import engine_keys, ensure_secret_file, run_secret_path
from dapo_megatron.trainer.progress_line import ProgressLine, ProgressLines

# `dapo-megatron train --help`; here, not trainer/train.py's docstring: the help imports no torch
TRAIN_HELP = """The DAPO training loop (docs/architecture.md, "One training step").

    dapo-megatron train configs/runs/tiny_cpu.yaml                      # CPU engines + actor, this machine
    dapo-megatron train configs/runs/tiny_cpu.yaml trainer.total_steps=5 --resume
    srun ... torchrun ... -m dapo_megatron.cli train CONFIG --resume    # slurm/train.sbatch (RANK is set)

Run by hand, `train` is the launcher (launch/local/launcher.py): it prepares the model, starts the CPU rollout
engines and the actor ranks under torchrun, and stops all of them on exit, error or Ctrl-C. Under
torchrun/srun (RANK set) it is one rank of the loop below. What each rank does is named by its
roles (distributed/roles.py): the driver (global rank 0) talks to the engines and builds the batch;
every rank trains on its data-parallel share; trainer/placement.py says what moves between phases.
"""


def train(argv: list[str]) -> int:
    """`dapo-megatron train`: by hand, the local launcher (launch/local/launcher.py); under torchrun/srun (RANK
    set), one rank of the loop (trainer/train.py)."""
    parser = argparse.ArgumentParser(
        prog="dapo-megatron train", description=TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="clear a previous run in trainer.output_dir first")
    parser.add_argument("--skip-plan", action="store_true", help="launch without checking the memory plan first")
    args = parser.parse_intermixed_args(argv)  # flags and key=value overrides in any order
    cfg = load_config(args.config, args.overrides)
    if "RANK" in os.environ:
        from dapo_megatron.trainer import train as loop  # the rank's torch and megatron: not the launcher's

        die_with_parent()  # a rank ends with torchrun, even when torchrun is SIGKILLed (launch/local/lifeline.py)
        os.register_at_fork(after_in_child=die_with_parent)  # so do its fork children (Megatron's checkpoint writers)
        return loop.train_rank_recorded(cfg, resume=args.resume) or 0  # None: the worker exited with SystemExit(0)

    try:
        return launch_training(
            cfg, args.config, args.overrides, resume=args.resume, overwrite=args.overwrite, skip_plan=args.skip_plan
        )
    except KeyboardInterrupt as stop:  # a second Ctrl-C, or one before the ranks ran: one line, no traceback
        return stopped_at_once(stop, cfg.trainer.output_dir)


def evaluate(argv: list[str]) -> int:
    """dapo-megatron eval CONFIG [key=value ...] [--checkpoint DIR] [--output FILE.json]
    dapo-megatron eval --compare A B      (A, B: eval JSON files or run directories: their newest eval)

    Every eval set of the config (data.eval_sets, else data.eval_path or the synthetic held-out split)
    sampled k = trainer.eval_n times per problem with the eval sampling settings
    (trainer.eval_temperature / eval_top_p; DAPO: k=32, T=1.0, top_p=0.7); the JSON holds avg@k with
    its 95% bootstrap interval, maj@k, unbiased pass@1, 2, 4, ..., k and one record per problem
    (trainer/evaluation/report.py; docs/algorithm.md, "Evaluation").
    rollout.engine=cpu starts CPU engines on the checkpoint; otherwise the engines of
    rollout.engine_urls or <output_dir>/engines load it with update_weights_from_disk.
    DIR is a run checkpoint (checkpoints/step_N), a HF model directory, or a run directory (its
    newest complete checkpoint); without --checkpoint, the config's trainer.output_dir.
    --compare: B's avg@k minus A's on the same problems, with a paired-bootstrap 95% interval.
    """
    import json
    from pathlib import Path

    if "--compare" in argv:
        return compare(argv)
    args = _eval_args(argv)  # before the imports of torch: `eval --help` answers at once

    from dapo_megatron.trainer.evaluation import report, sampling

    cfg = load_config(args.config, args.overrides)
    checkpoint, hf_dir = sampling.resolve_checkpoint(args.checkpoint or cfg.trainer.output_dir)
    if checkpoint != args.checkpoint:
        print(f"[eval] checkpoint: {checkpoint}", flush=True)
    output = Path(args.output or Path(checkpoint) / "eval.json")
    _, sets = train_and_eval_sets(cfg.data, on_rows=ProgressLines("[data]", unit="rows"))  # the train file is read too
    if not sets or not all(sets.values()):
        raise ValueError("an eval set is empty: set data.eval_sets, data.eval_path (or data.synthetic.num_eval)")
    samples = _sample_eval_sets(cfg, hf_dir, sets)
    step = _checkpoint_step(checkpoint)
    reports = {name: report.eval_report(samples[name], records, step=step, name=name) for name, records in sets.items()}
    t = cfg.trainer
    report.write_eval_file(
        output,
        reports,
        extra={"checkpoint": checkpoint, "model": hf_dir, "temperature": t.eval_temperature, "top_p": t.eval_top_p},
    )
    for one in reports.values():
        print(json.dumps({k: v for k, v in one.items() if k not in ("problems", "interval", "maj_tie_rule")}))
    print(f"[eval] wrote {output}")
    return 0


def _eval_args(argv: list[str]) -> argparse.Namespace:
    """`eval`'s command line; a run directory given as the config is refused with the command that works."""
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="dapo-megatron eval", description=evaluate.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument(
        "--checkpoint",
        default="",
        help="run checkpoint, HF model or run directory (default: the config's trainer.output_dir)",
    )
    parser.add_argument("--output", default="", help="JSON results (default <checkpoint>/eval.json)")
    args = parser.parse_intermixed_args(argv)  # flags and key=value overrides in any order
    if Path(args.config).is_dir():  # `eval RUN_DIR`: the run directory is what --checkpoint takes
        saved = sorted(Path(args.config).glob("slurm/config.yaml")) + sorted(Path(args.config).glob("*.yaml"))
        config_hint = saved[0] if saved else "CONFIG"
        raise ValueError(
            f"{args.config} is a directory, not a config file; a run directory goes to --checkpoint: "
            f"dapo-megatron eval {config_hint} --checkpoint {args.config}"
        )
    return args


def _sample_eval_sets(cfg, hf_dir: str, sets: dict) -> dict:
    """name -> EvalSamples of every eval set, on CPU engines started here on hf_dir (rollout.engine=cpu
    without rollout.engine_urls), else on the configured engines, which load hf_dir from disk."""
    import asyncio
    import tempfile

    from transformers import AutoTokenizer

    r, t = cfg.rollout, cfg.trainer
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)  # before any engine starts: a bad model fails here
    if r.engine == "cpu" and not r.engine_urls:
        with tempfile.TemporaryDirectory() as tmp:
            secret = run_secret_path(tmp)  # these engines' own key, gone with them
            keys = ensure_secret_file(secret)
            with LocalEngines(
                hf_dir,
                num_engines=r.num_engines,
                register_dir=os.path.join(tmp, "engines"),
                seed=t.seed,
                auth_file=secret,
            ) as engines:
                return asyncio.run(_sample_on_engines(cfg, hf_dir, tokenizer, sets, engines.urls, keys))
    # the user's keys for engine_urls, else the run's secret (its SGLang engines registered)
    urls = list(r.engine_urls) or None
    return asyncio.run(_sample_on_engines(cfg, hf_dir, tokenizer, sets, urls, engine_keys(r, t.output_dir)))


async def _sample_on_engines(cfg, hf_dir: str, tokenizer, sets: dict, urls: list[str] | None, keys) -> dict:
    """The eval sampling itself (k = trainer.eval_n samples per problem at the eval temperature and
    top_p), on the engines at urls, or on those registered under <output_dir>/engines after they
    loaded hf_dir."""
    import asyncio
    from pathlib import Path

    from dapo_megatron.rollout.pool import EnginePool
    from dapo_megatron.rollout.sampler import RolloutSampler, RolloutSettings
    from dapo_megatron.trainer.evaluation.sampling import sample_eval

    r, t = cfg.rollout, cfg.trainer
    if urls:
        pool = EnginePool(urls, timeout_s=r.request_timeout_s, max_retries=r.max_retries, keys=keys)
    else:
        pool = await EnginePool.from_registry(
            str(Path(t.output_dir) / "engines"),
            min_engines=1,
            timeout_s=r.request_timeout_s,
            max_retries=r.max_retries,
            keys=keys,
        )
        await asyncio.gather(*(c.update_weights_from_disk(hf_dir) for c in pool.live_clients()))
    try:
        sampler = RolloutSampler(
            pool, tokenizer, RolloutSettings.from_sections(r, cfg.algorithm, seed=t.seed, progress=False)
        )
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        seeded = await pool.seeds_honoured()
        out = {}
        for name, records in sets.items():
            progress = ProgressLine(f"[eval] {name}:", total=len(records), unit="problems")
            out[name] = await sample_eval(
                pool,
                [sampler.prompt_ids(rec) for rec in records],
                records,
                n=t.eval_n,
                temperature=t.eval_temperature,
                top_p=t.eval_top_p,
                max_new_tokens=r.max_response_length,
                seed=t.seed,
                stop_token_ids=eos,
                per_sample_seeds=seeded,
                on_problem=progress.update,
            )
            progress.close()
        return out
    finally:
        await pool.close()


def _checkpoint_step(checkpoint: str) -> int:
    """The step of a run checkpoint (its trainer_state.json), -1 for a plain HF model."""
    from pathlib import Path

    from dapo_megatron.trainer.checkpoint.files import read_state

    try:
        return int(read_state(Path(checkpoint))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def compare(argv: list[str]) -> int:
    """`dapo-megatron eval --compare A B`: per eval set, avg@k of A and B and B - A with its
    paired-bootstrap 95% interval (the same problems resampled for both; trainer/evaluation/report.py)."""
    parser = argparse.ArgumentParser(prog="dapo-megatron eval --compare", description=compare.__doc__)
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        required=True,
        help="eval JSON files or run directories (their newest evals/step_N.json)",
    )
    if "-h" in argv or "--help" in argv:  # `eval --compare --help`: --compare would take "--help" as A
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    from dapo_megatron.trainer.evaluation.report import compare_evals, load_eval_sets

    (path_a, sets_a), (path_b, sets_b) = (load_eval_sets(x) for x in args.compare)
    print(f"A: {path_a}\nB: {path_b}")
    for row in compare_evals(sets_a, sets_b, where_a=str(path_a), where_b=str(path_b)):
        low, high = row["diff_ci95"]
        print(
            f"{row['set']}: avg@k A {row['avg_a']:.1%}  B {row['avg_b']:.1%}  B-A {row['diff']:+.1%} "
            f"[{low:+.1%}, {high:+.1%}] (95% paired bootstrap, {row['num_prompts']} problems): {row['verdict']}"
        )
    return 0
