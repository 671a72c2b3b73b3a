"""The DAPO training loop (docs/architecture.md, "One training step").

    dapo-megatron train configs/runs/tiny_cpu.yaml                      # CPU engines + actor, this machine
    dapo-megatron train configs/runs/tiny_cpu.yaml trainer.total_steps=5 --resume
    srun ... torchrun ... -m dapo_megatron.cli train CONFIG --resume    # slurm/train.sbatch (RANK is set)

Run by hand, `train` is the launcher (launch/local.py): it prepares the model, starts the CPU rollout
engines and the actor ranks under torchrun, and stops all of them on exit, error or Ctrl-C. Under
torchrun/srun (RANK set) it is one rank of the loop below. What each rank does is named by its
roles (dataplane/roles.py): the driver (global rank 0) talks to the engines and builds the batch;
every rank trains on its data-parallel share; trainer/placement.py says what moves between phases.
"""

from __future__ import annotations

from pathlib import Path

from dapo_megatron.trainer import run_checkpoint as ckpt
from dapo_megatron.config import Config
from dapo_megatron.dataplane.step_metrics import Clock, reduce_updates
from dapo_megatron.trainer.recovery import (EnginesLost, evaluate_with_recovery, rollout_with_recovery,
                                            save_before_stopping, transfer_with_recovery)


def dapo_step(cfg: Config, step: int, *, roles, actor, ref, driver, placement) -> dict[str, float]:
    """One DAPO step on every rank; the step's metrics (complete on the driver)."""
    from dapo_megatron.actor import parallel
    from dapo_megatron.dataplane.batch import RolloutBatch
    from dapo_megatron.dataplane.step_metrics import old_logprob_metrics
    from dapo_megatron.dataplane.scatter import scatter_batch
    from dapo_megatron.trainer.driver import fill_advantages

    clock, log, batch = Clock(), {}, None
    placement.before_rollout(actor)  # colocated: the actor leaves the device, the engines come back
    log.update(placement.ledger("rollout", actor, ref))  # who holds what while the engines generate
    # dynamic sampling over scored groups (rewards + overlong shaping); redone after a re-sync if the
    # only engine died (every rank takes part: trainer/recovery.py)
    rolled = rollout_with_recovery(cfg, step, roles=roles, actor=actor, driver=driver, placement=placement)
    if roles.driver:
        groups, log_rollout = rolled
        fill_advantages(groups, eps=cfg.algorithm.advantage_eps)  # group-normalised advantages
        batch = RolloutBatch.from_groups(groups)  # the step as tensors, built once
        del groups  # no per-token Python list outlives the batch
        log.update(log_rollout)
    clock.lap("gen")
    placement.before_train(actor)  # colocated: the engines release weights and KV cache, the actor onloads
    share, scattered = scatter_batch(batch, groups=parallel, settings=actor.pack_settings,  # each DP rank: its token-balanced share
                                     sequences_per_mini_batch=cfg.rollout.n * cfg.trainer.mini_batch_size)
    clock.lap("scatter")
    updates = []
    if share.step_sequences:  # no kept group (on_gen_batches_exhausted=train): no update, no transfer
        old = actor.logprobs(share)  # pi_old, kept on the ranks that computed it
        share.batch.old_logprobs = old.logprobs
        if ref is not None:
            share.batch.ref_logprobs = ref.logprobs(share).logprobs
        log.update(old_logprob_metrics(share.batch, old.logprobs, old.entropies, reports=roles.reports))
        log.update(old.routing)  # MoE: routing agreement with the engine (reduced over every rank)
        clock.lap("logprob")
        updates = [actor.train(mini, step=step) for mini in share.mini_batches()]  # token-mean over each mini-batch
        clock.lap("train")
    log.update(placement.ledger("train", actor, ref))  # who holds what while the actor trains
    if share.step_sequences:
        # the engines get weight version step+1 (another pass if one died mid-sync: trainer/recovery.py)
        log.update(transfer_with_recovery(placement, actor, step=step + 1, roles=roles, driver=driver))
        clock.lap("sync")
    log.update(reduce_updates(updates))
    log.setdefault("actor/entropy_old", 0.0)
    log.update(clock.metrics())
    if roles.driver:
        log["throughput/train_tok_s"] = batch.num_tokens / max(clock.laps.get("train", 0.0), 1e-9)
        log["dataplane/batch_mb"] = batch.nbytes() / 2**20
        log.update(driver.engine_events())  # engines dropped / back / rejoined: console lines + counts
    return log


