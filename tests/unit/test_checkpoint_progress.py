"""trainer/checkpoint/progress.py: what a checkpoint's save and load say on the driver. While a part
writes, a line of the bytes below the directory (of the previous checkpoint's size); while it reads, the
bytes this process has read; then one closing line with the step, bytes, files and seconds per part. The
other ranks time the same parts and print nothing. The training run's own lines: test_train_tiny.py."""

from __future__ import annotations

import io
import time

from dapo_megatron.trainer.checkpoint import files as ckpt
from dapo_megatron.trainer.checkpoint.progress import CheckpointTimes, resumed_line, saved_line, size_text, tree_bytes
from dapo_megatron.trainer.progress_line import INTERVAL_ENV

MB = 1 << 20


def _wait_for(out: io.StringIO, text: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while text not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    return text in out.getvalue()


def test_a_save_counts_the_bytes_below_its_directory_of_the_previous_size(tmp_path, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0")  # a line at every look (the default: one per 15 s)
    out, tmp = io.StringIO(), tmp_path / "step_000004.tmp"
    times = CheckpointTimes(speaks=True, out=out)
    label = "[checkpoint] step 4: writing step_000004:"
    with times.writing("actor", tmp, label=label, expected_bytes=10 * MB):
        (tmp / "actor").mkdir(parents=True)
        (tmp / "actor" / "shard_0.distcp").write_bytes(b"\0" * (3 * MB))
        assert _wait_for(out, f"{label} 3/10 MB (")
    assert set(times.seconds) == {"actor"}
    assert tree_bytes(tmp) == (3 * MB, 1)
    silent = io.StringIO()
    other_rank = CheckpointTimes(speaks=False, out=silent)
    with other_rank.writing("actor", tmp, label=label, expected_bytes=None):
        time.sleep(0.3)
    assert silent.getvalue() == "" and set(other_rank.seconds) == {"actor"}


def test_a_load_counts_the_bytes_this_process_reads(tmp_path, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0")
    shard = tmp_path / "shard.distcp"
    shard.write_bytes(b"\1" * (4 * MB))
    out = io.StringIO()
    times = CheckpointTimes(speaks=True, out=out)
    with times.reading("actor", label="[checkpoint] resuming: loading step_000004/actor:"):
        assert len(shard.read_bytes()) == 4 * MB
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            int(line.split(": ")[-1].split()[0]) >= 4 for line in out.getvalue().splitlines()
        ):
            time.sleep(0.05)
    read = [int(line.split(": ")[-1].split()[0]) for line in out.getvalue().splitlines()]
    assert read and max(read) >= 4, out.getvalue()
    assert out.getvalue().splitlines()[-1].startswith("[checkpoint] resuming: loading step_000004/actor: ")
    assert " MB read by rank 0 (" in out.getvalue()


def test_the_closing_lines_name_step_size_files_and_parts(tmp_path):
    final = tmp_path / "checkpoints" / "step_000004"
    (final / "actor").mkdir(parents=True)
    (final / "actor" / "a.distcp").write_bytes(b"\0" * (5 * MB))
    (final / "trainer_state.json").write_text("{}")
    ckpt.write_manifest(final)
    size = ckpt.checkpoint_bytes(final)  # the manifest's entries: itself left out
    assert size == (5 * MB + 2, 2)
    times = CheckpointTimes(speaks=True)
    times.seconds = {"actor": 1.23, "hf": 0.4, "manifest": 0.05}
    line = saved_line(4, final, times, size=size)
    assert line.startswith("[checkpoint] step 4 saved: 5.0 MB in 2 files, ")
    assert line.endswith(f" s (actor 1.2 s, hf 0.4 s, manifest 0.1 s): {final}")
    times.seconds = {"verify": 0.25, "actor": 2.0}
    assert resumed_line(4, final, times, size=size) == (
        f"[checkpoint] resumed step 4 from {final} (5.0 MB in 2 files): verified in 0.2 s, actor loaded in 2.0 s"
    )
    assert [size_text(n) for n in (5 * MB, 3 << 30)] == ["5.0 MB", "3.0 GB"]
    (final / ckpt.MANIFEST_FILE).unlink()  # an older checkpoint: its files counted
    assert ckpt.checkpoint_bytes(final) == (5 * MB + 2, 2)
