"""No orphans: every process a run starts ends when the run ends, whichever process dies first.

    with_lifeline(argv)              # argv run so that it gets SIGTERM when its parent (the launcher) dies
    die_with_parent(signal.SIGKILL)  # this process (a rank, a multiprocessing child) ends with its parent
    become_subreaper(); ...; reap_descendants()   # the launcher adopts orphaned grandchildren, ends them

Who starts what in a local run, and what ends each (measured: docs/architecture.md, "Faults"):
  launcher (`dapo-megatron train`) -> CPU engines, torchrun            with_lifeline: SIGTERM when it dies
  torchrun -> ranks (`dapo_megatron.cli train`, RANK set)              die_with_parent: SIGKILL when torchrun dies
  rank -> Megatron's checkpoint helpers: a multiprocessing Manager      (spawn children import dapo_megatron.cli
          (spawn), fork writers, Python's resource_tracker              as __mp_main__, which calls die_with_parent;
                                                                        the tracker ends when its pipe closes)
A rank that dies leaves its children to the launcher, a child subreaper (PR_SET_CHILD_SUBREAPER): they
are re-parented to it instead of to init, and reap_descendants ends them when the ranks are done. Before
this, a SIGKILLed rank 0 left the Manager and the resource tracker running with PPID 1 for good.

PR_SET_PDEATHSIG fires when the *thread* that started the child ends, not the process: engines the
supervisor thread restarts get their SIGTERM when that thread stops, which is when the launcher stops
them anyway. Linux only; elsewhere these calls do nothing (the launcher's clean-up still runs).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Set as AbstractSet

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


# resolved once, at import: a fork child of a threaded rank (die_with_parent runs there) must not dlopen
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _prctl(option: int, value: int) -> bool:
    return _LIBC is not None and _LIBC.prctl(option, value, 0, 0, 0) == 0


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel for `sig` when this process's parent ends; end now if it already has (re-parented
    to init or a subreaper between our start and this call)."""
    parent = os.getppid()
    if _prctl(PR_SET_PDEATHSIG, int(sig)) and (parent == 1 or os.getppid() != parent):
        os.kill(os.getpid(), sig)


# exec'd by with_lifeline: set the parent-death signal, check the parent is still there, then become argv
_SHIM = (
    "import ctypes, os, sys; parent = int(sys.argv[1]); "
    "ctypes.CDLL(None).prctl(1, int(sys.argv[2]), 0, 0, 0); "
    "os.getppid() == parent or os._exit(1); "
    "os.execvp(sys.argv[3], sys.argv[3:])"
)


def with_lifeline(argv: list[str], sig: int = signal.SIGTERM) -> list[str]:
    """argv run through a one-line exec shim that sets its parent-death signal first: the flag survives
    exec, so the real program (taskset, torchrun, an engine) gets `sig` if this process dies, SIGKILL
    included. (subprocess's preexec_fn would do the same without the shim, but is unsafe in a process
    with threads, as the launcher is.)"""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _SHIM, str(os.getpid()), str(int(sig)), *argv]


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init (Linux >= 3.4)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def descendants() -> set[tuple[int, float]]:
    """(pid, start time) of every process below this one now: what reap_descendants must spare when
    the launcher runs inside a process that had children before the run (a test's rank pool)."""
    import psutil

    try:
        return {ident for ident in map(_ident, psutil.Process().children(recursive=True)) if ident}
    except psutil.NoSuchProcess:
        return set()


def _ident(proc) -> tuple[int, float] | None:
    import psutil

    try:
        return proc.pid, proc.create_time()
    except psutil.NoSuchProcess:  # ended meanwhile
        return None


def reap_descendants(grace_s: float = 10.0, *, spare: AbstractSet[tuple[int, float]] = frozenset()) -> list[str]:
    """SIGTERM every descendant still alive but those in `spare` (descendants() before the run),
    SIGKILL those left after grace_s, and reap them (a subreaper owns its adopted zombies). Returns a
    description of each process that had to be ended."""
    import psutil

    try:
        family = [p for p in psutil.Process().children(recursive=True) if _ident(p) not in spare]
    except psutil.NoSuchProcess:
        return []
    ended = []
    for proc in family:
        try:
            ended.append(f"pid {proc.pid} ({' '.join(proc.cmdline())[:120]})")
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    kill_survivors(family, grace_s=grace_s)
    return ended


def kill_survivors(family: list, *, grace_s: float) -> None:
    """Wait up to grace_s for these (signalled) psutil processes to end, SIGKILL the rest, reap them."""
    import psutil

    _, alive = psutil.wait_procs(family, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
