"""What `slurm submit` checks before it writes or submits a training run (one run, or every run of a
sweep): the three protections of `dapo-megatron train` (launch/local/launcher.py), at submission time, so a
mistake is found before hours in the queue rather than after.

    checks = check_training_submission(plan, resume=False, overwrite=False, command="dapo-megatron slurm submit C")
    # RunDirInUse / ValueError: nothing was written, nothing submitted (the CLI exits 2)
    clear_for_overwrite(checks)     # --overwrite, after every check passed: the runs' own files (RUN_FILES)

1. In use: a job recorded in <dir>/slurm/jobs.json (the run's, the sweep's) that squeue still lists as
   pending or running (role, id and state named; `scancel ID` or another trainer.output_dir), or a held
   <run_dir>/.run.lock (a local `train`, a running job: the holder named). Eval jobs only read the
   checkpoints: they block --overwrite alone. squeue that does not answer refuses the submission: it
   cannot tell whether a recorded job still runs (QueueUnavailable names the jobs and the way out).
2. The run-directory decision (launch/run_dir.py check_run_dir): a directory holding a run is refused
   unless --resume (the job continues it) or --overwrite (its files are cleared at submission);
   --resume of a run already at trainer.total_steps has nothing to do.
3. Every train and eval prompt row (launch/data_check.py check_prompt_data, the driver's own check): a bad
   row names file, row and key. The tokenizer for the length check: the tiny model's fixed byte-level
   tokenizer (built in memory: the tiny model itself is built by the job), or model.path's. A model.path
   that is not a directory on this machine leaves the lengths to the job (said in the line); a data
   file that is not here is an error unless --skip-data-check (a file only the compute nodes see).
The job repeats 1 and 2 under its own lock when it starts (launch/slurm/job_start.py), and the driver 3.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dapo_megatron.config import Config
from dapo_megatron.data.tiny_tokenizer import build_tiny_tokenizer
from dapo_megatron.launch.data_check import check_prompt_data
from dapo_megatron.launch.run_lock import RunDirInUse, holder, refusal
from dapo_megatron.launch.slurm.submit import training_configs
from dapo_megatron.trainer.checkpoint.resume_check import check_resume_layout

# states after which a job runs no more (squeue may still list them for a moment); anything else counts
# as pending or running: PENDING, RUNNING, CONFIGURING, COMPLETING, REQUEUED, SUSPENDED, ...
FINISHED = frozenset(
    {
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)
TRAINING_ROLES = ("train", "engines", "fp8_export", "sweep")  # write the run: block any new training job
READING_ROLES = ("eval", "eval_gather")  # read its checkpoints: block --overwrite only

Squeue = Callable[[list[str]], subprocess.CompletedProcess]


class QueueUnavailable(ValueError):
    """squeue did not answer: whether a recorded job still runs is unknown (refused, not guessed)."""


def _squeue(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def parse_squeue(stdout: str) -> list[tuple[str, str, str]]:
    """`squeue -h -r -o %i|%F|%T` lines -> (job or array task id, array job id, state)."""
    rows = []
    for line in stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[0]:
            rows.append((parts[0], parts[1], parts[2]))
    return rows


def live_jobs(
    records: list[dict], rows: list[tuple[str, str, str]], roles: tuple[str, ...]
) -> list[tuple[str, str, str, str]]:
    """(role, recorded id, squeue id, state) for each recorded job of `roles` that a squeue row shows
    unfinished. A record's id is a job, an array job (any of its tasks counts) or one array task (`A_i`)."""
    found = []
    for rec in records:
        if rec.get("role") not in roles:
            continue
        job = str(rec.get("job_id", ""))
        for task, array, state in rows:
            if (task == job or ("_" not in job and array == job)) and state.upper() not in FINISHED:
                found.append((rec["role"], job, task, state))
    return found


def queue_rows(job_ids: list[str], run: Squeue = _squeue) -> list[tuple[str, str, str]]:
    """squeue's rows for these jobs. squeue answers a single unknown id with an error ("Invalid job id
    specified"): that job is gone. Any other failure raises QueueUnavailable."""
    argv = ["squeue", "-h", "-r", "-j", ",".join(job_ids), "-o", "%i|%F|%T"]
    try:
        result = run(argv)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise QueueUnavailable(f"`{' '.join(argv)}` failed: {err}") from None
    if result.returncode != 0:
        if "Invalid job id" in (result.stderr or ""):
            return []
        raise QueueUnavailable(
            f"`{' '.join(argv)}` exited with {result.returncode}: "
            f"{(result.stderr or result.stdout or '').strip()[:300]}"
        )
    return parse_squeue(result.stdout)


