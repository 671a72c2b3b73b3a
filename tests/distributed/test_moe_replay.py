"""Routing replay (R3) in the Actor on a tiny Qwen3-MoE (gloo ranks, fp32), against transformers with
its routers forced to the same experts: with actor.routing_replay the old log-probs equal the forced
model's (and not the free one's) at EP=2, TP=2 (sequence parallel) and PP=2; the train step's loss
and gradient equal the forced model's big-batch gradient at EP=2; the agreement metric is 1 for the
model's own routing and the hand-counted overlap for another routing."""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers_actor import gradients_before_the_step, make_samples, moe_cfg
from helpers_fp32 import reference_step

NUM_LAYERS, TOPK, NUM_EXPERTS = 4, 2, 4
SPARSE = (0, 2, 3)  # layer 1 is dense (mlp_only_layers)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return str(save_tiny_hf(tmp_path_factory.mktemp("qwen3_moe_r3"), arch="qwen3_moe", num_layers=NUM_LAYERS, seed=8))


@contextlib.contextmanager
def routing(model, forced: dict | None = None, record: dict | None = None):
    """Hooks on transformers' routers: `forced[layer]` [N - 1, k] replaces the top-k of the first N - 1
    tokens (gate weights = the router's softmax at those experts, renormalised: norm_topk_prob);
    `record[layer]` receives the router's own top-k."""

    def hook(layer):
        def run(module, args, output):
            logits, weights, indices = output
            if record is not None:
                record[layer] = indices.clone()
            if forced is None:
                return None
            rows = forced[layer].to(indices.dtype)
            indices = torch.cat([rows, indices[rows.shape[0] :]])
            probs = torch.softmax(logits.float(), dim=-1).gather(1, indices)
            return logits, (probs / probs.sum(-1, keepdim=True)).to(weights.dtype), indices

        return run

    handles = [
        layer.mlp.gate.register_forward_hook(hook(i))
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def other_routing(samples, seed):
    """Random distinct top-2 experts per token and sparse layer, as the engine would send them
    ([P + R - 1, layers * k] uint8, zeros for the dense layer)."""
    gen = torch.Generator().manual_seed(seed)
    for s in samples:
        rows = torch.zeros(s.num_tokens - 1, NUM_LAYERS, TOPK, dtype=torch.uint8)
        for layer in SPARSE:
            rows[:, layer] = torch.stack(
                [torch.randperm(NUM_EXPERTS, generator=gen)[:TOPK] for _ in range(s.num_tokens - 1)]
            ).to(torch.uint8)
        s.routed_experts = rows.view(s.num_tokens - 1, -1)
    return samples


def forced_of(sample):
    rows = sample.routed_experts.view(sample.num_tokens - 1, NUM_LAYERS, TOPK).long()
    return {layer: rows[:, layer] for layer in SPARSE}


def hf_logprobs(moe_dir, samples, *, forced: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            with routing(model, forced_of(s) if forced else None):
                logp = torch.log_softmax(model(ids).logits[0].double(), -1)[len(s.prompt_ids) - 1 : -1]
            out.append(logp.gather(1, ids[0, len(s.prompt_ids) :, None])[:, 0].float())
    return out


def replayed_logprobs_on_rank(moe_dir, samples, tp, pp, ep, replay):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(tp=tp, pp=pp, ep=ep, seed=7) as layout:
        cfg = moe_cfg(tp=tp, ep=ep)
        cfg.actor.pp = pp
        cfg.actor.routing_replay = replay
        cfg.rollout.return_routed_experts = True
        out = Actor(actor_settings(cfg), moe_dir, layout).logprobs(samples)
    return out.logprobs, out.routing


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (2, 1, 1), (1, 2, 1)])
def test_replayed_logprobs_equal_transformers_forced_to_the_same_experts(rank_pool, moe_dir, tp, pp, ep):
    samples = other_routing(make_samples(6, seed=2), seed=0)
    forced, free = hf_logprobs(moe_dir, samples, forced=True), hf_logprobs(moe_dir, samples, forced=False)
    results = rank_pool(2).run(replayed_logprobs_on_rank, moe_dir, samples, tp, pp, ep, True)
    (logps, metrics), (logps_b, _) = results
    assert all(torch.equal(a, b) for a, b in zip(logps, logps_b))
    assert max(float((a - b).abs().max()) for a, b in zip(logps, forced)) <= 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(forced, free)) > 1e-2  # the routing matters
    assert set(metrics) == {"routing/agreement", "routing/exact_match", "routing/token_layers"}


