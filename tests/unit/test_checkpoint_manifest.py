"""Checkpoint manifests: sizes + CRC-32 written last, verified on resume, damaged checkpoints set aside.

Single-process cases run here; the 2-rank case (ranks share the hashing and agree on the verdict)
runs on the session's gloo rank pool with a real torch.distributed group.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from dapo_megatron.trainer.checkpoint import files as ckpt


def _fake_checkpoint(run_dir: Path, step: int, *, payload: bytes = b"weights") -> Path:
    """A step_<N>/ with nested files like a real one (actor shards, hf, trainer state) + its manifest."""
    path = ckpt.step_dir(run_dir, step)
    (path / "actor").mkdir(parents=True)
    (path / "hf").mkdir()
    (path / "actor" / "__0_0.distcp").write_bytes(payload * 1000 + bytes([step]))
    (path / "actor" / "__1_0.distcp").write_bytes(b"shard-1" * 10)
    (path / "hf" / "model.safetensors").write_bytes(b"st" * 50)
    ckpt.write_state(path, {"step": step})
    ckpt.write_manifest(path)
    return path


def test_manifest_lists_every_file_with_its_size_and_crc32(tmp_path):
    path = _fake_checkpoint(tmp_path, 3)
    files = json.loads((path / ckpt.MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == ["actor/__0_0.distcp", "actor/__1_0.distcp", "hf/model.safetensors", ckpt.STATE_FILE]
    data = (path / "actor" / "__0_0.distcp").read_bytes()
    assert files["actor/__0_0.distcp"] == {"bytes": 7001, "crc32": f"{zlib.crc32(data):08x}"}
    assert ckpt.verify_checkpoint(path) == []


def test_chunked_crc_equals_one_shot_crc(tmp_path):
    blob = bytes(range(256)) * 4099  # not a multiple of the chunk size
    (tmp_path / "f").write_bytes(blob)
    assert ckpt.file_crc32(tmp_path / "f", chunk_bytes=1000) == f"{zlib.crc32(blob):08x}"


@pytest.mark.parametrize(
    "damage, expect",
    [
        (lambda p: p.write_bytes(b""), "0 bytes, the manifest says 7001"),  # truncated to 0
        (lambda p: p.unlink(), "missing"),
        (lambda p: p.write_bytes(b"X" + p.read_bytes()[1:]), "checksum"),  # same size, flipped byte
    ],
)
def test_damaged_newest_checkpoint_is_named_set_aside_and_the_previous_one_used(tmp_path, damage, expect):
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    shard = newest / "actor" / "__0_0.distcp"
    damage(shard)
    said: list[str] = []
    chosen = ckpt.newest_valid_checkpoint(tmp_path, log=said.append)
    assert chosen == ckpt.step_dir(tmp_path, 2)
    assert str(shard) in said[0] and expect in said[0]
    assert "resuming from step_000002" in said[1]
    # kept for inspection under a name that is never listed (nor pruned by keep_checkpoints) again
    assert newest.with_name("step_000004.corrupt").is_dir() and not newest.exists()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]


def test_resume_without_any_valid_checkpoint_refuses_to_start_from_nothing(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint in"):
        ckpt.newest_valid_checkpoint(tmp_path)
    only = _fake_checkpoint(tmp_path, 1)
    (only / ckpt.STATE_FILE).write_text("{}  ")  # size changes
    with pytest.raises(ValueError, match=r"(?s)every checkpoint failed verification.*step_000001.*trainer_state.json"):
        ckpt.newest_valid_checkpoint(tmp_path, log=lambda _: None)


def test_unreadable_manifest_is_a_problem_and_a_missing_one_is_accepted(tmp_path):
    path = _fake_checkpoint(tmp_path, 1)
    (path / ckpt.MANIFEST_FILE).write_text("{not json")
    assert "unreadable" in ckpt.verify_checkpoint(path)[0]
    (path / ckpt.MANIFEST_FILE).unlink()  # written by a version before manifests: nothing to check against
    assert ckpt.verify_checkpoint(path) == []


def _two_rank_verify(root: str) -> dict:
    import torch.distributed as dist

    run_dir = Path(root)
    path = ckpt.step_dir(run_dir, 5)
    if dist.get_rank() == 0:
        (path / "actor").mkdir(parents=True)
        for i in range(5):
            (path / "actor" / f"__{i}_0.distcp").write_bytes(bytes([i]) * (100 + i))
        ckpt.write_state(path, {"step": 5})
    dist.barrier()
    ckpt.write_manifest(path)  # rank r hashes files r, r+2, ...; rank 0 writes the union
    intact = ckpt.verify_checkpoint(path)
    dist.barrier()
    if dist.get_rank() == 0:  # a file that rank 1 verifies (sorted index 3)
        (path / "actor" / "__3_0.distcp").write_bytes(b"")
    dist.barrier()
    damaged = ckpt.verify_checkpoint(path)
    return {
        "intact": intact,
        "damaged": damaged,
        "entries": sorted(json.loads((path / ckpt.MANIFEST_FILE).read_text())["files"]),
    }


def test_ranks_share_the_hashing_and_agree_on_the_verdict(rank_pool, tmp_path):
    results = rank_pool(2).run(_two_rank_verify, str(tmp_path))
    assert results[0] == results[1]  # every rank returns the same verdict
    assert results[0]["intact"] == []
    assert len(results[0]["entries"]) == 6  # 5 shards + trainer_state.json
    (problem,) = results[0]["damaged"]
    assert "__3_0.distcp: 0 bytes, the manifest says 103" in problem
