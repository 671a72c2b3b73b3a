"""weight_sync.flat_payload: a bucket whose tensors lie back to back in one buffer (the stage exporters'
flat buckets) leaves as a view of that buffer, no copy; any other bucket as flatten_bucket's copy.
Both hold the same bytes, SGLang's FlattenedTensorBucket's."""

from __future__ import annotations

import torch

from dapo_megatron.transfer.tensor_payload import flatten_bucket
from dapo_megatron.transfer.weight_sync import flat_payload


def test_back_to_back_views_leave_without_a_copy():
    flat = torch.arange(64, dtype=torch.uint8)
    a, b = flat[8:24].view(torch.float32), flat[24:40].view(torch.float32).view(2, 2)
    payload = flat_payload([("a", a), ("b", b)])
    assert payload.data_ptr() == flat[8:].data_ptr() and payload.numel() == 32
    assert torch.equal(payload, torch.arange(8, 40, dtype=torch.uint8))
    assert torch.equal(payload, flatten_bucket([("a", a), ("b", b)]))


def test_a_gap_another_buffer_or_a_strided_tensor_is_copied():
    flat = torch.arange(64, dtype=torch.uint8)
    a, gap = flat[8:24].view(torch.float32), flat[28:44].view(torch.float32)
    other = torch.ones(4)
    strided = flat[24:56].view(torch.float32).view(4, 2).t()
    for bucket in ([("a", a), ("gap", gap)], [("a", a), ("other", other)], [("a", a), ("t", strided)]):
        payload = flat_payload(bucket)
        assert payload.data_ptr() != flat.data_ptr() + 8
        assert torch.equal(payload, flatten_bucket(bucket))
