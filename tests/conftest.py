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


# The longest modules (their tests' seconds summed, 2026-11-27, 2-core AMD EPYC), run first: under
# pytest-xdist (README's test command, --dist loadscope: a module stays on one worker) the longest
# work starts first and the short modules fill the workers' ends. The MoE run and the tiny run (which
# builds the shared tiny model) lead, so no worker starts by waiting for the other's build.
LONGEST_FIRST = (
    "integration/test_train_tiny_moe.py",  # 288 s
    "integration/test_train_tiny.py",  # 172 s, builds tiny_cache and tiny_run_a
    "integration/test_multi_host.py",  # 283 s
    "integration/test_slurm_e2e.py",  # 138 s
    "integration/test_slurm_jobs.py",  # 133 s
    "integration/test_train_engine_faults.py",  # 120 s
    "integration/test_train_colocated.py",  # 80 s
    "integration/test_train_exit_paths.py",  # 77 s
    "integration/test_ladder_tiny.py",  # 69 s
    "integration/test_train_overlap.py",  # 68 s
    "distributed/test_long_response_cp.py",  # 50 s
)


def _run_order(item) -> int:
    path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_run_order)  # stable: every other test keeps its collection order
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
            pool.close(force=True)  # leaked gloo threads (rank_pool.MAX_THREADS_PER_RANK): start fresh ranks
        if pool is None or not pool.alive or pool.worn_out:
            pool = pools[world_size] = RankPool(world_size)
        return pool

    yield get
    # killed, not asked to stop: a rank holds nothing to keep, and its graceful exit (destroying the gloo
    # groups it leaked) outwaited close()'s 10 s join: 11.6 and 16.2 s at the end of each worker (2026-11-27)
    for pool in pools.values():
        pool.close(force=True)


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
