"""The commands that start processes on this machine: `dapo-megatron train` (the local launcher, or one
rank under torchrun/srun) and `dapo-megatron eval` (CPU engines on a checkpoint, or the run's engines).
They sit here, above trainer/, because by hand they start engines (launch/local.py, launch/engines.py).
"""

from __future__ import annotations

import argparse
import os


from dapo_megatron.config import load_config


def train(argv: list[str]) -> int:
    """`dapo-megatron train`: by hand, the local launcher (launch/local.py); under torchrun/srun (RANK
    set), one rank of the loop (trainer/train.py)."""
    from dapo_megatron.trainer import train as loop

    parser = argparse.ArgumentParser(prog="dapo-megatron train", description=loop.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="clear a previous run in trainer.output_dir first")
    parser.add_argument("--skip-plan", action="store_true", help="launch without checking the memory plan first")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if "RANK" in os.environ:
        from dapo_megatron.launch.lifeline import die_with_parent

        die_with_parent()  # a rank ends with torchrun, even when torchrun is SIGKILLed (launch/lifeline.py)
        os.register_at_fork(after_in_child=die_with_parent)  # so do its fork children (Megatron's checkpoint writers)
        return loop.run_worker_recorded(cfg, resume=args.resume)
    from dapo_megatron.launch.local import launch_training

    return launch_training(cfg, args.config, args.overrides, resume=args.resume, overwrite=args.overwrite,
                           skip_plan=args.skip_plan)


def evaluate(argv: list[str]) -> int:
    """dapo-megatron eval CONFIG [key=value ...] [--checkpoint DIR] [--output FILE.json]

    avg@k and pass@k (k = trainer.eval_n) of a checkpoint on the config's eval set with the eval
    sampling settings (trainer.eval_temperature / eval_top_p; DAPO: k=32, T=1.0, top_p=0.7).
    rollout.engine=cpu starts CPU engines on the checkpoint; otherwise the engines of
    rollout.engine_urls or <output_dir>/engines load it with update_weights_from_disk.
    DIR is a run checkpoint (checkpoints/step_N), a HF model directory, or a run directory (its
    newest complete checkpoint); without --checkpoint, the config's trainer.output_dir.
    """
    import argparse
    import asyncio
    import json
    import os
    import tempfile
    from pathlib import Path

    from dapo_megatron.trainer.evaluate import eval_metrics, resolve_checkpoint, sample_correct

    parser = argparse.ArgumentParser(prog="dapo-megatron eval", description=evaluate.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--checkpoint", default="",
                        help="run checkpoint, HF model or run directory (default: the config's trainer.output_dir)")
    parser.add_argument("--output", default="", help="JSON results (default <checkpoint>/eval.json)")
    args = parser.parse_args(argv)
    if Path(args.config).is_dir():  # `eval RUN_DIR`: the run directory is what --checkpoint takes
        saved = sorted(Path(args.config).glob("slurm/config.yaml")) + sorted(Path(args.config).glob("*.yaml"))
        config_hint = saved[0] if saved else "CONFIG"
        raise ValueError(f"{args.config} is a directory, not a config file; a run directory goes to --checkpoint: "
                         f"dapo-megatron eval {config_hint} --checkpoint {args.config}")
    cfg = load_config(args.config, args.overrides)
    checkpoint, hf_dir = resolve_checkpoint(args.checkpoint or cfg.trainer.output_dir)
    if checkpoint != args.checkpoint:
        print(f"[eval] checkpoint: {checkpoint}", flush=True)
    output = Path(args.output or Path(checkpoint) / "eval.json")

    from transformers import AutoTokenizer

    from dapo_megatron.data.datasets import train_and_eval_records
    from dapo_megatron.rollout.auth import engine_keys, ensure_secret_file, run_secret_path
    from dapo_megatron.rollout.pool import EnginePool
    from dapo_megatron.rollout.sampler import RolloutSampler, RolloutSettings

    _, records = train_and_eval_records(cfg.data)
    if not records:
        raise ValueError("the eval set is empty: set data.eval_path (or data.synthetic.num_eval)")
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    t, r = cfg.trainer, cfg.rollout

    async def run(urls: list[str] | None, keys):  # -> the [P, k] table of correct samples
        if urls:
            pool = EnginePool(urls, timeout_s=r.request_timeout_s, max_retries=r.max_retries, keys=keys)
        else:
            pool = await EnginePool.from_registry(str(Path(t.output_dir) / "engines"), min_engines=1,
                                                  timeout_s=r.request_timeout_s, max_retries=r.max_retries,
                                                  keys=keys)
            await asyncio.gather(*(c.update_weights_from_disk(hf_dir) for c in pool.live_clients()))
        try:
            sampler = RolloutSampler(pool, tokenizer, RolloutSettings.from_sections(r, cfg.algorithm, seed=t.seed, progress=False))
            ids = [sampler.prompt_ids(rec) for rec in records]
            eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
            return await sample_correct(pool, ids, records, n=t.eval_n, temperature=t.eval_temperature,
                                        top_p=t.eval_top_p, max_new_tokens=r.max_response_length, seed=t.seed,
                                        stop_token_ids=eos, per_sample_seeds=await pool.seeds_honoured())
        finally:
            await pool.close()

    if r.engine == "cpu" and not r.engine_urls:
        from dapo_megatron.launch.engines import LocalEngines

        with tempfile.TemporaryDirectory() as tmp:
            secret = run_secret_path(tmp)  # these engines' own key, gone with them
            keys = ensure_secret_file(secret)
            with LocalEngines(hf_dir, num_engines=r.num_engines, register_dir=os.path.join(tmp, "engines"),
                              seed=t.seed, auth_file=secret) as engines:
                correct = asyncio.run(run(engines.urls, keys))
    else:  # the user's keys for engine_urls, else the run's secret (its SGLang engines registered)
        correct = asyncio.run(run(list(r.engine_urls) or None, engine_keys(r, t.output_dir)))
    result = {"checkpoint": checkpoint, "model": hf_dir, "temperature": t.eval_temperature, "top_p": t.eval_top_p,
              **{key.removeprefix("eval/"): value for key, value in eval_metrics(correct).items()},
              "num_prompts": len(records), "k": t.eval_n,  # counts: ints (the logged eval/k is a float)
              "per_prompt_acc": correct.mean(dim=1).tolist()}
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = output.with_name(f".{output.name}.tmp")
    tmp_out.write_text(json.dumps(result, indent=1))
    tmp_out.replace(output)
    print(json.dumps({k: v for k, v in result.items() if k != "per_prompt_acc"}))
    return 0
