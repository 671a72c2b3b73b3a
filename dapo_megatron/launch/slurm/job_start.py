"""The run-directory guard of a Slurm training job (slurm/_trainer_launch.sh), on the first node before
the model preparation or anything else writes:

    LOCK_FILE=$(python -m dapo_megatron.launch.slurm.job_start lock-file CONFIG)     # <output_dir>/.run.lock
    exec 9<>"$LOCK_FILE"                                                       # the batch shell keeps it open
    START=$(python -m dapo_megatron.launch.slurm.job_start acquire CONFIG --fd 9 --job "$JOB_REF" --restart N
            --holder-pid $$ [--resume-requested])                             # "--resume" or ""
    ...                                                                        # the trainer runs
    python -m dapo_megatron.launch.slurm.job_start release "$LOCK_FILE" --fd 9        # the normal end

`acquire` takes the run lock (launch/run_lock.py) on the shell's descriptor, so the job holds it for
its whole life (an flock belongs to the open file description: it ends with the shell, SIGKILL
included), and decides, under the lock, how the trainer starts (job_start_args). Exit codes: 0 start
(stdout: the trainer's extra arguments), 2 refused: another run holds the directory (nothing written),
3 nothing to do (a `--resume` submission of a run already at trainer.total_steps), 4 refused under
this job's own lock: a first start finds a run there that the submission did not ask to continue
(nothing written; this submission's engine array is no one else's, so the script cancels it). On 3
and 4 the record is already emptied.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dapo_megatron.config import load_config
from dapo_megatron.launch.run_lock import LOCK_FILE, RunDirInUse, RunLock
from dapo_megatron.launch.script_entry import run_as_script


def job_start_args(
    run_dir: str | Path, *, resume_requested: bool, restart: int, total_steps: int, command: str
) -> tuple[list[str], str, bool]:
    """(the trainer's extra arguments, a line for the log or "", nothing to do) for one job start.

    restart > 0 (Slurm requeued this job): continue from the newest complete checkpoint; one requeued
    before its first checkpoint starts from the beginning (its own files only: the same job wrote them).
    A first start of a `--resume` submission continues too (already finished: nothing to do); its
    checkpoint gone meanwhile (a sweep run that never started has none) starts from step 0 in a directory
    holding no run, else it is refused. A first start of any other submission refuses a directory that
    holds a run (written after `slurm submit` looked: a local `train`, a job submitted by hand):
    ValueError with the ways out, before anything is written.
    """
    from dapo_megatron.launch.run_dir import check_run_dir
    from dapo_megatron.trainer.checkpoint.files import list_checkpoints

    found = list_checkpoints(run_dir)
    if restart > 0:
        if found:
            return ["--resume"], f"[job] requeued (restart {restart}): resuming from {found[-1][1].name}", False
        return [], f"[job] requeued (restart {restart}) before a complete checkpoint: starting from step 0", False
    if resume_requested and found:
        decision = check_run_dir(
            run_dir, resume=True, overwrite=False, total_steps=total_steps, command=command, prefix="[job]"
        )
        return ["--resume"], decision.message, decision.nothing_to_do
    try:
        check_run_dir(run_dir, resume=False, overwrite=False, total_steps=total_steps, command=command)
    except ValueError as err:
        raise ValueError(f"{err} (it was written after this job was submitted)") from None
    if resume_requested:
        return [], f"[job] --resume: no checkpoint in {run_dir} (nor a run): starting from step 0", False
    return [], "", False


def _acquire(args) -> int:
    cfg = load_config(args.config)
    run_dir = Path(cfg.trainer.output_dir)
    lock = RunLock(
        run_dir,
        command=f"dapo-megatron train {args.config}",
        fd=args.fd,
        job=args.job,
        restart=args.restart,
        holder_pid=args.holder_pid,
    )
    try:
        lock.acquire()
    except RunDirInUse as err:
        print(f"[job] {args.job}: refused, nothing written: {err}", file=sys.stderr, flush=True)
        return 2
    if lock.stale_note:
        print(lock.stale_note.replace("[train]", "[job]", 1), file=sys.stderr, flush=True)
    try:
        extra, message, nothing_to_do = job_start_args(
            run_dir,
            resume_requested=args.resume_requested,
            restart=args.restart,
            total_steps=cfg.trainer.total_steps,
            command=f"dapo-megatron slurm submit {args.config}",
        )
    except ValueError as err:
        lock.release()
        print(f"[job] {args.job}: refused, nothing written: {err}", file=sys.stderr, flush=True)
        return 4
    if message:
        print(message, file=sys.stderr, flush=True)
    if nothing_to_do:
        lock.release()
        return 3
    print(" ".join(extra))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dapo_megatron.launch.slurm.job_start")
    sub = ap.add_subparsers(dest="what", required=True)
    path = sub.add_parser("lock-file", help="make the run directory; print its lock file")
    path.add_argument("config")
    acquire = sub.add_parser("acquire", help="take the lock on an inherited descriptor; print the start arguments")
    acquire.add_argument("config")
    acquire.add_argument("--fd", type=int, required=True)
    acquire.add_argument("--job", required=True, help="the Slurm job (array tasks: ARRAYJOB_TASK)")
    acquire.add_argument("--restart", type=int, default=0, help="SLURM_RESTART_COUNT")
    acquire.add_argument("--resume-requested", action="store_true", help="submitted with `slurm submit --resume`")
    acquire.add_argument("--holder-pid", type=int, default=0, help="the shell keeping the descriptor open ($$)")
    release = sub.add_parser("release", help="empty the record (the flock ends when the shell closes the descriptor)")
    release.add_argument("lock_file")
    release.add_argument("--fd", type=int, required=True)
    args = ap.parse_args(argv)
    if args.what == "lock-file":
        run_dir = Path(load_config(args.config).trainer.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        print(run_dir / LOCK_FILE)
        return 0
    if args.what == "acquire":
        return _acquire(args)
    RunLock(Path(args.lock_file).parent, fd=args.fd).adopt().release()
    return 0


if __name__ == "__main__":
    run_as_script(main, "[job] error:")  # a config that does not load: named, as `train` would
