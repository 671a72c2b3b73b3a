"""Weight sync from a Megatron actor at TP=2 (gloo ranks) after one training step into a real
serve-rollout process: afterwards the engine's log-probs of its own samples equal the actor's."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from dapo_megatron.dataplane.sample import Sample
from rollout_helpers import ServerProcess, make_tiny_checkpoint

PROMPTS = [[1, 17, 42, 99, 7, 250], [1, 5, 6], [1, 200, 201, 202, 203, 204, 205, 9]]


def _cfg(tp: int):
    from dapo_megatron.config import ActorConfig, Config

    cfg = Config()
    cfg.actor = ActorConfig(
        tp=tp,
        attention_backend="torch",
        precision="fp32",
        micro_batch_tokens=64,
        use_distributed_optimizer=True,
        fused_logprob=False,
        fused_policy_loss=False,
    )
    cfg.rollout.temperature = 1.0
    cfg.trainer.lr, cfg.trainer.warmup_steps = 1e-3, 0
    return cfg


def _training_samples() -> list[Sample]:
    rng = random.Random(4)
    out = []
    for i in range(8):
        prompt = [rng.randrange(5, 300) for _ in range(rng.randint(2, 8))]
        response = [rng.randrange(5, 300) for _ in range(rng.randint(2, 10))]
        out.append(Sample(prompt_ids=prompt, response_ids=response, group_index=i // 2, advantage=[1.0, -1.0][i % 2]))
    return out


def _train_sync_score_rank(hf_dir: str, url: str):
    """Every rank: one train step at TP=2, stream the weights (rank 0 sends them to the engine),
    then the engine samples and the actor scores those samples."""
    import torch.distributed as dist

    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.rollout.client import EngineClient
    from dapo_megatron.trainer.settings import actor_settings
    from dapo_megatron.transfer.weight_sync import DistributedWeightSync

    rank = dist.get_rank()
    with model_parallel(tp=2, seed=7) as layout:
        actor = Actor(actor_settings(_cfg(2)), hf_dir, layout)
        samples = _training_samples()
        old = actor.logprobs(samples).logprobs
        for s, lp in zip(samples, old):
            s.old_logprobs = lp.tolist()
        metrics = actor.train(samples, step=0)

        engine_out = None
        if rank == 0:

            async def push_and_sample():
                async with EngineClient(url) as client:
                    sync = DistributedWeightSync(master_address="127.0.0.1", backend="gloo", bucket_bytes=100_000)
                    stats = await sync.sync([client], actor.iter_hf_weights(), weight_version="step_1")
                    await sync.close([client])
                    outs = await client.generate(
                        input_ids=PROMPTS,
                        return_logprob=True,
                        sampling_params={"max_new_tokens": 16, "sampling_seed": 21, "ignore_eos": True},
                    )
                    return stats, outs

            engine_out = asyncio.run(push_and_sample())
        else:
            for _ in actor.iter_hf_weights():  # the all-gathers are collective: rank 1 joins them
                pass
        box = [engine_out]
        dist.broadcast_object_list(box, src=0)
        stats, outs = box[0]
        scored = [
            Sample(prompt_ids=p, response_ids=o["output_ids"], group_index=i)
            for i, (p, o) in enumerate(zip(PROMPTS, outs))
        ]
        actor_lp = [t.double() for t in actor.logprobs(scored).logprobs]
    engine_lp = [
        torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]], dtype=torch.float64) for o in outs
    ]
    return metrics, stats.num_tensors, stats.bytes, engine_lp, actor_lp, [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_actor")
    model_dir = make_tiny_checkpoint(root / "model", seed=0)
    proc = ServerProcess(model_dir, root / "engines", log_path=root / "server.log")
    yield model_dir, proc
    proc.kill()


def test_engine_logprobs_match_tp2_actor_after_one_step_and_sync(rank_pool, engine):
    from transformers import AutoModelForCausalLM

    model_dir, proc = engine
    results = rank_pool(2).run(_train_sync_score_rank, str(model_dir), proc.url)
    metrics, num_tensors, nbytes, engine_lp, actor_lp, tokens = results[0]
    assert metrics["update_skipped"] == 0 and metrics["nonfinite"] == 0
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert num_tensors == len(original.state_dict())
    assert nbytes == sum(t.numel() * t.element_size() for t in original.state_dict().values())
    moved = 0.0
    for prompt, out_ids, e, a, a_rank1 in zip(PROMPTS, tokens, engine_lp, actor_lp, results[1][4]):
        assert len(e) == len(a) == len(out_ids) == 16
        torch.testing.assert_close(e, a, atol=1e-4, rtol=0)
        assert torch.equal(a, a_rank1)  # both ranks computed the same actor log-probs
        with torch.no_grad():  # the step moved the policy: the pre-step weights score these tokens otherwise
            logits = original(torch.tensor([prompt + out_ids])).logits[0].double()
        before = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(-1, torch.tensor(out_ids)[:, None])[:, 0]
        moved = max(moved, float((before - e).abs().max()))
    assert moved > 1e-2  # 100x the tolerance: the engine really serves the updated weights