def _recorded(jobs_dir: Path) -> list[dict]:
    import json

    path = jobs_dir / "slurm" / "jobs.json"
    if not path.is_file():
        return []
    try:
        return list(json.loads(path.read_text()).get("jobs", []))
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{path}: not a jobs record ({err}); move it aside if the jobs it named are gone") from None


def check_queue(jobs_dirs: list[Path], *, overwrite: bool, run: Squeue = _squeue) -> None:
    """RunDirInUse naming every recorded job of these directories that is still pending or running."""
    roles = TRAINING_ROLES + (READING_ROLES if overwrite else ())
    for jobs_dir in dict.fromkeys(jobs_dirs):
        records = [r for r in _recorded(jobs_dir) if r.get("role") in roles and r.get("job_id")]
        if not records:
            continue
        ids = list(dict.fromkeys(str(r["job_id"]) for r in records))
        try:
            rows = queue_rows(ids, run)
        except QueueUnavailable as err:
            raise QueueUnavailable(
                f"{err}. {jobs_dir / 'slurm/jobs.json'} records job(s) {', '.join(ids)} of this directory and "
                "whether they still run cannot be checked, so nothing was submitted. Try again when squeue "
                "answers (or, if you know those jobs have ended, move that jobs.json aside)"
            ) from None
        live = live_jobs(records, rows, roles)
        if live:
            what = (
                "reads its checkpoints, which --overwrite would delete"
                if all(role in READING_ROLES for role, *_ in live)
                else "still uses it"
            )
            raise RunDirInUse(
                f"{jobs_dir} is in use: {'; '.join(f'{role} job {task} ({state})' for role, _, task, state in live)}, "
                f"recorded in {jobs_dir / 'slurm/jobs.json'}, {what}. Wait for it to end, cancel it "
                f"(scancel {' '.join(dict.fromkeys(job for _, job, _, _ in live))}), "
                "or write elsewhere: trainer.output_dir=NEW_DIR"
            )


def check_lock(run_dir: Path, *, run: Squeue = _squeue) -> None:
    """RunDirInUse when <run_dir>/.run.lock is held (a local `train`, a running Slurm job)."""
    live, by_flock = holder(run_dir)
    if live is None:
        return
    job = str(live.get("job", ""))
    # no flock on this file system: the record decides, and squeue knows better than a pid on another host
    if job and not by_flock and not live_jobs([{"role": "train", "job_id": job}], queue_rows([job], run), ("train",)):
        return
    raise refusal(run_dir, live)


def check_data(cfg: Config, *, skip: bool, dry_run: bool = False) -> str:
    """Every train/eval row of cfg (ValueError naming file, row and key); returns the line to print.
    dry_run: a data file missing here is a warning (a dry run only looks; a real submit refuses it)."""
    if skip:
        return "data not checked (--skip-data-check): the job checks every row before training starts"
    files = [(f"data.{key}", getattr(cfg.data, key)) for key in ("train_path", "eval_path")]
    for key, path in files + [(f"data.eval_sets.{name}", path) for name, path in cfg.data.eval_sets.items()]:
        if path and not Path(path).is_file() and dry_run:
            return (
                f"warning: data not checked: config key '{key}': {path} is not a file on this machine; "
                "a real submit refuses this unless --skip-data-check (then the job checks every row)"
            )
        if path and not Path(path).is_file():
            raise ValueError(
                f"config key '{key}': {path} is not a file on this machine; if it exists only "
                "where the jobs run, pass --skip-data-check (the job checks every row there)"
            )
    note = ""
    if cfg.tiny.enabled:
        tokenizer = build_tiny_tokenizer()  # the tiny model's own tokenizer; the model is built by the job
    elif not cfg.model.path:
        raise ValueError("config key 'model.path' is empty: name a HF checkpoint directory (or set tiny.enabled=true)")
    elif Path(cfg.model.path).is_dir():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    else:
        tokenizer = None
        note = (
            f"; prompt lengths not checked: model.path {cfg.model.path} is not a directory on this machine "
            "(the job checks them)"
        )
    return check_prompt_data(cfg, tokenizer=tokenizer) + note


@dataclass
class RunCheck:
    label: str  # the config's name (a sweep's run) or "train"
    run_dir: Path
    nothing_to_do: bool = False
    message: str = ""  # the run-directory decision's line ("" = none)
    data_line: str = ""
    to_remove: tuple[str, ...] = ()  # --overwrite: the run's files that will be cleared


