"""Test-wide environment: set before any project module (or triton) is imported."""

import os
import subprocess

import pytest

# Triton reads TRITON_INTERPRET when @triton.jit decorates a kernel, i.e. at import time.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (tests/gpu/run_all.sh runs these where one is lent)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def rank_pool():
    """`rank_pool(world_size)` -> a RankPool of gloo ranks, one per size, reused for the session."""
    from rank_pool import RankPool

    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        pool = pools.get(world_size)
        if pool is not None and pool.alive and pool.worn_out:
            pool.close()  # leaked gloo threads (rank_pool.MAX_THREADS_PER_RANK): start fresh ranks
        if pool is None or not pool.alive or pool.worn_out:
            pool = pools[world_size] = RankPool(world_size)
        return pool

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(size, skip_reason) -> a fresh tmpfs of `size` (e.g. "5m") under tmp_path, unmounted after
    the test; the test is skipped with skip_reason where mounting is not allowed (not root)."""
    mounts = []

    def mount(size: str, skip_reason: str):
        path = tmp_path / f"fs{len(mounts)}"
        path.mkdir()
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode:
            pytest.skip(skip_reason)
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)
