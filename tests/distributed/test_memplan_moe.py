"""The memory plan's static numbers EQUAL what the real Actor allocates for a tiny Qwen3-MoE (gloo ranks).

The tiny Qwen3-MoE of helpers_tiny (hidden 64, 4 heads of 24 with QK-norm, 4 experts of width 32, top-2,
layer 0 sparse and layer 1 dense) is built by the real Actor (megatron GPTModel with the MoE layer spec +
DistributedDataParallel + get_megatron_optimizer), one DAPO step runs so Adam's state exists, and the
parameter storages, the DDP buffers (dense and expert-parallel), the fp32 master copies and Adam's
state are measured from the live objects (test_memplan_static.measure_actor_static) and compared with
dapo_megatron.memplan.static, which computes them from config.json alone.
"""

import pytest

from helpers_actor import make_samples, measure_actor_static, moe_cfg


def _rank(hf_dir, tp, ep, etp, precision, distributed):
    from megatron.core import parallel_state

    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.memplan.arch import model_dims_for
    from dapo_megatron.memplan.static import Layout, static_bytes
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(tp=tp, ep=ep, etp=etp, seed=3) as ranks:
        cfg = moe_cfg(tp=tp, ep=ep, etp=etp, micro_batch_tokens=64, lr=1e-3, warmup_steps=0)
        cfg.actor.precision = precision
        cfg.actor.use_distributed_optimizer = distributed
        cfg.model.path = hf_dir
        actor = Actor(actor_settings(cfg), hf_dir, ranks)
        samples = make_samples(4)
        for i, s in enumerate(samples):
            s.old_logprobs = [-1.0] * len(s.response_ids)
            s.advantage = 1.0 if i % 2 else -1.0
        assert actor.train(samples, step=0)["update_skipped"] == 0.0  # Adam's state now exists
        measured = measure_actor_static(actor)
        expert_buffers = sum(len(m.expert_parallel_buffers) for m in actor.model)
        layout = Layout(tp=tp, pp=1, cp=1, dp=ranks.dp_size, ep=ep, etp=etp, sequence_parallel=tp > 1)
        assert layout.expert_dp == parallel_state.get_expert_data_parallel_world_size()
        planned = static_bytes(
            model_dims_for(cfg),
            layout,
            precision=precision,
            distributed_optimizer=distributed,
            pp_rank=0,
            dp_rank=ranks.dp_cp_rank,
            expert_dp_rank=parallel_state.get_expert_data_parallel_rank(),
        )
    return measured, {k: getattr(planned, k) for k in measured}, expert_buffers


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return str(save_tiny_hf(tmp_path_factory.mktemp("qwen3_moe"), arch="qwen3_moe", num_layers=2, seed=6))


# (tp, ep, etp, precision, distributed optimizer); 2 ranks each
CASES = [
    (1, 2, None, "fp32", True),  # EP=2: 2 experts per rank in an expert buffer (EDP=1), dense buffer over DP=2
    (1, 2, None, "bf16", True),  # bf16: fp32 master shards of both buffers
    (1, 2, None, "bf16", False),  # EP=2 without the distributed optimizer: full fp32 copies of both
    (1, 1, None, "bf16", True),  # EP=1: the experts are ordinary parameters of the dense buffer (DP=2)
    (2, 2, 1, "bf16", True),  # TP=2 x EP=2, ETP=1: dense parts split over TP, whole experts per EP rank
    (2, 1, None, "bf16", True),  # TP=2, ETP=TP=2: every expert split like the dense MLP, dense buffer
]


@pytest.mark.parametrize("tp,ep,etp,precision,distributed", CASES)
def test_moe_static_bytes_equal_the_real_actor(rank_pool, moe_dir, tp, ep, etp, precision, distributed):
    results = rank_pool(2).run(_rank, moe_dir, tp, ep, etp, precision, distributed)
    for rank, (measured, planned, expert_buffers) in enumerate(results):
        assert planned == measured, f"rank {rank}"
        assert (expert_buffers > 0) == (ep > 1)  # the plan's premise: experts get their own buffer only at EP > 1
        assert (measured["main_params"] > 0) == (precision == "bf16")


