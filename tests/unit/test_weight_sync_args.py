"""Both weight syncs refuse a call that cannot tag or reach anything before they touch the network:
no engines, or an empty weight_version (every engine reply is checked against it)."""

from __future__ import annotations

import asyncio

import pytest

from dapo_megatron.rollout.client import EngineClient
from dapo_megatron.transfer.weight_sync import DistributedWeightSync, TensorWeightSync

# nothing listens here: a sync that got past its argument checks would fail with a connection error instead
UNREACHABLE = EngineClient("http://127.0.0.1:9")


@pytest.mark.parametrize("sync", [DistributedWeightSync(), TensorWeightSync()], ids=["distributed", "tensor"])
def test_sync_refuses_no_engines_and_an_empty_version(sync):
    with pytest.raises(ValueError, match="no engines to sync"):
        asyncio.run(sync.sync([], [], weight_version="step_1"))
    with pytest.raises(ValueError, match="weight_version must be a non-empty string"):
        asyncio.run(sync.sync([UNREACHABLE], [], weight_version=""))
    assert len(sync.history) == 0 and sync.history.last is None
