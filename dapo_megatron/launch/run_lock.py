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

A Slurm training job holds the lock for its whole life the same way (slurm/_trainer_launch.sh): the batch
shell opens the file on a descriptor (`exec 9<>FILE`) and `python -m dapo_megatron.launch.slurm.job_start acquire`
takes the flock on that inherited descriptor (`RunLock(..., fd=9)`): an flock belongs to the open file
description, which the shell keeps until the job ends. The record then also names the job (`job`), so a
requeued job, whose previous incarnation is necessarily dead, says it takes over its own lock rather than
a stale crash's. `holder(run_dir)` answers "who holds it?" for `slurm submit` without taking it over.

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
    since = (
        time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else ""
    )
    command = f", `{holder['command']}`" if holder.get("command") else ""
    job = f"Slurm job {holder['job']} (restart {holder.get('restart', 0)}): " if holder.get("job") else ""
    return f"{job}pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}{command}"


def _way_to_stop(holder: dict) -> str:
    if holder.get("job"):
        return f"scancel {holder['job']}"
    return f"kill {holder.get('pid', 'PID')} on {holder.get('host', 'its host')}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _read_record(fd: int, path: Path) -> dict:
    try:
        text = os.pread(fd, 1 << 16, 0).decode(errors="replace")
    except OSError:
        return {}
    if not text.strip():
        return {}
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {"pid": "?", "host": "?", "command": f"(unreadable {path}: {text[:80]!r})"}
    return holder if isinstance(holder, dict) else {}


# acquire() retries a held flock this long before refusing: `slurm submit` probing the lock (holder())
# holds it for microseconds, a run for hours; a job that waited in the queue must not lose to a probe
CONTENDED_RETRY_S = 2.0


class RunLock:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        command: str = "",
        fd: int | None = None,
        job: str = "",
        restart: int = 0,
        holder_pid: int = 0,
    ) -> None:
        """fd: an inherited descriptor already open on <run_dir>/.run.lock (the Slurm batch shell's);
        job / restart: the Slurm job holding it (SLURM_JOB_ID or ARRAY_TASK form, SLURM_RESTART_COUNT);
        holder_pid: the process that keeps fd open (the shell), recorded instead of this one's."""
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.command = command
        self.job = job
        self.restart = restart
        self.stale_note = ""  # set by acquire() when it took over a dead run's lock
        self._created_dir = False  # acquire() made run_dir: release() removes it if nothing else was written
        self._fd: int | None = None
        self._inherited = fd
        self.holder_pid = holder_pid or os.getpid()

    @property
    def _open_fd(self) -> int:
        assert self._fd is not None, f"{self.path}: the lock file is not open"
        return self._fd

    def _read_holder(self) -> dict:
        return _read_record(self._open_fd, self.path)

    def _refuse(self, holder: dict) -> RunDirInUse:
        return refusal(self.run_dir, holder)

    def _own_previous_incarnation(self, holder: dict) -> bool:
        """The record names this same Slurm job: Slurm runs one incarnation of a job at a time, so the one
        recorded (a requeue's predecessor) is dead, whatever the file system says about its flock."""
        return bool(self.job) and str(holder.get("job", "")) == self.job

    def _flock(self) -> None:
        deadline = time.monotonic() + CONTENDED_RETRY_S
        while True:
            try:
                fcntl.flock(self._open_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def acquire(self) -> RunLock:
        if self._inherited is not None:  # the batch shell's descriptor: it made the directory and the file
            self._fd = os.dup(self._inherited)
            os.set_inheritable(self._fd, False)
        else:
            self._created_dir = not self.run_dir.exists()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # children never inherit it
        try:
            self._flock()
        except BlockingIOError:
            holder = self._read_holder()
            self._close()
            raise self._refuse(holder) from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                self._close()
                raise
            holder = self._read_holder()  # no flock here: the record decides
            if (
                holder
                and not self._own_previous_incarnation(holder)
                and (holder.get("host") != socket.gethostname() or _alive(int(holder.get("pid", 0) or 0)))
            ):
                self._close()
                raise RunDirInUse(
                    f"{self._refuse(holder)} (this file system has no flock: if that run is gone, delete {self.path})"
                ) from None
        previous = self._read_holder()
        if previous and self._own_previous_incarnation(previous):
            self.stale_note = (
                f"[train] {self.path}: Slurm job {self.job} restart {self.restart} takes over the "
                f"lock of its previous incarnation (restart {previous.get('restart', '?')}, pid "
                f"{previous.get('pid', '?')} on host {previous.get('host', '?')}), which Slurm ended"
            )
        elif previous:
            self.stale_note = (
                f"[train] {self.path}: taking over the stale lock of {_describe(previous)}, which "
                "is no longer running (it ended without releasing the directory)"
            )
        record = {"pid": self.holder_pid, "host": socket.gethostname(), "started": time.time(), "command": self.command}
        if self.job:
            record.update(job=self.job, restart=self.restart)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)
        os.fsync(self._fd)
        return self

    def release(self) -> None:
        """Empty the record (a clean end: the next run sees no stale lock), then drop the flock. The file
        stays: unlinking it would let a run waiting on the old inode and one creating a new file both
        believe they hold the directory. With an inherited descriptor the flock is dropped when its
        owner (the batch shell) closes it."""
        if self._fd is None:
            return
        if self._inherited is not None:
            try:
                os.ftruncate(self._fd, 0)
            finally:
                self._close()
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

    def adopt(self) -> RunLock:
        """The inherited descriptor, already locked by an earlier acquire() on it (the job's release entry)."""
        if self._inherited is None:
            raise ValueError(f"{self.path}: adopt() needs the inherited descriptor (RunLock(..., fd=N))")
        self._fd = os.dup(self._inherited)
        return self

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def refusal(run_dir: Path, holder: dict) -> RunDirInUse:
    path = Path(run_dir) / LOCK_FILE
    return RunDirInUse(
        f"trainer.output_dir {run_dir} is in use by another run: {_describe(holder)} holds {path}. "
        "Two runs in one directory would use each other's engines and checkpoints: wait for it to end, "
        f"stop it ({_way_to_stop(holder)}), or write elsewhere: trainer.output_dir=NEW_DIR"
    )


def holder(run_dir: str | Path) -> tuple[dict | None, bool]:
    """(the live holder's record or None, whether flock decided): who holds <run_dir>/.run.lock now, asked
    without taking it over or writing anything (`slurm submit`). The flock is tried for an instant (a job
    starting at that moment retries: CONTENDED_RETRY_S). Without flock the record decides as in
    acquire(): a live local pid, or any other host's, counts as held; the caller may know better (a
    recorded Slurm job that squeue no longer lists)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, True
    try:
        record = _read_record(fd, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return record or {"pid": "?", "host": "?"}, True
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                raise
            live = record and (record.get("host") != socket.gethostname() or _alive(int(record.get("pid", 0) or 0)))
            return (record if live else None), False
        return None, True
    finally:
        os.close(fd)  # drops the instant's shared flock
