"""One run per output directory: `<run_dir>/.run.lock`, held by the launcher for the whole run.

    with RunLock(run_dir, command="dapo-megatron train configs/runs/tiny_cpu.yaml") as lock:
        if lock.stale_note:
            print(lock.stale_note)          # an earlier run died without releasing it
        ...                                 # nothing is written to run_dir before this point

Two `train` commands in one directory used each other's engines, crashed on each other's checkpoint
temp files and mixed their metrics (docs/architecture.md, "Faults"). The lock is an flock(2) on the
file, so the kernel releases it whenever its holder ends, SIGKILL included: a lock is never stuck. The
file also records the holder (pid, host, start time, command) so a refused second run can name it.
A clean release empties the file; a file that still names a holder although nobody holds the flock
is a stale lock: a run that died without releasing it. It is reported and taken over.

Where a file system has no flock (ENOLCK, ENOSYS, EOPNOTSUPP: some Lustre mounts), the recorded holder
decides: a live process of this host (or any process of another host, which cannot be checked from
here) refuses the run; the message names the file to delete if that run is gone.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".run.lock"
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class RunDirInUse(ValueError):
    """Another live run holds the output directory (a user mistake: ValueError)."""


def _describe(holder: dict) -> str:
    started = holder.get("started")
    since = time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else ""
    command = f", `{holder['command']}`" if holder.get("command") else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}{command}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


class RunLock:
    def __init__(self, run_dir: str | Path, *, command: str = "") -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.command = command
        self.stale_note = ""  # set by acquire() when it took over a dead run's lock
        self._created_dir = False  # acquire() made run_dir: release() removes it if nothing else was written
        self._fd: int | None = None

    def _read_holder(self) -> dict:
        try:
            text = os.pread(self._fd, 1 << 16, 0).decode(errors="replace")
        except OSError:
            return {}
        if not text.strip():
            return {}
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:
            return {"pid": "?", "host": "?", "command": f"(unreadable {self.path}: {text[:80]!r})"}
        return holder if isinstance(holder, dict) else {}

    def _refuse(self, holder: dict) -> RunDirInUse:
        return RunDirInUse(
            f"trainer.output_dir {self.run_dir} is in use by another run: {_describe(holder)} holds {self.path}. "
            "Two runs in one directory would use each other's engines and checkpoints: wait for it to end, "
            f"stop it (kill {holder.get('pid', 'PID')} on {holder.get('host', 'its host')}), "
            "or write elsewhere: trainer.output_dir=NEW_DIR")

    def acquire(self) -> "RunLock":
        self._created_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # children never inherit it
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read_holder()
            self._close()
            raise self._refuse(holder) from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                self._close()
                raise
            holder = self._read_holder()  # no flock here: the record decides
            if holder and (holder.get("host") != socket.gethostname() or _alive(int(holder.get("pid", 0) or 0))):
                self._close()
                raise RunDirInUse(f"{self._refuse(holder)} (this file system has no flock: if that run is gone, "
                                  f"delete {self.path})") from None
        previous = self._read_holder()
        if previous:
            self.stale_note = (f"[train] {self.path}: taking over the stale lock of {_describe(previous)}, which "
                               "is no longer running (it ended without releasing the directory)")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "command": self.command}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)
        os.fsync(self._fd)
        return self

    def release(self) -> None:
        """Empty the record (a clean end: the next run sees no stale lock), then drop the flock. The file
        stays: unlinking it would let a run waiting on the old inode and one creating a new file both
        believe they hold the directory."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            # a run refused before writing anything (a plan that does not fit, bad data) leaves no directory
            # it made: removed while the flock is still held, so no other run can be inside it
            if self._created_dir and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
                self.path.unlink()
                self.run_dir.rmdir()
        finally:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
