"""The preflight's command line without a cluster: start-up stays light, the dependency chain of
`slurm submit --preflight`, the node arithmetic, the report's numbers and the clock stand-in's parsing.
(The job itself on three hosts: test_preflight_twin.py.)

    pytest tests/integration/test_preflight_cli.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dapo_megatron.config import load_config
from dapo_megatron.launch.preflight import command as preflight
from dapo_megatron.launch.preflight import mesh as preflight_mesh
from dapo_megatron.launch.preflight import node as preflight_node
from dapo_megatron.launch.preflight.report import Check, link_record, merge, table
from dapo_megatron.launch.slurm import render

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/runs/tiny_cpu.yaml"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, env={**os.environ, **env}
    )


def test_the_command_and_the_node_worker_import_no_torch():
    # the CLI's help and the worker's import check run before torch is imported (a python without torch
    # still reports what it lacks)
    code = (
        "import sys, dapo_megatron.cli, dapo_megatron.launch.preflight.command, dapo_megatron.launch.preflight.node\n"
        "print(sorted(m for m in ('torch', 'megatron', 'transformers') if m in sys.modules))"
    )
    out = _python(code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_outside_an_allocation_it_says_how_to_run_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(
        [sys.executable, "-m", "dapo_megatron.cli", "preflight", str(TINY), f"trainer.output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env=env,
    )
    assert out.returncode == 2
    assert "preflight runs inside a Slurm allocation" in out.stderr and "--preflight" in out.stderr


def test_submit_preflight_goes_first_and_every_job_waits_for_it(tmp_path):
    cfg = tmp_path / "run.yaml"
    slurm = {"nodes": 2, "gpus_per_node": 0, "cpus_per_task": 1, "time": "2:00:00", "partition": "cpu"}
    cfg.write_text(yaml.safe_dump({"base": str(TINY), "actor": {"world_size": 2}, "slurm": slurm}))
    out = subprocess.run(
        [sys.executable, "-m", "dapo_megatron.cli", "slurm", "submit", str(cfg), "--engines", "3", "--preflight"]
        + ["--preflight-mb=16", "--dry-run", "--skip-data-check", f"trainer.output_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("#   sbatch")]
    assert [line.split("--job-name=dapo-")[1].split()[0] for line in lines] == ["preflight", "engines", "train"]
    assert "--dependency" not in lines[0]
    assert "'--dependency=afterok:<preflight job id>'" in lines[1]
    assert "'--dependency=after:<engines job id>,afterok:<preflight job id>'" in lines[2]
    script = out.stdout.split("slurm/preflight.sbatch\n#!/bin/bash", 1)[1].split("# ----", 1)[0]
    # 2 trainer nodes + 3 CPU engine nodes (one each), 15 minutes whatever slurm.time says, the run's partition
    for want in ("#SBATCH --nodes=5", "#SBATCH --time=00:15:00", "#SBATCH --partition=cpu", "BYTES=16777216"):
        assert want in script.splitlines(), script
    assert "ENGINE_NODES=3" in script


@pytest.mark.parametrize(
    ("gpus", "tp", "engines", "nodes"), [(8, 2, 5, 2), (8, 1, 8, 1), (8, 8, 3, 3), (0, 1, 3, 3), (8, 1, 0, 0)]
)
def test_engine_nodes(gpus, tp, engines, nodes):
    cfg = load_config(TINY, [f"slurm.gpus_per_node={gpus}", f"rollout.engine_tp={tp}"])
    assert render.engine_nodes(cfg, engines) == nodes


def test_link_numbers_and_the_report():
    # 8 MiB in 0.2 s: 8388608 * 8 / 0.2 / 1e9 = 0.33554432 Gbit/s; an all-reduce of 4 nodes carries 2*3/4 of it
    record = link_record(
        kind="all_reduce", path="trainer", backend="gloo", nodes=["a", "b", "c", "d"], nbytes=8 << 20, seconds=0.2,
        bus_factor=1.5,
    )  # fmt: skip
    assert record["gbit_per_s"] == 0.3355 and record["bus_gbit_per_s"] == 0.5033
    node_a = {"rank": 0, "host": "a", "role": "trainer", "checks": [Check("gpus", "a", True, "no GPU").as_dict()]}
    node_a["links"] = [record]
    report = merge([node_a], expected={0: ("a", "trainer"), 1: ("b", "engine")}, meta={"job": "7"}, extra=[])
    assert report["summary"] == {"checks": 2, "failed": 1}
    missing = report["checks"][1]
    assert (missing["name"], missing["node"], missing["ok"]) == ("node", "b", False) and missing["fix"]
    text = table(report)
    assert text.splitlines()[-1] == "preflight: 2 checks, 1 failed"
    assert "8 MiB in 200.0 ms = 0.336 Gbit/s (bus 0.503)" in text


def test_the_clock_stand_in_names_hosts(monkeypatch):
    monkeypatch.setattr(preflight_mesh.time, "time", lambda: 1000.0)
    monkeypatch.setenv(preflight_mesh.CLOCK_OFFSET_VAR, "n1=2.5,n2=-1")
    assert [preflight_mesh.wall_clock(h) for h in ("n0", "n1", "n2")] == [1000.0, 1002.5, 999.0]
    monkeypatch.setenv(preflight_mesh.CLOCK_OFFSET_VAR, "2")
    assert preflight_mesh.wall_clock("any") == 1002.0
    monkeypatch.delenv(preflight_mesh.CLOCK_OFFSET_VAR)
    assert preflight_mesh.wall_clock("any") == 1000.0


def _fake_nvidia_smi(tmp_path, monkeypatch, rows: list[str]) -> None:
    """A FAKE nvidia-smi (no GPU here): prints `name, MiB` rows as `--query-gpu=name,memory.total
    --format=csv,noheader,nounits` does; torch sees no CUDA on this machine, so check_gpus reads it."""
    bin_dir = tmp_path / "fake_bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + "".join(f"echo '{row}'\n" for row in rows))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")


def test_gpus_against_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi, no CUDA: a CPU node
    check, _ = preflight_node.check_gpus("n0", expected=0, memory_gb=80)
    assert check.ok and check.detail.startswith("no GPU")
    check, _ = preflight_node.check_gpus("n0", expected=8, memory_gb=80)
    assert not check.ok and "slurm.gpus_per_node=8" in check.detail and "gpus_per_node=0" in check.fix
    # an "80 GB" H100 reports 81559 MiB = 79.65 GiB: within 2% of the plan's 80 GiB
    _fake_nvidia_smi(tmp_path, monkeypatch, ["NVIDIA H100 80GB HBM3, 81559"] * 8)
    check, gpus = preflight_node.check_gpus("n0", expected=8, memory_gb=80)
    assert check.ok and len(gpus) == 8 and "8 x NVIDIA H100 80GB HBM3, 79.6 GiB each" in check.detail
    check, _ = preflight_node.check_gpus("n0", expected=8, memory_gb=141)  # the plan assumed H200s
    assert not check.ok and check.fix.startswith("slurm.gpu_memory_gb=80")


def test_fewer_gpus_than_asked(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, ["NVIDIA A100-SXM4-40GB, 40960"] * 4)
    check, _ = preflight_node.check_gpus("n3", expected=8, memory_gb=40)
    assert not check.ok and check.detail.startswith("4 x NVIDIA A100-SXM4-40GB, 40.0 GiB each")


def test_imports_name_what_is_missing():
    modules = (("json", True, "no-such-dist"), ("no_such_module_x", True, "x"), ("no_such_optional", False, "y"))
    check, found = preflight_node.check_imports("n2", "engine", modules, "slurm.engine_python", "/opt/py")
    assert not check.ok and found["no_such_optional"] is None
    assert "engine python /opt/py: missing no_such_module_x (ModuleNotFoundError" in check.detail
    assert check.fix == "install no_such_module_x into the engine environment (/opt/py, chosen by slurm.engine_python)"
    check, _ = preflight_node.check_imports("n2", "engine", modules[:1] + modules[2:], "", "/opt/py")
    assert check.ok and "no_such_optional: no" in check.detail


def test_a_port_with_a_listener_is_taken():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert preflight_node.port_taken(port) == "Address already in use"
        (check,) = preflight_node.check_ports("n0", [(port, "trainer rendezvous of job 7")])
        assert not check.ok and f"ss -ltnp 'sport = :{port}'" in check.fix
    assert preflight_node.port_taken(port) == ""


def test_each_role_runs_in_its_own_environment():
    cfg = load_config(
        TINY,
        [
            "slurm.nodes=2",
            "slurm.python=/opt/train/bin/python",
            "slurm.engine_python=/opt/engine/bin/python",
            "slurm.engine_setup=['module load cuda/12.8']",
            "slurm.container_image=train.sqsh",
            "slurm.engine_container_image=engine.sqsh",
        ],
    )
    ports = [{"port": 21234, "what": "trainer rendezvous of job 1234", "role": "trainer"}]
    trainer = preflight.step_argv(cfg, "trainer", first=0, count=2, common=["--job=7"], ports=ports)
    assert trainer[:6] == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--relative=0",
        "--kill-on-bad-exit=0",
    ]
    assert trainer[6:10] == [
        "--container-image=train.sqsh",
        "/opt/train/bin/python",
        "-m",
        "dapo_megatron.launch.preflight.node",
    ]
    assert "--check-port=21234:trainer rendezvous of job 1234" in trainer and trainer[-1] == "--job=7"
    engine = preflight.step_argv(cfg, "engine", first=2, count=1, common=["--job=7"], ports=ports)
    # the engines' setup lines run first (bash -c), then their srun step in their container and python
    assert engine[:3] == ["bash", "-c", 'module load cuda/12.8\nexec "$@"']
    step = engine[4:]
    assert step[:6] == [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        "--ntasks-per-node=1",
        "--relative=2",
        "--kill-on-bad-exit=0",
    ]
    assert step[6:8] == ["--container-image=engine.sqsh", "/opt/engine/bin/python"]
    assert "--rank-offset" in step and step[step.index("--rank-offset") + 1] == "2"
    assert not any(arg.startswith("--check-port") for arg in step)  # CPU engines bind port 0
