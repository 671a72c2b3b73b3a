"""What broke between a GPU trainer and its engines on the first H100 (2026-11-25), run for real on one GPU:

- collectives: a CPU tensor handed to an NCCL group fails in torch itself; through
  distributed/collectives.py the same tensor is staged to the GPU, and a CUDA tensor crosses a gloo group
  (a GPU trainer's weight group with CPU engines) through host memory; results come back to the
  caller's tensor.
- the colocated path on one GPU: the CPU stand-in engine holds its model on the same GPU
  (serve-rollout --device cuda:0); the trainer (this process) sends CUDA tensors as CUDA IPC handles
  (update_weights_from_tensor), the engine opens them; every tensor read back equals the trainer's;
  releasing the engine's weights gives their bytes back to the device and resuming takes them again,
  read from torch.cuda.mem_get_info; a sync after the resume restores the exact weights.
- the distributed weight sync from CUDA tensors to that engine over gloo (the group's backend follows
  the engine), with the greedy log-probs of the engine equal to the trainer model's.

    tests/gpu/run_all.sh --call 2 OUT   (step transfer_tests), or: pytest -m gpu tests/gpu/test_transfer_gpu.py
"""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS / "integration"))

# ~400 MB of fp32 weights: large against the caching allocator's blocks and the CUDA context's noise
SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _nccl_world():
    import torch.distributed as dist

    if not dist.is_initialized():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    return dist


def test_collectives_put_tensors_where_each_backend_needs_them():
    from dapo_megatron.distributed import collectives as coll

    dist = _nccl_world()
    cpu = torch.tensor([3.0, 4.0])
    with pytest.raises(Exception):  # noqa: B017 (any error will do) the bug class itself: NCCL has no backend for CPU tensors
        dist.all_reduce(cpu.clone())
    assert coll.backend_device() == torch.device("cuda", 0)
    out = coll.all_reduce(cpu)  # staged to the GPU, reduced (world of 1: unchanged), copied back
    assert out is cpu and cpu.device.type == "cpu" and cpu.tolist() == [3.0, 4.0]
    box = [{"step": 7}]
    coll.broadcast_object_list(box, src=0)
    assert box == [{"step": 7}]
    gloo = dist.new_group([0], backend="gloo")
    assert coll.backend_device(gloo) == torch.device("cpu")
    on_gpu = torch.arange(5, dtype=torch.float32, device="cuda")
    coll.broadcast(on_gpu, src=0, group=gloo)  # a CUDA bucket over a CPU engine's gloo group
    assert on_gpu.device.type == "cuda" and on_gpu.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    parts = [torch.zeros(2, device="cuda")]
    coll.all_gather(parts, torch.tensor([1.0, 2.0], device="cuda"), group=gloo)
    assert parts[0].device.type == "cuda" and parts[0].tolist() == [1.0, 2.0]


@pytest.fixture(scope="module")
def engine_on_gpu(tmp_path_factory):
    from rollout_helpers import ServerProcess, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("engine_gpu")
    model_dir = make_tiny_checkpoint(root / "model", seed=0, shape=SHAPE)
    server = ServerProcess(model_dir, root / "engines", extra_args=("--device", "cuda:0"), log_path=root / "engine.log")
    try:
        yield {"url": server.url, "model_dir": model_dir, "log": root / "engine.log"}
    finally:
        server.kill()


def _updated_model(model_dir, seed: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, device="cuda"))
    return model


async def _read_back_differences(client, weights) -> list[str]:
    """Names whose first rows on the engine differ from the trainer's (every tensor is read)."""
    wrong = []
    for name, tensor in weights:
        got = torch.tensor(await client.get_weights_by_name(name, truncate_size=2), dtype=torch.float32)
        want = tensor[:2].float().cpu() if tensor.dim() else tensor.float().cpu()
        if not torch.equal(got, want):
            wrong.append(name)
    return wrong


def test_colocated_on_one_gpu_ipc_sync_release_resume(engine_on_gpu):
    from dapo_megatron.rollout.client import EngineClient
    from dapo_megatron.transfer.weight_sync import TensorWeightSync

    trainer = _updated_model(engine_on_gpu["model_dir"], seed=1)
    weights = [(n, t.detach()) for n, t in trainer.state_dict().items()]
    assert all(t.is_cuda for _, t in weights)
    weight_bytes = sum(t.numel() * t.element_size() for _, t in weights)

    async def scenario():
        async with EngineClient(engine_on_gpu["url"]) as client:
            info = await client.server_info()
            assert info["cpu_engine_device"] == "cuda:0" and info["device"] == "cuda"
            stats = await TensorWeightSync(bucket_bytes=64 << 20).sync([client], iter(weights), weight_version="ipc_1")
            first = await _read_back_differences(client, weights)
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            await client.release_memory(["weights"])
            free_released = torch.cuda.mem_get_info()[0]
            await client.resume_memory(["weights"])
            free_resumed = torch.cuda.mem_get_info()[0]
            await TensorWeightSync(bucket_bytes=64 << 20).sync([client], iter(weights), weight_version="ipc_2")
            second = await _read_back_differences(client, weights)
            return stats, first, second, free_before, free_released, free_resumed

    stats, first, second, free_before, free_released, free_resumed = asyncio.run(scenario())
    print(
        f"weights {weight_bytes / 2**20:.1f} MiB; free before {free_before / 2**20:.0f} MiB, released "
        f"{free_released / 2**20:.0f} MiB (+{(free_released - free_before) / 2**20:.1f}), resumed "
        f"{free_resumed / 2**20:.0f} MiB; sync {stats.bytes / 2**20:.1f} MiB in {stats.seconds:.3f} s"
    )
    assert stats.num_tensors == len(weights) and stats.bytes == weight_bytes
    assert first == [] and second == []
    # the engine's weights went back to the device and came back: at least 90% of their bytes each way
    # (the allocator rounds blocks; nothing else on the GPU changes size meanwhile)
    assert free_released - free_before >= 0.9 * weight_bytes
    assert free_released - free_resumed >= 0.9 * weight_bytes


def test_distributed_sync_from_cuda_tensors_follows_the_engine_backend(engine_on_gpu):
    """The GPU trainer's buckets reach the CPU engine over gloo (staged through host memory); the engine's
    greedy log-probs then equal the trainer model's own (fp32 on the same GPU)."""
    from dapo_megatron.rollout.client import EngineClient
    from dapo_megatron.transfer.weight_sync import DistributedWeightSync

    trainer = _updated_model(engine_on_gpu["model_dir"], seed=2)
    weights = [(n, t.detach()) for n, t in trainer.state_dict().items()]
    prompt = [5, 17, 99, 3, 42, 8]

    async def scenario():
        async with EngineClient(engine_on_gpu["url"]) as client:
            sync = DistributedWeightSync(master_address="127.0.0.1", bucket_bytes=64 << 20)
            await sync.sync([client], iter(weights), weight_version="nccl_trainer_gloo_engine")
            out = await client.generate(
                input_ids=prompt,
                return_logprob=True,
                sampling_params={"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
            )
            await sync.close([client])
            return sync.backend, out

    backend, out = asyncio.run(scenario())
    assert backend == "gloo"
    ids = prompt + out["output_ids"]
    with torch.no_grad():
        logits = trainer(torch.tensor([ids], device="cuda")).logits[0].double()
    want = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
        1, torch.tensor(out["output_ids"], device="cuda")[:, None]
    )
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    # same weights, same device, same fp32 kernels up to batch shape: TF32 is off by default for matmuls
    torch.testing.assert_close(got, want[:, 0].cpu(), rtol=0, atol=1e-4)
