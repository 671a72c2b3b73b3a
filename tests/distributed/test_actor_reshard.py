"""A checkpoint saved under one parallel layout loads under every other (issue 50): saved after step 0
under TP=1 x DP=2 (distributed optimizer), TP=2, PP=2 and CP=2, then loaded under each of the other three
on the same two gloo ranks.

What must hold, and why it could fail:
- resharding moves values, never rounds them: the loaded model weights equal the saved ones exactly, and
  a checkpoint written again under the new layout holds exactly the saved master parameters and both Adam
  moments as full tensors (megatron's load_plain_tensors of both checkpoints; a shard read at a wrong
  offset or a moment left at zero differs). The padded vocabulary follows TP (the actor pads to a
  multiple of TP: 301 rows at TP=1, 302 at TP=2): its common rows are equal and a padding row is zero.
- the run continues: the next step under the new layout gives the loss, grad norm and weights of the
  uninterrupted run under the old one within the float64-derived fp32 bounds of the layout-parity tests
  (tests/helpers_fp32.py), doubled because both runs carry their own rounding. The weights' bound is the
  gradient bound times the slope of Adam's second update, derived below.
- the step counters and the learning rate continue (actor_state.json), and the RNG states are re-derived
  where the saved ones do not map (TP or PP changed)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers_actor import STEP, fill_rl_fields, hf_logprobs, make_cfg, make_samples, moe_cfg
from helpers_fp32 import U32, reference_step

LAYOUTS = {"tp1-dp2": dict(tp=1), "tp2": dict(tp=2), "pp2": dict(pp=2), "cp2": dict(cp=2)}
# the tiny Qwen3-MoE: each rank holds half the experts (EP=2), or all of them with DP=2 (EP=1)
MOE_LAYOUTS = {"ep2": dict(ep=2), "ep1-dp2": dict(ep=1)}
VOCAB = 301
BETAS = (0.9, 0.999)  # the config's defaults (trainer.adam_beta1 / adam_beta2), which make_cfg keeps


def _weights(actor):
    return {k: v.clone() for k, v in actor.iter_hf_weights()}


def _actor(hf_dir, layout, sizes):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.trainer.settings import actor_settings

    cfg = moe_cfg if "ep" in sizes else make_cfg
    actor = Actor(actor_settings(cfg(**sizes, micro_batch_tokens=40, lr=1e-3, warmup_steps=3)), hf_dir, layout)
    for group in actor.optimizer.param_groups:
        group["eps"] = STEP["eps"]  # the layout-parity tests' eps (test_actor_train.py says why)
    return actor


def _plain_difference(saved_dir, written_dir):
    """Every ShardedTensor of two checkpoints as full tensors: the keys of each, and per common key the
    largest difference over the common region plus the largest value outside it (padding rows)."""
    from megatron.core import dist_checkpointing

    a = _flat(dist_checkpointing.load_plain_tensors(str(saved_dir)))
    b = _flat(dist_checkpointing.load_plain_tensors(str(written_dir)))
    diffs = {}
    for key in set(a) & set(b):
        x, y = a[key], b[key]
        common = tuple(slice(0, min(n, m)) for n, m in zip(x.shape, y.shape))
        diffs[key] = (float((x[common] - y[common]).abs().max()), max(_outside(x, common), _outside(y, common)))
        diffs[key] += (tuple(x.shape), tuple(y.shape))
    return sorted(a), sorted(b), diffs


def _flat(tree, prefix=""):
    """The tensors of a nested dict / list: {'a': {'b': t}, 'c': [u]} -> {'a.b': t, 'c.0': u}"""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    return {k: v for key, sub in items for k, v in _flat(sub, f"{prefix}.{key}" if prefix else str(key)).items()}


def _outside(t, common):
    """The largest |value| of t outside the region `common` (0 when there is none)."""
    rest = t.clone()
    rest[common] = 0
    return float(rest.abs().max()) if rest.numel() else 0.0


def _reshard_rank(hf_dir, batches, root, saved_as, layouts=LAYOUTS):
    import multiprocessing
    from pathlib import Path

    from dapo_megatron.actor.parallel import model_parallel

    multiprocessing.current_process()._config["daemon"] = False  # dist_checkpointing's writer has children
    root = Path(root)
    with model_parallel(**layouts[saved_as], seed=7) as layout:
        actor = _actor(hf_dir, layout, layouts[saved_as])
        actor.train(batches[0], step=0)
        actor.save(root / saved_as)
        saved = _weights(actor)
        uninterrupted = actor.train(batches[1], step=1)
        after = _weights(actor)
        actor.close()
        del actor
    resumed = {}
    for label, sizes in layouts.items():
        if label == saved_as:
            continue
        # another seed: the RNG comes from the checkpoint or the run seed
        with model_parallel(**sizes, seed=99) as layout:
            actor = _actor(hf_dir, layout, sizes)
            meta = actor.load(root / saved_as, seed=7)
            loaded = _weights(actor)
            actor.save(root / f"{saved_as}_as_{label}")
            metrics = actor.train(batches[1], step=1)
            resumed[label] = dict(
                meta=meta,
                loaded_equal=all(torch.equal(loaded[n], w) for n, w in saved.items()),
                counters=(actor.num_updates, actor.last_step),
                metrics=metrics,
                after=_weights(actor),
                plain=_plain_difference(root / saved_as, root / f"{saved_as}_as_{label}"),
            )
            actor.close()
            del actor
    return dict(saved=saved, uninterrupted=uninterrupted, after=after, resumed=resumed)


def adam_second_update_slope(*, lr: float, eps: float, betas: tuple[float, float]) -> float:
    """A bound on |d u / d g| of AdamW's second update u = lr * m^ / (sqrt(v^) + eps), m^ and v^ the
    bias-corrected moments after the gradients g1 (step 0) and g (step 1). Differentiating,
        du/dg = lr / (1 - b1^2) * [ (1 - b1) / (s + eps)  -  m (1 - b2) g / ((1 - b2^2) s (s + eps)^2) ],
    s = sqrt(v^). The first term is at most lr (1 - b1) / (1 - b1^2) / eps. In the second,
    (1 - b2) |g| / ((1 - b2^2) s) <= sqrt((1 - b2) / (1 - b2^2)) <= 1 and |m^| / (s + eps) <= C with
    C = (1 - b1) / (1 - b1^2) * sqrt((1 - b2^2) / (1 - b2)) * sqrt(1 + b1^2 / b2) (Cauchy-Schwarz over the
    two gradients), so it is at most lr * C / eps."""
    b1, b2 = betas
    c = (1 - b1) / (1 - b1**2) * math.sqrt((1 - b2**2) / (1 - b2)) * math.sqrt(1 + b1**2 / b2)
    return lr * (1 - b1) / (1 - b1**2) / eps + lr * c / eps


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    # 301 tokens: an odd vocabulary, padded to a multiple of TP (302 rows at TP=2, one zero row)
    return str(save_tiny_hf(tmp_path_factory.mktemp("qwen"), arch="qwen2", tied=False, shape={"vocab_size": VOCAB}))


def _step1_reference(tiny_dir, step0_weights, batch, tmp_path):
    """The float64 step on the step-0 weights (the transformers model with them) and its fp32 bounds."""
    import shutil

    from safetensors.torch import save_file

    where = tmp_path / "step0_hf"
    shutil.copytree(tiny_dir, where)
    save_file({k: v.contiguous() for k, v in step0_weights.items()}, str(where / "model.safetensors"))
    return reference_step(str(where), batch)


def _batches(hf_dir):
    batches = []
    for seed in (21, 22):
        samples = make_samples(10, seed=seed)
        logps, _ = hf_logprobs(hf_dir, samples)
        batches.append(fill_rl_fields(samples, logps, seed=seed))
    return batches


def _check_resumed(results, ref, *, layouts, saved_as) -> dict[str, float]:
    """Every rank's every resumed layout: the loaded state exactly the saved one, the counters and lr
    continued, the next step within the doubled fp32 bounds of the uninterrupted one. Returns the worst
    weight error / bound per resumed layout."""
    slope = adam_second_update_slope(lr=STEP["lr"], eps=STEP["eps"], betas=BETAS)
    clip = min(1.0, STEP["grad_clip"] / (ref.grad_norm + 1e-6))
    worst = {}
    for rank, r in enumerate(results):
        assert set(r["resumed"]) == set(layouts) - {saved_as}
        for label, got in r["resumed"].items():
            what = f"rank {rank}: saved as {saved_as}, resumed as {label}"
            assert got["loaded_equal"], f"{what}: the loaded weights are not the saved ones"
            assert got["meta"]["optimizer_format"] == "fully_reshardable"
            for key in ("tp", "ep"):
                assert got["meta"]["layout"][key] == layouts[saved_as].get(key, 1), (what, key)
            assert got["counters"] == (2, 1), what
            keys_saved, keys_written, diffs = got["plain"]
            assert keys_saved == keys_written, what
            optimizer_keys = [k for k in keys_saved if k.startswith("optimizer.state.")]
            for moment in ("param", "exp_avg", "exp_avg_sq"):  # megatron's names: master param, Adam moments
                assert any(k.startswith(f"optimizer.state.{moment}.") for k in optimizer_keys), (what, moment)
            for key, (diff, outside, shape_saved, shape_written) in diffs.items():
                assert diff == 0.0, f"{what}: {key} differs by {diff:.3e} after the reshard"
                assert outside == 0.0, f"{what}: {key} {shape_saved} -> {shape_written}: a padding row is not zero"
            m, u = got["metrics"], r["uninterrupted"]
            assert m["lr"] == u["lr"] == pytest.approx(1e-3 * 2 / 3)  # warm-up step 1 of 3: the schedule's position
            assert abs(m["loss"] - u["loss"]) <= 2 * ref.loss_bound, what
            assert abs(m["grad_norm"] - u["grad_norm"]) <= 2 * ref.grad_norm_bound, what
            ratios = []
            for name, w in r["after"].items():
                g = ref.exact.grads[name].abs().max().item() * clip
                dg = clip * ref.grad_bounds[name] + g * (ref.grad_norm_bound / ref.grad_norm if clip < 1 else 0.0)
                bound = 2 * (slope * dg + 4 * U32 * (float(w.abs().max()) + STEP["lr"] * 2))
                err = float((got["after"][name].double() - w.double()).abs().max())
                assert err <= bound, f"{what}: {name} is {err:.3e} from the uninterrupted run, bound {bound:.3e}"
                ratios.append(err / bound)
            worst[label] = round(max(ratios), 3)
    moved = max(float((results[0]["after"][n] - results[0]["saved"][n]).abs().max()) for n in results[0]["saved"])
    assert moved > 5e-4  # the step-1 update is ~lr: the bounds above are far below what a wrong state would move
    return worst


@pytest.mark.parametrize("saved_as", list(LAYOUTS))
def test_a_checkpoint_loads_under_every_other_layout_and_the_run_continues(rank_pool, tiny_dir, tmp_path, saved_as):
    batches = _batches(tiny_dir)
    results = rank_pool(2).run(_reshard_rank, tiny_dir, batches, str(tmp_path / "ckpt"), saved_as)
    ref = _step1_reference(tiny_dir, results[0]["saved"], batches[1], tmp_path)
    worst = _check_resumed(results, ref, layouts=LAYOUTS, saved_as=saved_as)
    vocab = {k: v for k, v in results[0]["resumed"].items() if k == "tp2" or saved_as == "tp2"}
    for label, got in vocab.items():  # a TP change moved the padded vocabulary: 301 rows <-> 302
        shapes = {d[2][0] for k, d in got["plain"][2].items() if "embedding.word_embeddings.weight" in k}
        written = {d[3][0] for k, d in got["plain"][2].items() if "embedding.word_embeddings.weight" in k}
        assert shapes != written and shapes | written == {VOCAB, VOCAB + 1}, (label, shapes, written)
    print(f"saved as {saved_as}: worst weight error / bound per resumed layout {worst}")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return str(save_tiny_hf(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", num_layers=2, seed=6))


@pytest.mark.parametrize("saved_as", list(MOE_LAYOUTS))
def test_a_moe_checkpoint_moves_its_experts_between_ep2_and_ep1(rank_pool, moe_dir, tmp_path, saved_as):
    """The tiny Qwen3-MoE saved with each rank holding half the experts (EP=2) loads with every rank holding
    all of them (EP=1 x DP=2), and back: the experts' weights and Adam moments move, never round."""
    batches = _batches(moe_dir)
    results = rank_pool(2).run(_reshard_rank, moe_dir, batches, str(tmp_path / "ckpt"), saved_as, MOE_LAYOUTS)
    ref = _step1_reference(moe_dir, results[0]["saved"], batches[1], tmp_path)
    worst = _check_resumed(results, ref, layouts=MOE_LAYOUTS, saved_as=saved_as)
    expert_keys = [k for k in results[0]["resumed"][next(iter(results[0]["resumed"]))]["plain"][0] if "expert" in k]
    assert expert_keys  # the experts are in the compared tensors
    print(f"MoE saved as {saved_as}: worst weight error / bound {worst}")


