"""A failed checkpoint write names the path, the errno and the free space (trainer/checkpoint/write_failure.py),
on real file systems: a 1 MiB tmpfs filled by torch.save (whose own error carries no errno: the probe
finds ENOSPC), and, without root, a file-size limit (RLIMIT_FSIZE: the kernel fails the write with EFBIG)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dapo_megatron.trainer.checkpoint.write_failure import errno_of, write_failure_message


@pytest.fixture
def full_tmpfs(mount_tmpfs):
    return mount_tmpfs("1m", "cannot mount a tmpfs here (not root): test_file_size_limit covers the message")


def test_full_tmpfs_named_with_errno_and_free_space(full_tmpfs):
    previous = full_tmpfs / "checkpoints" / "step_000001"
    target = full_tmpfs / "checkpoints" / "step_000002.tmp"
    target.mkdir(parents=True)
    with pytest.raises(Exception) as raised:
        torch.save({"w": torch.zeros(1 << 20)}, target / "actor.pt")  # 4 MiB into 1 MiB
    assert errno_of(raised.value) is None  # what torch says carries no errno (the user's report)
    message = write_failure_message(target, raised.value, previous=previous)
    assert message.startswith(
        f"checkpoint write to {target} failed: [Errno 28] No space left on device "
        "(ENOSPC; a 1.0 MiB test write there failed with it); "
    )
    assert " MiB free of 1.0 MiB on its file system; " in message
    assert f"the previous checkpoint {previous} is intact: continue from it with --resume" in message
    assert "The writer said: RuntimeError: " in message


_LIMITED = """
import resource, signal, sys
from pathlib import Path
from dapo_megatron.trainer.checkpoint.write_failure import write_failure_message
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
target = Path(sys.argv[1])
try:
    with open(target / "state.bin", "wb") as f:
        f.write(bytes(4 << 20))
except OSError as err:
    print(write_failure_message(target, err, previous=None))
"""


def test_file_size_limit_named_with_errno(tmp_path):
    out = subprocess.run([sys.executable, "-c", _LIMITED, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith(
        f"checkpoint write to {tmp_path} failed: [Errno 27] File too large (EFBIG; from the error); "
    ), out.stderr
    assert "no earlier checkpoint exists" in out.stdout


def test_errno_found_in_a_chain_and_in_text():
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as inner:
            raise RuntimeError("Worker failure") from inner
    except RuntimeError as outer:
        assert errno_of(outer) == 28
    assert errno_of(RuntimeError("write failed: [Errno 122] Disk quota exceeded")) == 122
    assert errno_of(RuntimeError("unexpected pos 704 vs 598")) is None
