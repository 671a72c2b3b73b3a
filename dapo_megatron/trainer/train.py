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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dapo_megatron.algo import ADVANTAGES
from dapo_megatron.config import Config
from dapo_megatron.dataplane.batch import RolloutBatch
from dapo_megatron.trainer import run_checkpoint as ckpt
from dapo_megatron.trainer.eval_report import headline_avg
from dapo_megatron.trainer.recovery import EnginesLost, FaultPolicy, save_before_stopping
from dapo_megatron.trainer.step_record import StepRecord


@dataclass
class Run:
    """What every rank's step works with. Which rank does what is said once, by `roles`
    (dataplane/roles.py): `driver` is the Driver exactly where roles.driver, None elsewhere."""

    roles: Any
    actor: Any
    ref: Any  # the KL reference policy, None without algorithm.use_kl
    driver: Any
    placement: Any  # what moves between phases: disaggregated or colocated (trainer/placement.py)
    faults: FaultPolicy  # what every rank does when engines fail (trainer/recovery.py)
    advantage: str  # algorithm.advantage: the name of its estimator in algo's ADVANTAGES
    advantage_eps: float
    sequences_per_mini_batch: int  # rollout.n * trainer.mini_batch_size


def dapo_step(step: int, run: Run) -> dict[str, float]:
    """One DAPO step on every rank (docs/algorithm.md); the step's metrics, complete on the driver."""
    roles, actor, ref, placement = run.roles, run.actor, run.ref, run.placement
    record = StepRecord()  # every lap and metric of the step

    # 1. rollout with dynamic sampling: groups of rollout.n responses, each rewarded (correctness +
    #    overlong shaping), groups whose responses all agree dropped and refilled (rollout/sampler.py)
    placement.before_rollout(actor)  # colocated: the actor leaves the device, the engines come back
    record.add(placement.ledger("rollout", actor, ref))
    groups, rollout_stats = run.faults.rollout(step)  # the driver's; (None, {}) on the other ranks
    # 2. group advantages (algorithm.advantage; DAPO's A = (R - mean_g R) / (std_g R + eps)), then the
    #    step as tensors, built once
    batch = with_group_advantages(groups, estimator=run.advantage, eps=run.advantage_eps) if roles.driver else None
    del groups  # no per-token Python list outlives the batch
    record.add(rollout_stats).lap("gen")

    placement.before_train(actor)  # colocated: the engines release weights and KV cache, the actor onloads
    share = scatter(batch, actor, sequences_per_mini_batch=run.sequences_per_mini_batch)
    record.lap("scatter")
    updates = []
    if share.step_sequences:  # no kept group (on_gen_batches_exhausted=train): no update, no transfer
        # 3. old log-probs: pi_old (and the KL reference's), on the ranks that hold the share
        record.add(old_logprobs(share, actor, ref, reports=roles.reports)).lap("logprob")
        # 4. the mini-batch updates: the clipped policy loss, token-mean over each mini-batch
        updates = [actor.train(mini, step=step) for mini in share.mini_batches()]
        record.lap("train")
    record.add(placement.ledger("train", actor, ref))
    if share.step_sequences:
        # 5. weight transfer: the engines get weight version step + 1
        record.add(run.faults.transfer(step + 1)).lap("sync")
    return record.finish(updates, batch=batch, driver=run.driver)


def with_group_advantages(groups: list[list], *, eps: float, estimator: str = "grpo") -> RolloutBatch:
    """Each sample's group-relative advantage (algo/advantages.py: the registered `estimator`), then the
    step's RolloutBatch."""
    samples = [s for g in groups for s in g]
    if samples:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        index = torch.tensor([gi for gi, g in enumerate(groups) for _ in g])
        for sample, adv in zip(samples, ADVANTAGES.get(estimator)(rewards, index, eps=eps).tolist()):
            sample.advantage = adv
    return RolloutBatch.from_groups(groups)


def scatter(batch: RolloutBatch | None, actor, *, sequences_per_mini_batch: int):
    """Each data-parallel rank's token-balanced share of the driver's batch (dataplane/scatter.py)."""
    from dapo_megatron.dataplane.scatter import scatter_batch

    share, _ = scatter_batch(batch, layout=actor.layout, settings=actor.pack_settings,
                             sequences_per_mini_batch=sequences_per_mini_batch)
    return share