# Virtual pipeline stages (PP=2 x VPP=2: each rank holds two model chunks of one layer each, in the
# interleaved schedule): a checkpoint of two chunks per rank loads as one chunk of two layers (PP=2)
# and as the whole model (TP=1 x DP=2), and a DP=2 checkpoint loads as two chunks per rank.
VPP_LAYOUTS = {"pp2-vpp2": dict(pp=2, vpp=2), "pp2": dict(pp=2), "tp1-dp2": dict(tp=1)}


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return str(
        save_tiny_hf(
            tmp_path_factory.mktemp("qwen4"), arch="qwen2", tied=False, num_layers=4, shape={"vocab_size": VOCAB}
        )
    )


@pytest.mark.parametrize("saved_as", ["pp2-vpp2", "tp1-dp2"])
def test_a_virtual_pipeline_checkpoint_reshards_both_ways(rank_pool, tiny4_dir, tmp_path, saved_as):
    layouts = VPP_LAYOUTS if saved_as == "pp2-vpp2" else {k: VPP_LAYOUTS[k] for k in ("tp1-dp2", "pp2-vpp2")}
    batches = _batches(tiny4_dir)
    results = rank_pool(2).run(_reshard_rank, tiny4_dir, batches, str(tmp_path / "ckpt"), saved_as, layouts)
    ref = _step1_reference(tiny4_dir, results[0]["saved"], batches[1], tmp_path)
    worst = _check_resumed(results, ref, layouts=layouts, saved_as=saved_as)
    print(f"saved as {saved_as}: worst weight error / bound per resumed layout {worst}")


