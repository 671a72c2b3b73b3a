"""An engine SIGKILLed during a weight sync, with two real serve-rollout processes and the driver's
sync pass (transfer/engine_push.py: sync_dropping_dead, what Driver.push_weights runs for every export pass).

Pass 1 kills engine B between two buckets: B is dropped from the pool, the pass's iterator is still
consumed to its end (on the trainer it is the collective export every rank runs), and the pass asks
for another. Pass 2 re-forms the group with A alone and sends everything again: A's weights equal the
sent ones bit for bit. B restarted on its port (same url, newer started_at) is pending, gets the next
sync in a group re-formed with both, and is admitted: its weights equal that sync's bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import signal

import pytest
import torch

from dapo_megatron.rollout.pool import EngineEventReport, EnginePool
from dapo_megatron.transfer.engine_push import sync_dropping_dead
from dapo_megatron.transfer.weight_sync import DistributedWeightSync
from rollout_helpers import ServerProcess, engine_pair, engine_weights


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with engine_pair(tmp_path_factory.mktemp("sync_death")) as pair:
        yield pair


def _weights(model_dir, seed: int) -> list[tuple[str, torch.Tensor]]:
    """The 'trainer' weights of one step: every tensor of the model, changed."""
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return [(n, t + 0.05 * torch.randn(t.shape, generator=gen)) for n, t in sorted(state.items())]


def test_engine_killed_during_sync_is_dropped_and_rejoins_after_restart(setup):
    a, b = setup["engines"]
    step1, step2 = _weights(setup["model_dir"], 1), _weights(setup["model_dir"], 2)
    names = [n for n, _ in step1]
    yielded = []

    def export(weights, *, kill_after: int | None = None):
        """One export pass; with kill_after, SIGKILL engine B once that many tensors are out."""
        for i, pair in enumerate(weights):
            if i == kill_after:
                b.proc.send_signal(signal.SIGKILL)
                b.proc.wait(30)
            yielded.append(pair[0])
            yield pair

    async def scenario():
        pool = await EnginePool.from_registry(str(setup["root"] / "engines"), min_engines=2, wait_s=60)
        report = EngineEventReport(pool)
        sync = DistributedWeightSync(master_address="127.0.0.1", backend="gloo", bucket_bytes=64 * 1024, timeout_s=60)
        out = {}
        out["pass1"] = await sync_dropping_dead(pool, sync, export(step1, kill_after=8), weight_version="step_1")
        out["yielded1"] = list(yielded)
        out["states1"] = {u: s["state"] for u, s in pool.load().items()}
        out["a_after1"] = await engine_weights(a.url, names)
        out["pass2"] = await sync_dropping_dead(pool, sync, export(step1), weight_version="step_1")
        out["a_after2"] = await engine_weights(a.url, names)
        out["gen2"] = sync._generation
        lines = []
        out["report2"] = report.report(out=lines.append)
        # B comes back on its port: a new incarnation (newer started_at) that must be synced before use
        restarted = ServerProcess(
            setup["model_dir"],
            setup["root"] / "engines",
            seed=1,
            port=int(b.record["port"]),
            log_path=setup["root"] / "engine_1b.log",
        )
        setup["engines"].append(restarted)
        assert restarted.url == b.url and restarted.record["started_at"] > b.record["started_at"]
        out["pending"] = await pool.discover()
        out["pass3"] = await sync_dropping_dead(pool, sync, export(step2), weight_version="step_2")
        out["a_after3"] = await engine_weights(a.url, names)
        out["b_after3"] = await engine_weights(b.url, names)
        out["gen3"] = sync._generation
        out["live3"] = pool.live_urls()
        out["report3"] = report.report(out=lines.append)
        out["lines"] = lines
        await sync.close(pool.live_clients())
        await pool.close()
        return out

    out = asyncio.run(scenario())
    stats1, redo1 = out["pass1"]
    assert stats1 is None and redo1  # B died mid-pass: the survivors need the whole sync again
    assert out["yielded1"] == names  # the pass was consumed to its end all the same
    assert out["states1"] == {a.url: "live", b.url: "dead"}
    # the kill fell mid-sync: A holds some of step 1's tensors and still the base model's others
    got1 = [torch.equal(out["a_after1"][n], t) for n, t in step1]
    assert any(got1) and not all(got1), got1
    stats2, redo2 = out["pass2"]
    assert not redo2 and stats2.num_engines == 1 and stats2.num_tensors == len(names) and stats2.missing == []
    assert out["gen2"] == 2  # the group of A and B, then one of A alone
    for name, sent in step1:
        assert torch.equal(out["a_after2"][name], sent), name
    assert out["report2"]["engines/dropped_total"] == 1.0 and out["report2"]["engines/live"] == 1.0
    assert out["pending"] == [b.url]
    stats3, redo3 = out["pass3"]
    assert not redo3 and stats3.num_engines == 2 and out["gen3"] == 3  # re-formed with B's new incarnation
    assert sorted(out["live3"]) == sorted([a.url, b.url])
    for name, sent in step2:
        assert torch.equal(out["a_after3"][name], sent), name
        assert torch.equal(out["b_after3"][name], sent), name
    assert out["report3"]["engines/returned_total"] == 1.0 and out["report3"]["engines/rejoined_total"] == 1.0
    assert out["report3"]["engines/live"] == 2.0
    assert any(line.startswith(f"[engines] {b.url} dropped (died during weight sync step_1: ") for line in out["lines"])
    assert f"[engines] {b.url} rejoined with the current weights; 2 live" in out["lines"]
    json.dumps(out["report3"])  # the metrics row takes it as it is
