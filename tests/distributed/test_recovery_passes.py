"""recovery.FaultPolicy.transfer on 2 gloo ranks: every rank runs the same number of export passes,
decided by the driver after each (one broadcast int), so the collective export is never left half
walked on some ranks. The export here is a real collective walk (an all_reduce per bucket, as the
stage export gathers over its groups); the driver is a stand-in holding only what the policy reads: its
EngineFaults (sync_redo, set by Driver.push_weights when an engine died mid-pass, and the number of
passes the pool's engines allow)."""

from __future__ import annotations


def _passes(redo_after: tuple[int, ...]):
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from dapo_megatron.trainer.recovery import EngineFaults, FaultPolicy

    rank = dist.get_rank()

    class _Pool:
        def load(self):
            return {"http://a:1": {}, "http://b:2": {}}  # two engines known: at most 3 passes

    class _DriverStandIn:
        engine_faults = EngineFaults(
            _Pool(), run_dir=".", engine="sglang", engine_urls=(), num_engines=2, engine_wait_s=0.0
        )

    driver = _DriverStandIn() if rank == 0 else None
    sums = []

    class _Export:
        def transfer_weights(self, actor, *, step):
            total = 0.0
            for _ in range(3):  # three buckets, each a collective on every rank
                t = torch.tensor([float(rank + 1)])
                dist.all_reduce(t)
                total += t.item()
            sums.append(total)
            if driver is not None:
                driver.engine_faults.sync_redo = len(sums) in redo_after  # an engine died during this pass
            return {"sync/buckets": 3.0} if driver is not None else {}

    try:
        policy = FaultPolicy(
            roles=SimpleNamespace(driver=rank == 0), placement=_Export(), actor=None, driver=driver, engine_restarts=0
        )
        stats = policy.transfer(1)
    except RuntimeError as err:
        return {"passes": len(sums), "sums": sums, "error": str(err)}
    return {"passes": len(sums), "sums": sums, "stats": stats}


def test_every_rank_runs_the_drivers_number_of_passes(rank_pool):
    pool = rank_pool(2)
    driver, other = pool.run(_passes, ())
    assert driver == {"passes": 1, "sums": [9.0], "stats": {"sync/buckets": 3.0, "sync/passes": 1.0}}
    assert other == {"passes": 1, "sums": [9.0], "stats": {}}
    driver, other = pool.run(_passes, (1,))  # an engine died in pass 1: one more pass on both ranks
    assert driver["passes"] == other["passes"] == 2 and driver["stats"]["sync/passes"] == 2.0
    assert driver["sums"] == other["sums"] == [9.0, 9.0]  # 3 buckets x (1 + 2), every bucket matched


def test_engines_dying_in_every_pass_stop_every_rank_at_the_same_bound(rank_pool):
    results = rank_pool(2).run(_passes, (1, 2, 3))
    for r in results:
        assert r["passes"] == 3  # 2 engines known + 1
        assert r["error"] == "weight sync step_1: engines kept dying during the sync (3 passes)"
