"""transfer/colocated_sync.py's ColocatedTransfer.send on 2 gloo ranks when the driver's side fails:
every rank raises the driver's EngineError with the same message (distributed/driver_decides.py), the
weight-update session is closed on the way out, and the ranks are in step afterwards (a collective
right after the failure completes). The driver is a stand-in whose pool no longer holds the engine
(what a dead engine leaves), the one thing the CPU run cannot arrange on demand."""

from __future__ import annotations


def _send_to_a_dead_engine():
    import torch
    import torch.distributed as dist

    from dapo_megatron.distributed import collectives as coll
    from dapo_megatron.rollout.client import EngineError
    from dapo_megatron.transfer.colocated_sync import ColocatedTransfer, EngineSlot

    rank = dist.get_rank()
    asked = []

    class _PoolWithoutTheEngine:
        def weight_targets(self):
            asked.append("weight_targets")
            return []  # the engine was dropped: no client for it

    class _DriverStandIn:
        pool = _PoolWithoutTheEngine()

    slots = {0: [EngineSlot("http://e:1", 0, 2)], 1: [EngineSlot("http://e:1", 1, 2)]}
    transfer = ColocatedTransfer(slots, driver=_DriverStandIn() if rank == 0 else None, bucket_bytes=1 << 20)
    named = iter([("w", torch.ones(2))])
    try:
        transfer.send(named, weight_version="step_3")
        error = None
    except EngineError as err:
        error = str(err)
    total = coll.all_reduce(torch.tensor([float(rank + 1)]))  # every rank left the failed send together
    return {"error": error, "asked": asked, "sum": total.item(), "stream_untouched": next(named)[0] == "w"}


def test_a_failed_begin_raises_the_drivers_message_on_every_rank_and_leaves_them_in_step(rank_pool):
    driver, other = rank_pool(2).run(_send_to_a_dead_engine)
    message = "EngineError: colocated weight transfer: engines ['http://e:1'] are not in the pool (dead?)"
    assert driver["error"] == other["error"] == message
    assert driver["asked"] == ["weight_targets", "weight_targets"]  # begin, then the session's end
    assert other["asked"] == []  # only the driver talks to the engines
    assert driver["sum"] == other["sum"] == 3.0
    assert driver["stream_untouched"] and other["stream_untouched"]  # no bucket was sent after a failed begin