def old_logprobs(share, actor, ref, *, reports: bool) -> dict[str, float]:
    """pi_old (and pi_ref with the KL penalty) into the share's batch; their metrics: entropy,
    trainer/engine mismatch and, for MoE models, routing agreement with the engine."""
    from dapo_megatron.dataplane.step_metrics import old_logprob_metrics

    old = actor.logprobs(share)
    share.batch.old_logprobs = old.logprobs
    if ref is not None:
        share.batch.ref_logprobs = ref.logprobs(share).logprobs
    return {**old_logprob_metrics(share.batch, old.logprobs, old.entropies, reports=reports), **old.routing}


def run_worker(cfg: Config, *, resume: bool) -> int:
    from dapo_megatron.trainer import console

    console.quiet_backend_warnings()  # before megatron-core is imported (trainer/console.py: which, and why)
    from dapo_megatron.actor import parallel
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.trainer.settings import actor_settings
    from dapo_megatron.actor.ref_policy import ReferencePolicy
    from dapo_megatron.dataplane.roles import RankRoles
    from dapo_megatron.trainer.driver import Driver
    from dapo_megatron.trainer.preemption import PreemptionSignal
    from dapo_megatron.trainer.run_log import MetricsLogger
    from dapo_megatron.trainer.placement import make_placement

    parallel.init_distributed()
    tr, run_dir = cfg.trainer, Path(cfg.trainer.output_dir)
    with parallel.model_parallel(tp=cfg.actor.tp, pp=cfg.actor.pp, cp=cfg.actor.cp, vpp=cfg.actor.vpp, ep=cfg.actor.ep,
                                 etp=cfg.actor.etp, seed=tr.seed) as layout:
        roles = RankRoles.current(layout)
        actor = Actor(actor_settings(cfg), cfg.model.path, layout)
        ref = ReferencePolicy(actor_settings(cfg), cfg.model.path, layout) if cfg.algorithm.use_kl else None  # frozen, off-device when idle
        driver = Driver(cfg, model_dir=cfg.model.path, run_dir=run_dir) if roles.driver else None
        if roles.driver:
            console.actor_ready(cfg)
        placement = make_placement(cfg, roles=roles, driver=driver)
        faults = FaultPolicy(roles=roles, placement=placement, actor=actor, driver=driver,
                             engine_restarts=cfg.rollout.engine_restarts)
        run = Run(roles=roles, actor=actor, ref=ref, driver=driver, placement=placement, faults=faults,
                  advantage=cfg.algorithm.advantage, advantage_eps=cfg.algorithm.advantage_eps,
                  sequences_per_mini_batch=cfg.rollout.n * cfg.trainer.mini_batch_size)
        latest = ckpt.newest_valid_checkpoint(run_dir) if resume else None  # verified against its manifest
        state = ckpt.read_state(latest) if latest else {"step": 0, "nonfinite_in_row": 0}
        if latest:
            actor.load(latest / "actor")
            if roles.driver:
                driver.load_state_dict(state["driver"])
            faults.transfer(int(state["step"]))  # the engines start from the base model
        metrics = MetricsLogger(run_dir, wandb_mode=tr.wandb_mode, wandb_project=tr.wandb_project,
                                config=cfg.to_dict(), resume_step=int(state["step"]) if latest else None) if roles.driver else None
        preempt = PreemptionSignal().install()
        nonfinite_in_row = int(state["nonfinite_in_row"])
        if latest is None and tr.eval_every:  # the starting point of the curve (every rank: a re-sync may be needed)
            scores = faults.evaluate(0)
            if roles.driver:
                metrics.log(0, scores)
        for step in range(int(state["step"]), tr.total_steps):
            try:
                log = dapo_step(step, run)
            except EnginesLost as err:  # no engine came back: keep what was trained, name the cause
                actor.onload()  # colocated: it was offloaded for the rollout (no engine is left to make room for)
                saved = save_before_stopping(cfg, actor, driver, roles, step=step,
                                             extra={"nonfinite_in_row": nonfinite_in_row, "eval": None})
                raise EnginesLost(f"{err}; {saved}") from None
            nonfinite_in_row = nonfinite_in_row + 1 if log.get("actor/nonfinite") else 0
            log["nonfinite_in_row"] = float(nonfinite_in_row)
            if tr.eval_every and (step + 1) % tr.eval_every == 0:  # an engine lost here costs the eval, never the step
                log.update(faults.evaluate(step + 1))
            if roles.driver:
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
                                   extra={"nonfinite_in_row": nonfinite_in_row,
                                          "eval": headline_avg(log, list(cfg.data.eval_sets))})
            if stop and not last_step:
                if roles.driver:
                    print(preempt.stop_line(step + 1, ckpt.step_dir(run_dir, step + 1)), flush=True)
                break
        if roles.driver:
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
