"""The memory plan's static numbers EQUAL what the real Actor allocates (gloo ranks, tiny Qwen2).

Each case builds the real Actor (megatron GPTModel chunks + DistributedDataParallel +
get_megatron_optimizer), runs one train step so Adam's state exists, and measures from the live
objects: parameter storages (the DDP parameter buffer with the distributed optimizer), the DDP
gradient buffers, the fp32 master copies held by the optimizer, and Adam's exp_avg / exp_avg_sq.
The plan (dapo_megatron.memplan.static) computes the same four numbers from config.json alone.
"""

import pytest

from helpers_actor import make_cfg, make_samples, measure_actor_static


def _rank(hf_dir, tp, pp, vpp, precision, distributed):
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.memplan.arch import model_dims_for
    from dapo_megatron.memplan.static import Layout, static_bytes
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(tp=tp, pp=pp, vpp=vpp, seed=3) as ranks:
        cfg = make_cfg(tp=tp, pp=pp, micro_batch_tokens=64, lr=1e-3, warmup_steps=0)
        cfg.actor.vpp = vpp
        cfg.actor.precision = precision
        cfg.actor.use_distributed_optimizer = distributed
        cfg.model.path = hf_dir
        actor = Actor(actor_settings(cfg), hf_dir, ranks)
        if vpp is None:
            samples = make_samples(4 * pp)
            for i, s in enumerate(samples):
                s.old_logprobs = [-1.0] * len(s.response_ids)
                s.advantage = 1.0 if i % 2 else -1.0
            assert actor.train(samples, step=0)["update_skipped"] == 0.0  # Adam's state now exists
        else:  # Actor.train under the interleaved schedule hangs on gloo (reported); allocate the state as AdamW does
            from dapo_megatron.actor.optimizer import init_empty_optimizer_state

            init_empty_optimizer_state(actor.optimizer)
        measured = measure_actor_static(actor)
        layout = Layout(tp=tp, pp=pp, cp=1, dp=ranks.dp_size, vpp=vpp)
        planned = static_bytes(
            model_dims_for(cfg),
            layout,
            precision=precision,
            distributed_optimizer=distributed,
            pp_rank=ranks.pp_rank,
            dp_rank=ranks.dp_cp_rank,
        )
    return measured, {k: getattr(planned, k) for k in measured}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return {
        (tied, layers): str(save_tiny_hf(tmp_path_factory.mktemp("qwen"), arch="qwen2", tied=tied, num_layers=layers))
        for tied, layers in ((False, 2), (True, 2), (False, 4))
    }


# (tp, pp, vpp, precision, distributed optimizer, tied, layers); 2 ranks each
CASES = [
    (1, 1, None, "fp32", True, False, 2),  # DP=2, distributed optimizer: padded buffers, sharded state
    (1, 1, None, "fp32", False, False, 2),  # DP=2 without it: full state on every rank
    (1, 1, None, "bf16", True, True, 2),  # DP=2 bf16: fp32 master shards; tied embeddings at PP=1
    (2, 1, None, "bf16", True, False, 2),  # TP=2: every tensor split (vocab, QKV rows, fc1/fc2)
    (2, 1, None, "bf16", False, False, 2),  # TP=2 bf16 without it: Float16Optimizer's full fp32 copies
    (1, 2, None, "fp32", True, True, 2),  # PP=2 tied: embedding first stage, own LM-head copy last, own buckets
    (1, 2, 2, "bf16", True, False, 4),  # PP=2 x VPP=2: two DDP buffers per rank
]


@pytest.mark.parametrize("tp,pp,vpp,precision,distributed,tied,layers", CASES)
def test_static_bytes_equal_the_real_actor(rank_pool, tiny_dirs, tp, pp, vpp, precision, distributed, tied, layers):
    results = rank_pool(2).run(_rank, tiny_dirs[(tied, layers)], tp, pp, vpp, precision, distributed)
    for rank, (measured, planned) in enumerate(results):
        assert planned == measured, f"rank {rank}"
        assert measured["weights"] > 0 and measured["grads"] > 0 and measured["adam"] > 0
        assert (measured["main_params"] > 0) == (precision == "bf16")


def test_static_bytes_hand_computed():
    """The tiny Qwen2 of helpers_tiny (h 64, ffn 128, 4/2 heads of 16, vocab 300, untied) by hand.

    Per layer: norms 2*64, proj 64*64, qkv (64+2*32)*64 + 128 bias, fc1 256*64, fc2 64*128
    = 128 + 4096 + 8192 + 128 + 16384 + 8192 = 37120; embedding and LM head 300*64 = 19200 each;
    final norm 64. Two layers: 74240 + 38400 + 64 = 112704 parameters.
    """
    from dapo_megatron.memplan.arch import dims_from_hf_config
    from dapo_megatron.memplan.static import Layout, static_bytes

    dims = dims_from_hf_config(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 300,
        },
        name="tiny",
        source="test",
    )
    plain = static_bytes(dims, Layout(dp=2), precision="fp32", distributed_optimizer=False, pp_rank=0)
    assert plain.param_numel == 112704
    assert (plain.weights, plain.grads, plain.main_params, plain.adam) == (4 * 112704, 4 * 112704, 0, 8 * 112704)
    # distributed optimizer, DP=2: parameters start on multiples of 64 (every size here is one already) and
    # the bucket ends on a multiple of lcm(2, 128) = 128: 112704 -> 112768 elements
    sharded = [
        static_bytes(dims, Layout(dp=2), precision="bf16", distributed_optimizer=True, pp_rank=0, dp_rank=r)
        for r in (0, 1)
    ]
    assert all(s.weights == 2 * 112768 and s.grads == 4 * 112768 for s in sharded)
    # rank 0 owns elements [0, 56384) of the buffer (all real), rank 1 [56384, 112768) minus 64 padding
    assert [s.adam for s in sharded] == [8 * 56384, 8 * (56384 - 64)]
    assert [s.main_params for s in sharded] == [4 * 56384, 4 * (56384 - 64)]
