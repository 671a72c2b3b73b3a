"""Actor offload / onload and the frozen reference on gloo ranks (tiny Qwen2, CPU twin of the GPU path).

The "device" memory on CPU is the tensors' storage: offload must really free it (storage nbytes 0,
the ledger counts 0), onload must restore every parameter, gradient and optimizer-state byte, and a
train step after an offload/onload cycle must equal one without it bit for bit (loss, grad norm,
weights, Adam state), at DP=2 with and without the distributed optimizer and at TP=2."""

import gc
import warnings

import pytest
import torch

from helpers_actor import fill_rl_fields, hf_logprobs, make_cfg, make_samples

# tiny Qwen2 (helpers_tiny): 2 layers x (qkv 64x128 + bias 128, proj 64x64, fc1 64x256, fc2 128x64,
# 2 norms of 64) + embedding 300x64 + untied output 300x64 + final norm 64
TINY_NUMEL = 2 * (64 * 128 + 128 + 64 * 64 + 64 * 256 + 128 * 64 + 2 * 64) + 2 * 300 * 64 + 64
TINY_NORMS = 2 * 2 * 64 + 64  # replicated across TP ranks; every other tensor is split in two at TP=2


def rank_numel(tp):
    """Parameters one TP rank holds."""
    return (TINY_NUMEL - TINY_NORMS) // tp + TINY_NORMS


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return str(save_tiny_hf(tmp_path_factory.mktemp("qwen"), arch="qwen2", tied=False))


@pytest.fixture(scope="module")
def batches(tiny_dir):
    """Two mini-batches with RL fields (old log-probs near the model's, mixed advantages)."""
    out = []
    for seed in (5, 6):
        samples = make_samples(8, seed=seed)
        logps, _ = hf_logprobs(tiny_dir, samples)
        out.append(fill_rl_fields(samples, logps, seed=seed))
    return out


def _cfg(*, tp, dist_opt, precision="fp32"):
    cfg = make_cfg(tp=tp, micro_batch_tokens=40, lr=1e-3, warmup_steps=0)
    cfg.actor.use_distributed_optimizer = dist_opt
    cfg.actor.precision = precision
    return cfg


