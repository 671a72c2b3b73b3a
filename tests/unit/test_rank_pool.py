"""The rank pool itself: collectives really cross processes, errors come back with the rank."""

import pytest
import torch
import torch.distributed as dist


def _allreduce_rank_squares():
    t = torch.tensor([float(dist.get_rank() + 1) ** 2], dtype=torch.float64)
    dist.all_reduce(t)
    return (dist.get_rank(), t)


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return dist.get_rank()


def test_pool_runs_collectives_and_reports_errors(rank_pool):
    pool = rank_pool(2)
    results = pool.run(_allreduce_rank_squares)
    assert [r for r, _ in results] == [0, 1]
    assert all(t.item() == 1.0 + 4.0 for _, t in results)  # 1^2 + 2^2
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*boom on purpose"):
        pool.run(_fail_on_rank_one)
    assert pool.run(_allreduce_rank_squares)[1][1].item() == 5.0  # still usable afterwards


def _start_threads(count):
    import threading

    stop = threading.Event()
    for _ in range(count):
        threading.Thread(target=stop.wait, daemon=True).start()
    return dist.get_rank()


def test_a_pool_whose_ranks_leak_threads_is_replaced(rank_pool):
    """Ranks report their thread count after each job; past the bound the fixture starts new ranks."""
    from rank_pool import MAX_THREADS_PER_RANK

    pool = rank_pool(2)
    pool.run(_start_threads, 0)
    assert not pool.worn_out and 0 < pool.max_threads < MAX_THREADS_PER_RANK
    pool.run(_start_threads, MAX_THREADS_PER_RANK)
    assert pool.worn_out
    fresh = rank_pool(2)
    assert fresh is not pool and not pool.alive and fresh.max_threads == 0
    assert fresh.run(_allreduce_rank_squares)[0][1].item() == 5.0
