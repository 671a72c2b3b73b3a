"""One rank of the DAPO training loop (docs/architecture.md, "One training step"): `dapo-megatron train`
under torchrun/srun runs train_rank_recorded (launch/local/commands.py, whose TRAIN_HELP is the command's
--help: how the command starts the launcher or a rank)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dapo_megatron.actor import parallel
from dapo_megatron.actor.actor import Actor
from dapo_megatron.actor.ref_policy import ReferencePolicy
from dapo_megatron.algo import ADVANTAGES
from dapo_megatron.config import Config
from dapo_megatron.dataplane.batch import RolloutBatch
from dapo_megatron.dataplane.scatter import scatter_batch
from dapo_megatron.dataplane.share import BatchShare
from dapo_megatron.distributed.layout import ParallelLayout
from dapo_megatron.distributed.roles import RankRoles
from dapo_megatron.trainer import console, console_log, heap
from dapo_megatron.trainer.checkpoint.checkpointer import Checkpointer
from dapo_megatron.trainer.checkpoint.files import TrainerState
from dapo_megatron.trainer.driver import Driver
from dapo_megatron.trainer.evaluation.evaluator import Evaluator
from dapo_megatron.trainer.evaluation.report import headline_avg
from dapo_megatron.trainer.metrics_log import MetricsLogger
from dapo_megatron.trainer.nonfinite import NonFiniteGuard
from dapo_megatron.trainer.placement import Placement, make_placement
from dapo_megatron.trainer.preemption import PreemptionSignal
from dapo_megatron.trainer.recovery import EnginesLost, FaultPolicy
from dapo_megatron.trainer.settings import actor_settings
from dapo_megatron.trainer.step_metrics import old_logprob_metrics
from dapo_megatron.trainer.step_record import StepRecord

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # torchrun's per-rank error file (torch.distributed.elastic)


@dataclass
class Components:
    """What every rank's step works with. Which rank does what is said once, by `roles`
    (distributed/roles.py): `driver` is the Driver exactly where roles.driver, None elsewhere."""

    roles: RankRoles
    actor: Actor
    ref: ReferencePolicy | None  # the KL reference policy, None without algorithm.use_kl
    driver: Driver | None
    placement: Placement  # what moves between phases: disaggregated or colocated (trainer/placement.py)
    faults: FaultPolicy  # what every rank does when engines fail (trainer/recovery.py)
    advantage: str  # algorithm.advantage: the name of its estimator in algo's ADVANTAGES
    advantage_eps: float
    sequences_per_mini_batch: int  # rollout.n * trainer.mini_batch_size


def dapo_step(step: int, run: Components) -> dict[str, float]:
    """One DAPO step on every rank (docs/algorithm.md); the step's metrics, complete on the driver."""
    roles, actor, ref, placement = run.roles, run.actor, run.ref, run.placement
    record = StepRecord()  # every lap and metric of the step

    # 1. rollout with dynamic sampling: groups of rollout.n responses, each rewarded (correctness +
    #    overlong shaping), groups whose responses all agree dropped and refilled (rollout/sampler.py)
    placement.before_rollout(actor)  # colocated: the actor leaves the device, the engines come back
    record.add(placement.ledger("rollout", actor, ref))
    #    (the driver's rollout, redone after a weight re-sync when every engine was lost: trainer/recovery.py)
    groups, rollout_stats = run.faults.around_rollout(step=step)  # the driver's; (None, {}) off the driver
    # 2. group advantages (algorithm.advantage; DAPO's A = (R - mean_g R) / (std_g R + eps)), then the
    #    step as tensors, built once
    batch = None
    if roles.driver:
        assert groups is not None  # the driver's rollout returns its groups
        batch = with_group_advantages(groups, estimator=run.advantage, eps=run.advantage_eps)
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


def scatter(batch: RolloutBatch | None, actor: Actor, *, sequences_per_mini_batch: int) -> BatchShare:
    """Each data-parallel rank's token-balanced share of the driver's batch (dataplane/scatter.py)."""
    share, _ = scatter_batch(
        batch, layout=actor.layout, settings=actor.pack_settings, sequences_per_mini_batch=sequences_per_mini_batch
    )
    return share


