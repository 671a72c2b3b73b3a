"""What global rank 0 owns in a DAPO run: prompts, rollout engines, the sampler, evaluation and the
engine side of the weight transfer. Every other rank only runs the actor (trainer/train.py).

    driver = Driver(cfg, model_dir=..., run_dir=...)
    groups, stats = driver.rollout()           # dynamic sampling: generated, scored (+ overlong shaping) groups
    verdict, result = driver.try_phase(driver.rollout, ...)   # or what to do when every engine was lost
                                                              # (trainer/recovery.py)
    stats = driver.push_weights(buckets, step=3)   # the actor's export buckets (trainer/placement.py) -> every engine
    scores = driver.evaluate()                 # every eval set: metrics, and <run_dir>/evals/step_N.json
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import torch

from dapo_megatron.config import Config, RolloutConfig
from dapo_megatron.data.datasets import train_and_eval_sets
from dapo_megatron.data.stream import PromptStream
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.quant.engine_checkpoint import fp8_converter, fp8_rollout_dir
from dapo_megatron.rollout.async_rollout import AsyncRollout, engine_phases
from dapo_megatron.rollout.auth import engine_keys
from dapo_megatron.rollout.client import EngineError
from dapo_megatron.rollout.pool import EngineEventReport, EnginePool
from dapo_megatron.rollout.registry import engine_events_path
from dapo_megatron.rollout.sampler import RolloutSampler, RolloutSettings
from dapo_megatron.trainer.checkpoint.files import DriverState
from dapo_megatron.trainer.evaluation.report import (
    eval_file_path,
    eval_report,
    metric_prefix,
    report_metrics,
    write_eval_file,
)
from dapo_megatron.trainer.evaluation.sampling import sample_eval
from dapo_megatron.trainer.progress_line import ProgressLine, ProgressLines
from dapo_megatron.trainer.recovery import EngineFaults, Verdict
from dapo_megatron.trainer.timeline import Timeline
from dapo_megatron.transfer.engine_push import sync_dropping_dead
from dapo_megatron.transfer.sync_protocol import WeightSync
from dapo_megatron.transfer.weight_sync import DistributedWeightSync

T = TypeVar("T")  # what a phase returns (try_phase)


class Driver:
    def __init__(self, cfg: Config, *, model_dir: str | Path, run_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.loop = asyncio.new_event_loop()
        r = cfg.rollout
        self.pool = self._connect_engines(r)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        # start-up admissions are not faults; restarts are the local launcher's (launch/local/supervise.py)
        self.engine_report = EngineEventReport(self.pool, restart_events=engine_events_path(self.run_dir))
        # what the driver knows when engines fail; the loop's FaultPolicy asks it (trainer/recovery.py)
        self.engine_faults = EngineFaults(
            self.pool,
            run_dir=self.run_dir,
            engine=r.engine,
            engine_urls=r.engine_urls,
            num_engines=r.num_engines,
            engine_wait_s=r.engine_wait_s,
        )
        self.sampler = self._rollout_sampler(cfg)
        # checked like the launcher checked them before start (data.skip_bad_rows leaves out the same rows)
        train, self.eval_sets = train_and_eval_sets(
            cfg.data,
            tokenizer=self.tokenizer,
            max_prompt_length=r.max_prompt_length,
            on_rows=ProgressLines("[data]", unit="rows"),
        )
        self.prompts = PromptStream(train, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
        # master_address "" = the trainer address every engine reaches (weight_group.trainer_address)
        # the group's backend follows the engines (gloo for CPU engines, nccl for SGLang), not the trainer
        self.weight_sync: WeightSync = DistributedWeightSync(
            bucket_bytes=r.weight_bucket_mb << 20, master_address=r.weight_sync_address
        )
        # rollout.quantization=fp8: every sync sends modelopt's fp8 weights + scales (quant/engine_checkpoint.py)
        self.fp8 = fp8_converter(fp8_rollout_dir(cfg.trainer.output_dir)) if r.quantization == "fp8" else None
        # phase stamps (phase, step, start, end), streamed to <run_dir>/timeline.jsonl (trainer/timeline.py);
        # rollout.max_staleness >= 1 runs this loop on a thread that generates the next k batches while the
        # trainer trains (rollout/async_rollout.py)
        self.timeline = Timeline(self.run_dir)
        self.next_step, self._rollout_end = 0, 0.0
        self.overlap = None
        if r.max_staleness >= 1:
            self.overlap = AsyncRollout(
                self.loop,
                self.sampler,
                self.prompts,
                max_staleness=r.max_staleness,
                train_batch_size=cfg.trainer.train_batch_size,
                total_steps=cfg.trainer.total_steps,
                timeline=self.timeline,
            )

    def _connect_engines(self, r: RolloutConfig) -> EnginePool:
        """The pool over rollout.engine_urls (the user's engines, their keys), else over the engines that
        register in the run directory (at least rollout.num_engines, the run's secret)."""
        keys = engine_keys(r, self.run_dir)  # the user's keys for engine_urls, else the run's secret
        if r.engine_urls:
            return EnginePool(list(r.engine_urls), timeout_s=r.request_timeout_s, max_retries=r.max_retries, keys=keys)
        # engines the run does not start itself (SGLang's array job, colocated engines) may take minutes
        line = ProgressLine(
            f"[train] rollout: waiting in {self.run_dir / 'engines'}:", total=r.num_engines, unit="engines up"
        )
        try:
            return self.loop.run_until_complete(
                EnginePool.from_registry(
                    str(self.run_dir / "engines"),
                    min_engines=r.num_engines,
                    timeout_s=r.request_timeout_s,
                    max_retries=r.max_retries,
                    keys=keys,
                    on_wait=line.update,
                )
            )
        finally:
            line.close()

    def _rollout_sampler(self, cfg: Config) -> RolloutSampler:
        """The training rollouts' sampler: stop at the tokenizer's EOS, per-sample seeds where every engine
        honours them."""
        r = cfg.rollout
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        # sampling_seed only where every engine honours it (SGLang: --enable-deterministic-inference)
        seeded = self.loop.run_until_complete(self.pool.seeds_honoured())
        return RolloutSampler(
            self.pool,
            self.tokenizer,
            RolloutSettings.from_sections(
                r, cfg.algorithm, seed=cfg.trainer.seed, stop_token_ids=tuple(eos), per_sample_seeds=seeded
            ),
            rid_prefix="train",
        )

    def run(self, coro):
        """A coroutine on the driver's loop: here, or on its thread while steps overlap (every caller of
        the engines goes through this, never through self.loop directly)."""
        return self.overlap.run(coro) if self.overlap is not None else self.loop.run_until_complete(coro)

    # --- state carried by checkpoints ---------------------------------------------------------------
    def state_dict(self) -> DriverState:
        return {"prompts": self.prompts.state_dict(), "num_requests": self.sampler.num_requests}

    def load_state_dict(self, state: DriverState) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.sampler.num_requests = int(state["num_requests"])

    # --- one step's data ------------------------------------------------------------------------------
    def rollout(self) -> tuple[list[list[Sample]], dict[str, float]]:
        """train_batch_size groups of rollout.n scored responses (rewards with overlong shaping; groups
        all right or all wrong dropped and refilled: DAPO's dynamic sampling), and their statistics."""
        tic, step = time.time(), self.next_step
        overlap_stats: dict[str, float] = {}
        if self.overlap is not None:  # generated while earlier steps trained; groups staler than k dropped
            result, overlap_stats = self.overlap.next_batch(step)
        else:
            result = self.loop.run_until_complete(
                self.sampler.collect(self.prompts, train_batch_size=self.cfg.trainer.train_batch_size)
            )
            self.timeline.append(("generate", step, tic, time.time()))
            self.timeline.extend(engine_phases(self.sampler.engine_spans, step))
            self.sampler.engine_spans.clear()
        self.next_step, self._rollout_end = step + 1, time.time()
        samples = result.samples
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
        stats = {
            f"sampler/{k}": float(v)
            for k, v in result.stats.items()
            if isinstance(v, (int, float)) and k not in ("tokens_per_s", "seconds")
        }
        stats.update(
            {
                "throughput/rollout_tok_s": float(result.stats.get("tokens_per_s", 0.0)),
                "reward/mean": float(torch.tensor([s.reward for s in samples]).mean()) if samples else 0.0,
                "acc/mean": float(torch.tensor([s.acc for s in samples]).mean()) if samples else 0.0,
                "response_length/mean": float(lengths.mean()) if samples else 0.0,
                "response_length/max": float(lengths.max()) if samples else 0.0,
                "response_length/clip_ratio": float(sum(s.truncated for s in samples) / max(len(samples), 1)),
            }
        )
        stats.update(overlap_stats)
        return result.groups, stats

    def try_phase(
        self,
        phase: Callable[[], T],
        *,
        restore_prompts: bool = False,
        during: str,
        then: str,
        updates: int,
        step: int,
    ) -> tuple[Verdict, T | None]:
        """(Verdict.OK, phase()) or, when every engine was lost during it, (Verdict.RESYNC | LOST, None) from
        EngineFaults.after_loss (trainer/recovery.py: FaultPolicy). restore_prompts (the rollout): the
        prompt stream and request counter are put back where the phase began, so that the redone
        rollout asks for the same samples."""
        # not while steps overlap: the producer thread draws prompts ahead, and its failed batch's
        # prompts stay used (rollout/async_rollout.py)
        state = copy.deepcopy(self.state_dict()) if restore_prompts and self.overlap is None else None
        try:
            return Verdict.OK, phase()
        except EngineError as err:
            if not self.engine_faults.is_engine_loss(err):
                raise  # engines answer: not an engine loss
            if state is not None:
                self.load_state_dict(state)
            return self.engine_faults.after_loss(
                err, during=during, then=then, updates=updates, step=step, run=self.run
            ), None

    # --- weights out ----------------------------------------------------------------------------------
    def push_weights(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], *, step: int) -> dict[str, float]:
        """Send the actor's buckets of HF-named tensors (the weights after `step` updates) to every
        engine as weight version "step_<step>", bucket by bucket as they come, then admit re-registered
        engines that were waiting for them. From here on, a reply made by any other version is stale
        (the sampler drops and counts it). The weight sync regroups the tensors by the same
        rollout.weight_bucket_mb (it holds views into at most two export buckets at a time); sending
        each stage's flat buffer as it is waits for the per-stage weight groups (stage_export.py)."""
        version = f"step_{step}"
        named = (pair for bucket in buckets for pair in bucket)
        if self.fp8 is not None:
            named = self.fp8.convert(named)

        # an engine dying during the sync is dropped from it and the pass is still consumed to its end;
        # sync_redo asks every rank for another pass (recovery.FaultPolicy.transfer). While steps
        # overlap, the engines are paused in "retract" mode around it (partial rollouts: async_rollout.py)
        around = self.overlap.paused_sync if self.overlap is not None else None
        tic = time.time()
        if self._rollout_end:  # the trainer's part of step step-1 on this rank: scatter, log-probs, updates
            self.timeline.append(("train", step - 1, self._rollout_end, tic))
        stats, self.engine_faults.sync_redo = self.run(
            sync_dropping_dead(self.pool, self.weight_sync, named, weight_version=version, around=around)
        )
        if stats is None:
            return {}
        self.sampler.weight_version = version
        if self._rollout_end:
            self.timeline.append(("sync", step - 1, tic, time.time()))
        self.next_step, self._rollout_end = step, 0.0
        return {
            "sync/seconds": stats.seconds,
            "sync/gb": stats.bytes / 1e9,
            "sync/gb_per_s": stats.gb_per_s,
            "sync/buckets": float(stats.num_buckets),
            "sync/collectives": float(stats.num_collectives),
        }

    def weights_now(self, version: str) -> None:
        """The engines hold weight version `version` (a transfer by another transport, trainer/placement.py):
        replies of any other version are stale from here on; engines that waited for it are admitted."""
        self.sampler.weight_version = version
        self.pool.admit(self.pool.pending_urls())

    # --- engine faults --------------------------------------------------------------------------------
    def engine_events(self) -> dict[str, float]:
        """Engines dropped / back / rejoined since the last call: console lines and running counts."""
        return self.engine_report.report()

    # --- evaluation -----------------------------------------------------------------------------------
    def evaluate(self, *, step: int) -> dict[str, float]:
        """Every eval set with the eval sampling settings (trainer.eval_n/eval_temperature/eval_top_p) on
        the weights after `step` updates, written to <run_dir>/evals/step_<step>.json; the metrics
        returned are that file's numbers (trainer/evaluation/report.py: eval/avg@k, or eval/<set>/avg@k with
        several sets)."""
        if not self.eval_sets:
            return {}
        t = self.cfg.trainer
        start, tic = time.perf_counter(), time.time()
        reports = {}
        for name, records in self.eval_sets.items():
            # a long eval (thousands of samples on a cluster) shows its count and time left
            progress = ProgressLine(f"[eval] step {step} {name}:", total=len(records), unit="problems")
            samples = self.run(
                sample_eval(
                    self.pool,
                    [self.sampler.prompt_ids(r) for r in records],
                    records,
                    n=t.eval_n,
                    temperature=t.eval_temperature,
                    top_p=t.eval_top_p,
                    max_new_tokens=self.cfg.rollout.max_response_length,
                    seed=t.seed,
                    stop_token_ids=self.sampler.settings.stop_token_ids,
                    per_sample_seeds=self.sampler.settings.per_sample_seeds,
                    on_problem=progress.update,
                )
            )
            progress.close()
            reports[name] = eval_report(samples, records, step=step, name=name)
        write_eval_file(
            eval_file_path(self.run_dir, step),
            reports,
            extra={"temperature": t.eval_temperature, "top_p": t.eval_top_p},
        )
        # the timeline's "eval" lane: without it an eval step is an unlabelled gap in timeline.png
        self.timeline.append(("eval", step, tic, time.time()))
        metrics = {
            key: value
            for name, report in reports.items()
            for key, value in report_metrics(report, prefix=metric_prefix(name, num_sets=len(reports))).items()
        }
        return {**metrics, "time/eval_s": time.perf_counter() - start}

    def close(self) -> None:
        """Every way the run ends (trainer/train.py: `finish`): the producer stopped, the timeline and its
        PNG written, the weight group and the engine connections closed, the loop closed; each step is
        tried even when one before it fails (an engine already gone, say), and the first failure is raised."""

        async def disconnect() -> None:
            try:
                await self.weight_sync.close(self.pool.live_clients())
            finally:
                await self.pool.close()

        with contextlib.ExitStack() as steps:  # run in reverse order of the callbacks below
            steps.callback(self.loop.close)
            steps.callback(lambda: self.loop.run_until_complete(disconnect()))
            steps.callback(self.timeline.close)
            if self.overlap is not None:
                steps.callback(self.overlap.close)  # the producer's requests aborted; the loop stopped, back here

    def __enter__(self) -> Driver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