def _with_layout_line(cfg, newest: Path | None, message: str, *, where: str) -> str:
    """The resume line as the job will do it, then, for a --resume onto another layout or allocation
    (trainer/checkpoint/resume_check.py), the resharding line; a ValueError for what cannot change. The
    model is compared by the job's ranks, where model.path is (a cluster path is rarely on the
    submitting machine)."""
    message = message.replace(" resuming ", " the job resumes ", 1)
    if newest is None:
        return message
    try:
        line = check_resume_layout(cfg, newest, prefix=f"[slurm submit] {where}".rstrip())
    except ValueError as err:
        raise ValueError(f"{where}{err}") from None
    return f"{message}\n{line}" if line else message


def check_training_submission(
    plan,
    *,
    resume: bool,
    overwrite: bool,
    command: str,
    skip_data_check: bool = False,
    dry_run: bool = False,
    run: Squeue = _squeue,
) -> list[RunCheck]:
    """Every check of a training plan (plan_train / plan_sweep), in the order a user fixes them: in use,
    then the run directory, then the data. Raises (RunDirInUse, QueueUnavailable, ValueError) before
    anything is written; returns one RunCheck per run."""
    from dapo_megatron.launch.run_dir import RUN_FILES, check_run_dir

    if resume and overwrite:
        raise ValueError("--resume continues the run in trainer.output_dir and --overwrite deletes it: choose one")
    runs = training_configs(plan)
    check_queue([plan.run_dir, *(Path(cfg.trainer.output_dir) for _, cfg in runs)], overwrite=overwrite, run=run)
    checks = []
    for label, cfg in runs:
        run_dir = Path(cfg.trainer.output_dir)
        check_lock(run_dir, run=run)
        where = f"{label}: " if len(runs) > 1 else ""
        if overwrite:
            check = RunCheck(
                label,
                run_dir,
                to_remove=tuple(n for n in RUN_FILES if (run_dir / n).exists() or (run_dir / n).is_symlink()),
            )
        else:
            from dapo_megatron.trainer.checkpoint.files import list_checkpoints

            if resume and len(runs) > 1 and not list_checkpoints(run_dir) and not (run_dir / "metrics.jsonl").exists():
                # a sweep's run that never started: it starts from the beginning (the job says so too)
                check = RunCheck(
                    label,
                    run_dir,
                    message=f"[slurm submit] {where}no checkpoint in {run_dir}: this run starts from step 0",
                )
            else:
                try:
                    decision = check_run_dir(
                        run_dir,
                        resume=resume,
                        overwrite=False,
                        total_steps=cfg.trainer.total_steps,
                        command=command,
                        prefix=f"[slurm submit] {where}".rstrip(),
                    )
                except ValueError as err:
                    raise ValueError(f"{where}{err}") from None
                message = decision.message
                if resume and not decision.nothing_to_do:
                    message = _with_layout_line(cfg, decision.checkpoint, message, where=where)
                check = RunCheck(label, run_dir, nothing_to_do=decision.nothing_to_do, message=message)
        if not check.nothing_to_do:
            check.data_line = _data_line(cfg, where, skip=skip_data_check, dry_run=dry_run)
        checks.append(check)
    return checks


def _data_line(cfg: Config, where: str, *, skip: bool, dry_run: bool) -> str:
    """check_data's line for one run of the plan (a sweep's named); its ValueError names the run too."""
    try:
        return f"[slurm submit] {where}{check_data(cfg, skip=skip, dry_run=dry_run)}"
    except ValueError as err:
        raise ValueError(f"{where}{err}") from None


def clear_for_overwrite(checks: list[RunCheck], *, dry_run: bool = False, out: Callable[[str], None] = print) -> None:
    """--overwrite, once every check passed: delete each run's own files (RUN_FILES), as `train --overwrite`."""
    from dapo_megatron.launch.run_dir import clear_run

    for check in checks:
        if not check.to_remove:
            continue
        if dry_run:
            out(f"[slurm submit] --overwrite would remove {', '.join(check.to_remove)} from {check.run_dir}")
        else:
            removed = clear_run(check.run_dir)
            out(f"[slurm submit] --overwrite: removed {', '.join(removed)} from {check.run_dir}")


def report(checks: list[RunCheck], out: Callable[[str], None] = print) -> int | None:
    """Print the decisions; 0 when no run has anything to do (nothing to submit), else None."""
    for check in checks:
        for line in (check.message, check.data_line):
            if line:
                out(line)
    return 0 if checks and all(c.nothing_to_do for c in checks) else None
