"""Which GPU a rank drives, decided once at start-up (actor/parallel.py) and used by every collective
whatever thread calls it (distributed/collectives.py). No GPU here: the decisions are pure functions of
numbers, and CUDA's per-thread current device is played by a STAND-IN selector (named so below)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dapo_megatron.actor.parallel import gpu_for_local_rank, local_world_size
from dapo_megatron.distributed import collectives as coll


class StandInCudaCurrentDevice:
    """STAND-IN for torch.cuda.current_device() on a machine without CUDA: per thread, like CUDA's
    (a thread that never called set_device sees device 0)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def set_device(self, index: int) -> None:
        self._local.index = index

    def __call__(self) -> int:
        return getattr(self._local, "index", 0)


def test_collectives_stage_on_the_rank_gpu_from_any_thread(monkeypatch):
    """Local rank 1: start-up sets and records cuda:1 on the main thread; a weight-sync executor thread
    and a rollout-loop style thread see current device 0, yet stage NCCL tensors on cuda:1."""
    monkeypatch.setattr(coll, "_RANK_DEVICE", None)
    current = StandInCudaCurrentDevice()
    current.set_device(1)  # torch.cuda.set_device(1) in init_distributed ...
    coll.set_rank_device(torch.device("cuda", 1))  # ... and the record made right there
    seen = {}

    def from_thread(name):
        seen[name] = (current(), coll.staging_device("nccl", current_cuda_index=current))

    thread = threading.Thread(target=from_thread, args=("thread",))
    thread.start()
    thread.join()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(from_thread, "executor").result()
    from_thread("main")
    assert seen["thread"][0] == seen["executor"][0] == 0  # the stand-in behaves as CUDA does
    assert seen["main"][0] == 1
    for name, (_, device) in seen.items():
        assert device == torch.device("cuda", 1), name
    assert coll.staging_device("gloo", current_cuda_index=current) == torch.device("cpu")


def test_without_a_record_nccl_staging_uses_the_calling_threads_device(monkeypatch):
    """A process that set up NCCL itself (no init_distributed, e.g. the GPU tests) keeps the old rule."""
    monkeypatch.setattr(coll, "_RANK_DEVICE", None)
    current = StandInCudaCurrentDevice()
    current.set_device(3)
    assert coll.staging_device("nccl", current_cuda_index=current) == torch.device("cuda", 3)
    assert coll.rank_device() is None


@pytest.mark.parametrize("local_rank,ranks,gpus", [(0, 8, 8), (7, 8, 8), (1, 2, 8), (0, 1, 1), (2, None, 4)])
def test_one_rank_per_gpu_drives_its_own(local_rank, ranks, gpus):
    assert gpu_for_local_rank(local_rank, ranks, gpus) == local_rank


@pytest.mark.parametrize("local_rank,ranks,gpus", [(1, 8, 4), (5, 8, 4), (0, 2, 1), (4, None, 4)])
def test_more_ranks_per_node_than_gpus_is_refused_naming_the_numbers(local_rank, ranks, gpus):
    """3eb0efe mapped local_rank % device_count: local ranks 1 and 5 of 8 on 4 GPUs both took GPU 1, and
    NCCL failed much later ("Duplicate GPU detected")."""
    shown = ranks if ranks is not None else local_rank + 1
    with pytest.raises(
        ValueError,
        match=rf"{shown} ranks per node \(LOCAL_WORLD_SIZE\) but {gpus} GPU\(s\) "
        rf"visible: LOCAL_RANK={local_rank} would share a GPU",
    ):
        gpu_for_local_rank(local_rank, ranks, gpus)


def test_ranks_per_node_from_torchrun_or_srun():
    assert local_world_size({"LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "1"}) == 8  # torchrun wins
    assert local_world_size({"SLURM_NTASKS_PER_NODE": "4"}) == 4
    assert local_world_size({"SLURM_TASKS_PER_NODE": "4(x2),3"}) == 4
    assert local_world_size({}) is None
