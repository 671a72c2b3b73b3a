"""The rollout sampler: prompts -> scored groups of n responses, with DAPO's dynamic sampling.

    # or RolloutSettings(n=16, ...)
    settings = RolloutSettings.from_sections(cfg.rollout, cfg.algorithm, seed=cfg.trainer.seed)
    sampler = RolloutSampler(pool, tokenizer, settings)  # reward: each record's data_source scorer
    result = await sampler.collect(prompt_iter, train_batch_size=512)
    result.groups    # list of train_batch_size groups, each a list of n dapo_megatron.dataplane.sample.Sample
    result.stats     # rounds, groups seen/kept/filtered, tokens generated, tokens/s,
                     # samples_abort_requested / samples_aborted (confirmed by the engines),
                     # groups_unscored (finished together with the batch-filling group, dropped),
                     # groups_stale / samples_stale (made by other weights than the last sync's)

One round takes gen_batch_size prompts from `prompt_iter` (an iterator the training loop owns, so
the data order is resumable; prompts drawn in a round count as consumed even when their requests
are aborted) and sends one /generate per prompt holding its n samples as n items (input_ids = [ids]
* n, one rid per sample, n = 1 each): SGLang gives the samples of an n > 1 request fresh uuid rids
that no abort can name, so the samples are separate items with our own rids. Each finished group is
scored (reward_fn on the decoded response; overlong shaping from the response length; accuracy;
truncated = finish_reason "length"). As soon as the groups kept so far fill the batch, every sample
still in flight is aborted (EnginePool.abort) and the round waits for the engines' replies: a sample
counts as aborted when its reply says finish_reason "abort", not when we asked.

Every reply carries the engine's weight_version (meta_info, and per-token spans in weight_versions
after a mid-request update). A group with a sample from other weights than `weight_version` (the
last sync's, set by the driver) is stale: counted and dropped, never trained on.

Sample j of the k-th request of this sampler: rid f"{rid_prefix}-{k}-{j}." (the terminating "."
keeps rids prefix-free: SGLang's scheduler aborts every rid that STARTS with the one named) and, where
the engines honour seeds (settings.per_sample_seeds; SGLang only with
--enable-deterministic-inference), sampling_seed = seed * 1_000_003 + k + j, so a run with the same
seed asks the engines for the same samples (the groups' arrival order, hence which ones fill a batch,
depends on timing unless in_order).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dapo_megatron.algo import DynamicSampler, keep_group, overlong_penalty
from dapo_megatron.config import AlgorithmConfig, RolloutConfig
from dapo_megatron.data.prompts import PromptRecord, prompt_token_ids
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.reward import Scorer, scorer_for_data_source
from dapo_megatron.rollout.pool import EnginePool
from dapo_megatron.rollout.routing import routed_experts_of
from dapo_megatron.rollout.sglang_api import GenerateOutput, MetaInfo

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger(__name__)
RID_END = "."  # terminates every rid: no rid is a prefix of another (SGLang aborts by prefix)
INITIAL_WEIGHT_VERSION = "default"  # what SGLang (--weight-version) and the CPU engine report before a sync


@dataclass
class RolloutSettings:
    n: int  # responses per prompt (group size)
    max_new_tokens: int  # L_max, the generation cap (rollout.max_response_length)
    gen_batch_size: int  # prompts per generation round
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    max_prompt_length: int = 0  # 0 = unchecked
    dynamic_sampling: bool = True
    max_num_gen_batches: int = 0  # 0 = unlimited
    on_exhausted: str = "raise"  # raise | train
    overlong_shaping: bool = True
    overlong_buffer_length: int = 0  # L_cache
    overlong_penalty_factor: float = 1.0
    seed: int = 0
    progress: bool = True
    in_order: bool = True  # groups fill the batch in request order: reproducible (see _round)
    return_routed_experts: bool = False  # MoE: each Sample carries the engine's experts (routing.py)
    per_sample_seeds: bool = True  # send sampling_seed (only where the engines honour it: pool.seeds_honoured)

    @classmethod
    def from_sections(
        cls,
        rollout: RolloutConfig,
        algorithm: AlgorithmConfig,
        *,
        seed: int,
        stop_token_ids: tuple[int, ...] = (),
        per_sample_seeds: bool = True,
        progress: bool = True,
    ) -> RolloutSettings:
        """From the config's rollout and algorithm sections (dapo_megatron/config.py) and trainer.seed; the
        rest from the run (the tokenizer's EOS ids, whether the engines honour seeds, a terminal)."""
        r, a = rollout, algorithm
        return cls(
            n=r.n,
            max_new_tokens=r.max_response_length,
            gen_batch_size=r.gen_batch_size,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_prompt_length=r.max_prompt_length,
            dynamic_sampling=a.dynamic_sampling,
            max_num_gen_batches=a.max_num_gen_batches,
            on_exhausted=a.on_gen_batches_exhausted,
            overlong_shaping=a.overlong_shaping,
            overlong_buffer_length=a.overlong_buffer_length,
            overlong_penalty_factor=a.overlong_penalty_factor,
            seed=seed,
            in_order=r.in_order,
            return_routed_experts=r.return_routed_experts,
            stop_token_ids=stop_token_ids,
            per_sample_seeds=per_sample_seeds,
            progress=progress,
        )


@dataclass
class RolloutResult:
    groups: list[list[Sample]]
    stats: dict[str, float] = field(default_factory=dict)  # counts, seconds, rates

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g]


