"""Tensor payloads of the weight-update protocol: flattened buckets (SGLang's FlattenedTensorBucket
layout: bytes in order, each tensor's offset a multiple of its element size), and update_weights_from_tensor
entries travelling by shared memory between two unrelated processes (what a trainer and a colocated
engine are), read back bit for bit, each entry once; the engine's unpickler refuses anything but tensors."""

from __future__ import annotations

import base64
import inspect
import io
import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from dapo_megatron.transfer.tensor_payload import (
    PayloadError,
    deserialize_payload,
    flatten_bucket,
    flattened_size,
    serialize_for_engine_rank,
    split_for_alignment,
    unflatten_bucket,
)


def test_flatten_is_the_tensors_bytes_in_order_and_views_back():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    c = torch.tensor(7, dtype=torch.int64)  # 0-dim: one element, at byte 24 (a multiple of 8)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    flat = flatten_bucket([("a", a), ("c", c), ("b", b)])
    assert flat.dtype == torch.uint8 and flat.numel() == 24 + 8 + 4
    assert flat.numpy().tobytes() == a.numpy().tobytes() + c.numpy().tobytes() + b.view(torch.int16).numpy().tobytes()
    specs = [("a", torch.float32, [2, 3]), ("c", torch.int64, []), ("b", torch.bfloat16, [2])]
    assert flattened_size(specs) == 36
    back = dict(unflatten_bucket(flat, specs))
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b) and torch.equal(back["c"], c)
    with pytest.raises(ValueError, match="holds 36 bytes"):
        unflatten_bucket(flat, specs[:2])


def test_alignment_split_keeps_every_offset_a_multiple_of_the_element_size():
    # 3 bf16 = 6 bytes, then an fp32 would start at byte 6 (not a multiple of 4): new bucket there
    named = [
        ("h", torch.zeros(3, dtype=torch.bfloat16)),
        ("f", torch.zeros(2)),
        ("g", torch.zeros(1)),
        ("i", torch.zeros(1, dtype=torch.int8)),
        ("j", torch.zeros(1, dtype=torch.float16)),
    ]
    parts = split_for_alignment(named)
    assert [[n for n, _ in p] for p in parts] == [["h"], ["f", "g", "i"], ["j"]]  # j at byte 13: odd
    for part in parts:
        offset = 0
        for _, t in part:
            assert offset % t.element_size() == 0
            offset += t.numel() * t.element_size()
    with pytest.raises(RuntimeError):  # what an unsplit bucket would do to the engine (torch's view rule)
        flatten_bucket(named)[6:14].view(torch.float32)


def test_shared_memory_payload_read_by_an_unrelated_process(tmp_path):
    """The trainer serializes (ForkingPickler, file_system strategy); a separate Python process (not a
    child sharing our authkey) reads the tensors from shared memory, each TP rank's entry separately."""
    gen = torch.Generator().manual_seed(0)
    named = [
        ("w", torch.randn(64, 32, generator=gen)),
        ("b", torch.randn(32, generator=gen).to(torch.bfloat16)),
        ("i", torch.arange(5)),
    ]
    entries = [serialize_for_engine_rank(named) for _ in range(2)]  # one per engine TP rank
    assert all(len(e) < 2000 for e in entries)  # handles, not the 8 KB of data
    (tmp_path / "payload.json").write_text(json.dumps(entries))
    reader = textwrap.dedent("""
        import json, sys
        from dapo_megatron.transfer.tensor_payload import deserialize_payload
        entries = json.load(open(sys.argv[1]))
        out = []
        for entry in entries:
            named = deserialize_payload(entry)
            out.append({n: [str(t.dtype), list(t.shape), t.float().flatten().tolist()] for n, t in named})
        print(json.dumps(out))
    """)
    proc = subprocess.run(
        [sys.executable, "-c", reader, str(tmp_path / "payload.json")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for got in json.loads(proc.stdout.strip().splitlines()[-1]):
        for name, tensor in named:
            dtype, shape, values = got[name]
            assert dtype == str(tensor.dtype) and shape == list(tensor.shape)
            assert torch.equal(torch.tensor(values, dtype=torch.float32), tensor.float().flatten())
    # an entry is read once: its reader took the segment's last reference (as a CUDA IPC handle's
    # reference count works in SGLang: hence one entry per rank, never one shared by all ranks)
    with pytest.raises(PayloadError, match="unable to open shared memory"):
        deserialize_payload(entries[0])


def test_the_engine_unpickler_refuses_anything_but_tensors():
    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("true",))

    evil = base64.b64encode(pickle.dumps([("x", Evil())])).decode()
    with pytest.raises(PayloadError, match="names posix.system|names os.system"):
        deserialize_payload(evil)
    with pytest.raises(PayloadError, match="not base64"):
        deserialize_payload("%%%")
    buf = io.BytesIO()
    pickle.dump({"not": "a list"}, buf)
    with pytest.raises(PayloadError, match="list of \\(name, tensor\\)"):
        deserialize_payload(base64.b64encode(buf.getvalue()).decode())


def _cuda_payload_of_cpu_tensor(t: torch.Tensor) -> str:
    """A payload with the globals and argument layout torch's reduce_tensor writes for a CUDA tensor
    (torch/multiprocessing/reductions.py, its storage.is_cuda branch), made from a CPU tensor: this machine has no
    GPU, so the IPC handle is a placeholder and only the rebuild call itself can fail."""
    from torch.multiprocessing import reductions

    storage = t._typed_storage()
    args = (
        type(t),
        t.size(),
        t.stride(),
        0,
        type(storage),
        t.dtype,
        0,
        b"ipc-handle",
        storage.nbytes(),
        0,
        False,
        b"ref-counter",
        0,
        b"event",
        False,
    )
    names = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert len(names) == len(args) and names[4] == "storage_cls" and names[6] == "storage_device"

    class CudaTensorStandIn:
        def __reduce__(self):
            return reductions.rebuild_cuda_tensor, args

    return base64.b64encode(pickle.dumps([("w", CudaTensorStandIn())])).decode()


def test_a_cuda_ipc_payload_passes_the_engine_unpickler_up_to_the_rebuild():
    """The first GPU run (2026-11-26, H100) found every colocated sync refused: a CUDA payload names
    torch.storage.TypedStorage (rebuild_cuda_tensor's storage_cls), which the allow list lacked."""
    payload = _cuda_payload_of_cpu_tensor(torch.arange(6, dtype=torch.float32))
    assert type(torch.empty(1)._typed_storage()) is torch.storage.TypedStorage
    with pytest.raises(PayloadError) as err:
        deserialize_payload(payload, cuda=True)
    # every global was let through: what fails is opening the handle without a GPU, not the allow list
    assert "cannot unpickle" in str(err.value) and "names" not in str(err.value)
    # a CPU engine (cuda=False) refuses the same payload, naming the GPU it would need
    with pytest.raises(PayloadError, match="rebuild_cuda_tensor.*serve-rollout --device cuda"):
        deserialize_payload(payload)
