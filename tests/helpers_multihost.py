"""The tiny run as the multi-host tests run it (tests/integration/test_multi_host.py): its config cut
to two short steps, the environment its processes get, and the one-time preparation the session's
`multihost_tiny` fixture (tests/integration/conftest.py) makes: the warm-started model, a second
interpreter path for the engines and the one-host reference run of the same layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from helpers_runs import metrics

REPO = Path(__file__).resolve().parents[1]
TINY_CPU = REPO / "configs/runs/tiny_cpu.yaml"
STEPS = 2

# the tiny run cut to two short steps: 8 prompts x 8 samples per step, 16 held-out prompts at steps 0 and 2;
# the warm start (300 steps on tiny_cpu.yaml's 2000 train prompts) is the session's tiny_cache entry
SHORT = {
    "tiny": {"warm_start_steps": 300},
    "data": {"synthetic": {"num_train": 2000, "num_eval": 16}},
    "rollout": {"gen_batch_size": 16, "placement": "disaggregated", "num_engines": 1},
    "actor": {"world_size": 2},
    "trainer": {
        "total_steps": STEPS,
        "train_batch_size": 8,
        "mini_batch_size": 4,
        "eval_every": STEPS,
        "save_every": 1,
        "keep_checkpoints": 2,
        "keep_best_checkpoint": False,
        "wandb_mode": "disabled",
    },
    "slurm": {
        "nodes": 2,
        "gpus_per_node": 0,
        "cpus_per_task": 1,
        "time": "20:00",
        "signal_seconds": 60,
        "extra_sbatch": ["--exclusive"],
    },
}


def run_env() -> dict[str, str]:
    """This process's environment without *_SOCKET_IFNAME (each rank must pick its interface itself)."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def write_config(path: Path, **sections) -> Path:
    """SHORT over tiny_cpu.yaml, each of `sections` updating its section, written to `path`."""
    raw = {"base": str(TINY_CPU), **json.loads(json.dumps(SHORT))}
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def prepare_multihost_tiny(root: Path, *, cache: Path) -> dict:
    """The warm-started tiny model (built once), a second interpreter path for the engines (its own
    directory with pyvenv.cfg and bin/python, the packages shared) and the one-host reference run of
    SHORT's layout (`dapo-megatron train`: torchrun with 2 ranks and one engine on this machine).
    Returns {"root", "model", "engine_python", "one_host": the reference run's metrics records}.
    cache: tiny.cache_dir of the session's tiny_cache fixture (the same warm start: a cache hit)."""
    cfg = write_config(root / "prep.yaml", tiny={"cache_dir": str(cache)}, trainer={"output_dir": str(root / "prep")})
    out = subprocess.run(
        [sys.executable, "-m", "dapo_megatron.launch.prepare", str(cfg)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=run_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    model = Path(out.stdout.strip())
    venv = Path(sys.prefix)
    engine_env = root / "engine-venv"
    (engine_env / "bin").mkdir(parents=True)
    (engine_env / "pyvenv.cfg").write_text((venv / "pyvenv.cfg").read_text())
    (engine_env / "lib").symlink_to(venv / "lib")
    (engine_env / "bin" / "python").symlink_to(Path(os.path.realpath(sys.executable)))
    one_host = root / "one_host"
    argv = ["train", str(cfg), f"trainer.output_dir={one_host}", f"model.path={model}", "tiny.enabled=false"]
    run = subprocess.run(
        [sys.executable, "-m", "dapo_megatron.cli", *argv],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env=run_env(),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {"root": root, "model": model, "engine_python": engine_env / "bin" / "python", "one_host": metrics(one_host)}
