"""The memory plan's activation model against a CPU measurement of the real Actor's train step.

Measurement: during Actor.train (gloo ranks, tiny Qwen2, torch attention backend, the unfused
log-prob path that runs on CPU), every tensor autograd saves for the backward is recorded through
torch.autograd.graph.saved_tensors_hooks, from the start of a micro-batch's forward (Actor._forward_step)
to the end of its loss (Actor._loss): what that micro-batch keeps until its backward. Storages are
counted once; parameters are not activations. Recomputation inside the backward is not counted (the
plan counts it separately as a working set). The plan's ActivationModel.saved() for the same
micro-batch (its length, response tokens and longest sequence) must be within 2% (the brief asks
30%; the torch backend's formula is exact up to the loss terms' per-token constant: measured +0.02%
to +0.13%).
"""

import pytest
import torch

from helpers_actor import make_cfg, memplan_samples


def _measure_rank(hf_dir, tp, sp, precision, recompute, budget, num_samples, fp8_run_dir=None, head_loss="separate"):
    from torch.autograd.graph import saved_tensors_hooks

    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.memplan.activations import ActivationModel
    from dapo_megatron.memplan.arch import model_dims_for
    from dapo_megatron.trainer.settings import actor_settings

    with model_parallel(tp=tp, seed=3) as layout:
        cfg = make_cfg(tp=tp, micro_batch_tokens=budget, sequence_parallel=sp, lr=1e-3, warmup_steps=0)
        cfg.actor.precision, cfg.actor.recompute, cfg.actor.fused_logprob = precision, recompute, False
        cfg.model.path = hf_dir
        cfg.actor.head_loss = head_loss
        if fp8_run_dir is not None:  # actor.quantization_aware: the engines' FP8 export is in the run dir
            cfg.rollout.quantization, cfg.actor.quantization_aware = "fp8", True
            cfg.trainer.output_dir = fp8_run_dir
        actor = Actor(actor_settings(cfg), hf_dir, layout)
        params = {p.untyped_storage().data_ptr() for m in actor.model for p in m.module.parameters()}
        records, current = [], None

        def pack(t):
            if current is not None:
                st = t.untyped_storage()
                if st.data_ptr() not in params:
                    current[st.data_ptr()] = st.nbytes()
            return t

        forward_step, loss, one_pass_loss = actor._forward_step, actor._loss, actor._one_pass_loss

        def start_forward(*args, **kwargs):
            nonlocal current
            current = {}
            return forward_step(*args, **kwargs)

        def end_forward(mb, pos, *args, **kwargs):
            nonlocal current
            out = loss(mb, pos, *args, **kwargs)
            records.append((sum(current.values()), mb.length, int(pos.numel()), max(mb.seq_lengths_padded)))
            current = None
            return out

        def end_one_pass(mb, gpt, output, pos, **kwargs):
            nonlocal current
            out = one_pass_loss(mb, gpt, output, pos, **kwargs)
            records.append((sum(current.values()), mb.length, int(pos.numel()), max(mb.seq_lengths_padded)))
            current = None
            return out

        actor._forward_step, actor._loss, actor._one_pass_loss = start_forward, end_forward, end_one_pass
        with saved_tensors_hooks(pack, lambda t: t):
            actor.train(memplan_samples(num_samples), step=0)
        model = ActivationModel(
            model_dims_for(cfg),
            tp=tp,
            sequence_parallel=sp,
            backend="torch",
            recompute=recompute,
            precision=precision,
            fused_logprob=False,
            head_loss=head_loss,
            quantization_aware=fp8_run_dir is not None,
        )
        layers = model.dims.layers
        return [
            (
                measured,
                sum(
                    model.saved(
                        tokens=length, response_tokens=n, layers=layers, first=True, last=True, max_sequence=longest
                    ).values()
                ),
                length,
            )
            for measured, length, n, longest in records
        ]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from helpers_tiny import save_tiny_hf

    return str(save_tiny_hf(tmp_path_factory.mktemp("qwen"), arch="qwen2"))


# (tp, sequence parallel, precision, recompute, micro_batch_tokens, samples); 2 ranks: DP=2 or TP=2
CASES = [
    (1, False, "fp32", "none", 512, 8),  # one micro-batch per DP rank (~100-160 tokens)
    (1, False, "fp32", "none", 48, 8),  # small budget: several micro-batches of <= 48 tokens
    (1, False, "bf16", "selective", 512, 8),  # checkpointed core attention: no [T, T] mask, no repeated K/V
    (1, False, "fp32", "full", 512, 8),  # only each layer's input
    (2, True, "fp32", "none", 512, 8),  # TP=2 + sequence parallel: norms / linear inputs split; vocab-parallel head
    (2, False, "bf16", "none", 1024, 16),  # TP=2 without SP, a longer micro-batch (~300 tokens)
]