def run_worker(cfg: Config, *, resume: bool) -> int:
    from dapo_megatron.trainer import console

    console.quiet_backend_warnings()  # before megatron-core is imported (trainer/console.py: which, and why)
    from dapo_megatron.actor import parallel
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.ref_policy import ReferencePolicy
    from dapo_megatron.dataplane.roles import RankRoles
    from dapo_megatron.trainer.driver import Driver
    from dapo_megatron.trainer.preemption import PreemptionSignal
    from dapo_megatron.trainer.run_log import MetricsLogger
    from dapo_megatron.trainer.placement import make_placement

    parallel.init_distributed()
    tr, run_dir = cfg.trainer, Path(cfg.trainer.output_dir)
    with parallel.model_parallel(tp=cfg.actor.tp, pp=cfg.actor.pp, cp=cfg.actor.cp, vpp=cfg.actor.vpp, ep=cfg.actor.ep,
                                 etp=cfg.actor.etp, seed=tr.seed):
        roles = RankRoles.current(parallel)
        actor = Actor(cfg, cfg.model.path)
        ref = ReferencePolicy(cfg, cfg.model.path) if cfg.algorithm.use_kl else None  # frozen, off-device when idle
        driver = Driver(cfg, model_dir=cfg.model.path, run_dir=run_dir, backend=_backend()) if roles.driver else None
        if roles.driver:
            console.actor_ready(cfg)
        placement = make_placement(cfg, roles=roles, driver=driver)
        latest = ckpt.newest_valid_checkpoint(run_dir) if resume else None  # verified against its manifest
        state = ckpt.read_state(latest) if latest else {"step": 0, "nonfinite_in_row": 0}
        if latest:
            actor.load(latest / "actor")
            if driver:
                driver.load_state_dict(state["driver"])
            # the engines start from the base model
            transfer_with_recovery(placement, actor, step=int(state["step"]), roles=roles, driver=driver)
        metrics = MetricsLogger(run_dir, wandb_mode=tr.wandb_mode, wandb_project=tr.wandb_project,
                                config=cfg.to_dict(), resume_step=int(state["step"]) if latest else None) if driver else None
        preempt = PreemptionSignal().install()
        nonfinite_in_row = int(state["nonfinite_in_row"])
        if latest is None and tr.eval_every:  # the starting point of the curve (every rank: a re-sync may be needed)
            scores = evaluate_with_recovery(cfg, updates=0, roles=roles, actor=actor, driver=driver, placement=placement)
            if driver:
                metrics.log(0, scores)
        for step in range(int(state["step"]), tr.total_steps):
            try:
                log = dapo_step(cfg, step, roles=roles, actor=actor, ref=ref, driver=driver, placement=placement)
            except EnginesLost as err:  # no engine came back: keep what was trained, name the cause
                actor.onload()  # colocated: it was offloaded for the rollout (no engine is left to make room for)
                saved = save_before_stopping(cfg, actor, driver, roles, step=step,
                                             extra={"nonfinite_in_row": nonfinite_in_row, "eval": None})
                raise EnginesLost(f"{err}; {saved}") from None
            nonfinite_in_row = nonfinite_in_row + 1 if log.get("actor/nonfinite") else 0
            log["nonfinite_in_row"] = float(nonfinite_in_row)
            if tr.eval_every and (step + 1) % tr.eval_every == 0:  # an engine lost here costs the eval, never the step
                log.update(evaluate_with_recovery(cfg, updates=step + 1, roles=roles, actor=actor, driver=driver,
                                                  placement=placement))
            if driver:
                metrics.log(step + 1, log)
            if nonfinite_in_row >= tr.max_nonfinite_in_row:
                raise RuntimeError(f"{nonfinite_in_row} updates in a row had a NaN/inf loss or grad norm "
                                   f"(trainer.max_nonfinite_in_row={tr.max_nonfinite_in_row}); stopping. "
                                   f"Last good checkpoint: {ckpt.latest_checkpoint(run_dir)}")
            last_step = step + 1 == tr.total_steps
            stop = preempt.should_stop()  # collective: every rank decides the same at the same step
            if (tr.save_every and (step + 1) % tr.save_every == 0) or last_step or stop:
                with placement.actor_on_device(actor, step=step + 1):  # colocated: the engines make room
                    ckpt.save_step(cfg, actor, driver, roles, step=step + 1,
                                   extra={"nonfinite_in_row": nonfinite_in_row, "eval": log.get("eval/avg@k")})
            if stop and not last_step:
                if driver:
                    print(f"[train] {preempt.received.name if preempt.received else 'signal'}: checkpoint of "
                          f"step {step + 1} written; exiting so the job can be requeued", flush=True)
                break
        if driver:
            metrics.close()
            driver.close()
    return 0


def run_worker_recorded(cfg, *, resume: bool) -> int:
    """run_worker, with an exception written to the error file torchrun gives each rank
    (TORCHELASTIC_ERROR_FILE), so torchrun's closing "Root Cause" block shows the first failing rank's
    whole traceback, after the other ranks' errors, rather than "To enable traceback see: ..."
    (torch/distributed/elastic/multiprocessing/errors/__init__.py, `record`)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(run_worker)(cfg, resume=resume)


def _backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"