def old_logprobs(share, actor, ref, *, reports: bool) -> dict[str, float]:
    """pi_old (and pi_ref with the KL penalty) into the share's batch; their metrics: entropy,
    trainer/engine mismatch and, for MoE models, routing agreement with the engine."""
    if actor.settings.algorithm.bypass_old_logprobs:
        return bypass_old_logprobs(share, ref)
    old = actor.logprobs(share)
    share.batch.old_logprobs = old.logprobs
    if ref is not None:
        share.batch.ref_logprobs = ref.logprobs(share).logprobs
    metrics = old_logprob_metrics(
        share.batch, old.logprobs, old.entropies, reports=reports, correction=actor.objective.rollout_correction
    )
    return {**metrics, **old.routing}


def bypass_old_logprobs(share, ref) -> dict[str, float]:
    """algorithm.bypass_old_logprobs: the engine's log-probs stand in for pi_old, so the trainer's forward
    over every token of the step is skipped (the PPO ratio and its clip are then taken against the
    engine's policy; nothing is measured against it: docs/algorithm.md 11)."""
    if share.batch.num_sequences and share.batch.rollout_logprobs is None:
        raise ValueError("algorithm.bypass_old_logprobs=true needs the engines' log-probs (the batch has none)")
    share.batch.old_logprobs = share.batch.rollout_logprobs
    if ref is not None:
        share.batch.ref_logprobs = ref.logprobs(share).logprobs
    return {}


def train_rank(cfg: Config, *, resume: bool) -> int:
    """One rank of the run: the components below each decide their own timing, so the loop reads as
    the algorithm's outer loop. Whatever the rank opens is closed on every way out (the last step, a
    stop request, a non-finite stop, EnginesLost, an exception in a step): `finish` unwinds it in
    reverse order (the metrics: wandb finished, curves.png; the driver: timeline, weight group, engine
    pool), after the cause of a failure is recorded (first_cause_recorded)."""
    console.quiet_backend_warnings()  # before megatron-core is imported (trainer/console.py: which, and why)

    parallel.init_distributed()
    if torch.distributed.get_rank() == 0:  # the driver: its console (the step table) also to logs/train.log
        console_log.start(cfg.trainer.output_dir)
    tr = cfg.trainer
    with (
        parallel.model_parallel(
            tp=cfg.actor.tp,
            pp=cfg.actor.pp,
            cp=cfg.actor.cp,
            vpp=cfg.actor.vpp,
            ep=cfg.actor.ep,
            etp=cfg.actor.etp,
            seed=tr.seed,
        ) as layout,
        contextlib.ExitStack() as finish,
        first_cause_recorded(),
    ):
        run = build_components(cfg, layout, finish=finish)
        checkpointer = Checkpointer(cfg, actor=run.actor, driver=run.driver, roles=run.roles, placement=run.placement)
        resumed = checkpointer.resume() if resume else None  # verified against its manifest
        if resumed is not None:
            run.faults.transfer(resumed.step)  # the engines start from the base model
        metrics = finish.enter_context(open_metrics(cfg, resumed)) if run.roles.driver else None
        train_steps(
            cfg, run, checkpointer=checkpointer, metrics=metrics, state=resumed or TrainerState(), fresh=resumed is None
        )
    return 0


def train_steps(
    cfg: Config,
    run: Components,
    *,
    checkpointer: Checkpointer,
    metrics: MetricsLogger | None,
    state: TrainerState,
    fresh: bool,
) -> None:
    """The outer loop, from `state`'s step to trainer.total_steps (or a stop request): each step logged,
    evaluated and checkpointed when its component says so."""
    tr = cfg.trainer
    evaluator = Evaluator(run.faults, eval_every=tr.eval_every)
    guard = NonFiniteGuard(
        max_in_row=tr.max_nonfinite_in_row, in_row=state.nonfinite_in_row, last_good=checkpointer.latest
    )
    preempt = PreemptionSignal().install()
    if fresh and evaluator.should_evaluate(0):  # the starting point of the curve (every rank: a re-sync may be needed)
        scores = evaluator.evaluate(0)
        if metrics is not None:
            metrics.log(0, scores)
    for step in range(state.step, tr.total_steps):
        try:
            log = dapo_step(step, run)
        except EnginesLost as err:  # no engine came back: keep what was trained, name the cause
            saved = checkpointer.save_before_stopping(TrainerState(step=step, nonfinite_in_row=guard.in_row))
            raise EnginesLost(f"{err}; {saved}") from None
        guard.observe(log)
        last_step = step + 1 == tr.total_steps  # evaluated whatever eval_every: the summary is the trained policy's
        if evaluator.should_evaluate(step + 1, last=last_step):  # an engine lost here costs the eval, never the step
            log.update(evaluator.evaluate(step + 1))
        if metrics is not None:
            metrics.log(step + 1, log)
        guard.stop_if_exceeded()
        stop = preempt.should_stop()  # collective: every rank, the same step
        checkpointer.save(
            TrainerState(
                step=step + 1, nonfinite_in_row=guard.in_row, eval=headline_avg(log, list(cfg.data.eval_sets))
            ),
            last_step=last_step,
            stop=stop,
        )
        heap.release_free_heap()  # the step's freed C heap back to the OS: RSS flat over a long run (trainer/heap.py)
        if stop and not last_step:
            if run.roles.driver:
                print(preempt.stop_line(step + 1, checkpointer.step_dir(step + 1)), flush=True)
            return


