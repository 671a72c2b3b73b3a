"""Linear memory of the torch attention backend (actor/attention.py), measured on CPU.

On a tiny 2-layer Qwen2 (megatron GPTModel, torch backend, fp32, tp=1), one packed micro-batch of T
tokens (three documents of T/2, T/4 and T/4 tokens) runs forward; every tensor autograd saves while a
core-attention module (TorchSDPAttention) runs is recorded through torch.autograd.graph.saved_tensors_hooks,
storages counted once (q and k after RoPE, the storage v is a view of, the outputs, the logsumexp).
At T = 512, 1024, 2048, 4096 the saved bytes must grow linearly: bytes(4096) / bytes(512) <= 8.5. The
dense-mask reference (tests/attention_reference.py, what the backend did before) is measured the same
way and printed for comparison (it grows with T^2: its [T, T] mask is kept as a float for the backward).
The memory plan's attention terms (memplan/activations.py, ActivationModel.layer_parts) must equal the
measurement exactly.
"""

import torch

LENGTHS_T = (512, 1024, 2048, 4096)


def _measure_rank(dense: bool):
    from torch.autograd.graph import saved_tensors_hooks

    from attention_reference import block_causal_mask, dense_attention
    from dapo_megatron.actor import attention
    from dapo_megatron.actor.model import build_model_chunks, packed_position_ids, packed_seq_params_from_lengths
    from dapo_megatron.actor.parallel import model_parallel
    from helpers_tiny import tiny_hf_config

    hf_config = tiny_hf_config(arch="qwen2", num_layers=2)
    hf_config.max_position_embeddings = 8192
    original = attention.TorchSDPAttention._attend
    if dense:

        def dense_attend(self, q, k, v, blocks, mask):
            cu = torch.tensor(sorted({b.q_start for b in blocks} | {blocks[-1].q_end}))
            return dense_attention(q, k, v, block_causal_mask(cu, q.size(2)), scale=self.softmax_scale)

        attention.TorchSDPAttention._attend = dense_attend
    try:
        with model_parallel(tp=1, seed=0):
            (model,) = build_model_chunks(hf_config, attention_backend="torch", precision="fp32")
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            recording, saved = [False], {}

            def pack(t):
                if recording[0] and t.untyped_storage().data_ptr() not in params:
                    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            for module in model.modules():
                if isinstance(module, attention.TorchSDPAttention):
                    module.register_forward_pre_hook(lambda *_: recording.__setitem__(0, True))
                    module.register_forward_hook(lambda *_: recording.__setitem__(0, False))
            rows = []
            for total in LENGTHS_T:
                lengths = [total // 2, total // 4, total // 4]
                ids = torch.randint(5, hf_config.vocab_size, (1, total))
                saved.clear()
                with saved_tensors_hooks(pack, lambda t: t):
                    out = model(
                        ids,
                        packed_position_ids(lengths),
                        attention_mask=None,
                        packed_seq_params=packed_seq_params_from_lengths(lengths),
                    )
                rows.append((total, sum(saved.values()) / hf_config.num_hidden_layers))
                del out
            return rows
    finally:
        attention.TorchSDPAttention._attend = original


def test_attention_saved_bytes_grow_linearly_and_match_the_plan(rank_pool):
    from dapo_megatron.memplan.activations import ActivationModel
    from dapo_megatron.memplan.arch import dims_from_hf_config
    from helpers_tiny import tiny_hf_config

    (new,) = rank_pool(1).run(_measure_rank, False)
    (dense,) = rank_pool(1).run(_measure_rank, True)
    for (total, b_new), (_, b_dense) in zip(new, dense):
        print(f"T={total}: attention saves {b_new:.0f} B per layer (dense-mask reference {b_dense:.0f} B)")
    ratio_new, ratio_dense = new[-1][1] / new[0][1], dense[-1][1] / dense[0][1]
    print(f"bytes(4096) / bytes(512): {ratio_new:.2f} (dense-mask reference {ratio_dense:.2f})")
    assert ratio_new <= 8.5
    assert ratio_dense > 30  # the reference really is quadratic: the test can tell the two apart

    dims = dims_from_hf_config(tiny_hf_config(arch="qwen2", num_layers=2).to_dict(), name="tiny", source="test")
    plan = ActivationModel(dims, backend="torch", precision="fp32", recompute="none")
    for total, measured in new:
        parts = plan.layer_parts(tokens=total)
        planned = parts["attention"]
        assert planned == measured, (total, planned, measured, parts)
