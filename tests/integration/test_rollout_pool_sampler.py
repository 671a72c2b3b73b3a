"""Engine pool and sampler against two real serve-rollout processes (each decoding one sequence at
a time, --max-batch-size 1, so a round keeps requests queued long enough to kill or abort them)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from dapo_megatron.rollout.pool import EngineEventReport, EnginePool
from dapo_megatron.rollout.sampler import RolloutSampler, RolloutSettings
from dapo_megatron.transfer.weight_sync import DistributedWeightSync
from rollout_helpers import ServerProcess, get_json, make_tiny_checkpoint


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("rollout_pool")
    model_dir = make_tiny_checkpoint(root / "model", seed=0)
    servers = [
        ServerProcess(
            model_dir, root / "engines", seed=i, log_path=root / f"s{i}.log", extra_args=("--max-batch-size", "1")
        )
        for i in range(2)
    ]
    yield SimpleNamespace(
        root=root, model_dir=model_dir, servers=servers, tokenizer=AutoTokenizer.from_pretrained(model_dir)
    )
    for s in servers:
        s.kill()


def records(kinds):
    return [SimpleNamespace(prompt=f"What is {i} + 1?", ground_truth=kind) for i, kind in enumerate(kinds)]


class ScriptedReward:
    """acc from the ground truth: "mixed" alternates 1, 0, 1, 0 ... (an informative group of n=2),
    "same" is always 1 (a group dynamic sampling drops)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, response: str, ground_truth: str):
        self.calls += 1
        acc = float(self.calls % 2) if ground_truth == "mixed" else 1.0
        return SimpleNamespace(score=2 * acc - 1, acc=acc, pred=None)


def test_dynamic_sampling_stops_when_full_and_aborts_leftovers(env):
    url = env.servers[0].url
    source = iter(records(["mixed", "same", "mixed", "same"] + ["mixed"] * 16))
    settings = RolloutSettings(
        n=2,
        max_new_tokens=32,
        gen_batch_size=4,
        dynamic_sampling=True,
        max_num_gen_batches=5,
        overlong_shaping=True,
        overlong_buffer_length=8,
        stop_token_ids=(),
        progress=False,
        seed=7,
    )

    def server_aborted() -> list[str]:
        return get_json(url + "/server_info")["cpu_engine"]["aborted_rids"]

    async def scenario():
        pool = EnginePool(urls=[url])
        sampler = RolloutSampler(pool, env.tokenizer, settings, reward_fn=ScriptedReward(), rid_prefix="dyn")
        aborted_before = len(server_aborted())
        result = await sampler.collect(source, train_batch_size=3)
        await pool.close()
        return result, aborted_before

    result, aborted_before = asyncio.run(scenario())
    st = result.stats
    assert st["rounds"] == 2  # round 1 keeps 2 of 4 groups; round 2 stops at its first group
    assert st["groups_seen"] == 5 and st["groups_filtered"] == 2 and st["groups_returned"] == 3
    # the 3 other requests of round 2 (6 samples): aborted in flight (normally all, decoded one sequence
    # at a time), or dropped unscored if one finished in the same instant as the batch-filling group
    leftover = 3 - st["groups_unscored"]
    assert leftover >= 2 and st["samples_abort_requested"] == 2 * leftover
    # the metric is what the engine confirmed: replies with finish_reason "abort", exactly the samples the
    # engine reports it aborted; a sample that finished before the abort reached it is not counted
    hits = server_aborted()[aborted_before:]
    assert st["samples_aborted"] == len(hits) and st["samples_aborted"] >= st["samples_abort_requested"] - 1
    assert st["samples_aborted"] + st["samples_finished_after_abort"] == st["samples_abort_requested"]
    assert set(hits) <= {f"dyn-{k}-{j}." for k in range(5, 8) for j in range(2)}  # the samples' own rids
    assert next(source).prompt == "What is 8 + 1?"  # exactly two rounds of prompts were drawn

    assert [len(g) for g in result.groups] == [2, 2, 2]
    for gi, group in enumerate(result.groups):
        assert sorted(s.acc for s in group) == [0.0, 1.0]
        for s in group:
            assert s.group_index == gi and s.ground_truth == "mixed"
            assert len(s.rollout_logprobs) == len(s.response_ids) > 0
            assert s.truncated == (s.extra["finish_reason"] == "length")
            # overlong shaping with L_max 32, L_cache 8: the ramp starts after 24 tokens
            L = len(s.response_ids)
            assert s.extra["overlong_penalty"] == pytest.approx(0.0 if L <= 24 else (24 - L) / 8)
            assert s.reward == pytest.approx(s.extra["score"] + s.extra["overlong_penalty"])
    assert st["tokens_generated"] > 0 and st["tokens_per_s"] > 0


