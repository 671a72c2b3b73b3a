"""Rendering, planning, gathering and status parsing of the Slurm launcher (no cluster needed).

pytest tests/integration/test_slurm_render.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.launch.experiments import gather
from dapo_megatron.launch.slurm import render, status, submit

REPO = Path(__file__).resolve().parents[2]
HOSTILE = [
    "; rm -rf /",
    "$(touch {d}/PWNED_subst)",
    "`touch {d}/PWNED_tick`",
    "a'b\"c\\d",
    "two\nlines",
    "",
    "-n",
    "*",
    "~",
    "${HOME}",
    "$HOME",
    "it's; echo $(id)",
    "\t tab",
]


def _bash(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True, timeout=30)


def test_quoted_values_come_back_byte_for_byte_and_run_nothing(tmp_path):
    values = [v.replace("{d}", str(tmp_path)) for v in HOSTILE]
    block = render.shell_assignments({**{f"V{i}": v for i, v in enumerate(values)}, "ARR": values})
    printer = "".join(f'printf "%s\\0" "$V{i}"; ' for i in range(len(values))) + 'printf "%s\\0" "${ARR[@]}"'
    out = _bash(block + "\n" + printer)
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().split("\0")[:-1] == values + values
    assert list(tmp_path.iterdir()) == []  # no $(...) or `...` ran


def test_bad_variable_name_is_refused():
    with pytest.raises(ValueError, match="shell variable name"):
        render.shell_assignments({"X; rm": "v"})


def test_train_32b_render_has_the_multinode_launch():
    cfg = load_config(REPO / "configs/runs/qwen2.5-32b_dapo.yaml", ["slurm.partition=h100", "slurm.account=rl"])
    text = render.render_train(cfg, config_file="/runs/x/slurm/config.yaml")
    header = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert header == [
        "#SBATCH --nodes=16",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=96",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=h100",
        "#SBATCH --account=rl",
        "#SBATCH --mem=0",
        "#SBATCH --time=48:00:00",
        "#SBATCH --signal=B:USR1@600",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
    ]
    assert "NNODES=16\n" in text and "NPROC_PER_NODE=8\n" in text  # 16 x 8 = actor.world_size 128
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in text
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in text
    assert 'scontrol requeue "$JOB_REF"' in text
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in text and "NCCL_SOCKET_IFNAME" in text
    assert "#{{" not in text
    assert subprocess.run(["bash", "-n"], input=text.encode(), capture_output=True).returncode == 0


def test_cpu_render_asks_for_no_gpus_and_runs_world_size_ranks(tmp_path):
    cfg = load_config(None, ["slurm.gpus_per_node=0", "actor.world_size=2", "slurm.cpus_per_task=1"])
    text = render.render_train(cfg, config_file=str(tmp_path / "c.yaml"))
    assert "--gpus" not in text
    assert "NPROC_PER_NODE=2\n" in text


def test_world_size_that_does_not_fill_the_nodes_is_a_config_error():
    cfg = load_config(REPO / "configs/runs/qwen2.5-32b_dapo.yaml", ["actor.world_size=64"])
    with pytest.raises(ValueError, match="actor.world_size"):
        render.render_train(cfg, config_file="/x.yaml")


@pytest.mark.parametrize(
    "override, key",
    [
        ("slurm.partition=; rm -rf /", "slurm.partition"),
        ("slurm.account=$(reboot)", "slurm.account"),
        ("slurm.time=1:00 --wrap=x", "slurm.time"),
        ("slurm.mem=`id`", "slurm.mem"),
        ("slurm.constraint=a b", "slurm.constraint"),
    ],
)
def test_header_values_outside_slurm_syntax_are_refused(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(REPO / "configs/runs/qwen2.5-32b_dapo.yaml", [override])


def test_every_template_renders_to_valid_bash(tmp_path):
    cfg = load_config(REPO / "configs/runs/qwen2.5-7b_dapo.yaml", ["slurm.setup=['module load cuda/12.4']"])
    texts = {
        "train": render.render_train(cfg, config_file="/c.yaml", engine_job="77"),
        "sweep": render.render_sweep_array(cfg, configs_dir="/s"),
        "engines": render.render_rollout_array(cfg, register_dir="/r/engines"),
        "eval": render.render_eval_array(cfg, config_file="/c", checkpoints_file="/k", results_dir="/e"),
        "gather": render.render_eval_gather(cfg, results_dir="/e"),
        "bench": render.render_bench_kernels(cfg),
    }
    for name, text in texts.items():
        check = subprocess.run(["bash", "-n"], input=text.encode(), capture_output=True)
        assert check.returncode == 0, f"{name}: {check.stderr.decode()}"
        assert "#{{" not in text and "module load cuda/12.4" in text, name
    # one engine = engine_tp GPUs and that share of the node's CPUs: 96 * 2 / 8 = 24
    assert "#SBATCH --gpus-per-node=2" in texts["engines"] and "#SBATCH --cpus-per-task=24" in texts["engines"]
    assert "ENGINE_JOB=77\n" in texts["train"]
    assert "#SBATCH --gpus-per-node" not in texts["gather"]


def test_sweep_of_the_ablation_ladder(tmp_path):
    plan = submit.plan_sweep(REPO / "configs/ablations", [f"trainer.output_dir={tmp_path}/abl"])
    (job,) = plan.jobs
    assert job.sbatch_args[0] == "--array=0-5%2"  # six rungs, slurm.array_throttle 2
    assert plan.run_dir == tmp_path / "abl"
    stems = [Path(rel).stem for rel in plan.files if rel.startswith("slurm/configs/")]
    assert stems == sorted(p.stem for p in (REPO / "configs/ablations").glob("*.yaml"))
    outputs = [
        load_config_text(text).trainer.output_dir
        for rel, text in plan.files.items()
        if rel.startswith("slurm/configs/")
    ]
    assert outputs == [f"{tmp_path}/abl/{stem}" for stem in stems]
    # without the override each rung keeps its own output_dir; the sweep lives beside them
    plan = submit.plan_sweep(REPO / "configs/ablations")
    assert plan.run_dir == Path("/shared/runs/sweep_ablations")


def load_config_text(text: str):
    import yaml

    from dapo_megatron.config import config_from_dict

    return config_from_dict(yaml.safe_load(text))


def test_sweep_configs_sharing_an_output_dir_are_refused(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text("trainer: {output_dir: /same}\n")
    with pytest.raises(ValueError, match="a.yaml and b.yaml both write to trainer.output_dir /same"):
        submit.plan_sweep(tmp_path)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(REPO / "configs/runs/qwen2.5-32b_dapo.yaml", ["algorithm.clip_ratio_c=null"])
    plan = submit.plan_train(cfg)
    assert load_config_text(plan.files["slurm/config.yaml"]) == cfg


def test_eval_plan_lists_complete_checkpoints_in_step_order(tmp_path):
    for step in (10, 9, 100):
        (tmp_path / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_000011.tmp").mkdir()  # being written
    (tmp_path / "checkpoints" / "step_000011.tmp" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_000012").mkdir()  # no trainer_state.json: incomplete
    plan = submit.plan_eval(load_config(None), tmp_path)
    assert plan.files["slurm/eval_checkpoints.txt"].split() == [
        str(tmp_path / "checkpoints" / f"step_{n:06d}") for n in (9, 10, 100)
    ]
    eval_job, gather_job = plan.jobs
    assert eval_job.sbatch_args[0] == "--array=0-2%2"
    assert gather_job.dependency == ("afterok", "eval")
    assert "--dependency=afterok:41" in submit.sbatch_argv(plan, gather_job, {"eval": "41"})
    with pytest.raises(ValueError, match="no complete checkpoints"):
        submit.plan_eval(load_config(None), tmp_path / "checkpoints" / "step_000012")


def test_gather_writes_one_table_in_step_order(tmp_path):
    (tmp_path / "step_20.json").write_text(json.dumps({"avg@32": 0.5, "pass@32": 0.875, "aime": {"n": 30}}))
    (tmp_path / "step_5.json").write_text(json.dumps({"avg@32": 0.25, "pass@32": 0.5, "note": "a|b"}))
    md, csv_path = gather.gather(tmp_path)
    assert md.read_text() == (
        "| checkpoint | avg@32 | pass@32 | note | aime.n |\n"
        "|---|---|---|---|---|\n"
        "| step_5 | 0.2500 | 0.5000 | a\\|b |  |\n"
        "| step_20 | 0.5000 | 0.8750 |  | 30 |\n"
    )
    assert csv_path.read_text() == (
        "checkpoint,avg@32,pass@32,note,aime.n\nstep_5,0.25,0.5,a|b,\nstep_20,0.5,0.875,,30\n"
    )
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ValueError, match="bad.json: expected a JSON object"):
        gather.gather(tmp_path)


def test_status_falls_back_from_squeue_to_scontrol_to_gone():
    scontrol_line = (
        "JobId=12 ArrayJobId=11 ArrayTaskId=1 JobName=dapo-sweep JobState=COMPLETED Reason=None "
        "Restarts=1 RunTime=00:00:09"
    )
    answers = {"squeue": "", "scontrol": scontrol_line + "\n", "sacct": None}
    rows = status.job_rows("11", lambda argv: answers[argv[0]])
    assert rows == [{"id": "11_1", "state": "COMPLETED", "elapsed": "00:00:09", "restarts": "1", "reason": "None"}]
    rows = status.job_rows("13", lambda argv: {"squeue": "13|RUNNING|0:05|None\n"}[argv[0]])
    assert rows[0]["state"] == "RUNNING" and rows[0]["elapsed"] == "0:05"
    rows = status.job_rows("14", lambda argv: None)  # nothing knows it, sacct unavailable
    assert rows[0]["state"] == "gone"


def test_colocated_engines_split_per_node(monkeypatch):
    from dapo_megatron.launch.slurm import colocated

    cfg = load_config(REPO / "configs/runs/qwen2.5-32b_dapo.yaml", ["model.path=/m"])  # 32 engines, tp 4, 16 nodes
    monkeypatch.setenv("SLURM_NODEID", "3")
    cmds = colocated.engine_commands(cfg, host="10.0.0.3", python="py")
    assert len(cmds) == 2  # 32 engines / 16 nodes; 2 x tp 4 = the node's 8 GPUs
    assert [c[c.index("--base-gpu-id") + 1] for c in cmds] == ["0", "4"]
    assert [c[c.index("--seed") + 1] for c in cmds] == ["48", "49"]  # seed 42 + node 3 * 2 + i
    assert all(
        "--colocate" in c and c[c.index("--register-dir") + 1] == "/shared/runs/qwen2.5-32b_dapo/engines" for c in cmds
    )
    with pytest.raises(ValueError, match="rollout.num_engines"):
        colocated.engines_per_node(load_config(REPO / "configs/runs/qwen2.5-32b_dapo.yaml", ["rollout.num_engines=33"]))
    with pytest.raises(ValueError, match="rollout.num_engines"):  # 4 per node x tp 4 > 8 GPUs
        colocated.engines_per_node(load_config(REPO / "configs/runs/qwen2.5-32b_dapo.yaml", ["rollout.num_engines=64"]))


def test_colocated_removes_only_this_hosts_registrations(tmp_path):
    from dapo_megatron.launch.slurm import colocated

    for host, port in (("10.0.0.1", 1), ("10.0.0.1", 2), ("10.0.0.2", 1)):
        (tmp_path / f"{host}_{port}.json").write_text(json.dumps({"host": host, "port": port}))
    removed = colocated.remove_stale_registrations(tmp_path, "10.0.0.1")
    assert sorted(p.name for p in removed) == ["10.0.0.1_1.json", "10.0.0.1_2.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["10.0.0.2_1.json"]


def test_preemption_request_by_file_or_signal(tmp_path):
    import os
    import signal

    from dapo_megatron.trainer.preemption import PreemptionSignal

    request = tmp_path / "preempt-7"
    stop = PreemptionSignal(request_file=str(request)).install()
    try:
        assert not stop.should_stop()
        request.touch()  # what the batch script's USR1 trap does
        assert stop.should_stop() and stop.reason == f"request file {request}"
        request.unlink()
        os.kill(os.getpid(), signal.SIGUSR1)  # a signal sent to the rank itself
        assert stop.should_stop() and stop.reason == "SIGUSR1"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_progress_compares_the_latest_checkpoint_with_total_steps(tmp_path):
    from dapo_megatron.launch.slurm import progress

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_dump({"trainer": {"output_dir": str(tmp_path / "run"), "total_steps": 3}}))
    assert progress.main([str(cfg)]) == 1  # no checkpoint yet
    for step in (2, 3):
        (tmp_path / "run/checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (tmp_path / "run/checkpoints/step_000002/trainer_state.json").write_text("{}")
    assert progress.main([str(cfg)]) == 1  # step 3 is not complete (no trainer_state.json)
    (tmp_path / "run/checkpoints/step_000003/trainer_state.json").write_text("{}")
    assert progress.main([str(cfg)]) == 0


def yaml_dump(data) -> str:
    import yaml

    return yaml.safe_dump(data)


def test_dry_run_prints_the_sbatch_lines_and_scripts_before_the_config(tmp_path, capsys):
    from dapo_megatron.launch.slurm import cli

    assert (
        cli.main(
            [
                "submit",
                str(REPO / "configs/runs/qwen2.5-7b_dapo.yaml"),
                f"trainer.output_dir={tmp_path}/run",
                "slurm.partition=h100",
                "--engines",
                "2",
                "--dry-run",
                "--skip-data-check",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("# dry run: nothing is written or submitted")
    # what `head` shows first: the two sbatch command lines, in submission order
    assert lines[1] == (
        f"#   sbatch --parsable --array=0-1 --output={tmp_path}/run/slurm/logs/engines-%A_%a.out "
        f"--job-name=dapo-engines {tmp_path}/run/slurm/engines.sbatch"
    )
    assert (
        lines[2].startswith("#   sbatch --parsable --output=") and "'--dependency=after:<engines job id>'" in lines[2]
    )
    order = [
        text.index(marker)
        for marker in (
            f"# ---- {tmp_path}/run/slurm/engines.sbatch",
            f"# ---- {tmp_path}/run/slurm/train.sbatch",
            f"# ---- {tmp_path}/run/slurm/config.yaml",
        )
    ]
    assert order == sorted(order)
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


@pytest.mark.parametrize(
    "overrides, warned",
    [
        ([], "slurm.partition and slurm.account are empty"),
        (["slurm.partition=h100"], "slurm.account is empty"),
        (["slurm.partition=h100", "slurm.account=rl"], None),
    ],
)
def test_submit_warns_when_no_partition_or_account_is_named(tmp_path, capsys, overrides, warned):
    from dapo_megatron.launch.slurm import cli

    assert (
        cli.main(
            [
                "submit",
                str(REPO / "configs/runs/qwen2.5-7b_dapo.yaml"),
                f"trainer.output_dir={tmp_path}/run",
                *overrides,
                "--dry-run",
                "--skip-data-check",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    if warned is None:
        assert "warning:" not in err
    else:
        (line,) = [x for x in err.splitlines() if x.startswith("warning:")]
        assert warned in line and "sbatch uses the cluster's default" in line


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["slurm.setup=['source /shared/venvs/dapo/bin/activate']"], "python"),  # the venv's, after activation
        (["slurm.setup=['module load python']", "slurm.python=/opt/py/bin/python3.12"], "/opt/py/bin/python3.12"),
        ([], sys.executable),  # no setup lines: the submitter's own interpreter (same image, e.g. the test cluster)
    ],
)
def test_jobs_run_the_interpreter_the_setup_lines_provide(overrides, expected, tmp_path):
    import shlex

    cfg = load_config(REPO / "configs/runs/qwen2.5-7b_dapo.yaml", overrides)
    plan = submit.plan_train(cfg, engines=1)
    for job in plan.jobs:
        text = job.script({"engines": "1"})
        assert f"\nPYTHON={shlex.quote(expected)}\n" in text, job.role
        # the setup lines run before the first use of the interpreter
        if cfg.slurm.setup:
            assert text.index(cfg.slurm.setup[0]) < text.index('"$PYTHON"'), job.role
