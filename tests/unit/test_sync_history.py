"""What a weight sync keeps of its past syncs stays bounded over a run of any length (issue 42 item 7:
a list of every SyncStats grew each step on the driver): the count and totals of all, the last few."""

from __future__ import annotations

from dapo_megatron.transfer.sync_protocol import SyncHistory, SyncStats


def test_history_keeps_totals_of_all_and_only_the_last_few():
    history = SyncHistory(keep=3)
    for i in range(1, 1001):
        history.record(SyncStats(bytes=i, seconds=0.5, weight_version=f"step_{i}"))
    assert len(history) == 1000
    assert history.total_bytes == 1000 * 1001 // 2  # 500500
    assert history.total_seconds == 500.0
    assert [s.weight_version for s in history.recent] == ["step_998", "step_999", "step_1000"]
    assert history.last is not None and history.last.bytes == 1000


def test_an_empty_history_has_no_last_sync():
    history = SyncHistory()
    assert len(history) == 0 and history.last is None and history.total_bytes == 0