def _reward_for(record: PromptRecord) -> Scorer:
    """The record's scorer (reward.scorer_for_data_source of its data_source; math_dapo if none)."""
    return scorer_for_data_source(getattr(record, "data_source", "") or "math_dapo")


def _consume_outcome(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def engine_span(output: GenerateOutput, received: float) -> tuple[float, float] | None:
    """When the engine worked on one reply, by its own clock: SGLang's meta_info carries e2e_latency
    (finished_time - created_time of the request, TokenizerManager) and, with --enable-metrics,
    request_received_ts (created_time as epoch seconds; srt/observability/req_time_stats.py:
    convert_to_output_meta_info); the CPU engine sends both. Without request_received_ts the span ends
    when the reply reached us (`received`). None when the engine reports no latency."""
    meta: MetaInfo = output.get("meta_info") or {}
    latency = meta.get("e2e_latency")
    if not isinstance(latency, (int, float)):
        return None
    start = meta.get("request_received_ts")
    start = float(start) if isinstance(start, (int, float)) else received - float(latency)
    return start, start + float(latency)


class RolloutSampler:
    def __init__(
        self,
        pool: EnginePool,
        tokenizer: object,  # passed through to data.prompts.prompt_token_ids
        settings: RolloutSettings,
        *,
        reward_fn: Scorer | None = None,
        rid_prefix: str | None = None,
    ):
        if settings.n < 1 or settings.gen_batch_size < 1 or settings.max_new_tokens < 1:
            raise ValueError(f"RolloutSettings: n, gen_batch_size and max_new_tokens must be >= 1, got {settings}")
        self.pool = pool
        self.tokenizer = tokenizer
        self.settings = settings
        self.reward_fn = reward_fn  # None: each record's own scorer
        self.rid_prefix = rid_prefix or uuid.uuid4().hex[:8]
        if RID_END in self.rid_prefix:
            raise ValueError(f"RolloutSampler: rid_prefix {self.rid_prefix!r} must not contain {RID_END!r}")
        self.num_requests = 0  # k of the next request (seeds and rids)
        # the engines' own stamps of every reply, (start, end) in epoch seconds (engine_span); the driver
        # drains them after each collect into its timeline's "engine" lane (trainer/timeline.py)
        self.engine_spans: list[tuple[float, float]] = []
        self.weight_version = INITIAL_WEIGHT_VERSION  # replies made by other weights are stale
        # overlapped steps (rollout/async_rollout.py): the versions a reply may have been made by; None = only
        # weight_version (the synchronous step)
        self.accepted_versions: set[str] | None = None

    # ------------------------------------------------------------------ one group
    def prompt_ids(self, record: PromptRecord) -> list[int]:
        ids = prompt_token_ids(self.tokenizer, record)  # the same function the start-up check uses (data/prompts.py)
        limit = self.settings.max_prompt_length
        if limit and len(ids) > limit:
            raise ValueError(
                f"prompt of {len(ids)} tokens exceeds rollout.max_prompt_length={limit}: {str(record)[:200]}"
            )
        return ids

    def sample_rid(self, k: int, j: int) -> str:
        return f"{self.rid_prefix}-{k}-{j}{RID_END}"

    def sampling_params(self, k: int) -> list[dict]:
        """One dict per sample of request k (n = 1 each; per-sample seeds where honoured)."""
        s = self.settings
        base = {
            "n": 1,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "max_new_tokens": s.max_new_tokens,
            "stop_token_ids": list(s.stop_token_ids),
        }
        if not s.per_sample_seeds:
            return [base] * s.n
        first = s.seed * 1_000_003 + k
        return [{**base, "sampling_seed": (first + j) % (2**62)} for j in range(s.n)]

    def rids(self, k: int) -> list[str]:
        return [self.sample_rid(k, j) for j in range(self.settings.n)]

    async def _generate_group(self, record: PromptRecord, k: int) -> tuple[PromptRecord, list[dict]]:
        ids = self.prompt_ids(record)
        routed = {"return_routed_experts": True} if self.settings.return_routed_experts else {}
        outs = await self.pool.generate(
            input_ids=[ids] * self.settings.n,
            sampling_params=self.sampling_params(k),
            return_logprob=True,
            rid=self.rids(k),
            **routed,
        )
        received = time.time()
        self.engine_spans.extend(span for span in (engine_span(o, received) for o in outs) if span is not None)
        return record, [dict(o, prompt_ids=ids) for o in outs]

    def is_stale(self, outputs: list[dict]) -> bool:
        """Whether any sample was made (even partly) by other weights than self.weight_version."""
        for o in outputs:
            meta = o["meta_info"]
            spans = meta.get("weight_versions") or [{"version": meta.get("weight_version")}]
            accepted = self.accepted_versions if self.accepted_versions is not None else {self.weight_version}
            if any(str(span["version"]) not in accepted for span in spans):
                return True
        return False

    def score_group(self, record: PromptRecord, outputs: list[dict]) -> list[Sample]:
        s = self.settings
        lengths = [len(o["output_ids"]) for o in outputs]
        if s.overlong_shaping:
            shaping = overlong_penalty(
                lengths,
                max_length=s.max_new_tokens,
                buffer_length=s.overlong_buffer_length,
                factor=s.overlong_penalty_factor,
            ).tolist()
        else:
            shaping = [0.0] * len(outputs)
        ground_truth = str(getattr(record, "ground_truth", ""))
        samples = []
        for o, extra_reward in zip(outputs, shaping):
            result = (self.reward_fn or _reward_for(record))(o["text"], ground_truth)
            meta = o["meta_info"]
            samples.append(
                Sample(
                    prompt_ids=o["prompt_ids"],
                    response_ids=list(o["output_ids"]),
                    group_index=-1,
                    response_text=o["text"],
                    ground_truth=ground_truth,
                    reward=float(result.score) + float(extra_reward),
                    acc=float(result.acc),
                    truncated=meta["finish_reason"]["type"] == "length",
                    rollout_logprobs=[float(lp[0]) for lp in meta.get("output_token_logprobs", [])],
                    routed_experts=routed_experts_of(o, where=f"request {meta.get('id')}"),
                    extra={
                        "score": float(result.score),
                        "overlong_penalty": float(extra_reward),
                        "pred": getattr(result, "pred", None),
                        "finish_reason": meta["finish_reason"]["type"],
                        # the weights that made it (every version, for a reply spanning an update)
                        "weight_versions": [
                            str(sp["version"])
                            for sp in meta.get("weight_versions") or [{"version": meta.get("weight_version")}]
                        ],
                    },
                )
            )
        return samples

    # ------------------------------------------------------------------ dynamic sampling
    async def collect(self, prompts: Iterator[PromptRecord], *, train_batch_size: int) -> RolloutResult:
        s = self.settings
        acc: DynamicSampler[list[Sample]] = DynamicSampler(
            train_batch_size=train_batch_size,
            enabled=s.dynamic_sampling,
            max_num_gen_batches=s.max_num_gen_batches,
            on_exhausted=s.on_exhausted,
        )
        bar = None
        if s.progress:
            import sys

            from tqdm import tqdm

            # a live bar on a terminal only: in a log file its redraws would bury the step table
            bar = tqdm(
                total=train_batch_size, desc="rollout groups", unit="grp", leave=False, disable=not sys.stderr.isatty()
            )
        totals: dict[str, int] = {}
        tic = time.perf_counter()
        try:
            while not acc.done:
                records = [r for _, r in zip(range(s.gen_batch_size), prompts)]
                if not records:
                    raise ValueError(
                        f"the prompt source ran out after {acc.stats()['rounds']} rounds with "
                        f"{acc.num_kept} of {train_batch_size} groups kept"
                    )
                round_groups, counts = await self._round(records, acc.num_kept, train_batch_size, bar)
                for key, value in counts.items():
                    totals[key] = totals.get(key, 0) + value
                acc.add_round(round_groups)  # raises when the round budget is spent (on_exhausted="raise")
        finally:
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - tic
        groups = acc.take()
        for gi, group in enumerate(groups):
            for sample in group:
                sample.group_index = gi
        scored = totals.get("scored", 0)
        stats = {
            **acc.stats(),
            "tokens_generated": totals.get("tokens", 0),
            "seconds": seconds,
            "tokens_per_s": totals.get("tokens", 0) / seconds if seconds > 0 else 0.0,
            "samples_abort_requested": totals.get("abort_requested", 0),
            "samples_aborted": totals.get("aborted", 0),  # confirmed: the engine replied finish_reason abort
            "samples_finished_after_abort": totals.get("finished_after_abort", 0),  # the abort came too late
            "groups_unscored": totals.get("unscored", 0),
            "groups_stale": totals.get("stale_groups", 0),
            "samples_stale": totals.get("stale_samples", 0),
            # accuracy of every scored response, before the filter (kept groups bias it to ~0.5)
            "acc_all": totals.get("correct", 0) / scored if scored else 0.0,
            "responses_scored": scored,
        }
        return RolloutResult(groups=groups, stats=stats)

    async def _round(self, records: list[PromptRecord], kept_before: int, target: int, bar) -> tuple[list, dict]:
        """One generation round; returns (scored groups, counters). The round stops at the group that
        fills the batch: finished groups after it are dropped unscored, unfinished ones aborted.

        Which groups fill the batch: with settings.in_order (the default) groups are taken in request
        order (group k is scored only once groups < k are), so the batch is a function of the seeds
        alone and a resumed or repeated run trains on the same data; otherwise in completion order,
        which never waits on a slow early request (faster with long-tailed 20K-token responses)."""
        tasks: dict[asyncio.Task, int] = {}
        for record in records:
            k = self.num_requests
            self.num_requests += 1
            tasks[asyncio.ensure_future(self._generate_group(record, k))] = k
        groups: list[list[Sample]] = []
        counts = {"tokens": 0, "correct": 0, "scored": 0, "stale_groups": 0, "stale_samples": 0}
        kept = 0
        pending, unscored = set(tasks), []
        finished: dict[int, asyncio.Task] = {}  # in_order: done but not yet reachable in order
        next_k = min(tasks.values()) if tasks else 0
        try:
            while pending and kept_before + kept < target:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if self.settings.in_order:
                    finished.update((tasks[t], t) for t in done)
                    ready = []
                    while next_k in finished:
                        ready.append(finished.pop(next_k))
                        next_k += 1
                else:
                    ready = sorted(done, key=tasks.__getitem__)
                for i, task in enumerate(ready):
                    if kept_before + kept >= target:
                        unscored = ready[i:]
                        break
                    kept += int(self._take_group(task, tasks[task], groups, counts, bar))
            unscored = [*unscored, *finished.values()]
            # generated all the same: their tokens count towards throughput
            counts["tokens"] += sum(len(o["output_ids"]) for t in unscored for o in t.result()[1])
        except BaseException:
            await self._abort(pending, tasks, wait=False)  # failing: stop the engines' work, do not wait
            for task in tasks:  # the first failure is raised; the rest (mostly the same engine loss) are not
                task.add_done_callback(_consume_outcome)  # news: no "Task exception was never retrieved" dumps
            raise
        for key, value in (await self._abort(pending, tasks, wait=True)).items():  # the batch is full
            counts[key] = counts.get(key, 0) + value
        counts["unscored"] = len(unscored)
        return groups, counts

    def _take_group(
        self,
        task: asyncio.Task[tuple[PromptRecord, list[dict]]],
        k: int,
        groups: list[list[Sample]],
        counts: dict[str, int],
        bar: tqdm | None,
    ) -> bool:
        """Score the group of finished request k into `groups`, or drop it when stale (made by other
        weights); returns whether it fills the batch (informative, or any group without dynamic sampling)."""
        record, outputs = task.result()
        counts["tokens"] += sum(len(o["output_ids"]) for o in outputs)
        if self.is_stale(outputs):
            counts["stale_groups"] += 1
            counts["stale_samples"] += len(outputs)
            log.warning(
                "rollout: request %d was answered by weights %s, expected %s: group dropped",
                k,
                sorted({o["meta_info"].get("weight_version") for o in outputs}),
                self.weight_version,
            )
            return False
        group = self.score_group(record, outputs)
        groups.append(group)
        counts["correct"] += sum(int(x.acc > 0) for x in group)
        counts["scored"] += len(group)
        informative = (not self.settings.dynamic_sampling) or keep_group(group)
        if bar is not None:
            bar.update(int(informative))
            bar.set_postfix(seen=len(groups), refresh=False)
        return informative

    async def _abort(self, pending: set, tasks: dict, *, wait: bool) -> dict[str, int]:
        """Abort every sample of the pending requests; with wait, collect the engines' replies and count
        what they confirm: a sample is aborted when its reply says finish_reason "abort" (one that
        finished before the abort reached it is not)."""
        if not pending:
            return {"abort_requested": 0, "aborted": 0}
        rids = [rid for t in pending for rid in self.rids(tasks[t])]
        await self.pool.abort(rids)
        if not wait:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return {}
        results = await asyncio.gather(*pending, return_exceptions=True)
        outputs = [o for r in results if not isinstance(r, BaseException) for o in r[1]]
        for r in results:
            if isinstance(r, BaseException):
                log.warning("rollout: an aborted request failed instead of confirming: %s", r)
        aborted = sum(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outputs)
        return {
            "abort_requested": len(rids),
            "aborted": aborted,
            "finished_after_abort": len(outputs) - aborted,
            "tokens": sum(len(o["output_ids"]) for o in outputs),
        }
