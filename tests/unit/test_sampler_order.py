"""Which groups fill a dynamic-sampling batch when requests finish out of order.

Completion order can only be scripted with a stand-in for the engine pool: `ScriptedPool` below
(a test double, not a rollout engine) answers request k after a scripted delay with scripted
responses; everything else is the real RolloutSampler, DynamicSampler and math_dapo reward.
"""

import asyncio

from dapo_megatron.data.prompts import PromptRecord
from dapo_megatron.rollout.sampler import RolloutSampler, RolloutSettings


class ScriptedPool:
    """Request k (the sampler's k-th request; its samples' rids are "t-k-j.") answers after delays[k]
    seconds with answers[k]; an abort makes a request still sleeping answer at once, every sample with
    finish_reason "abort" (as an engine confirms an abort)."""

    def __init__(self, delays, answers):
        self.delays, self.answers, self.aborted = delays, answers, []
        self.abort_events: dict[int, asyncio.Event] = {}

    async def generate(self, *, rid, input_ids, sampling_params, return_logprob):
        k = int(rid[0].split("-")[1])
        assert [r.split("-")[2] for r in rid] == [f"{j}." for j in range(len(rid))] and len(input_ids) == len(rid)
        event = self.abort_events.setdefault(k, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), self.delays[k])
            finish = "abort"
        except asyncio.TimeoutError:
            finish = "stop"
        return [
            {
                "text": f"Answer: {a}",
                "output_ids": [7, 7],
                "meta_info": {
                    "finish_reason": {"type": finish},
                    "weight_version": "default",
                    "output_token_logprobs": [[-0.5, 7, None]] * 2,
                },
            }
            for a in self.answers[k]
        ]

    async def abort(self, rids):
        self.aborted.extend(rids)
        for r in rids:
            self.abort_events.setdefault(int(r.split("-")[1]), asyncio.Event()).set()
        return len(rids)


class Tok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1, 2, 3]}


MIXED, ALL_RIGHT = ["3", "4"], ["3", "3"]  # ground truth "3": a mixed group is informative


def _collect(in_order, delays, answers, batch=2):
    pool = ScriptedPool(delays, answers)
    settings = RolloutSettings(
        n=2, max_new_tokens=2, gen_batch_size=len(delays), overlong_shaping=False, progress=False, in_order=in_order
    )
    sampler = RolloutSampler(pool, Tok(), settings, rid_prefix="t")
    records = iter([PromptRecord(prompt=f"q{k}", ground_truth="3") for k in range(len(delays))])
    result = asyncio.run(sampler.collect(records, train_batch_size=batch))
    return result.groups, result.stats, pool


def test_in_order_takes_the_first_informative_groups_by_request_index():
    # requests 0..3 finish in the order 3, 2, 1, 0; 0 is uninformative (all right), 1..3 informative
    delays = [1.2, 0.9, 0.6, 0.0]  # gaps wide enough to keep the order on a loaded machine
    answers = [ALL_RIGHT, MIXED, MIXED, MIXED]
    groups, stats, pool = _collect(True, delays, answers)
    assert stats["groups_kept"] == 2 and stats["groups_seen"] == 3  # k = 0 (filtered), 1, 2
    # the batch is requests 1 and 2 whatever the timing: request 3 finished first but comes later
    assert stats["groups_unscored"] == 1
    assert stats["acc_all"] == (2 + 1 + 1) / 6  # 0: 2 right; 1, 2: one right each
    assert pool.aborted == [] and stats["samples_aborted"] == 0  # everything had finished by the time 0 arrived


def test_completion_order_takes_the_fastest_groups():
    delays = [1.2, 0.9, 0.6, 0.0]  # gaps wide enough to keep the order on a loaded machine
    answers = [ALL_RIGHT, MIXED, MIXED, MIXED]
    groups, stats, pool = _collect(False, delays, answers)
    assert stats["groups_kept"] == 2 and stats["groups_seen"] == 2  # 3 then 2, both informative
    # requests 0 and 1 were still running when the batch filled: all 4 samples aborted, and confirmed
    assert sorted(pool.aborted) == ["t-0-0.", "t-0-1.", "t-1-0.", "t-1-1."]
    assert stats["samples_abort_requested"] == 4 and stats["samples_aborted"] == 4