# Four ranks: a checkpoint whose optimizer state is sharded over DP=2 inside each TP=2 position loads where
# the same four ranks form two pipeline stages (PP=2 x DP=2) and a TP=2 x PP=2 grid (no DP).
FOUR_RANK_LAYOUTS = {"tp2-dp2": dict(tp=2), "pp2-dp2": dict(pp=2), "tp2-pp2": dict(tp=2, pp=2)}


def test_a_four_rank_checkpoint_loads_under_other_four_rank_grids(rank_pool, tiny_dir, tmp_path):
    batches = _batches(tiny_dir)
    results = rank_pool(4).run(_reshard_rank, tiny_dir, batches, str(tmp_path / "ckpt"), "tp2-dp2", FOUR_RANK_LAYOUTS)
    ref = _step1_reference(tiny_dir, results[0]["saved"], batches[1], tmp_path)
    worst = _check_resumed(results, ref, layouts=FOUR_RANK_LAYOUTS, saved_as="tp2-dp2")
    print(f"4 ranks, saved as tp2-dp2: worst weight error / bound per resumed layout {worst}")


def _read_bytes() -> int:
    """Bytes this process has read through read() calls (/proc/self/io rchar), page cache included."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar"))


def _load_read_bytes_rank(hf_dir, batch, root):
    import multiprocessing

    import dapo_megatron.actor.actor as actor_module
    from dapo_megatron.actor.parallel import model_parallel

    multiprocessing.current_process()._config["daemon"] = False  # dist_checkpointing's writer has children
    load = actor_module.load_checkpoint
    read = {}
    with model_parallel(seed=7) as layout:
        actor = _actor(hf_dir, layout, {})
        actor.train(batch, step=0)  # megatron's distributed optimizer has no state to save before a step
        actor.save(root)
        for label, group in (("each rank reads all", None), ("parallel", layout.dp_cp_group)):
            actor_module.load_checkpoint = lambda path, *, sharded_state_dict, parallel_group, g=group: load(
                path, sharded_state_dict=sharded_state_dict, parallel_group=g
            )
            try:
                before = _read_bytes()
                actor.load(root)
                read[label] = _read_bytes() - before
            finally:
                actor_module.load_checkpoint = load
        weights = _weights(actor)
        actor.close()
    return read, weights


def test_data_parallel_ranks_read_a_checkpoint_once_between_them(rank_pool, tiny_dir, tmp_path):
    """The DP=2 ranks need the same tensors (model replicas, the position's whole optimizer state): with
    megatron's fully parallel load each reads half and they exchange the rest (checkpoint.load_checkpoint)."""
    results = rank_pool(2).run(_load_read_bytes_rank, tiny_dir, _batches(tiny_dir)[0], str(tmp_path / "ckpt"))
    for read, _ in results:
        assert read["parallel"] < 0.6 * read["each rank reads all"], read
    assert all(torch.equal(results[0][1][n], results[1][1][n]) for n in results[0][1])
    print(f"bytes read per rank at a DP=2 load: {[r for r, _ in results]}")
