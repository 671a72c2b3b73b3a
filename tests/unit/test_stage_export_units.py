"""Pieces of the per-stage export: shards merged straight into bucket views equal merge_shards;
the bucket and shard-file plans; the streamed safetensors header reads back with safetensors."""

import pytest
import torch
from safetensors.torch import load_file

from dapo_megatron.transfer.stage_export import ExportItem, bucket_layout, plan_buckets, views_of
from dapo_megatron.transfer.stage_save import _write_tensor, plan_files, safetensors_header
from dapo_megatron.weights.mapping import Dims, merge_shards, merge_shards_into, shard_for_rank

DIMS = Dims(hidden=12, num_heads=6, num_groups=2, head_dim=2, ffn=10, vocab=13, num_layers=1, qkv_bias=True, tied=False)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    "kind,shapes",
    [
        ("replicated", [(12,)]),
        ("vocab", [(13, 12)]),
        ("row", [(12, 10)]),
        ("fc1", [(10, 12), (10, 12)]),
        ("qkv", [(12, 12), (4, 12), (4, 12)]),
        ("qkv", [(12,), (4,), (4,)]),
        # one expert's weights (MoE at EP=1 exports them through this path: the first GPU plan's e2e_moe found it)
        ("expert_row", [(12, 10)]),
        ("expert_fc1", [(10, 12), (10, 12)]),
    ],
)
def test_merge_into_views_equals_merge_shards(kind, shapes, tp):
    gen = torch.Generator().manual_seed(len(shapes) + tp)
    full = [torch.randn(s, generator=gen) for s in shapes]
    vocab_rows = 14 if kind == "vocab" else None  # 13 rows padded to a multiple of tp = 2
    shards = [shard_for_rank(kind, full, tp_rank=r, tp_size=tp, dims=DIMS, vocab_rows=vocab_rows) for r in range(tp)]
    want = merge_shards(kind, shards, dims=DIMS)
    outputs = [torch.full(s, float("nan")) for s in shapes]
    merge_shards_into(kind, shards, outputs, dims=DIMS)
    for a, b, f in zip(want, outputs, full):
        assert torch.equal(a, b) and torch.equal(b, f)


def _item(name, *shapes, dtype=torch.float32):
    return ExportItem(
        key=name, names=tuple(f"{name}.{i}" for i in range(len(shapes))), shapes=tuple(shapes), dtype=dtype, kind="row"
    )


def test_bucket_plan_layout_and_views():
    a, b, c, d = _item("a", (10,)), _item("b", (3, 3), (1,)), _item("c", (100,)), _item("d", (5,), dtype=torch.bfloat16)
    # 40 | 36 + 4 = 40 -> new bucket; c = 400 alone (bigger than the bound); d = 10 bytes
    assert [[i.key for i in g] for g in plan_buckets([a, b, c, d], 64)] == [["a"], ["b"], ["c"], ["d"]]
    assert [[i.key for i in g] for g in plan_buckets([a, b, c, d], 80)] == [["a", "b"], ["c"], ["d"]]
    layout = bucket_layout([a, b])  # back to back: SGLang's flattened-bucket bytes
    assert [(n, off, size) for n, _, _, off, size in layout] == [("a.0", 0, 40), ("b.0", 40, 36), ("b.1", 76, 4)]
    flat = torch.zeros(80, dtype=torch.uint8)
    views = views_of(flat, [a, b])
    views[1][1].fill_(1.0)
    assert flat[40:76].view(torch.float32).reshape(3, 3).sum() == 9.0 and views[0][1].shape == (10,)
    # mixed dtypes: a tensor never starts at an offset its element size does not divide
    # d is 10 bytes: an fp32 tensor after one d (offset 10) or after a + d (offset 50) starts a new bucket
    assert [[i.key for i in g] for g in plan_buckets([d, a, d, a], 1000)] == [["d"], ["a", "d"], ["a"]]
    assert [[i.key for i in g] for g in plan_buckets([a, d, d, a], 1000)] == [["a", "d", "d", "a"]]  # 60 % 4 == 0
    with pytest.raises(ValueError, match="bucket bound must be positive"):
        plan_buckets([a], 0)


def test_shard_files_group_buckets_and_the_header_reads_back(tmp_path):
    a, b = _item("a", (2, 3)), _item("b", (4,), (1,), dtype=torch.bfloat16)
    assert plan_files([[a], [b], [a]], 40) == [[0, 1], [2]]  # 24 + 10 <= 40; + 24 > 40
    tensors = {
        "a.0": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b.0": torch.tensor([1.5, -2, 3, 4], dtype=torch.bfloat16),
        "b.1": torch.tensor([7.0], dtype=torch.bfloat16),
    }
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as fh:
        fh.write(safetensors_header([a, b]))
        for t in tensors.values():
            _write_tensor(fh, t)
    back = load_file(path)
    assert set(back) == set(tensors) and all(
        torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items()
    )
