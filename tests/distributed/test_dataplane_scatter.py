"""The step's batch scattered per DP share (dataplane/scatter.py) on gloo ranks: every rank receives
exactly the share it would have selected itself from the full list (tensors and plan, bit for bit),
and nothing more (bytes received = its share + a header; the driver receives nothing); the actor on
the scattered share computes the same old log-probs and the same updates as the list-of-Samples
path on each mini-batch, the first update of a step is exactly on-policy, and the step metrics
(entropy, train-inference mismatch, the rollout correction's KLs, chi-square, ESS and masked fractions)
reduced over DP equal a float64 reference over all tokens."""

from __future__ import annotations

import random

import pytest
import torch

from dapo_megatron.algo.mismatch import group_counts, masked_group_metrics, mismatch_metrics, mismatch_sums
from dapo_megatron.algo.rollout_correction import RolloutCorrection
from dapo_megatron.dataplane.sample import Sample
from helpers_actor import hf_logprobs, make_cfg

# the step metrics' correction (engine log-probs uniform in [-6, 0] against a near-uniform model's ~-5.7):
# some responses rejected by the geometric band, some vetoed, the others weighted
CORRECTION = RolloutCorrection.from_keys(
    seq_is_cap=2.0, rejection="geometric", rejection_upper=2.0, rejection_lower=0.08, veto_threshold=0.004
)