def open_metrics(cfg: Config, resumed: TrainerState | None) -> MetricsLogger:
    """The driver's metrics: console table, metrics.jsonl, wandb; closed (wandb finished, curves.png) by
    leaving its `with`, whichever way the run ends."""
    tr = cfg.trainer
    return MetricsLogger(
        tr.output_dir,
        wandb_mode=tr.wandb_mode,
        wandb_project=tr.wandb_project,
        config=cfg.to_dict(),
        resume_step=None if resumed is None else resumed.step,
        console=sys.stdout,  # this process's stdout now (console_log's copy to logs/train.log), not at import
    )


def build_components(cfg: Config, layout: ParallelLayout, *, finish: contextlib.ExitStack) -> Components:
    """Every rank's actor (and KL reference), the driver on global rank 0, the placement and the fault
    policy, in this rank's parallel layout (model_parallel's). The driver is closed by `finish`."""
    roles = RankRoles.current(layout)
    actor = Actor(actor_settings(cfg), cfg.model.path, layout)
    ref = (
        ReferencePolicy(actor_settings(cfg), cfg.model.path, layout) if cfg.algorithm.use_kl else None
    )  # frozen, off-device when idle
    driver = None
    if roles.driver:
        driver = finish.enter_context(Driver(cfg, model_dir=cfg.model.path, run_dir=Path(cfg.trainer.output_dir)))
        console.actor_ready(cfg)
    placement = make_placement(cfg, roles=roles, driver=driver)
    faults = FaultPolicy(
        roles=roles, placement=placement, actor=actor, driver=driver, engine_restarts=cfg.rollout.engine_restarts
    )
    return Components(
        roles=roles,
        actor=actor,
        ref=ref,
        driver=driver,
        placement=placement,
        faults=faults,
        advantage=cfg.algorithm.advantage,
        advantage_eps=cfg.algorithm.advantage_eps,
        sequences_per_mini_batch=cfg.rollout.n * cfg.trainer.mini_batch_size,
    )


@contextlib.contextmanager
def first_cause_recorded() -> Iterator[None]:
    """An exception leaving the block is written at once to the error file torchrun gives each rank
    (TORCHELASTIC_ERROR_FILE), before the clean-up runs: torchrun names the failure recorded first as the
    root cause, so the rank that failed first is named, never a peer that failed because of it (gloo's
    "Connection closed by peer" once this rank has gone)."""
    try:
        yield
    except Exception as err:
        _record(err)
        raise


def _record(err: BaseException) -> None:
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    if not getattr(err, "_dapo_recorded", False):
        get_error_handler().record_exception(err)  # the type, message and traceback; time.time() as its timestamp
        err._dapo_recorded = True  # type: ignore[attr-defined]  # once: the first record's time is the cause's


def train_rank_recorded(cfg: Config, *, resume: bool) -> int:
    """train_rank; an exception ends the rank with exit code 1 and prints nothing: it is in the error
    file torchrun gives each rank (first_cause_recorded), from which the local launcher prints one line
    naming the first failing rank's cause (launch/local/ranks.py) and torchrun under Slurm prints its "Root
    Cause" block with the whole traceback. Without an error file (no torchrun) it is raised as usual."""
    if not os.environ.get(ERROR_FILE_ENV):
        return train_rank(cfg, resume=resume)
    try:
        return train_rank(cfg, resume=resume)
    except Exception as err:
        _record(err)  # one raised before the layout was set up
        return 1