def test_engine_killed_mid_round_loses_no_prompt_and_rejoins_after_resync(env):
    a, b = env.servers
    settings = RolloutSettings(
        n=2, max_new_tokens=48, gen_batch_size=8, dynamic_sampling=False, overlong_shaping=False, progress=False, seed=3
    )
    served_before = get_json(a.url + "/get_server_info")["cpu_engine"]["num_requests"]

    killed = {"b": False}

    def reward_killing_b(response, ground_truth):
        if not killed["b"]:  # the first finished group: b still holds queued requests
            killed["b"] = True
            b.kill()
        return SimpleNamespace(score=1.0, acc=1.0, pred=None)

    async def round_with_kill():
        pool = await EnginePool.from_registry(str(env.root / "engines"), min_engines=2, wait_s=30, max_retries=2)
        report = EngineEventReport(pool)  # what the trainer prints and logs each step
        sampler = RolloutSampler(pool, env.tokenizer, settings, reward_fn=reward_killing_b, rid_prefix="kill")
        result = await sampler.collect(iter(records([f"gt{i}" for i in range(8)])), train_batch_size=8)
        return pool, result, report

    async def scenario():
        pool, result, report = await round_with_kill()
        state_after_kill = pool.load()
        after_kill = report.report(out=lines.append)
        # b comes back on the same host:port (a requeued array task): pending until synced
        restarted = ServerProcess(
            env.model_dir,
            env.root / "engines",
            seed=5,
            port=b.record["port"],
            log_path=env.root / "s1.log",
            extra_args=("--max-batch-size", "1"),
        )
        env.servers[1] = restarted
        pending = await pool.discover()
        live_before_admit = pool.live_urls()
        after_return = report.report(out=lines.append)
        from transformers import AutoModelForCausalLM

        trainer = AutoModelForCausalLM.from_pretrained(env.model_dir, dtype=torch.float32)
        with torch.no_grad():
            for p in trainer.parameters():
                p.mul_(1.01)
        sync = DistributedWeightSync(master_address="127.0.0.1", backend="gloo")
        stats = await sync.sync(pool.weight_targets(), iter(trainer.state_dict().items()), weight_version="step_1")
        await sync.close(pool.weight_targets())
        pool.admit(pending)
        after_rejoin = report.report(out=lines.append)
        counts.extend([after_kill, after_return, after_rejoin])
        client_b = next(c for c in pool.live_clients() if c.url == restarted.url)
        row = await client_b.get_weights_by_name("lm_head.weight", truncate_size=2)
        await pool.close()
        return result, state_after_kill, pending, live_before_admit, pool, stats, row, trainer

    lines, counts = [], []
    result, state, pending, live_before_admit, pool, stats, row, trainer = asyncio.run(scenario())
    assert sorted(g[0].ground_truth for g in result.groups) == sorted(f"gt{i}" for i in range(8))
    assert all(len(g) == 2 for g in result.groups)
    assert state[b.url]["state"] == "dead" and state[b.url]["failures"] == 1
    served = get_json(a.url + "/get_server_info")["cpu_engine"]["num_requests"] - served_before
    assert served > 4  # a served its own share and b's retried requests
    assert state[a.url]["served"] + state[b.url]["served"] == 8

    assert pending == [b.url] and live_before_admit == [a.url]
    assert stats.num_engines == 2
    assert sorted(pool.live_urls()) == sorted([a.url, b.url])
    assert torch.equal(torch.tensor(row), trainer.state_dict()["lm_head.weight"][:2])
    assert [e.split(":")[0] for _, e, u in pool.events if u == b.url] == [
        "pending",
        "admitted",
        "dropped",
        "pending",
        "admitted",
    ]
    # one console line per fault event (start-up admissions are not faults), running counts as metrics
    assert len(lines) == 3, lines
    assert lines[0].startswith(f"[engines] {b.url} dropped (") and lines[0].endswith("; 1 live")
    assert lines[1] == f"[engines] {b.url} answers again; it rejoins after the next weight sync"
    assert lines[2] == f"[engines] {b.url} rejoined with the current weights; 2 live"
    assert counts == [
        {
            "engines/live": 1.0,
            "engines/dropped_total": 1.0,
            "engines/returned_total": 0.0,
            "engines/rejoined_total": 0.0,
        },
        {
            "engines/live": 1.0,
            "engines/dropped_total": 1.0,
            "engines/returned_total": 1.0,
            "engines/rejoined_total": 0.0,
        },
        {
            "engines/live": 2.0,
            "engines/dropped_total": 1.0,
            "engines/returned_total": 1.0,
            "engines/rejoined_total": 1.0,
        },
    ]


def test_pool_survives_one_event_loop_per_step(env):
    """The training loop may call asyncio.run once per step with the same pool (and sampler)."""
    pool = EnginePool(urls=[env.servers[0].url])
    sampler = RolloutSampler(
        pool,
        env.tokenizer,
        RolloutSettings(n=2, max_new_tokens=4, gen_batch_size=2, dynamic_sampling=False, progress=False),
        reward_fn=lambda text, gt: SimpleNamespace(score=1.0, acc=1.0, pred=None),
    )
    # the engine may hold a trainer's weights from an earlier test: expect the version it serves
    sampler.weight_version = get_json(env.servers[0].url + "/model_info")["weight_version"]
    source = iter(records(["x"] * 4))
    first = asyncio.run(sampler.collect(source, train_batch_size=2))
    second = asyncio.run(sampler.collect(source, train_batch_size=2))
    asyncio.run(pool.close())
    assert [len(r.groups) for r in (first, second)] == [2, 2]
    assert {g[0].prompt_ids[0] for g in first.groups + second.groups} and sampler.num_requests == 4


def test_sample_eval_counts_each_problem_once_done_and_the_count_changes_no_sample(env):
    """on_problem(k) (the eval's progress line) is called with 1..P as problems finish; the samples are the
    same with and without it (seeded per sample)."""
    from dapo_megatron.trainer.evaluation.sampling import sample_eval

    recs = [SimpleNamespace(prompt=f"{i}+1=", ground_truth=str(i + 1)) for i in range(3)]
    ids = [env.tokenizer.encode(r.prompt) for r in recs]
    settings = dict(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=3, per_sample_seeds=True)

    async def scenario(on_problem):
        pool = EnginePool(urls=[env.servers[0].url])
        try:
            return await sample_eval(pool, ids, recs, **settings, on_problem=on_problem)
        finally:
            await pool.close()

    counted: list[int] = []
    with_count, without = asyncio.run(scenario(counted.append)), asyncio.run(scenario(None))
    assert counted == [1, 2, 3]
    assert with_count.answers == without.answers and torch.equal(with_count.response_tokens, without.response_tokens)