def make_step(num_groups, n, *, seed, vocab=300, experts_width=0):
    """experts_width > 0: MoE samples with the engine's routed experts (ids 0..7), one in five without."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(2, 7))]
        for _ in range(n):
            r = rng.randint(1, 11)
            out.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(5, vocab) for _ in range(r)],
                    group_index=g,
                    advantage=rng.uniform(-1.5, 1.5),
                    reward=rng.choice([-1.0, 1.0]),
                    truncated=rng.random() < 0.2,
                    rollout_logprobs=[-rng.random() * 6 for _ in range(r)],
                )
            )
            if experts_width and rng.random() < 0.8:
                rows = [[rng.randrange(8) for _ in range(experts_width)] for _ in range(len(prompt) + r - 1)]
                out[-1].routed_experts = torch.tensor(rows, dtype=torch.uint8)
    return out


def _scatter_rank(samples, tp, pp, cp, per_mini, budget):
    import torch.distributed as dist

    from dapo_megatron.actor import parallel
    from dapo_megatron.dataplane.batch import RolloutBatch
    from dapo_megatron.dataplane.scatter import _header, _header_bytes, scatter_batch
    from dapo_megatron.dataplane.share import BatchShare, PackSettings, plan_shares

    settings = PackSettings.for_layout(
        micro_batch_tokens=budget, tp=tp, pp=pp, cp=cp, vpp=None, sequence_parallel=tp > 1
    )
    with parallel.model_parallel(tp=tp, pp=pp, cp=cp) as layout:
        batch = RolloutBatch.from_samples(samples)
        share, stats = scatter_batch(
            batch if dist.get_rank() == 0 else None, layout=layout, settings=settings, sequences_per_mini_batch=per_mini
        )
        # what this rank would have selected itself from the full list
        plan = plan_shares(
            batch.seq_lengths, sequences_per_mini_batch=per_mini, settings=settings, dp_size=layout.dp_size
        )[layout.dp_rank]
        mine = BatchShare.from_plan(batch, plan, step_sequences=batch.num_sequences)
        got, want = share.batch.tensors(), mine.batch.tensors()
        assert set(got) == set(want), (set(got), set(want))
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        for name in ("micro_batch_sizes", "micro_batches_per_mini", "mini_batch_lengths"):
            assert torch.equal(getattr(share, name), getattr(mine, name)), name
        assert share.step_sequences == len(samples)
        return {
            "rank": dist.get_rank(),
            "received": stats.bytes_received,
            "share": stats.share_bytes,
            "header": _header_bytes(_header(mine)),
            "sequences": share.batch.num_sequences,
            "plan": sum(
                8 * getattr(mine, k).numel()
                for k in ("micro_batch_sizes", "micro_batches_per_mini", "mini_batch_lengths")
            ),
            "dp_rank": layout.dp_rank,
            "fields": sorted(k for k in got if k.startswith("token_fields.")),
        }


# (world, tp, pp, cp): pure DP, TP and PP peers, CP peers, no DP at all
SCATTER_LAYOUTS = [(4, 1, 1, 1), (4, 2, 1, 1), (4, 1, 2, 1), (4, 1, 1, 2), (4, 2, 2, 1), (2, 1, 1, 1)]


@pytest.mark.parametrize("world,tp,pp,cp", SCATTER_LAYOUTS, ids=lambda v: str(v))
def test_every_rank_receives_exactly_its_share(rank_pool, world, tp, pp, cp):
    experts_width = 6 if world == 2 or (tp, pp) == (2, 2) else 0  # MoE: the routed experts travel too
    # 3 mini-batches of 8 sequences
    samples = make_step(6, 4, seed=world * 10 + tp + 2 * pp + 3 * cp, experts_width=experts_width)
    results = rank_pool(world).run(_scatter_rank, samples, tp, pp, cp, 8, 64)
    assert all(r["fields"] == (["token_fields.routed_experts"] if experts_width else []) for r in results)
    assert sum(
        r["sequences"] for r in results if r["rank"] == min(q["rank"] for q in results if q["dp_rank"] == r["dp_rank"])
    ) == len(samples)
    for r in results:
        if r["rank"] == 0:
            assert r["received"] == 0  # the driver holds the batch
        else:  # its share's tensors once, its plan (a few int64s) and a header; nothing of other shares
            assert r["received"] == r["share"] + r["plan"] + r["header"], r
            assert r["header"] < 700


def test_a_share_of_no_sequence(rank_pool):
    """More DP ranks than sequences: the empty shares travel as headers alone."""
    samples = make_step(1, 3, seed=4)
    results = rank_pool(4).run(_scatter_rank, samples, 1, 1, 1, 3, 64)
    assert sorted(r["sequences"] for r in results) == [0, 1, 1, 1]


def _share_vs_list_rank(hf_dir, samples, tp, pp, per_mini, budget):
    """The training loop's path (driver batch -> scatter -> logprobs(share) -> train per mini-batch)
    and the list path (every rank holds each mini-batch's Samples) on two fresh actors."""
    import torch.distributed as dist

    from dapo_megatron.actor import parallel
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.dataplane.batch import RolloutBatch
    from dapo_megatron.dataplane.scatter import scatter_batch
    from dapo_megatron.dataplane.share import plan_shares
    from dapo_megatron.distributed.roles import RankRoles
    from dapo_megatron.trainer.settings import actor_settings
    from dapo_megatron.trainer.step_metrics import old_logprob_metrics

    cfg = make_cfg(tp=tp, pp=pp, micro_batch_tokens=budget, lr=1e-3, warmup_steps=0)
    with parallel.model_parallel(tp=tp, pp=pp, seed=7) as layout:
        roles = RankRoles.current(layout)
        actor = Actor(actor_settings(cfg), hf_dir, layout)
        batch = RolloutBatch.from_samples(samples) if roles.driver else None
        share, _ = scatter_batch(batch, layout=layout, settings=actor.pack_settings, sequences_per_mini_batch=per_mini)
        old = actor.logprobs(share)
        share.batch.old_logprobs = old.logprobs
        metrics = old_logprob_metrics(share.batch, old.logprobs, old.entropies, reports=roles.reports)
        corrected = old_logprob_metrics(
            share.batch, old.logprobs, old.entropies, reports=roles.reports, correction=CORRECTION
        )
        updates = [actor.train(mini, step=0) for mini in share.mini_batches()]
        weights = {k: v.clone() for k, v in actor.iter_hf_weights()}

        reference = Actor(actor_settings(cfg), hf_dir, layout)
        minis = [samples[i : i + per_mini] for i in range(0, len(samples), per_mini)]
        list_old = [reference.logprobs(m) for m in minis]  # each mini-batch planned alone: the same micro-batches
        for m, out in zip(minis, list_old):
            for s, lp in zip(m, out.logprobs):
                s.old_logprobs = lp.tolist()
        list_updates = [reference.train(m, step=0) for m in minis]
        list_weights = {k: v.clone() for k, v in reference.iter_hf_weights()}
        order = plan_shares(
            RolloutBatch.from_samples(samples).seq_lengths,
            sequences_per_mini_batch=per_mini,
            settings=actor.pack_settings,
            dp_size=layout.dp_size,
        )[layout.dp_rank].indices
        return {
            "holds": roles.holds_results,
            "share_old": old.logprobs,
            "share_ent": old.entropies,
            "order": order,
            "dp_rank": layout.dp_rank,
            "rank": dist.get_rank(),
            "list_old": [lp for out in list_old for lp in out.logprobs],
            "list_ent": [e for out in list_old for e in out.entropies],
            "metrics": metrics,
            "corrected": corrected,
            "updates": updates,
            "list_updates": list_updates,
            "weights": weights,
            "list_weights": list_weights,
        }


def _whole_batch(samples, holder):
    """MismatchTokens of every sample in one piece: the list path's old log-probs, the engine's, the loss mask."""
    from dapo_megatron.algo.rollout_correction import MismatchTokens

    old = torch.cat([lp.double() for lp in holder["list_old"]])
    rollout = torch.cat([torch.tensor(s.rollout_logprobs, dtype=torch.float32).double() for s in samples])
    seq = torch.cat([torch.full((len(s.response_ids),), i) for i, s in enumerate(samples)])
    return MismatchTokens.of(
        old_logprobs=old, rollout_logprobs=rollout, mask=torch.ones_like(old), seq_ids=seq, num_sequences=len(samples)
    )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return str(save_tiny_hf(tmp_path_factory.mktemp("qwen"), arch="qwen2", tied=False))


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)])
def test_actor_on_scattered_shares_equals_the_list_path(rank_pool, tiny_dir, tp, pp):
    samples = make_step(4, 4, seed=tp + pp)  # 2 mini-batches of 8 sequences
    results = rank_pool(2).run(_share_vs_list_rank, tiny_dir, samples, tp, pp, 8, 40)
    want, want_ent = hf_logprobs(tiny_dir, samples)
    for r in results:
        for a, b in zip(r["updates"], r["list_updates"]):
            assert a == b  # same loss, grad norm, clip fractions: the maths did not change
        assert all(torch.equal(r["weights"][k], r["list_weights"][k]) for k in r["list_weights"])
        assert r["updates"][0]["ratio_max"] == 1.0  # pi_old recomputed bit for bit by the first update
        if not r["holds"]:
            assert r["share_old"] is None  # log-probs stay on the last stage
    # the share's old log-probs, in share order, are the list path's values for those sequences, bit for bit
    holders = [r for r in results if r["holds"]]
    covered = set()
    for r in holders:  # the driver's share and received ones alike
        assert torch.equal(r["share_old"], torch.cat([r["list_old"][i] for i in r["order"].tolist()]))
        assert torch.equal(r["share_ent"], torch.cat([r["list_ent"][i] for i in r["order"].tolist()]))
        covered.update(r["order"].tolist())
    assert covered == set(range(len(samples)))
    # metrics: entropy over all tokens and |trainer - engine| against a float64 reference
    ent = torch.cat([e.double() for e in holders[0]["list_ent"]])
    diff = torch.cat(
        [
            (lp.double() - torch.tensor(s.rollout_logprobs, dtype=torch.float32).double()).abs()
            for lp, s in zip(holders[0]["list_old"], samples)
        ]
    )
    for r in results:
        m = r["metrics"]
        assert m["actor/entropy_old"] == pytest.approx(float(ent.mean()), rel=1e-12)
        assert m["mismatch/mean"] == pytest.approx(float(diff.mean()), rel=1e-12)
        assert m["mismatch/max"] == float(diff.max())
    for got, ref in zip(holders[0]["list_old"], want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # the mismatch metrics and the correction's fractions (algo/mismatch.py): the DP shares' sums reduced equal
    # the whole batch's metrics computed in one piece
    tokens = _whole_batch(samples, holders[0])
    whole = mismatch_metrics(*[x.tolist() for x in mismatch_sums(tokens, CORRECTION)], CORRECTION)
    groups = torch.tensor([s.group_index for s in samples])
    whole.update(masked_group_metrics(group_counts(tokens, CORRECTION, group_index=groups, num_groups=4)))
    assert 0 < whole["correction/masked_group_frac"] < 1  # a group split over the shares counts once
    assert 0 < whole["correction/masked_response_frac"] < 1 and whole["correction/vetoed_response_frac"] > 0
    for r in results:
        got = {
            k: v
            for k, v in r["corrected"].items()
            if k.startswith(("mismatch/k", "mismatch/l", "mismatch/c", "mismatch/e", "mismatch/r", "correction/"))
        }
        assert got.keys() == whole.keys()
        assert got == pytest.approx(whole, rel=1e-12)


def _roles_rank(tp, pp, cp):
    import torch.distributed as dist

    from dapo_megatron.actor import parallel
    from dapo_megatron.distributed.roles import RankRoles

    with parallel.model_parallel(tp=tp, pp=pp, cp=cp) as layout:
        r = RankRoles.current(layout)
        names = {n for n in ("driver", "batch_source", "holds_results", "reports", "exporter") if getattr(r, n)}
        return names, dist.get_process_group_ranks(layout.replica_group)


# megatron's order tp-cp-dp-pp, worked out by hand: rank = tp + TP * (cp + CP * (dp + DP * pp))
ROLES = {
    (2, 2, 1): [
        {"driver", "batch_source", "exporter"},
        set(),
        {"holds_results", "reports", "exporter"},
        {"holds_results"},
    ],
    (1, 1, 2): [
        {"driver", "batch_source", "holds_results", "reports", "exporter"},
        {"holds_results"},
        {"batch_source", "holds_results", "reports"},
        {"holds_results"},
    ],
    (1, 2, 1): [
        {"driver", "batch_source", "exporter"},
        {"batch_source"},
        {"holds_results", "reports", "exporter"},
        {"holds_results", "reports"},
    ],
}
REPLICAS = {
    (2, 2, 1): [[0, 1, 2, 3]] * 4,
    (1, 1, 2): [[0, 1], [0, 1], [2, 3], [2, 3]],
    (1, 2, 1): [[0, 2], [1, 3], [0, 2], [1, 3]],
}


@pytest.mark.parametrize("layout", list(ROLES), ids=lambda v: f"tp{v[0]}pp{v[1]}cp{v[2]}")
def test_rank_roles_and_replica_groups(rank_pool, layout):
    results = rank_pool(4).run(_roles_rank, *layout)
    assert [names for names, _ in results] == ROLES[layout]
    assert [ranks for _, ranks in results] == REPLICAS[layout]
