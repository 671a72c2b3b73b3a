"""The DAPO training loop (docs/architecture.md, "One training step").

    dapo-megatron train configs/runs/tiny_cpu.yaml                      # CPU engines + actor, this machine
    dapo-megatron train configs/runs/tiny_cpu.yaml trainer.total_steps=5 --resume
    srun ... torchrun ... -m dapo_megatron.cli train CONFIG --resume    # slurm/train.sbatch (RANK is set)

Run by hand, `train` is the launcher (launch/local.py): it prepares the model, starts the CPU rollout
engines and the actor ranks under torchrun, and stops all of them on exit, error or Ctrl-C. Under
torchrun/srun (RANK set) it is one rank of the loop below; global rank 0 also drives (driver.py).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dapo_megatron import checkpointing as ckpt
from dapo_megatron.config import Config, load_config


def mini_batches(samples: list, *, group_size: int, prompts_per_update: int) -> list[list]:
    """Consecutive groups of `prompts_per_update` prompts (a group's responses never split)."""
    per = group_size * prompts_per_update
    return [samples[i: i + per] for i in range(0, len(samples), per)]


def logprob_mismatch(samples: list) -> dict[str, float]:
    """|log pi_trainer - log pi_engine| on the sampled tokens: kernels, precision and attention
    differences between the two show up here before they show up as instability."""
    diffs = [abs(a - b) for s in samples if s.rollout_logprobs for a, b in zip(s.old_logprobs, s.rollout_logprobs)]
    if not diffs:
        return {}
    t = torch.tensor(diffs, dtype=torch.float64)
    return {"mismatch/mean": float(t.mean()), "mismatch/max": float(t.max())}


def reduce_updates(updates: list[dict[str, float]]) -> dict[str, float]:
    """Per-step view of the mini-batch updates: means, except counts (sum) and maxima (max)."""
    if not updates:
        return {"actor/num_updates": 0.0}
    out = {}
    for key in updates[0]:
        values = [u[key] for u in updates]
        if key in ("num_tokens", "nonfinite", "update_skipped"):
            out[f"actor/{key}"] = float(sum(values))
        elif key in ("ratio_max",):
            out[f"actor/{key}"] = float(max(values))
        else:
            out[f"actor/{key}"] = float(sum(values) / len(values))
    out["actor/grad_norm_max"] = float(max(u["grad_norm"] for u in updates))
    out["actor/num_updates"] = float(len(updates))
    return out


def push_weights(actor, driver, *, step: int) -> dict[str, float]:
    """Collective: every rank walks actor.iter_hf_weights() in step; rank 0 sends what it yields
    (the engines then report weight version "step_<step>")."""
    named = actor.iter_hf_weights()
    if driver is not None:
        return driver.push_weights(named, step=step)
    for _ in named:
        pass
    return {}


def save_checkpoint(cfg: Config, actor, driver, *, step: int, extra: dict) -> None:
    """All ranks: write checkpoints/step_<step>.tmp, then rank 0 renames it into place."""
    final = ckpt.step_dir(cfg.trainer.output_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if driver is not None:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    actor.save(tmp / "actor")
    if cfg.trainer.save_hf:
        from dapo_megatron.weights import save_hf_checkpoint

        named = actor.iter_hf_weights()
        if driver is not None:
            save_hf_checkpoint(named, actor.hf_config, tmp / "hf", copy_from=cfg.model.path)
        else:
            for _ in named:
                pass
    if driver is not None:
        ckpt.write_state(tmp, {"step": step, "driver": driver.state_dict(), **extra})
    dist.barrier()
    ckpt.write_manifest(tmp)  # last: sizes + checksums of everything above (collective)
    if driver is not None:
        ckpt.commit(tmp, final, keep=cfg.trainer.keep_checkpoints, keep_best=cfg.trainer.keep_best_checkpoint)
    dist.barrier()


def run_worker(cfg: Config, *, resume: bool) -> int:
    from dapo_megatron import console

    console.quiet_backend_warnings()  # before megatron-core is imported (console.py: which, and why)
    from dapo_megatron.actor import parallel
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.offload import trainer_memory_gb
    from dapo_megatron.actor.reference import ReferencePolicy
    from dapo_megatron.driver import Driver
    from dapo_megatron.launch.signals import PreemptionSignal
    from dapo_megatron.metrics import MetricsLogger

    parallel.init_distributed()
    tr, run_dir = cfg.trainer, Path(cfg.trainer.output_dir)
    with parallel.model_parallel(tp=cfg.actor.tp, pp=cfg.actor.pp, cp=cfg.actor.cp, vpp=cfg.actor.vpp, ep=cfg.actor.ep,
                                 etp=cfg.actor.etp, seed=tr.seed):
        actor = Actor(cfg, cfg.model.path)
        ref = ReferencePolicy(cfg, cfg.model.path) if cfg.algorithm.use_kl else None  # frozen, off-device when idle
        is_driver = dist.get_rank() == 0
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        driver = Driver(cfg, model_dir=cfg.model.path, run_dir=run_dir, backend=backend) if is_driver else None
        if driver:
            console.actor_ready(cfg)
        latest = ckpt.newest_valid_checkpoint(run_dir) if resume else None  # verified against its manifest
        state = ckpt.read_state(latest) if latest else {"step": 0, "nonfinite_in_row": 0}
        if latest:
            actor.load(latest / "actor")
            if driver:
                driver.load_state_dict(state["driver"])
            push_weights(actor, driver, step=int(state["step"]))  # engines start from the base model
        metrics = MetricsLogger(run_dir, wandb_mode=tr.wandb_mode, wandb_project=tr.wandb_project,
                                config=cfg.to_dict(), resume_step=int(state["step"]) if latest else None) if driver else None
        preempt = PreemptionSignal().install()
        nonfinite_in_row = int(state["nonfinite_in_row"])
        if driver and latest is None and tr.eval_every:
            metrics.log(0, driver.evaluate())  # the starting point of the curve
        for step in range(int(state["step"]), tr.total_steps):
            t0 = time.perf_counter()
            memory = trainer_memory_gb(phase="rollout", actor=actor, ref=ref)  # what the trainer holds while engines generate
            samples, log = driver.rollout() if driver else (None, {})
            box = [samples]
            dist.broadcast_object_list(box, src=0)
            samples = box[0]
            t1 = time.perf_counter()
            old, updates = None, []  # no kept group (on_gen_batches_exhausted=train): no update
            if samples:  # every rank holds the same list, so every rank takes the same branch
                old = actor.logprobs(samples)
                for sample, lp in zip(samples, old.logprobs):
                    sample.old_logprobs = lp.tolist()
                if ref is not None:
                    for sample, lp in zip(samples, ref.logprobs(samples).logprobs):
                        sample.ref_logprobs = lp.tolist()
            t2 = time.perf_counter()
            if samples:
                updates = [actor.train(mb, step=step) for mb in
                           mini_batches(samples, group_size=cfg.rollout.n, prompts_per_update=tr.mini_batch_size)]
            t3 = time.perf_counter()
            memory.update(trainer_memory_gb(phase="train", actor=actor, ref=ref))
            if updates:
                log.update(push_weights(actor, driver, step=step + 1))
            t4 = time.perf_counter()
            nonfinite_in_row = nonfinite_in_row + 1 if any(u["nonfinite"] for u in updates) else 0
            if driver:
                train_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
                log.update(reduce_updates(updates))
                log.update(memory)
                log.update(logprob_mismatch(samples))
                log.update(old.routing if samples else {})  # MoE: routing agreement with the engine
                log.update(driver.engine_events())  # engines dropped / back / rejoined: console lines + counts
                log["actor/entropy_old"] = float(torch.cat(old.entropies).mean()) if samples else 0.0
                log.update({"time/gen_s": t1 - t0, "time/logprob_s": t2 - t1, "time/train_s": t3 - t2,
                            "time/sync_s": t4 - t3, "time/step_s": t4 - t0,
                            "throughput/train_tok_s": train_tokens / max(t3 - t2, 1e-9),
                            "nonfinite_in_row": float(nonfinite_in_row)})
                if tr.eval_every and (step + 1) % tr.eval_every == 0:
                    log.update(driver.evaluate())
                metrics.log(step + 1, log)
            if nonfinite_in_row >= tr.max_nonfinite_in_row:
                last = ckpt.latest_checkpoint(run_dir)
                raise RuntimeError(f"{nonfinite_in_row} updates in a row had a NaN/inf loss or grad norm "
                                   f"(trainer.max_nonfinite_in_row={tr.max_nonfinite_in_row}); stopping. "
                                   f"Last good checkpoint: {last}")
            last_step = step + 1 == tr.total_steps
            stop = preempt.should_stop()  # collective: every rank decides the same at the same step
            if (tr.save_every and (step + 1) % tr.save_every == 0) or last_step or stop:
                save_checkpoint(cfg, actor, driver, step=step + 1, extra={"nonfinite_in_row": nonfinite_in_row,
                                                                          "eval": log.get("eval/avg@k")})
            if stop and not last_step:
                if driver:
                    print(f"[train] {preempt.received.name if preempt.received else 'signal'}: checkpoint of "
                          f"step {step + 1} written; exiting so the job can be requeued", flush=True)
                break
        if driver:
            metrics.close()
            driver.close()
    return 0


def _run_worker_recorded(cfg, *, resume: bool) -> int:
    """run_worker, with an exception written to the error file torchrun gives each rank
    (TORCHELASTIC_ERROR_FILE), so torchrun's closing "Root Cause" block shows the first failing rank's
    whole traceback, after the other ranks' errors, rather than "To enable traceback see: ..."
    (torch/distributed/elastic/multiprocessing/errors/__init__.py, `record`)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(run_worker)(cfg, resume=resume)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dapo-megatron train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="clear a previous run in trainer.output_dir first")
    parser.add_argument("--skip-plan", action="store_true", help="launch without checking the memory plan first")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if "RANK" in os.environ:
        return _run_worker_recorded(cfg, resume=args.resume)
    from dapo_megatron.launch.local import launch_training

    return launch_training(cfg, args.config, args.overrides, resume=args.resume, overwrite=args.overwrite,
                           skip_plan=args.skip_plan)