@pytest.mark.parametrize("tp,precision", [(1, "bf16"), (2, "bf16")])
def test_qwen3_dense_static_bytes_equal_the_real_actor(rank_pool, tmp_path_factory, tp, precision):
    """Qwen3 dense (QK-norm, head_dim 24 from the config: q/k norms of 24 elements move the next tensor to
    a multiple of 64 in the distributed optimizer's buffer)."""
    from helpers_tiny import save_tiny_hf

    hf_dir = str(save_tiny_hf(tmp_path_factory.mktemp("qwen3"), arch="qwen3", num_layers=2, seed=4))
    for measured, planned, expert_buffers in rank_pool(2).run(_rank, hf_dir, tp, 1, None, precision, True):
        assert planned == measured and expert_buffers == 0


def test_moe_static_hand_computed():
    """The same tiny Qwen3-MoE by hand. Attention per layer: norms 64 + 64, q/k norms 24 + 24, proj
    64*96, qkv (96 + 2*48)*64 = 6144 + 12288 = 18608. Dense MLP (layer 1): 256*64 + 64*128 = 24576.
    Sparse MLP (layer 0): router 4*64 = 256, 4 experts of fc1 64*64 + fc2 64*32 = 6144 each.
    Embedding and LM head 300*64 = 19200 each, final norm 64."""
    from dapo_megatron.memplan.arch import dims_from_hf_config
    from dapo_megatron.memplan.static import Layout, static_bytes, total_params

    dims = dims_from_hf_config(
        {
            "model_type": "qwen3_moe",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 24,
            "vocab_size": 300,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
        },
        name="tiny",
        source="test",
    )
    assert dims.sparse_layers == (True, False) and dims.qk_norm and not dims.qkv_bias
    attention = 2 * 18608
    dense = attention + 24576 + 256 + 2 * 19200 + 64
    assert total_params(dims) == dense + 4 * 6144 == 125_088
    # EP=2, DP=2 (EDP=1), fp32, distributed optimizer: the dense buffer holds 100,512 parameters; each starts
    # on a multiple of 64, so the tensor after each q/k norm of 24 moves up by 40 (twice per layer): 100,672,
    # padded to a multiple of 128: 100,736, halved over DP=2. The buffer is laid out in reverse (LM head
    # first), so rank 0's half [0, 50368) holds layer 1's two 40-element gaps. The expert buffer holds this
    # rank's 2 experts (12,288 elements, a multiple of 128), all owned by the one EDP rank.
    layout = Layout(dp=2, ep=2)
    assert layout.expert_dp == 1
    s = static_bytes(dims, layout, precision="fp32", distributed_optimizer=True, pp_rank=0, dp_rank=0)
    dense_buffer = -(-(dense + 4 * 40) // 128) * 128
    assert s.param_numel == dense + 2 * 6144
    assert s.grads == 4 * (dense_buffer + 12288) and s.weights == 4 * (dense_buffer + 12288)
    assert dense_buffer == 100_736
    assert s.adam == 8 * (dense_buffer // 2 - 80 + 12288)
    # EP=2 over 8 ranks (DP=8, EDP=4): each expert-data-parallel rank owns a quarter of the expert buffer
    s8 = static_bytes(
        dims, Layout(dp=8, ep=2), precision="bf16", distributed_optimizer=True, pp_rank=0, dp_rank=0, expert_dp_rank=3
    )
    expert_buffer = -(-12288 // 128) * 128
    rank0_dense = dense_buffer // 8  # [0, 12592): inside the LM head (19,200), no gap
    assert s8.adam == 8 * (rank0_dense + expert_buffer // 4)
    assert s8.main_params == 4 * (rank0_dense + expert_buffer // 4)


# --- activations ------------------------------------------------------------------------------------


def _measure_activations(hf_dir, tp, ep, precision, recompute):
    """What each micro-batch keeps for its backward (saved_tensors_hooks, as test_memplan_activations
    measures the dense model), with the token-expert pairs the MoE layer's local experts received."""
    import dataclasses

    from torch.autograd.graph import saved_tensors_hooks

    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.memplan.activations import ActivationModel
    from dapo_megatron.memplan.arch import model_dims_for
    from dapo_megatron.trainer.settings import actor_settings
    from helpers_actor import memplan_samples

    etp = 1 if tp > 1 else None
    with model_parallel(tp=tp, ep=ep, etp=etp, seed=3) as ranks:
        cfg = moe_cfg(tp=tp, ep=ep, etp=etp, micro_batch_tokens=512, lr=1e-3, warmup_steps=0)
        cfg.actor.precision, cfg.actor.recompute = precision, recompute
        cfg.actor.fused_logprob = cfg.actor.fused_policy_loss = False
        cfg.model.path = hf_dir
        actor = Actor(actor_settings(cfg), hf_dir, ranks)
        params = {p.untyped_storage().data_ptr() for m in actor.model for p in m.module.parameters()}
        records, current, routed = [], None, []

        def pack(t):
            if current is not None:
                st = t.untyped_storage()
                if st.data_ptr() not in params:
                    current[st.data_ptr()] = st.nbytes()
            return t

        for layer in actor.model[0].module.decoder.layers:  # count the rows each rank's experts receive
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:

                def counting(hidden, tokens_per_expert, probs, _forward=experts.forward):
                    if current is not None:
                        routed.append(int(tokens_per_expert.sum()))
                    return _forward(hidden, tokens_per_expert, probs)

                experts.forward = counting

        forward_step, loss = actor._forward_step, actor._loss

        def start_forward(*args, **kwargs):
            nonlocal current
            current = {}
            routed.clear()
            return forward_step(*args, **kwargs)

        def end_forward(mb, pos, *args, **kwargs):
            nonlocal current
            out = loss(mb, pos, *args, **kwargs)
            records.append(
                (sum(current.values()), mb.length, int(pos.numel()), max(mb.seq_lengths_padded), list(routed))
            )
            current = None
            return out

        actor._forward_step, actor._loss = start_forward, end_forward
        with saved_tensors_hooks(pack, lambda t: t):
            actor.train(memplan_samples(8), step=0)
        dims = model_dims_for(cfg)
        model = ActivationModel(
            dims,
            tp=tp,
            sequence_parallel=tp > 1,
            backend="torch",
            recompute=recompute,
            precision=precision,
            fused_logprob=False,
            ep=ep,
            etp=1,
        )
        rows = []
        for measured, length, n, longest, pairs in records:
            balanced = model.routed_pairs(tokens=length)
            # the one sparse layer (layer 0) with the token-expert pairs it really received on this rank
            exact = dataclasses.replace(model, expert_load=sum(pairs) / balanced if pairs else 1.0)
            planned = sum(
                exact.saved(
                    tokens=length,
                    response_tokens=n,
                    layers=dims.layers,
                    first=True,
                    last=True,
                    max_sequence=longest,
                    sparse_layers=dims.num_sparse_layers,
                ).values()
            )
            rows.append((measured, planned, length, pairs, balanced))
        return rows


# (tp, ep, precision, recompute); 2 ranks
ACTIVATION_CASES = [
    (1, 2, "fp32", "none"),  # EP=2 fp32: QK-norm's k keeps the QKV output; experts' SwiGLU + weighted act
    (1, 2, "bf16", "none"),  # bf16: fp32 norm copies, bf16 probs
    (1, 2, "bf16", "selective"),  # the core attention recomputed; the MoE terms stay (recompute_modules core_attn)
    (1, 2, "fp32", "full"),  # only each layer's input
    (2, 2, "fp32", "none"),  # TP=2 + SP x EP=2 (ETP=1): each rank routes its T/2 tokens
]


@pytest.mark.parametrize("tp,ep,precision,recompute", ACTIVATION_CASES)
def test_moe_activations_match_cpu_measurement(rank_pool, moe_dir, tp, ep, precision, recompute):
    """Within 2% of the measurement given the token-expert pairs the rank received (the plan's formula is
    exact up to the loss terms' per-token constant, as for the dense model); the plan itself assumes
    MOE_EXPERT_LOAD_ALLOWANCE x the balanced share, printed here next to the measured share."""
    rows = [
        row for rank in rank_pool(2).run(_measure_activations, moe_dir, tp, ep, precision, recompute) for row in rank
    ]
    assert rows and all(measured > 0 for measured, *_ in rows)
    for measured, planned, length, pairs, balanced in rows:
        print(
            f"tp={tp} ep={ep} {precision} {recompute} T={length}: measured {measured} B, planned {planned:.0f} B "
            f"({planned / measured - 1:+.2%}); routed pairs {pairs} vs balanced {balanced:.0f}"
        )
        assert len(pairs) == 1  # one sparse layer, one forward per micro-batch
        assert abs(planned / measured - 1) < 0.02, (measured, planned, length)