def _raw(t):
    """The tensor's bytes (bit-for-bit comparisons: torch.equal calls -0.0 == 0.0)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def _snapshot(actor):
    """Every parameter, main_grad and optimizer-state tensor of the actor, as raw bytes."""
    from dapo_megatron.actor.offload import _inner_optimizers

    snap = {}
    for c, chunk in enumerate(actor.model_chunks):
        for name, p in chunk.named_parameters():
            snap[f"{c}.{name}"] = _raw(p)
            snap[f"{c}.{name}.main_grad"] = _raw(p.main_grad)
    for i, inner in enumerate(_inner_optimizers(actor.optimizer)):
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                snap[f"opt{i}.{g}.{j}.main_param"] = _raw(p)
                for key, value in inner.state[p].items():
                    snap[f"opt{i}.{g}.{j}.{key}"] = _raw(value)
    return snap


def _optimizer_numel(actor):
    """(numel of the optimizer's own params, their count) from the optimizer objects."""
    from dapo_megatron.actor.offload import _inner_optimizers

    params = [p for inner in _inner_optimizers(actor.optimizer) for g in inner.param_groups for p in g["params"]]
    return sum(p.numel() for p in params), len(params)


def _roundtrip_rank(hf_dir, samples, tp, dist_opt, precision):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(tp=tp, seed=7) as layout:
        actor = Actor(actor_settings(_cfg(tp=tp, dist_opt=dist_opt, precision=precision)), hf_dir, layout)
        actor.train(samples, step=0)  # Adam state exists, grad buffers hold the step's gradient
        before = _snapshot(actor)
        full = actor.resident_bytes()
        opt_numel, opt_count = _optimizer_numel(actor)
        buffers = [b for m in actor.model for b in m.buffers]

        actor.offload("grads", "optimizer", keep_grads=True)  # what the weight transfer does not need
        for_transfer = actor.resident_bytes()
        grads_freed = all(b.grad_data.untyped_storage().nbytes() == 0 for b in buffers)
        adam = [
            v
            for inner in actor.optimizer.chained_optimizers
            for s in inner.optimizer.state.values()
            for k, v in s.items()
            if k.startswith("exp_avg")
        ]
        adam_freed = all(v.untyped_storage().nbytes() == 0 for v in adam)
        weights = {k: v.clone() for k, v in actor.iter_hf_weights()}  # the transfer reads only params
        try:
            actor.train(samples, step=1)
            refused = ""
        except RuntimeError as err:
            refused = str(err)
        actor.offload()
        offloaded = actor.resident_bytes()
        params_freed = all(p.untyped_storage().nbytes() == 0 for c in actor.model_chunks for p in c.parameters())
        actor.onload()
        after = _snapshot(actor)
    return dict(
        full=full,
        for_transfer=for_transfer,
        offloaded=offloaded,
        grads_freed=grads_freed,
        adam_freed=adam_freed,
        num_adam=len(adam),
        params_freed=params_freed,
        refused=refused,
        opt_numel=opt_numel,
        opt_count=opt_count,
        before=before,
        after=after,
        weights=weights,
        buffer_numel=sum(b.grad_data.numel() for b in buffers),
        buffer_numel_unpadded=sum(b.numel_unpadded for b in buffers),
    )


@pytest.mark.parametrize(
    "tp,dist_opt,precision", [(1, False, "fp32"), (1, True, "fp32"), (2, True, "fp32"), (1, True, "bf16")]
)
def test_offload_frees_every_storage_and_onload_restores_every_byte(
    rank_pool, tiny_dir, batches, tp, dist_opt, precision
):
    results = rank_pool(2).run(_roundtrip_rank, tiny_dir, batches[0], tp, dist_opt, precision)
    param_bytes = 2 if precision == "bf16" else 4
    for r in results:
        assert r["buffer_numel_unpadded"] == rank_numel(tp)
        numel = r["buffer_numel"]  # this rank's param/grad buffer (the distributed optimizer pads it)
        padding = numel - rank_numel(tp)
        # megatron's distributed optimizer starts each of the 17 params at a multiple of 64 values and
        # ends the bucket at a multiple of lcm(DP, 128) (param_and_grad_buffer.py _pad_*_if_needed)
        assert padding == 0 if not dist_opt else 0 <= padding < 17 * 64 + 128
        # the ledger by hand: params in the model dtype; fp32 grad buffer (grad_reduce_in_fp32);
        # Adam moments (+ a 4-byte fp32 step per param) over the optimizer's params, plus the fp32
        # master copies under bf16 (under fp32 they are the model params / param-buffer views:
        # counted once, as params)
        adam = 2 * 4 * r["opt_numel"] + 4 * r["opt_count"]
        masters = 4 * r["opt_numel"] if precision == "bf16" else 0
        assert r["full"] == {"params": param_bytes * numel, "grads": 4 * numel, "optimizer": adam + masters}
        assert r["for_transfer"] == {"params": param_bytes * numel, "grads": 0, "optimizer": 0}
        assert r["grads_freed"] and r["adam_freed"] and r["num_adam"] > 0
        assert "offloaded" in r["refused"] and "onload" in r["refused"]
        assert r["offloaded"] == {"params": 0, "grads": 0, "optimizer": 0}
        assert r["params_freed"]
        assert r["before"].keys() == r["after"].keys()
        changed = [k for k in r["before"] if not torch.equal(r["before"][k], r["after"][k])]
        assert not changed, changed[:5]
        assert any(r["before"][k].any() for k in r["before"] if k.endswith("exp_avg_sq"))  # not vacuous
    # the weights read while grads + optimizer were offloaded are the trained ones on every rank
    for name, w in results[0]["weights"].items():
        assert torch.equal(w, results[1]["weights"][name])


def _two_steps_rank(hf_dir, batches, tp, dist_opt, cycle):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(tp=tp, seed=7) as layout:
        actor = Actor(actor_settings(_cfg(tp=tp, dist_opt=dist_opt)), hf_dir, layout)
        first = actor.train(batches[0], step=0)
        if cycle:  # the colocated step: grads + optimizer off, then params off, then all back
            actor.offload("grads", "optimizer")
            actor.offload("params")
            actor.onload()
        second = actor.train(batches[1], step=1)
        weights = {k: v.clone() for k, v in actor.iter_hf_weights()}
        state = {k: v for k, v in _snapshot(actor).items() if ".main_grad" not in k}
    return first, second, weights, state


@pytest.mark.parametrize("tp,dist_opt", [(1, False), (1, True), (2, True)])
def test_train_step_after_offload_and_onload_equals_one_without(rank_pool, tiny_dir, batches, tp, dist_opt):
    plain = rank_pool(2).run(_two_steps_rank, tiny_dir, batches, tp, dist_opt, False)
    cycled = rank_pool(2).run(_two_steps_rank, tiny_dir, batches, tp, dist_opt, True)
    for (_, s0, w0, st0), (_, s1, w1, st1) in zip(plain, cycled):
        assert s0["update_skipped"] == 0 and s0["grad_norm"] > 0
        assert s1["loss"] == s0["loss"] and s1["grad_norm"] == s0["grad_norm"]
        assert s1 == s0
        assert w1.keys() == w0.keys() and all(torch.equal(w1[k], w0[k]) for k in w0)
        assert st1.keys() == st0.keys() and all(torch.equal(st1[k], st0[k]) for k in st0)


def _live_storage_bytes():
    """Bytes of every distinct storage that a live Python tensor object views (gc's view)."""
    gc.collect()
    seen = {}
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _reference_rank(hf_dir, samples, tp):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.actor.policy import Policy
    from dapo_megatron.actor.ref_policy import ReferencePolicy
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(tp=tp, seed=7) as layout:
        cfg = _cfg(tp=tp, dist_opt=True)
        old_ref = Actor(actor_settings(cfg), hf_dir, layout)  # what trainer/train.py used as the reference before
        want = old_ref.logprobs(samples)
        old_ref.train(samples, step=0)  # allocates the Adam state a full Actor carries
        base = _live_storage_bytes()
        frozen = Policy(actor_settings(cfg), hf_dir, layout)  # what the reference holds
        frozen_cost = _live_storage_bytes() - base
        param_bytes = sum(p.untyped_storage().nbytes() for c in frozen.model_chunks for p in c.parameters())
        # megatron's RotaryEmbedding keeps inv_freq as a plain attribute (not a parameter or buffer)
        rotary_bytes = sum(c.rotary_pos_emb.inv_freq.untyped_storage().nbytes() for c in frozen.model_chunks)
        full_cost = sum(old_ref.resident_bytes().values())
        del frozen
        ref = ReferencePolicy(actor_settings(cfg), hf_dir, layout)
        idle = ref.resident_bytes()
        got = ref.logprobs(samples)
        again = ref.logprobs(samples)  # the second onload comes from the backup taken once
        policy = ref._policy
        facts = dict(
            # a Policy, not an Actor: no optimizer, no train step (it cannot train by construction)
            trains=[name for name in ("optimizer", "lr_schedule", "train", "save", "load") if hasattr(policy, name)],
            grads=any(p.grad is not None for c in ref.model_chunks for p in c.parameters()),
            main_grad=any(hasattr(p, "main_grad") for c in ref.model_chunks for p in c.parameters()),
            wrapped=any(m is not c for m, c in zip(policy.model, ref.model_chunks)),
            idle=idle,
            after=ref.resident_bytes(),
            frozen_cost=frozen_cost,
            param_bytes=param_bytes,
            full_cost=full_cost,
            rotary_bytes=rotary_bytes,
        )
    return want, got, again, facts


@pytest.mark.parametrize("tp", [1, 2])
def test_frozen_reference_equals_the_old_reference_actor_and_holds_no_training_state(rank_pool, tiny_dir, batches, tp):
    samples = batches[0]
    for want, got, again, facts in rank_pool(2).run(_reference_rank, tiny_dir, samples, tp):
        for a, b, c in zip(want.logprobs, got.logprobs, again.logprobs):
            assert torch.equal(a, b) and torch.equal(a, c)
        for a, b in zip(want.entropies, got.entropies):
            assert torch.equal(a, b)
        assert facts["trains"] == [] and not facts["grads"] and not facts["main_grad"]
        assert not facts["wrapped"]  # no DDP: no contiguous param/grad buffers
        zero = {"params": 0, "grads": 0, "optimizer": 0}
        assert facts["idle"] == zero and facts["after"] == zero  # offloaded when idle
        # measured from the live objects: building it allocated its parameters and nothing else
        assert facts["param_bytes"] == 4 * rank_numel(tp)
        assert facts["rotary_bytes"] == 4 * 16 // 2  # head dim 16: 8 fp32 frequencies
        assert facts["frozen_cost"] == facts["param_bytes"] + facts["rotary_bytes"]
        assert facts["full_cost"] > 3 * facts["param_bytes"]  # a full Actor: + grad buffer + 2 Adam moments


def test_unknown_category_is_a_clear_error():
    from dapo_megatron.actor.offload import DeviceMemory

    memory = DeviceMemory(lambda: {"params": [torch.ones(3)]})
    with pytest.raises(ValueError, match="'weights'.*params, grads, optimizer"):
        memory.offload("weights")
