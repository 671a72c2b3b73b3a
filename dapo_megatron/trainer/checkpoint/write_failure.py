"""A failed checkpoint write, said plainly: the path, the errno and the free space, and what is safe.

    try:
        write_checkpoint(tmp_dir)
    except Exception as err:
        raise CheckpointWriteError(write_failure_message(tmp_dir, err, previous=latest)) from err

A full disk reached the user as `RuntimeError: Worker failure: [enforce fail at inline_container.cc:672]
. unexpected pos 704 vs 598` (Megatron's checkpoint writer processes lose the OSError on the way back):
neither "No space", ENOSPC nor the path appeared. So the errno is taken from the exception chain when
one carries it, and otherwise found by writing a 1 MiB probe file where the checkpoint was going (the
same file system answers the same way, ENOSPC or EDQUOT or EROFS or EIO); the free space is read from
the file system. The previous checkpoint is untouched by construction (a checkpoint is written under
step_<N>.tmp and renamed only when whole: trainer/checkpoint/files.py).
"""

from __future__ import annotations

import errno as errno_codes
import os
import re
import shutil
from pathlib import Path

PROBE_BYTES = 1 << 20
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")
_TEXT_ERRNO = {
    "No space left on device": errno_codes.ENOSPC,
    "Disk quota exceeded": errno_codes.EDQUOT,
    "Read-only file system": errno_codes.EROFS,
    "File too large": errno_codes.EFBIG,
}


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the message names path, errno, free space and the last good one."""


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def errno_of(err: BaseException) -> int | None:
    """The errno an exception (or anything in its cause/context chain) carries, also as text."""
    seen = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        err = current
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno:
            return err.errno
        text = str(err)
        found = _ERRNO_IN_TEXT.search(text)
        if found:
            return int(found.group(1))
        for phrase, number in _TEXT_ERRNO.items():
            if phrase in text:
                return number
        current = err.__cause__ or err.__context__
    return None


def probe_errno(directory: Path, num_bytes: int = PROBE_BYTES) -> int | None:
    """Write (and fsync, then delete) num_bytes in directory: the errno it fails with, None if it works."""
    directory = _existing(directory)
    probe = directory / f".write_probe.{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * num_bytes)
            f.flush()
            os.fsync(f.fileno())
        return None
    except OSError as err:
        return err.errno
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def write_failure_message(path: str | Path, err: BaseException, *, previous: str | Path | None) -> str:
    path = Path(path)
    number = errno_of(err)
    how = "from the error"
    if number is None:
        number, how = probe_errno(path), f"a {_mib(PROBE_BYTES)} test write there failed with it"
    if number is None:
        said = "no errno (the writer did not give one, and a 1 MiB test write there succeeded)"
    else:
        said = f"[Errno {number}] {os.strerror(number)} ({errno_codes.errorcode.get(number, '?')}; {how})"
    try:
        usage = shutil.disk_usage(_existing(path))
        space = f"{_mib(usage.free)} free of {_mib(usage.total)} on its file system"
    except OSError as usage_err:
        space = f"free space unknown ({usage_err})"
    kept = (
        f"the previous checkpoint {previous} is intact: continue from it with --resume once there is room"
        if previous
        else "no earlier checkpoint exists"
    )
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    return (
        f"checkpoint write to {path} failed: {said}; {space}; {kept} (trainer.output_dir, "
        f"trainer.keep_checkpoints). The writer said: {type(err).__name__}: {first_line}"
    )


def remove_partial(path: str | Path) -> None:
    """Drop the half-written step_<N>.tmp so the space it took is free again (it is never used)."""
    shutil.rmtree(path, ignore_errors=True)
