"""Who is named when forming a weight group fails (DistributedWeightSync._join_failures): the engines
whose init_weights_update_group raised, or, when the trainer's own side timed out, every engine whose
join has not returned (it never reached the trainer's store), else the trainer itself. Real futures,
no network: the rendezvous outcome is what is under test, not the transport."""

from __future__ import annotations

import asyncio

from dapo_megatron.rollout.client import EngineClient
from dapo_megatron.transfer.weight_sync import DistributedWeightSync, _GroupPlan

A, B = EngineClient("http://10.0.0.1:30000"), EngineClient("http://10.0.0.2:30000")
PLAN = _GroupPlan(address="10.0.0.9", port=29555, world_size=3, rank_offsets=[1, 2])


def _outcome(*, own_error: BaseException | None, join_errors: list[BaseException | None | str]):
    """join_errors[i]: an exception (join raised), None (join returned), "pending" (not returned)."""

    async def run():
        loop = asyncio.get_running_loop()
        own = loop.create_future()
        own.set_exception(own_error) if own_error else own.set_result("pg")
        joins = []
        for err in join_errors:
            j = loop.create_future()
            if err is None:
                j.set_result({"success": True})
            elif isinstance(err, BaseException):
                j.set_exception(err)
            joins.append(j)
        done = {f for f in (own, *joins) if f.done()}
        failures = DistributedWeightSync(timeout_s=42)._join_failures([A, B], own, joins, done, PLAN)
        for f in (own, *joins):  # retrieve or cancel, so that asyncio reports nothing unretrieved
            f.exception() if f.done() else f.cancel()
        return failures

    return asyncio.run(run())


def test_an_engine_that_refused_is_named_alone():
    refused = RuntimeError("HTTP 400: group exists")
    failures = _outcome(own_error=None, join_errors=[refused, "pending"])
    assert failures == {A.url: refused}


def test_the_trainer_timing_out_names_every_engine_that_never_joined():
    failures = _outcome(own_error=TimeoutError("store"), join_errors=[None, "pending"])
    assert list(failures) == [B.url]
    assert isinstance(failures[B.url], TimeoutError)
    assert str(failures[B.url]) == (
        "did not join within 42 s; it must reach 10.0.0.9:29555 (set rollout.weight_sync_address, "
        "or NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME)"
    )


def test_the_trainer_timing_out_with_every_engine_joined_names_the_trainer():
    timeout = TimeoutError("store")
    assert _outcome(own_error=timeout, join_errors=[None, None]) == {"trainer": timeout}


def test_nothing_failed_names_no_one():
    assert _outcome(own_error=None, join_errors=["pending", None]) == {}
