"""The whole tiny run across three hosts (tests/multihost_cluster.py: network namespaces with their own
address, hostname and Debian-style /etc/hosts, one real Slurm): `dapo-megatron slurm submit` of
configs/runs/tiny_cpu.yaml (shortened) with slurm.nodes=2, so the two DP ranks are on two hosts, and
an engine array of one CPU engine, which lands on the third host (--exclusive: each job owns its
nodes). The engines run another interpreter path than the trainer (slurm.engine_python: a second
venv directory sharing the packages).

Learning: the code is deterministic for a given layout (same prompts, same per-sample seeds, the same
sampled tokens; the DP all-reduce of two gloo ranks sums in the same order over a veth as over
loopback), so the three-host run must give the same per-step metrics as the one-host run of the same
layout (`dapo-megatron train`: torchrun with 2 ranks and one engine on this machine), exactly, fp32
losses and gradient norms included, and the same held-out avg@k.

    pytest -m slurm tests/integration/test_multi_host.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_train_tiny import EXACT_KEYS, FLOAT_KEYS

REPO = Path(__file__).resolve().parents[2]
TINY_CPU = REPO / "configs/runs/tiny_cpu.yaml"
STEPS = 2

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]

# the tiny run cut to two short steps: 8 prompts x 8 samples per step, 16 held-out prompts at steps 0 and 2
SHORT = {
    "tiny": {"warm_start_steps": 300},
    "data": {"synthetic": {"num_train": 256, "num_eval": 16}},
    "rollout": {"gen_batch_size": 16, "placement": "disaggregated", "num_engines": 1},
    "actor": {"world_size": 2},
    "trainer": {"total_steps": STEPS, "train_batch_size": 8, "mini_batch_size": 4, "eval_every": STEPS,
                "save_every": 1, "keep_checkpoints": 2, "keep_best_checkpoint": False, "wandb_mode": "disabled"},
    "slurm": {"nodes": 2, "gpus_per_node": 0, "cpus_per_task": 1, "time": "20:00", "signal_seconds": 60,
              "extra_sbatch": ["--exclusive"]},
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def write_config(path: Path, **sections) -> Path:
    raw = {"base": str(TINY_CPU), **json.loads(json.dumps(SHORT))}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def logs(run_dir: Path, *, tail: int = 5000) -> str:
    return "\n".join(f"==> {p.name}\n" + p.read_text(errors="replace")[-tail:]
                     for p in sorted((run_dir / "slurm/logs").glob("*.out")))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from multihost_cluster import MultiHostSlurm

    cluster = MultiHostSlurm(tmp_path_factory.mktemp("mh3"), hosts=3).start()
    try:
        yield cluster
    finally:
        cluster.stop()  # raises naming any namespace, link, daemon or /etc/netns entry left behind


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The warm-started tiny model (built once), a second interpreter path for the engines, and the
    one-host reference run of the same layout."""
    root = tmp_path_factory.mktemp("mhshared")
    cfg = write_config(root / "prep.yaml", trainer={"output_dir": str(root / "prep")})
    out = subprocess.run([sys.executable, "-m", "dapo_megatron.launch.prepare", str(cfg)], capture_output=True,
                         text=True, timeout=600, cwd=REPO, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    model = Path(out.stdout.strip())
    # the engines' environment: its own directory (pyvenv.cfg, bin/python), the packages shared
    venv = Path(sys.prefix)
    engine_env = root / "engine-venv"
    (engine_env / "bin").mkdir(parents=True)
    (engine_env / "pyvenv.cfg").write_text((venv / "pyvenv.cfg").read_text())
    (engine_env / "lib").symlink_to(venv / "lib")
    (engine_env / "bin" / "python").symlink_to(Path(os.path.realpath(sys.executable)))
    one_host = root / "one_host"
    run = subprocess.run([sys.executable, "-m", "dapo_megatron.cli", "train", str(cfg), f"trainer.output_dir={one_host}",
                          f"model.path={model}", "tiny.enabled=false"], capture_output=True, text=True, timeout=900,
                         cwd=REPO, env=_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {"root": root, "model": model, "engine_python": engine_env / "bin" / "python",
            "one_host": metrics(one_host)}


def submit(cluster, shared, run_dir: Path, *overrides: str) -> dict[str, str]:
    cfg = write_config(run_dir.parent / f"{run_dir.name}.yaml", trainer={"output_dir": str(run_dir)})
    out = subprocess.run([sys.executable, "-m", "dapo_megatron.cli", "slurm", "submit", str(cfg), "--engines", "1",
                          "--skip-data-check", f"model.path={shared['model']}", "tiny.enabled=false",
                          f"slurm.engine_python={shared['engine_python']}", *overrides],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env={**_env(), **cluster.env})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    ids = dict(line.split(": ", 1) for line in out.stdout.splitlines() if line.startswith(("train: ", "engines: ")))
    assert set(ids) == {"train", "engines"}, out.stdout
    return ids


def node_of(cluster, job: str) -> list[str]:
    out = cluster.run(["squeue", "-h", "-j", job, "-o", "%N"], check=False).stdout.strip()
    return cluster.run(["scontrol", "show", "hostnames", out], check=False).stdout.split() if out else []


def engine_interpreters(run_dir: Path) -> set[str]:
    """argv[0] of each registered engine process (the registration names its pid; one pid space here)."""
    seen = set()
    for path in (run_dir / "engines").glob("*.json"):
        try:
            pid = json.loads(path.read_text())["pid"]
            seen.add(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
        except (OSError, ValueError, KeyError):
            continue
    return seen


def test_run_across_three_hosts_learns_as_on_one_host(cluster, shared, tmp_path):
    run_dir = tmp_path / "run"
    ids = submit(cluster, shared, run_dir)
    started = time.monotonic()
    trainer_nodes, engine_nodes, interpreters = [], [], set()
    while cluster.job_states([ids["train"]]).get(ids["train"]) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
        assert time.monotonic() - started < 600, logs(run_dir)
        trainer_nodes = trainer_nodes or node_of(cluster, ids["train"])
        engine_nodes = engine_nodes or node_of(cluster, ids["engines"])
        interpreters |= engine_interpreters(run_dir)
        time.sleep(1)
    assert cluster.job_states([ids["train"]]) == {ids["train"]: "COMPLETED"}, logs(run_dir)
    hosts = {h.name for h in cluster.hosts}
    # the trainer's two ranks on two hosts, the engine on the third
    assert len(trainer_nodes) == 2 and len(engine_nodes) == 1 and set(trainer_nodes + engine_nodes) == hosts, \
        (trainer_nodes, engine_nodes)
    assert interpreters == {str(shared["engine_python"])}, interpreters  # not the trainer's sys.executable
    text = logs(run_dir, tail=10**6)
    # each rank chose its host's eth0 toward the other host, never 127.0.1.1
    by_name = {h.name: h.address for h in cluster.hosts}
    for node in trainer_nodes:
        assert f"gloo/nccl interface eth0 ({by_name[node]})" in text, text[-4000:]
    ours, theirs = metrics(run_dir), shared["one_host"]
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(STEPS + 1))
    for mine, ref in zip(ours, theirs):
        for key in EXACT_KEYS + FLOAT_KEYS + ("eval/avg@k", "eval/pass@k"):
            assert mine.get(key) == ref.get(key), (mine["step"], key, mine.get(key), ref.get(key))
    assert ours[-1]["eval/avg@k"] is not None
    print(f"\n[multi-host] three-host run: {time.monotonic() - started:.0f} s; trainer on {trainer_nodes}, "
          f"engine on {engine_nodes}; step rewards {[r.get('reward/mean') for r in ours[1:]]}")
