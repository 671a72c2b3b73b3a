"""Which trainer rank feeds which colocated engine TP rank (transfer/colocated_sync.py)."""

from __future__ import annotations

import pytest

from dapo_megatron.transfer.colocated_sync import EngineSlot, assign_engine_slots


def _engine(url: str, node: str, base: int, tp: int) -> dict:
    return {"url": url, "node": node, "base_gpu_id": base, "tp_size": tp, "host": node, "port": 1, "started_at": "t"}


def test_two_nodes_two_engines_each_of_tp2():
    # 8 trainer ranks, 4 per node; engines of TP 2 on GPUs 0-1 and 2-3 of each node
    devices = [("n0", g) for g in range(4)] + [("n1", g) for g in range(4)]
    records = [
        _engine("http://n1:2", "n1", 2, 2),
        _engine("http://n0:1", "n0", 0, 2),
        _engine("http://n0:2", "n0", 2, 2),
        _engine("http://n1:1", "n1", 0, 2),
    ]
    slots = assign_engine_slots(records, devices)
    assert slots == {
        0: [EngineSlot("http://n0:1", 0, 2)],
        1: [EngineSlot("http://n0:1", 1, 2)],
        2: [EngineSlot("http://n0:2", 0, 2)],
        3: [EngineSlot("http://n0:2", 1, 2)],
        4: [EngineSlot("http://n1:1", 0, 2)],
        5: [EngineSlot("http://n1:1", 1, 2)],
        6: [EngineSlot("http://n1:2", 0, 2)],
        7: [EngineSlot("http://n1:2", 1, 2)],
    }


def test_one_engine_on_fewer_gpus_than_the_trainer_and_two_engines_sharing_a_gpu():
    devices = [("n0", 0), ("n0", 1), ("n0", 2), ("n0", 3)]
    slots = assign_engine_slots([_engine("http://a:1", "n0", 1, 1), _engine("http://b:1", "n0", 1, 1)], devices)
    # rank 1 is the only rank on GPU 1: it feeds both engines there; ranks 0, 2, 3 feed none
    assert slots == {1: [EngineSlot("http://a:1", 0, 1), EngineSlot("http://b:1", 0, 1)]}


def test_the_lowest_rank_on_a_shared_gpu_feeds_it():
    devices = [("n0", 0), ("n0", 0)]  # e.g. two CPU-twin ranks reporting the same slot
    assert assign_engine_slots([_engine("http://a:1", "n0", 0, 1)], devices) == {0: [EngineSlot("http://a:1", 0, 1)]}


def test_an_engine_rank_on_a_gpu_without_a_trainer_rank_is_named():
    devices = [("n0", 0), ("n0", 1)]
    with pytest.raises(ValueError, match=r"engine http://a:1 TP rank 1 runs on node n0 GPU 2, where no trainer rank"):
        assign_engine_slots([_engine("http://a:1", "n0", 1, 2)], devices)
    with pytest.raises(ValueError, match=r"engine http://b:1 TP rank 0 runs on node n9 GPU 0"):
        assign_engine_slots([_engine("http://b:1", "n9", 0, 1)], devices)


def test_an_engine_without_its_placement_in_the_registry_is_refused():
    rec = _engine("http://a:1", "n0", 0, 1)
    del rec["base_gpu_id"]
    with pytest.raises(ValueError, match=r"engine http://a:1 did not register its node and GPUs"):
        assign_engine_slots([rec], [("n0", 0)])
