"""Per-role environments and pyxis containers in the rendered sbatch files (no cluster needed), and the
addresses and ports the rendered scripts choose. pyxis cannot be installed here (it is a SPANK plugin
of a site's slurmd, with enroot): its options are checked as rendered text only.

    pytest tests/integration/test_slurm_render_roles.py
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.launch.slurm import submit

REPO = Path(__file__).resolve().parents[2]
SEVEN_B = REPO / "configs/runs/qwen2.5-7b_dapo.yaml"


def _scripts(tmp_path, *overrides: str) -> dict[str, str]:
    cfg = load_config(SEVEN_B, [f"trainer.output_dir={tmp_path}/run", *overrides])
    plan = submit.plan_train(cfg, engines=2)
    return {job.role: job.script({"engines": "77"}) for job in plan.jobs}


def test_engines_get_their_own_interpreter_and_setup_lines(tmp_path):
    scripts = _scripts(
        tmp_path,
        "slurm.setup=['source /venvs/train/bin/activate']",
        "slurm.python=/venvs/train/bin/python",
        "slurm.engine_python=/venvs/sglang/bin/python",
        "slurm.engine_setup=['module load cuda/12.8', 'source /venvs/sglang/bin/activate']",
    )
    train, engines = scripts["train"], scripts["engines"]
    assert "PYTHON=/venvs/train/bin/python\n" in train and "source /venvs/train/bin/activate\n" in train
    assert "/venvs/sglang" not in train and "module load cuda/12.8" not in train
    assert "PYTHON=/venvs/sglang/bin/python\n" in engines
    assert "module load cuda/12.8\nsource /venvs/sglang/bin/activate\n" in engines
    assert "/venvs/train" not in engines
    # engine_setup alone: `python` as those lines leave it on PATH, not the trainer's interpreter
    alone = _scripts(tmp_path, "slurm.python=/venvs/train/bin/python", "slurm.engine_setup=['source /e/bin/activate']")
    assert "PYTHON=python\n" in alone["engines"] and "PYTHON=/venvs/train/bin/python\n" in alone["train"]
    # neither set: the engines run what the trainer runs (one environment, as before)
    same = _scripts(tmp_path, "slurm.python=/venvs/one/bin/python")
    assert "PYTHON=/venvs/one/bin/python\n" in same["engines"] and "PYTHON=/venvs/one/bin/python\n" in same["train"]


def test_pyxis_options_reach_every_srun_line_per_role(tmp_path):
    scripts = _scripts(
        tmp_path,
        "slurm.container_image=nvcr.io#nvidia/pytorch:25.09-py3",
        "slurm.container_mounts=/lustre:/lustre,/home/u/.cache:/root/.cache",
        "slurm.engine_container_image=lmsysorg/sglang:v0.5.21",
        "slurm.engine_container_mounts=/lustre:/lustre:ro",
    )
    train, engines = scripts["train"], scripts["engines"]
    assert (
        "CONTAINER_ARGS=('--container-image=nvcr.io#nvidia/pytorch:25.09-py3' "  # quoted: '#' starts a comment
        "--container-mounts=/lustre:/lustre,/home/u/.cache:/root/.cache)"
    ) in train
    srun_lines = [line.strip() for line in train.splitlines() if line.lstrip().startswith("srun ")]
    # every srun that runs the project's code runs it in the container; the requeued job's empty steps
    # (a fresh step id for the trainer: _trainer_launch.sh) run `true` on the node, no image to start
    empty_step = "srun --overlap --nodes=1 --ntasks=1 true 9>&- || true"
    assert srun_lines.count(empty_step) == 1 and len(srun_lines) == 3
    assert all('"${CONTAINER_ARGS[@]}"' in line for line in srun_lines if line != empty_step)
    assert (
        "ENGINE_SRUN=(srun --ntasks=1 --container-image=lmsysorg/sglang:v0.5.21 --container-mounts=/lustre:/lustre:ro)"
    ) in engines
    assert engines.count('exec "${ENGINE_SRUN[@]}" "$PYTHON" -m ') == 2  # SGLang and the CPU engine
    # no container: the arrays are empty and the lines run as before
    plain = _scripts(tmp_path)
    assert "CONTAINER_ARGS=()\n" in plain["train"] and "ENGINE_SRUN=()\n" in plain["engines"]
    # the engines inherit the trainer's image when they have none of their own
    inherit = _scripts(tmp_path, "slurm.container_image=img:1")
    assert "ENGINE_SRUN=(srun --ntasks=1 --container-image=img:1)\n" in inherit["engines"]
    for text in (train, engines, plain["train"], plain["engines"]):
        assert subprocess.run(["bash", "-n"], input=text.encode(), capture_output=True).returncode == 0


def test_dry_run_shows_the_container_lines(tmp_path, capsys):
    from dapo_megatron.launch.slurm import cli

    assert (
        cli.main(
            [
                "submit",
                str(SEVEN_B),
                f"trainer.output_dir={tmp_path}/run",
                "slurm.partition=h100",
                "slurm.container_image=img:1",
                "slurm.engine_python=/e/bin/python",
                "--engines",
                "1",
                "--dry-run",
                "--skip-data-check",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "CONTAINER_ARGS=(--container-image=img:1)" in out
        and "ENGINE_SRUN=(srun --ntasks=1 --container-image=img:1)" in out
    )
    assert "PYTHON=/e/bin/python" in out


@pytest.mark.parametrize(
    "key, value",
    [
        ("container_mounts", "/a:/a"),
        ("engine_python", "/x/python\nrm -rf /"),
        ("engine_setup", ["a\nb"]),
        ("engine_container_image", "img:1 "),
    ],
)
def test_bad_role_settings_are_refused_naming_the_key(key, value):
    from dapo_megatron.config import validate

    cfg = load_config(SEVEN_B)
    setattr(cfg.slurm, key, value)
    with pytest.raises(ValueError, match=rf"slurm\.{key}"):
        validate(cfg)


def _run_engine_port_lines(script: str, job_id: int, port_range: str) -> int:
    """The rendered engine script's port arithmetic, on a given ip_local_port_range."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if "read -r EPHEMERAL_LO" in line)
    block = "\n".join(lines[start : start + 3]).replace("/proc/sys/net/ipv4/ip_local_port_range", "/dev/stdin")
    out = subprocess.run(
        ["bash", "-c", f"SLURM_JOB_ID={job_id}\n{block}\necho $ENGINE_PORT"],
        input=port_range,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(out.stdout)


def test_sglang_engine_port_is_below_the_ephemeral_range_and_registers_the_node_address(tmp_path):
    engines = _scripts(tmp_path, "rollout.engine=sglang")["engines"]
    # Linux's default range 32768-60999: 22768..32767 (10000 ports under it); on 3eb0efe 30000 + id % 10000
    assert _run_engine_port_lines(engines, 4321, "32768\t60999\n") == 22768 + 4321
    assert _run_engine_port_lines(engines, 19999, "32768\t60999\n") == 22768 + 9999 == 32767
    # a range that starts low leaves fewer ports, still all below it and above the privileged ones
    assert _run_engine_port_lines(engines, 5000, "5000\t65000\n") == 1024 + 5000 % 3976
    assert '--advertise-host "$ENGINE_HOST"' in engines  # Slurm's NodeAddr, not the host's own name


def test_trainer_leaves_the_socket_interfaces_to_the_ranks(tmp_path):
    train = _scripts(tmp_path)["train"]
    # on 3eb0efe: export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}" (first non-excluded interface)
    assert "export NCCL_SOCKET_IFNAME" not in train and "export GLOO_SOCKET_IFNAME" not in train


def test_advertised_host_prefers_the_given_address():
    from dapo_megatron.rollout.sglang_launcher import advertised_host

    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("10.9.9.9") == "10.9.9.9"


def test_colocated_sglang_engines_advertise_the_node_address(monkeypatch):
    """As the array's: Slurm's NodeAddr (engine_commands' host), not the node's own name (3eb0efe
    registered socket.getfqdn(), which Debian-style nodes map to 127.0.1.1 for themselves)."""
    from dapo_megatron.launch.slurm import colocated

    cfg = load_config(REPO / "configs/runs/qwen2.5-32b_dapo.yaml", ["model.path=/m"])
    monkeypatch.setenv("SLURM_NODEID", "0")
    for cmd in colocated.engine_commands(cfg, host="10.0.0.3", python="py"):
        assert cmd[cmd.index("--advertise-host") + 1] == "10.0.0.3" and cmd[cmd.index("--host") + 1] == "0.0.0.0"