def test_agreement_is_one_for_the_models_own_routing_and_the_overlap_otherwise(rank_pool, moe_dir):
    from transformers import AutoModelForCausalLM

    samples = make_samples(6, seed=3)
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    own = []
    for s in samples:  # what an engine running this very model reports
        record = {}
        with torch.no_grad(), routing(model, record=record):
            model(torch.tensor([s.prompt_ids + s.response_ids]))
        rows = torch.zeros(s.num_tokens - 1, NUM_LAYERS, TOPK, dtype=torch.uint8)
        for layer in SPARSE:
            rows[:, layer] = record[layer][:-1].to(torch.uint8)
        own.append(rows)
        s.routed_experts = rows.view(s.num_tokens - 1, -1)
    _, metrics = rank_pool(2).run(replayed_logprobs_on_rank, moe_dir, samples, 1, 1, 2, False)[0]
    token_layers = sum(s.num_tokens - 1 for s in samples) * len(SPARSE)
    assert metrics == {"routing/agreement": 1.0, "routing/exact_match": 1.0, "routing/token_layers": token_layers}

    other = other_routing(make_samples(6, seed=3), seed=1)
    overlap = exact = 0
    for s, rows in zip(other, own):
        engine = s.routed_experts.view(s.num_tokens - 1, NUM_LAYERS, TOPK).long()
        for layer in SPARSE:
            hits = (rows[:, layer, :, None].long() == engine[:, layer, None, :]).any(-1).sum(-1)
            overlap, exact = overlap + int(hits.sum()), exact + int((hits == TOPK).sum())
    _, metrics = rank_pool(2).run(replayed_logprobs_on_rank, moe_dir, other, 1, 1, 2, False)[0]
    assert metrics["routing/agreement"] == pytest.approx(overlap / (token_layers * TOPK), abs=1e-12)
    assert metrics["routing/exact_match"] == pytest.approx(exact / token_layers, abs=1e-12)
    assert 0.2 < metrics["routing/agreement"] < 0.9  # random top-2 of 4 vs the router: ~half overlaps


def replayed_grads_on_rank(moe_dir, samples, ep):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with gradients_before_the_step() as captured, model_parallel(ep=ep, seed=7) as layout:
        cfg = moe_cfg(ep=ep, micro_batch_tokens=40, lr=1e-3, warmup_steps=0)
        cfg.actor.use_distributed_optimizer = False
        cfg.actor.routing_replay = cfg.rollout.return_routed_experts = True
        captured.actor = Actor(actor_settings(cfg), moe_dir, layout)
        metrics = captured.actor.train(samples, step=0)
    return metrics, captured.grads


def test_replayed_train_step_has_the_forced_models_gradient(rank_pool, moe_dir):
    from helpers_actor import fill_rl_fields

    samples = other_routing(make_samples(8, seed=4), seed=2)
    samples = fill_rl_fields(samples, hf_logprobs(moe_dir, samples, forced=True), seed=3)
    # the big-batch token-mean DAPO step on transformers with the same forced routing, float64 and fp32
    ref = reference_step(moe_dir, samples, forward_context=lambda model, s: routing(model, forced_of(s)))
    for metrics, grads in rank_pool(2).run(replayed_grads_on_rank, moe_dir, samples, 2):
        worst = max(ref.check_loss(metrics["loss"]), ref.check_grads(grads))
    print(f"replayed step vs float64: worst error / fp32 bound {worst:.2f}")
    want = ref.exact.grads
    router = want["model.layers.0.mlp.gate.weight"]
    assert float(router.abs().max()) > 1e-3  # the replayed gate weights still train the router
