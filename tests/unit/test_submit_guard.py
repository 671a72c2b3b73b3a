"""`slurm submit`'s checks before a training submission (launch/slurm/submit_guard.py) and the training job's
start decision under its lock (launch/slurm/job_start.py), on real directories, real flocks and hand-written
squeue output (the real Slurm runs in tests/integration/test_slurm_jobs.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.launch.run_lock import LOCK_FILE, RunDirInUse, RunLock, holder
from dapo_megatron.launch.slurm import submit, submit_guard
from dapo_megatron.launch.slurm.job_start import job_start_args
from dapo_megatron.trainer.checkpoint import files as ckpt

REPO = Path(__file__).resolve().parents[2]
SQUEUE = "4614|4614|PENDING\n4615_0|4615|RUNNING\n4615_1|4615|PENDING\n4616|4616|COMPLETING\n4617|4617|COMPLETED\n"


def _checkpoint(run_dir: Path, step: int) -> None:
    tmp = ckpt.step_dir(run_dir, step).with_name(f"step_{step}.tmp")
    tmp.mkdir(parents=True)
    ckpt.write_state(tmp, {"step": step})
    ckpt.commit(tmp, ckpt.step_dir(run_dir, step), keep=5)


def _answer(stdout: str = "", stderr: str = "", rc: int = 0):
    calls = []

    def run(argv):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, rc, stdout, stderr)

    return run, calls


def test_squeue_rows_match_jobs_array_jobs_and_single_tasks():
    rows = submit_guard.parse_squeue(SQUEUE + "garbage line\n")
    assert len(rows) == 5
    records = [
        {"role": "train", "job_id": "4614"},
        {"role": "engines", "job_id": "4615"},
        {"role": "sweep", "job_id": "4615_1"},
        {"role": "train", "job_id": "4617"},
        {"role": "eval", "job_id": "4616"},
    ]
    assert submit_guard.live_jobs(records, rows, submit_guard.TRAINING_ROLES) == [
        ("train", "4614", "4614", "PENDING"),
        ("engines", "4615", "4615_0", "RUNNING"),
        ("engines", "4615", "4615_1", "PENDING"),
        ("sweep", "4615_1", "4615_1", "PENDING"),
    ]
    # eval jobs count only for --overwrite (they read the checkpoints); COMPLETED is no longer live
    assert submit_guard.live_jobs(records, rows, ("eval",)) == [("eval", "4616", "4616", "COMPLETING")]


def test_squeue_unknown_id_is_gone_other_failures_refuse(tmp_path):
    run, calls = _answer(stderr="slurm_load_jobs error: Invalid job id specified\n", rc=1)
    assert submit_guard.queue_rows(["99"], run) == []
    assert calls == [["squeue", "-h", "-r", "-j", "99", "-o", "%i|%F|%T"]]
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm/jobs.json").write_text(json.dumps({"jobs": [{"role": "train", "job_id": "77"}]}))
    run, _ = _answer(stderr="slurm_load_jobs error: Unable to contact slurm controller\n", rc=1)
    with pytest.raises(submit_guard.QueueUnavailable) as err:
        submit_guard.check_queue([tmp_path], overwrite=False, run=run)
    assert "Unable to contact slurm controller" in str(err.value) and "job(s) 77" in str(err.value)
    assert "nothing was submitted" in str(err.value)

    def missing(argv):
        raise FileNotFoundError("squeue")

    with pytest.raises(submit_guard.QueueUnavailable):
        submit_guard.check_queue([tmp_path], overwrite=False, run=missing)


def test_recorded_live_job_refuses_naming_role_id_state_and_scancel(tmp_path):
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm/jobs.json").write_text(
        json.dumps(
            {
                "jobs": [
                    {"role": "train", "job_id": "4617"},
                    {"role": "engines", "job_id": "4615"},
                    {"role": "eval", "job_id": "4616"},
                ]
            }
        )
    )
    run, _ = _answer(SQUEUE)
    with pytest.raises(RunDirInUse) as err:
        submit_guard.check_queue([tmp_path], overwrite=False, run=run)
    text = str(err.value)
    assert "engines job 4615_0 (RUNNING); engines job 4615_1 (PENDING)" in text and "scancel 4615)" in text
    assert "4617" not in text and "eval" not in text  # finished train job, and an eval that only reads
    (tmp_path / "slurm/jobs.json").write_text(json.dumps({"jobs": [{"role": "eval", "job_id": "4616"}]}))
    submit_guard.check_queue([tmp_path], overwrite=False, run=run)  # an eval of the run is fine ...
    with pytest.raises(RunDirInUse, match=r"eval job 4616 \(COMPLETING\).*which --overwrite would delete"):
        submit_guard.check_queue([tmp_path], overwrite=True, run=run)  # ... unless its checkpoints are deleted


def _config(tmp_path: Path, run_dir: Path, *extra: str):
    return load_config(
        REPO / "configs/runs/tiny_cpu.yaml",
        [
            f"trainer.output_dir={run_dir}",
            "trainer.total_steps=4",
            "rollout.placement=colocated",
            "slurm.gpus_per_node=0",
            *extra,
        ],
    )


def test_submission_refuses_a_directory_holding_a_run_resume_and_overwrite(tmp_path):
    run_dir = tmp_path / "run"
    cfg = _config(tmp_path, run_dir)
    no_queue, calls = _answer()
    fresh = submit_guard.check_training_submission(
        submit.plan_train(cfg), resume=False, overwrite=False, command="dapo-megatron slurm submit C", run=no_queue
    )
    assert fresh[0].message == "" and "prompts checked (prompts within rollout.max_prompt_length" in fresh[0].data_line
    assert calls == [] and not run_dir.exists()  # no jobs.json: squeue not asked; nothing written
    _checkpoint(run_dir, 2)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(ValueError) as err:
        submit_guard.check_training_submission(
            submit.plan_train(cfg), resume=False, overwrite=False, command="dapo-megatron slurm submit C", run=no_queue
        )
    assert "already holds a run (checkpoints up to step 2)" in str(err.value)
    assert "continue it: dapo-megatron slurm submit C ... --resume" in str(err.value)
    assert "start over: dapo-megatron slurm submit C ... --overwrite" in str(err.value)
    (check,) = submit_guard.check_training_submission(
        submit.plan_train(cfg, resume=True), resume=True, overwrite=False, command="x", run=no_queue
    )
    assert check.message == f"[slurm submit] the job resumes {run_dir} from step 2 of 4 (step_000002)"
    assert "RESUME_REQUESTED=1" in submit.plan_train(cfg, resume=True).jobs[-1].script()
    assert "RESUME_REQUESTED=0" in submit.plan_train(cfg).jobs[-1].script()
    finished = _config(tmp_path, run_dir, "trainer.total_steps=2")
    (done,) = submit_guard.check_training_submission(
        submit.plan_train(finished, resume=True), resume=True, overwrite=False, command="x", run=no_queue
    )
    assert done.nothing_to_do and "already at step 2 of 2" in done.message and done.data_line == ""
    assert submit_guard.report([done], out=lambda line: None) == 0
    with pytest.raises(ValueError, match="choose one"):
        submit_guard.check_training_submission(submit.plan_train(cfg), resume=True, overwrite=True, command="x")
    (over,) = submit_guard.check_training_submission(
        submit.plan_train(cfg), resume=False, overwrite=True, command="x", run=no_queue
    )
    assert over.to_remove == ("checkpoints", "metrics.jsonl") and (run_dir / "checkpoints").is_dir()  # not yet
    said = []
    submit_guard.clear_for_overwrite([over], dry_run=True, out=said.append)
    assert (run_dir / "checkpoints").is_dir() and said == [
        f"[slurm submit] --overwrite would remove checkpoints, metrics.jsonl from {run_dir}"
    ]
    submit_guard.clear_for_overwrite([over], out=said.append)
    assert sorted(p.name for p in run_dir.iterdir()) == [] and said[-1].endswith(
        f"removed checkpoints, metrics.jsonl from {run_dir}"
    )


def test_resume_onto_another_allocation_says_the_reshard_and_refuses_another_precision(tmp_path):
    """`slurm submit --resume` with another layout and world size (issue 50): the resume line, then the
    resharding line; a change of what cannot change (actor.precision) refused naming the saved value."""
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 2)
    meta = {"last_step": 1, "layout": {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "vpp": 1, "ep": 1, "etp": 1, "world": 2}}
    meta.update(optimizer_format="fully_reshardable", precision="fp32", distributed_optimizer=False)
    actor = ckpt.step_dir(run_dir, 2) / "actor"
    actor.mkdir()
    (actor / "actor_state.json").write_text(json.dumps(meta))
    no_queue, _ = _answer()
    cfg = _config(tmp_path, run_dir, "actor.tp=2", "actor.world_size=4")  # TP=2 x DP=2 on 4 ranks
    (check,) = submit_guard.check_training_submission(
        submit.plan_train(cfg, resume=True), resume=True, overwrite=False, command="x", run=no_queue
    )
    assert check.message.splitlines() == [
        f"[slurm submit] the job resumes {run_dir} from step 2 of 4 (step_000002)",
        "[slurm submit] resuming step 2 saved at TP=1 PP=1 CP=1 DP=2 under TP=2 PP=1 CP=1 DP=2: resharding "
        "(model and optimizer through megatron's global-shape checkpoint, RNG states re-derived from trainer.seed)",
    ]
    bf16 = _config(tmp_path, run_dir, "actor.precision=bf16")
    with pytest.raises(ValueError, match=r"actor.precision='bf16' but checkpoint .* saved with actor.precision='fp32'"):
        submit_guard.check_training_submission(
            submit.plan_train(bf16, resume=True), resume=True, overwrite=False, command="x", run=no_queue
        )


def test_bad_row_and_missing_file_refuse_before_anything_is_written(tmp_path):
    bad = tmp_path / "train.jsonl"
    good = {
        "data_source": "x",
        "prompt": [{"role": "user", "content": "1+1?"}],
        "reward_model": {"ground_truth": "2", "style": "rule"},
    }
    bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, "reward_model": {"ground_truth": ""}}) + "\n")
    from dapo_megatron.data.tiny_model import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(tmp_path / "tok")  # model.path: only its tokenizer is read here
    files = ["tiny.enabled=false", f"model.path={tmp_path}/tok"]
    cfg = _config(tmp_path, tmp_path / "run", *files, f"data.train_path={bad}")
    with pytest.raises(ValueError) as err:
        submit_guard.check_training_submission(submit.plan_train(cfg), resume=False, overwrite=False, command="x")
    assert str(bad) in str(err.value) and "row 1 (0-based), line 2: column 'reward_model.ground_truth' is empty" in str(
        err.value
    )
    missing = _config(tmp_path, tmp_path / "run", *files, f"data.train_path={tmp_path}/nope.parquet")
    with pytest.raises(
        ValueError, match=r"data.train_path.*nope.parquet is not a file on this machine.*--skip-data-check"
    ):
        submit_guard.check_training_submission(submit.plan_train(missing), resume=False, overwrite=False, command="x")
    (skipped,) = submit_guard.check_training_submission(
        submit.plan_train(missing), resume=False, overwrite=False, command="x", skip_data_check=True
    )
    assert "data not checked (--skip-data-check)" in skipped.data_line
    assert not (tmp_path / "run").exists()


def test_held_lock_refuses_submission_naming_the_job_and_probe_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT)  # as the batch shell's `exec 9<>`
    try:
        shell = os.getppid()  # stands for the batch shell that keeps the descriptor (recorded, not this process)
        lock = RunLock(
            run_dir, command="dapo-megatron train C", fd=fd, job="4620", restart=0, holder_pid=shell
        ).acquire()
        record = (run_dir / LOCK_FILE).read_text()
        assert json.loads(record)["job"] == "4620" and json.loads(record)["pid"] == shell
        live, by_flock = holder(run_dir)
        assert by_flock and live["job"] == "4620" and (run_dir / LOCK_FILE).read_text() == record
        with pytest.raises(RunDirInUse) as err:
            submit_guard.check_lock(run_dir)
        assert f"in use by another run: Slurm job 4620 (restart 0): pid {shell} on host" in str(err.value)
        assert "scancel 4620" in str(err.value)
        # another process (a second job) is refused while the descriptor stays open, even after this
        # process's own duplicate is released: the flock belongs to the shell's open file description
        lock.release()
        assert (run_dir / LOCK_FILE).read_text() == ""
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from dapo_megatron.launch.run_lock import RunLock; RunLock(sys.argv[1]).acquire()",
                str(run_dir),
            ],
            capture_output=True,
            text=True,
        )
        assert other.returncode != 0 and "RunDirInUse" in other.stderr
    finally:
        os.close(fd)
    assert holder(run_dir) == (None, True)


def test_requeued_job_takes_over_its_own_lock_with_an_accurate_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "node7", "job": "4621", "restart": 0}))
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
    try:
        lock = RunLock(run_dir, fd=fd, job="4621", restart=1).acquire()
        assert lock.stale_note == (
            f"[train] {run_dir / LOCK_FILE}: Slurm job 4621 restart 1 takes over the lock of "
            "its previous incarnation (restart 0, pid 999999 on host node7), which Slurm ended"
        )
        lock.release()
    finally:
        os.close(fd)
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "node7", "job": "4600"}))
    with RunLock(run_dir, job="4622") as lock:  # another job's record: a stale crash, said as such
        assert "taking over the stale lock of Slurm job 4600" in lock.stale_note


def test_job_start_decisions(tmp_path):
    run_dir = tmp_path / "run"
    command = "dapo-megatron slurm submit C"
    # fresh directory: first start goes; a requeue before any checkpoint starts over (its own files)
    assert job_start_args(run_dir, resume_requested=False, restart=0, total_steps=4, command=command) == ([], "", False)
    (run_dir).mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert job_start_args(run_dir, resume_requested=False, restart=1, total_steps=4, command=command) == (
        [],
        "[job] requeued (restart 1) before a complete checkpoint: starting from step 0",
        False,
    )
    # a first start finding a run written after the submission: refused, with the ways out
    with pytest.raises(ValueError, match="already holds a run .* written after this job was submitted"):
        job_start_args(run_dir, resume_requested=False, restart=0, total_steps=4, command=command)
    _checkpoint(run_dir, 3)
    assert job_start_args(run_dir, resume_requested=False, restart=2, total_steps=4, command=command) == (
        ["--resume"],
        "[job] requeued (restart 2): resuming from step_000003",
        False,
    )
    assert job_start_args(run_dir, resume_requested=True, restart=0, total_steps=4, command=command) == (
        ["--resume"],
        f"[job] resuming {run_dir} from step 3 of 4 (step_000003)",
        False,
    )
    extra, message, nothing = job_start_args(run_dir, resume_requested=True, restart=0, total_steps=3, command=command)
    assert nothing and "already at step 3 of 3" in message
