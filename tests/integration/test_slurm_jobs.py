"""The launcher against a real single-node Slurm on localhost (fixture `slurm_cluster`).

    pytest -m slurm tests/integration/test_slurm_jobs.py

The trainer here is tests/integration/slurm_counter_trainer.py, a STAND-IN for `dapo-megatron train`
(real torchrun + gloo ranks that count steps and checkpoint a counter, with the trainer's own
preemption handler), so the launch path is tested in seconds; the rollout engines are the real
`dapo-megatron serve-rollout`. test_slurm_e2e.py runs the same scripts with the real trainer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dapo_megatron.config import load_config
from dapo_megatron.launch.slurm import submit
from helpers_runs import logs, metrics

# generous waits: a shared 2-core machine under load starts a Python job in tens of seconds
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
STAND_IN = [str(REPO / "tests/integration/slurm_counter_trainer.py")]

# smallest config that validates; 1 CPU per job, no GPUs, ranks per node = actor.world_size
TINY = {
    # the stand-in trainer talks to no engine: a fixed URL keeps train.sbatch from starting colocated ones
    "rollout": {
        "n": 2,
        "max_prompt_length": 16,
        "max_response_length": 16,
        "engine": "cpu",
        "gen_batch_size": 2,
        "engine_urls": ["http://127.0.0.1:9"],
    },
    "algorithm": {"overlong_buffer_length": 4},
    "actor": {"world_size": 1, "micro_batch_tokens": 64, "attention_backend": "torch", "precision": "fp32"},
    "trainer": {"total_steps": 2, "train_batch_size": 2, "mini_batch_size": 2},
    "slurm": {
        "nodes": 1,
        "gpus_per_node": 0,
        "cpus_per_task": 1,
        "time": "10:00",
        "signal_seconds": 60,
        "array_throttle": 1,
    },
}


def write_config(path: Path, output_dir: Path, **sections) -> Path:
    raw = json.loads(json.dumps(TINY))
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    raw["trainer"]["output_dir"] = str(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def cli(slurm, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(slurm.env, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "dapo_megatron.cli", "slurm", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def queue(slurm) -> list[str]:
    return slurm.run(["squeue", "-h", "-o", "%i"]).stdout.split()


def _records(registry: Path) -> list[dict]:
    """The registrations present now (an engine that stops removes its file, possibly mid-listing)."""
    from dapo_megatron.rollout.registry import read_registrations

    return read_registrations(str(registry)) if registry.is_dir() else []


def test_dry_run_prints_and_submits_nothing(slurm_cluster, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run")
    before = queue(slurm_cluster)
    # --skip-plan: the stand-in trainer has no model for the memory plan to read (tests/unit/test_memplan.py
    # covers the plan's own hook in `slurm submit`)
    # --skip-data-check: TINY has no prompts or model to check (test_one_run_per_directory... checks them)
    out = cli(
        slurm_cluster,
        "submit",
        str(cfg),
        "--dry-run",
        "trainer.total_steps=3",
        "--engines",
        "2",
        "--skip-plan",
        "--skip-data-check",
    )
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --requeue" in out.stdout and "serve-rollout" in out.stdout
    assert f"#   sbatch --parsable --array=0-1 --output={tmp_path}/run/slurm/logs/engines-%A_%a.out" in out.stdout
    assert "'--dependency=after:<engines job id>'" in out.stdout
    assert "total_steps: 3" in out.stdout  # the resolved config that would be written
    assert queue(slurm_cluster) == before
    assert not (tmp_path / "run").exists()


def test_submit_prints_real_job_ids_and_status_shows_them(slurm_cluster, tmp_path):
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run")
    out = cli(slurm_cluster, "submit", str(cfg), 'slurm.time="5:00"', "--skip-plan", "--skip-data-check")  # see above
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith("[slurm submit] data not checked (--skip-data-check)")
    (job_id,) = [line.removeprefix("train: ") for line in out.stdout.splitlines() if line.startswith("train: ")]
    assert job_id.isdigit()
    shown = slurm_cluster.run(["scontrol", "-o", "show", "job", job_id]).stdout
    assert "JobName=dapo-train" in shown
    assert f"Command={tmp_path}/run/slurm/train.sbatch" in shown and "TimeLimit=00:05:00" in shown
    jobs = json.loads((tmp_path / "run/slurm/jobs.json").read_text())["jobs"]
    assert [(j["role"], j["job_id"]) for j in jobs] == [("train", job_id)]
    slurm_cluster.run(["scancel", job_id])
    status = cli(slurm_cluster, "status", str(tmp_path / "run"))
    assert status.returncode == 0, status.stderr
    (row,) = [line for line in status.stdout.splitlines() if line.startswith("train ")]
    assert row.split()[1] == job_id


def test_sweep_array_runs_each_config_into_its_own_run_dir(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    write_config(sweep / "0_short.yaml", tmp_path / "runs/short", trainer={"total_steps": 2})
    write_config(sweep / "1_long.yaml", tmp_path / "runs/long", trainer={"total_steps": 3})
    plan = submit.plan_sweep(sweep, entry=STAND_IN)
    ids = submit.submit(plan, env=dict(slurm_cluster.env, COUNTER_STEP_SECONDS="0.1"))
    shown = slurm_cluster.run(["scontrol", "-o", "show", "job", ids["sweep"]]).stdout
    assert "ArrayTaskThrottle=1" in shown  # slurm.array_throttle -> --array=0-1%1
    states = slurm_cluster.wait_done([ids["sweep"]], timeout_s=300)
    assert states == {f"{ids['sweep']}_0": "COMPLETED", f"{ids['sweep']}_1": "COMPLETED"}, logs(plan.run_dir)
    assert [m["step"] for m in metrics(tmp_path / "runs/short")] == [1, 2]
    assert [m["step"] for m in metrics(tmp_path / "runs/long")] == [1, 2, 3]
    assert (tmp_path / "runs/short/DONE").read_text() == "2" and (tmp_path / "runs/long/DONE").read_text() == "3"
    assert plan.run_dir == tmp_path / "runs/sweep_sweep"
    # each run's own jobs.json names its array task: a later `slurm submit` into that directory sees it
    for task, name in enumerate(("short", "long")):
        (record,) = json.loads((tmp_path / "runs" / name / "slurm/jobs.json").read_text())["jobs"]
        assert (record["role"], record["job_id"]) == ("sweep", f"{ids['sweep']}_{task}")
        assert (tmp_path / "runs" / name / ".run.lock").read_text() == ""  # each task held, then released
    status = cli(slurm_cluster, "status", str(plan.run_dir)).stdout
    assert f"sweep        {ids['sweep']}_0" in status and f"sweep        {ids['sweep']}_1" in status
    assert "last metrics of 0_short" in status and "last metrics of 1_long" in status
    assert '"step": 3' in status.split("last metrics of 1_long")[1]


def test_usr1_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    """Slurm's `--signal=B:USR1@T` is `scancel --batch --signal=USR1` at T seconds before the limit:
    the trap writes the request file, the 2 ranks see it at a step boundary, checkpoint and exit, the
    script requeues the job, and the restart (SLURM_RESTART_COUNT=1) runs with --resume from the
    checkpoint to the end."""
    run_dir = tmp_path / "run"
    cfg = load_config(write_config(tmp_path / "c.yaml", run_dir, trainer={"total_steps": 6}, actor={"world_size": 2}))
    job = submit.submit(submit.plan_train(cfg, entry=STAND_IN), env=dict(slurm_cluster.env, COUNTER_STEP_SECONDS="1"))[
        "train"
    ]
    deadline = time.monotonic() + 225
    while len(metrics(run_dir)) < 2:
        assert time.monotonic() < deadline, logs(run_dir)
        time.sleep(0.2)
    slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job])
    assert slurm_cluster.wait_done([job], timeout_s=375) == {job: "COMPLETED"}, logs(run_dir)
    shown = slurm_cluster.run(["scontrol", "-o", "show", "job", job]).stdout
    assert "Restarts=1" in shown
    steps = [(m["step"], m["restart"], m["rank_sum"]) for m in metrics(run_dir)]
    first_run = [s for s, restart, _ in steps if restart == 0]
    k = first_run[-1]
    assert 2 <= k < 6
    # every step exactly once: 1..k before the requeue, k+1..6 after it, both ranks in each (1 + 2 = 3)
    assert steps == [(s, 0, 3) for s in range(1, k + 1)] + [(s, 1, 3) for s in range(k + 1, 7)]
    text = logs(run_dir)
    assert "SIGUSR1" in text and f"preempted by request file {run_dir}/slurm/preempt-{job}" in text
    assert f"checkpoint at step {k}, exiting" in text and f"at checkpoint {k}/6; requeueing {job}" in text
    assert f"resumed from step {k}" in text and f"[job] requeued (restart 1): resuming from step_{k:06d}" in text
    # the requeued incarnation took over its own run lock (not "a stale lock"), and the end emptied it
    assert (
        f"[job] {run_dir / '.run.lock'}: Slurm job {job} restart 1 takes over the lock of its previous "
        "incarnation (restart 0"
        in text
        and "stale lock" not in text
    )
    assert (run_dir / ".run.lock").read_text() == ""
    assert not (run_dir / "slurm" / f"preempt-{job}").exists()  # removed by the script
    status = subprocess.run(
        [sys.executable, "-m", "dapo_megatron.cli", "slurm", "status", str(run_dir)],
        env=slurm_cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"train        {job}" in status.stdout and "COMPLETED" in status.stdout
    assert '"step": 6' in status.stdout  # the last metrics line


def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory with its bytes, but the Slurm logs (each job writes its own)."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and "logs" not in p.relative_to(run_dir).parts
    }


def test_one_run_per_directory_at_submission_and_in_the_job(slurm_cluster, tmp_path, monkeypatch):
    """`slurm submit`'s guards against a real queue, with the stand-in trainer: a second submission while
    the first job runs is refused naming it (nothing recorded); a job started by hand into the directory
    exits at once naming the holder and writes nothing; the finished run is refused without --resume
    (with --resume of a finished run: nothing submitted); a --resume job continues from the checkpoint's
    step; a bad prompt row fails the submission with exit 2, nothing written, nothing queued."""
    from dapo_megatron.data.tiny_model import build_tiny_tokenizer
    from dapo_megatron.launch.slurm import submit_guard

    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])  # the in-process checks ask squeue
    build_tiny_tokenizer().save_pretrained(tmp_path / "tok")  # model.path: `slurm submit` reads its tokenizer
    run_dir = tmp_path / "run"
    data = {"synthetic": {"num_train": 16, "num_eval": 4, "style": "compact"}}  # "27+58=": 6 tokens at most
    path = write_config(
        tmp_path / "c.yaml", run_dir, trainer={"total_steps": 3}, data=data, model={"path": str(tmp_path / "tok")}
    )
    env = dict(slurm_cluster.env, COUNTER_STEP_SECONDS="0.1", COUNTER_HOLD_FILE=str(tmp_path / "release"))
    plan = submit.plan_train(load_config(path), entry=STAND_IN)
    (check,) = submit_guard.check_training_submission(plan, resume=False, overwrite=False, command="c")
    assert check.data_line == (
        "[slurm submit] 16 train and 4 eval prompts checked (prompts within rollout.max_prompt_length=16 tokens)"
    )
    first = submit.submit(plan, env=env)["train"]
    deadline = time.monotonic() + 225
    while len(metrics(run_dir)) < 2:  # steps 1 and 2 done; the stand-in holds before step 3
        assert time.monotonic() < deadline, logs(run_dir)
        time.sleep(0.2)
    held = json.loads((run_dir / ".run.lock").read_text())
    assert held["job"] == first and held["restart"] == 0
    jobs_before = (run_dir / "slurm/jobs.json").read_bytes()

    second = cli(slurm_cluster, "submit", str(path), "--skip-plan")
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"train job {first} (RUNNING), recorded in {run_dir}/slurm/jobs.json" in second.stderr
    assert f"scancel {first}" in second.stderr
    assert (run_dir / "slurm/jobs.json").read_bytes() == jobs_before and queue(slurm_cluster) == [first]

    # by hand, past `slurm submit`: the job takes the lock first, is refused, writes nothing
    before = _files(run_dir)
    by_hand = slurm_cluster.sbatch(
        [f"--output={run_dir}/slurm/logs/by-hand-%j.out", str(run_dir / "slurm/train.sbatch")]
    )
    assert slurm_cluster.wait_done([by_hand], timeout_s=225) == {by_hand: "FAILED"}, logs(run_dir)
    text = (run_dir / f"slurm/logs/by-hand-{by_hand}.out").read_text()
    assert (
        f"[job] {by_hand}: refused, nothing written: trainer.output_dir {run_dir} is in use by another run: "
        f"Slurm job {first} (restart 0): pid {held['pid']}"
        in text
        and f"scancel {first}" in text
    )
    assert _files(run_dir) == before  # the holder's record included

    (tmp_path / "release").touch()
    assert slurm_cluster.wait_done([first], timeout_s=225) == {first: "COMPLETED"}, logs(run_dir)
    assert (run_dir / ".run.lock").read_text() == ""  # released at the normal end
    # the same script started again by hand: its first start finds the finished run and refuses it
    # under its own lock (no --resume was asked), writing nothing
    before = _files(run_dir)
    late = slurm_cluster.sbatch([f"--output={run_dir}/slurm/logs/late-%j.out", str(run_dir / "slurm/train.sbatch")])
    assert slurm_cluster.wait_done([late], timeout_s=225) == {late: "FAILED"}, logs(run_dir)
    text = (run_dir / f"slurm/logs/late-{late}.out").read_text()
    assert (
        f"[job] {late}: refused, nothing written: trainer.output_dir {run_dir} already holds a run "
        "(checkpoints up to step 3)"
        in text
        and "(it was written after this job was submitted)" in text
    )
    assert _files(run_dir) == before
    again = cli(slurm_cluster, "submit", str(path), "--skip-plan")
    assert again.returncode == 2 and "already holds a run (checkpoints up to step 3)" in again.stderr
    assert f"continue it: dapo-megatron slurm submit {path} ... --resume" in again.stderr
    done = cli(slurm_cluster, "submit", str(path), "--skip-plan", "--resume")
    assert done.returncode == 0, done.stderr
    assert "already at step 3 of 3 (trainer.total_steps): nothing to do" in done.stdout
    assert "[slurm submit] nothing to submit" in done.stdout
    assert (run_dir / "slurm/jobs.json").read_bytes() == jobs_before and queue(slurm_cluster) == []

    # --resume with more steps: the job's first start continues from step 3 (no requeue involved)
    longer = load_config(path, ["trainer.total_steps=5"])
    plan = submit.plan_train(longer, entry=STAND_IN, resume=True)
    (check,) = submit_guard.check_training_submission(plan, resume=True, overwrite=False, command="c")
    assert check.message == f"[slurm submit] the job resumes {run_dir} from step 3 of 5 (step_000003)"
    resumed = submit.submit(plan, env=env)["train"]
    assert slurm_cluster.wait_done([resumed], timeout_s=225) == {resumed: "COMPLETED"}, logs(run_dir)
    assert [(m["step"], m["restart"]) for m in metrics(run_dir)] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    assert "resumed from step 3" in (run_dir / f"slurm/logs/train-{resumed}.out").read_text()

    # one bad prompt row: exit 2 naming file, row and key; no directory, no job
    bad = tmp_path / "bad.jsonl"
    row = {
        "data_source": "x",
        "prompt": [{"role": "user", "content": "1+1?"}],
        "reward_model": {"ground_truth": "2", "style": "rule"},
    }
    bad.write_text(json.dumps(row) + "\n" + json.dumps({**row, "prompt": []}) + "\n")
    refused = cli(
        slurm_cluster,
        "submit",
        str(path),
        f"trainer.output_dir={tmp_path}/bad_run",
        f"data.train_path={bad}",
        "--skip-plan",
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"data.train_path: {bad}: 1 of 2 rows" in refused.stderr and "row 1 (0-based), line 2" in refused.stderr
    assert not (tmp_path / "bad_run").exists() and queue(slurm_cluster) == []


def test_malicious_values_are_rendered_inert(slurm_cluster, tmp_path):
    """Shell syntax in every free-text value that reaches a script: the run works in the literal
    directory and nothing of it executes."""
    evil = f"run; touch {tmp_path}/PWNED1 && $(touch {tmp_path}/PWNED2) `touch {tmp_path}/PWNED3` 'q\" $HOME %j"
    run_dir = tmp_path / evil
    cfg = load_config(
        write_config(tmp_path / "c.yaml", run_dir),
        [f"model.path=$(touch {tmp_path}/PWNED4); touch {tmp_path}/PWNED5", "rollout.engine_urls=[]"],
    )
    ids = submit.submit(
        submit.plan_train(cfg, engines=1, entry=STAND_IN), env=dict(slurm_cluster.env, COUNTER_STEP_SECONDS="0.1")
    )
    # the engine's model path does not exist: serve-rollout refuses it by name (and runs nothing)
    slurm_cluster.wait_done([ids["engines"]], timeout_s=225)
    slurm_cluster.run(["scancel", ids["train"]])
    slurm_cluster.wait_done([ids["train"]], timeout_s=150)
    engine_log = logs(run_dir)
    assert f"--model: no such directory '$(touch {tmp_path}/PWNED4); touch {tmp_path}/PWNED5'" in engine_log
    # the same directory name with a plain trainer run: it completes inside the literal directory
    cfg = load_config(write_config(tmp_path / "c2.yaml", run_dir))
    job = submit.submit(
        submit.plan_train(cfg, entry=STAND_IN), env=dict(slurm_cluster.env, COUNTER_STEP_SECONDS="0.1")
    )["train"]
    assert slurm_cluster.wait_done([job], timeout_s=225) == {job: "COMPLETED"}, logs(run_dir)
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    # a `touch` that ran would have made tmp_path/PWNEDi; the only entries are ours (the run directory's
    # first component is the literal "run; touch ")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.yaml", "c2.yaml", evil.split("/")[0]])
    assert not any((tmp_path / f"PWNED{i}").exists() for i in range(1, 6))


def test_engine_array_and_trainer_rendezvous_through_the_registry(slurm_cluster, tmp_path):
    """Two real serve-rollout engines as an array job register in <run_dir>/engines/; the trainer job
    (after:engines) finds both there, generates on each, finishes, and cancels the engine array.
    A requeued engine task registers again with a newer started_at."""
    sys.path.insert(0, str(REPO / "tests/integration"))
    from rollout_helpers import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "model")
    run_dir = tmp_path / "run"
    cfg = load_config(
        write_config(tmp_path / "c.yaml", run_dir, trainer={"total_steps": 3}),
        [f"model.path={model}", "rollout.engine_urls=[]"],
    )
    # the trainer holds its last step until the replaced engine is back (the test creates `release`)
    env = dict(
        slurm_cluster.env, COUNTER_STEP_SECONDS="0.5", HF_HUB_OFFLINE="1", COUNTER_HOLD_FILE=str(tmp_path / "release")
    )
    plan = submit.plan_train(cfg, engines=2, entry=STAND_IN)
    ids = submit.submit(plan, env=env)
    registry = run_dir / "engines"
    deadline = time.monotonic() + 300
    while len(list(registry.glob("*.json"))) < 2:
        assert time.monotonic() < deadline, logs(run_dir)
        time.sleep(0.3)
    first = {json.loads(p.read_text())["url"]: json.loads(p.read_text()) for p in registry.glob("*.json")}
    deadline = time.monotonic() + 300
    while not metrics(run_dir):  # the trainer has generated on both engines and finished step 1
        assert time.monotonic() < deadline, logs(run_dir)
        time.sleep(0.3)
    # replace engine task 1 while the trainer runs: Slurm requeues it, it serves and registers again
    # (the stopped incarnation removed its own file on SIGTERM: the registry lists live engines)
    slurm_cluster.run(["scontrol", "requeue", f"{ids['engines']}_1"])
    deadline = time.monotonic() + 300
    while not (fresh := [r for r in _records(registry) if r["url"] not in first]):
        assert time.monotonic() < deadline, logs(run_dir)
        time.sleep(0.3)
    (tmp_path / "release").touch()
    assert slurm_cluster.wait_done([ids["train"]], timeout_s=300) == {ids["train"]: "COMPLETED"}, logs(run_dir)
    assert [(m["step"], m["engines"]) for m in metrics(run_dir)] == [(1, 2), (2, 2), (3, 2)]
    text = logs(run_dir)
    assert text.count("generated [") == 2 and all(f"engine {url} generated" in text for url in first)
    (newest,) = fresh
    assert newest["started_at"] > max(r["started_at"] for r in first.values())
    # the trainer cancelled its engines when it finished; scancel's SIGTERM made the requeued engine
    # remove its registration on the way out
    engine_states = slurm_cluster.wait_done([ids["engines"]], timeout_s=150)
    assert set(engine_states.values()) == {"CANCELLED"}, engine_states
    deadline = time.monotonic() + 30
    while newest["url"] in {r["url"] for r in _records(registry)} and time.monotonic() < deadline:
        time.sleep(0.3)
    assert newest["url"] not in {r["url"] for r in _records(registry)}, logs(run_dir)
    assert f"training ended: cancelling the rollout engines (job {ids['engines']})" in text


def test_cluster_stop_leaves_nothing_running(tmp_path):
    """A second cluster: a running job's processes and all three daemons are gone after stop()."""
    from slurm_cluster import LocalSlurm, missing_binaries

    if missing_binaries():
        pytest.skip(f"Slurm binaries not installed: {missing_binaries()}")
    cluster = LocalSlurm(tmp_path / "c2").start()
    try:
        job = cluster.sbatch(["-c", "1", "--wrap", "sleep 300"])
        cluster.wait_state(job, "RUNNING")
        assert cluster.job_processes()  # slurmstepd and the sleep carry this cluster's SLURM_CONF
        daemons = dict(cluster.started)
    finally:
        cluster.stop()
    assert cluster.still_running() == {}
    for pid in daemons.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_eval_array_then_afterok_gather_builds_one_table(slurm_cluster, tmp_path):
    """One array task per checkpoint (eval STAND-IN: avg@4 = step/100), then the dependent gather job."""
    run_dir = tmp_path / "run"
    for step in (20, 5, 10):
        ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    cfg = load_config(write_config(tmp_path / "c.yaml", run_dir))
    plan = submit.plan_eval(cfg, run_dir, entry=[str(REPO / "tests/integration/slurm_eval_stand_in.py")])
    ids = submit.submit(plan, env=slurm_cluster.env)
    shown = slurm_cluster.run(["scontrol", "-o", "show", "job", ids["eval_gather"]]).stdout
    assert f"Dependency=afterok:{ids['eval']}" in shown
    assert slurm_cluster.wait_done([ids["eval_gather"]], timeout_s=300) == {ids["eval_gather"]: "COMPLETED"}, logs(
        run_dir
    )
    assert set(slurm_cluster.job_states([ids["eval"]]).values()) == {"COMPLETED"}
    assert (run_dir / "eval/results.md").read_text() == (
        "| checkpoint | step | avg@4 | pass@4 |\n"
        "|---|---|---|---|\n"
        "| step_000005 | 5 | 0.0500 | 0.1000 |\n"
        "| step_000010 | 10 | 0.1000 | 0.2000 |\n"
        "| step_000020 | 20 | 0.2000 | 0.4000 |\n"
    )
    assert (run_dir / "eval/results.csv").read_text().splitlines()[1] == "step_000005,5,0.05,0.1"