@pytest.mark.parametrize("tp,sp,precision,recompute,budget,num_samples", CASES)
def test_activations_match_cpu_measurement(rank_pool, tiny_dir, tp, sp, precision, recompute, budget, num_samples):
    results = rank_pool(2).run(_measure_rank, tiny_dir, tp, sp, precision, recompute, budget, num_samples)
    rows = [row for rank in results for row in rank]
    assert rows and all(measured > 0 for measured, _, _ in rows)
    if budget < 100:
        assert len(rows) > 2  # several micro-batches really ran
    for measured, planned, length in rows:
        print(
            f"tp={tp} sp={sp} {precision} {recompute} T={length}: measured {measured} B, planned {planned:.0f} B "
            f"({planned / measured - 1:+.2%})"
        )
        assert abs(planned / measured - 1) < 0.02, (measured, planned, length)


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory):
    """A tiny Qwen2 with whole 128-channel groups (the FP8 engines' rule) and its block-FP8 export."""
    from dapo_megatron.quant.fp8_export import export_fp8_checkpoint
    from helpers_tiny import save_tiny_hf

    root = tmp_path_factory.mktemp("qat_mem")
    hf_dir = save_tiny_hf(root / "qwen", arch="qwen2", shape={"hidden_size": 128, "intermediate_size": 256})
    export_fp8_checkpoint(hf_dir, root / "run" / "rollout_fp8", dtype=torch.bfloat16)
    return str(hf_dir), str(root / "run")


# quantization-aware forward: the fake-quantized weights, the attention output kept twice, fp32 casts
QAT_CASES = [
    (1, False, "fp32", "none", 512, 8),
    (2, True, "fp32", "none", 512, 8),  # TP shards of the weights, the row-parallel inputs' groups
    (1, False, "bf16", "selective", 512, 8),  # no casts in bf16; checkpointed attention: no second output
]


@pytest.mark.parametrize("tp,sp,precision,recompute,budget,num_samples", QAT_CASES)
def test_quantization_aware_activations_match_cpu_measurement(
    rank_pool, fp8_tiny, tp, sp, precision, recompute, budget, num_samples
):
    pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt not installed")
    hf_dir, run_dir = fp8_tiny
    results = rank_pool(2).run(_measure_rank, hf_dir, tp, sp, precision, recompute, budget, num_samples, run_dir)
    plain = rank_pool(2).run(_measure_rank, hf_dir, tp, sp, precision, recompute, budget, num_samples)
    for (measured, planned, length), (plain_measured, _, _) in zip(
        [row for rank in results for row in rank], [row for rank in plain for row in rank]
    ):
        print(
            f"quantization-aware tp={tp} sp={sp} {precision} {recompute} T={length}: measured {measured} B "
            f"(without: {plain_measured} B), planned {planned:.0f} B ({planned / measured - 1:+.2%})"
        )
        assert measured > plain_measured  # the fake-quantized copies really are kept
        assert abs(planned / measured - 1) < 0.02, (measured, planned, length)


# actor.head_loss=one_pass (the op in the Triton interpreter): its saved gradients instead of the head's and the
# loss's tensors; several micro-batches at TP=1, the vocab-parallel op with sequence parallelism at TP=2
@pytest.mark.parametrize(
    "tp,sp,precision,budget", [(1, False, "fp32", 48), (2, True, "fp32", 512), (2, False, "bf16", 1024)]
)
def test_one_pass_head_activations_match_cpu_measurement(rank_pool, tiny_dir, tp, sp, precision, budget):
    results = rank_pool(2).run(_measure_rank, tiny_dir, tp, sp, precision, "none", budget, 8, head_loss="one_pass")
    rows = [row for rank in results for row in rank]
    assert rows and all(measured > 0 for measured, _, _ in rows)
    for measured, planned, length in rows:
        print(
            f"one_pass tp={tp} sp={sp} {precision} T={length}: measured {measured} B, planned {planned:.0f} B "
            f"({planned / measured - 1:+.2%})"
        )
        assert abs(planned / measured - 1) < 0.02, (measured, planned, length)
