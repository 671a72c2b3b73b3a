"""The driver's Timeline streams its stamps to timeline.jsonl as they come (trainer/timeline.py): its
memory does not grow with the run (issue 42 item 7: global rank 0 grew 0.17 MiB per step over 400
steps), and what it leaves at close is exactly what write_timeline makes of the same stamps."""

from __future__ import annotations

import gc
import tracemalloc

from dapo_megatron.trainer.timeline import Timeline, read_timeline, write_timeline


def _stamps(step: int) -> list[tuple[str, int, float, float]]:
    t = 1.7e9 + 10.0 * step
    return [("generate", step, t, t + 4.0), ("engine", step, t + 0.5, t + 3.5), ("train", step, t + 4.0, t + 9.0)]


def test_two_thousand_steps_of_stamps_keep_nothing_in_memory(tmp_path):
    timeline = Timeline(tmp_path)
    timeline.extend(_stamps(0))  # the file is opened with the first stamp
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for step in range(1, 2_001):
        timeline.extend(_stamps(step))
        timeline.append(("sync", step, 1.7e9 + 10.0 * step + 9.0, 1.7e9 + 10.0 * step + 9.5))
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    # 8,000 stamps kept as tuples would hold > 1 MB (a 4-tuple of a str, an int and two floats: ~130 B);
    # a few KiB is the file object's buffer and the interpreter's caches
    assert grown < 64 * 1024, grown
    assert timeline.count == 8_003
    assert sum(1 for _ in (tmp_path / "timeline.jsonl").open()) == 8_003


def test_close_writes_what_write_timeline_writes(tmp_path):
    stamps = [*_stamps(0), ("engine", 1, 1.7e9 - 0.25, 1.7e9 + 1.0), *_stamps(1)]  # an engine stamp before the first
    streamed = Timeline(tmp_path / "streamed")
    for stamp in stamps:
        streamed.append(stamp)
    assert streamed.close() == tmp_path / "streamed" / "timeline.jsonl"
    write_timeline(stamps, tmp_path / "listed")
    text = (tmp_path / "streamed" / "timeline.jsonl").read_text()
    assert text == (tmp_path / "listed" / "timeline.jsonl").read_text()
    assert read_timeline(tmp_path / "streamed" / "timeline.jsonl")[3] == ("engine", 1, 0.0, 1.25)
    assert (tmp_path / "streamed" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    streamed.append(("sync", 9, 0.0, 1.0))  # after close (the overlapped producer's last stamp): the file is final
    assert (tmp_path / "streamed" / "timeline.jsonl").read_text() == text


def test_a_run_that_stamped_nothing_writes_no_timeline(tmp_path):
    assert Timeline(tmp_path).close() is None
    assert list(tmp_path.iterdir()) == []
