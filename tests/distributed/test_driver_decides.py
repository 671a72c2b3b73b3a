"""distributed/driver_decides.py on 2 and 3 gloo ranks: the driver's result on every rank, the driver's
exception raised on every rank (type and message), and a non-driver rank never calls the function."""

from __future__ import annotations

import pytest


class _TwoArgError(Exception):
    """An exception that does not survive pickling: its __init__ takes two arguments, args holds one."""

    def __init__(self, engine: str, code: int) -> None:
        super().__init__(f"engine {engine} answered {code}")


def _decide(case: str):
    import torch.distributed as dist

    from dapo_megatron.distributed.driver_decides import driver_decides

    rank = dist.get_rank()
    calls = []

    def decide():
        calls.append(rank)
        if case == "value":
            return {"slots": [rank * 10 + 7, "on the driver"], "rank": rank}
        if case == "value_error":
            raise ValueError(f"engine slot refused by rank {rank}")
        if case == "unpicklable_error":
            raise _TwoArgError("http://a:1", 503)
        if case == "unpicklable_result":
            return lambda: None
        raise AssertionError(case)

    try:
        result = driver_decides(decide)
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        return {"calls": calls, "error": (type(err).__name__, str(err))}
    # a second collective after the first: every rank left the first one (none is still waiting)
    after = driver_decides(lambda: rank + 100)
    return {"calls": calls, "result": result, "after": after}


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_drivers_result_and_only_the_driver_runs_it(rank_pool, world):
    results = rank_pool(world).run(_decide, "value")
    assert results[0]["calls"] == [0]
    assert [r["calls"] for r in results[1:]] == [[]] * (world - 1)  # a non-driver never calls it
    assert [r["result"] for r in results] == [{"slots": [7, "on the driver"], "rank": 0}] * world
    assert [r["after"] for r in results] == [100] * world


@pytest.mark.parametrize("world", [2, 3])
def test_the_drivers_exception_is_raised_on_every_rank_with_its_type_and_message(rank_pool, world):
    results = rank_pool(world).run(_decide, "value_error")
    assert [r["error"] for r in results] == [("ValueError", "engine slot refused by rank 0")] * world
    assert [r["calls"] for r in results] == [[0]] + [[]] * (world - 1)


def test_an_exception_that_does_not_unpickle_reaches_the_others_as_its_type_and_message(rank_pool):
    driver, *others = rank_pool(3).run(_decide, "unpicklable_error")
    assert driver["error"] == ("_TwoArgError", "engine http://a:1 answered 503")  # the driver: its own
    assert [o["error"] for o in others] == [("RuntimeError", "_TwoArgError: engine http://a:1 answered 503")] * 2


def test_a_result_that_cannot_be_sent_is_an_error_on_every_rank(rank_pool):
    results = rank_pool(2).run(_decide, "unpicklable_result")
    assert {r["error"][0] for r in results} == {"RuntimeError"}
    assert len({r["error"][1] for r in results}) == 1
    assert results[0]["error"][1].startswith("driver_decides: the driver's result (function) cannot be sent")


def test_a_single_process_is_the_driver():
    from dapo_megatron.distributed.driver_decides import driver_decides

    assert driver_decides(lambda: 42) == 42
    with pytest.raises(KeyError, match="missing"):
        driver_decides(lambda: {}["missing"])
