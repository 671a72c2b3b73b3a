"""Setting Megatron's parallel state up and down repeatedly must not leak process groups (each
leaked gloo group keeps polling threads alive: the test pool once reached 1,600 threads)."""

import threading


def _counts_after_three_cycles():
    from torch.distributed import distributed_c10d as c10d

    from dapo_megatron.actor.parallel import model_parallel

    counts = []
    for _ in range(3):
        with model_parallel(tp=2):
            assert len(c10d._world.pg_map) > 1  # megatron made its subgroups
        counts.append((len(c10d._world.pg_map), threading.active_count()))
    return counts


def test_model_parallel_exit_destroys_its_groups(rank_pool):
    for counts in rank_pool(2).run(_counts_after_three_cycles):
        groups = [g for g, _ in counts]
        threads = [t for _, t in counts]
        assert groups == [1, 1, 1]  # only the default group is left after each exit
        assert threads[0] == threads[1] == threads[2]  # no thread growth from cycle to cycle
