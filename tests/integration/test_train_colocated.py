"""The real `dapo-megatron train` on configs/runs/tiny_cpu_colocated.yaml: two CPU engines and 2 gloo
actor ranks take turns on the memory as on a GPU node (trainer/placement.py), shortened to 4 steps. Engine i
sits on slot i, so rank 0 feeds engine 0 and rank 1 feeds engine 1: rank 1's shared-memory payloads
reach the driver by gather and its engine through the driver's POST, as on a GPU node.

  A  4 colocated steps, checkpoints at 2 and 4 (written while the engines are released, then the
     weights sent again), every sync read back from the engine (rollout.verify_weight_sync: the run
     fails unless the engine's tensors equal the actor's bit for bit)

  D  the same 4 steps disaggregated (tiny_cpu.yaml: one engine, weights broadcast over gloo): the
     session's tiny_run_a (conftest.py), from the same warm-start cache
A's per-step metrics equal D's to the bit: the weights reach the engines bit for bit through shared
memory, and per-sample seeds make the sampled tokens independent of which engine serves a request. The memory
ledger in metrics.jsonl is asserted phase by phase.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import helpers_train

ROOT = Path(__file__).resolve().parents[2]
# the dense run's deterministic keys, and here its fp32 values and the eval too: both runs do the same arithmetic
EXACT_KEYS = (*helpers_train.EXACT_KEYS, "actor/loss", "actor/grad_norm", "actor/entropy", "eval/avg@k")
NUM_TENSORS = 27  # the tiny Qwen2's HF tensors (2 layers x 12 + embed, final norm, lm_head)

pytestmark = pytest.mark.slow


def _train(config: str, out: Path, cache: Path, *extra: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "train",
        str(ROOT / "configs/runs" / config),
        f"trainer.output_dir={out}",
        f"tiny.cache_dir={cache}",
        "tiny.warm_start_steps=300",
        "trainer.eval_every=4",
        "trainer.save_every=2",
        "trainer.keep_checkpoints=2",
        "trainer.wandb_mode=disabled",
        "trainer.total_steps=4",
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_run_a):
    root = tmp_path_factory.mktemp("colocated")
    return {
        "a": _train(
            "tiny_cpu_colocated.yaml",
            root / "a",
            tiny_run_a["cache"],
            "rollout.verify_weight_sync=true",
            "rollout.num_engines=2",
        ),
        "d": tiny_run_a["a"],
    }


def test_colocated_steps_equal_the_disaggregated_run(runs):
    a, d = runs["a"], runs["d"]
    assert [r["step"] for r in a] == [r["step"] for r in d] == [0, 1, 2, 3, 4]
    for ra, rd in zip(a, d):
        for key in EXACT_KEYS:
            assert ra.get(key) == rd.get(key), (ra["step"], key, ra.get(key), rd.get(key))
    assert d[1]["sync/collectives"] == 1 and "sync/verified_tensors" not in d[1]  # D really broadcast


def test_every_sync_put_the_actors_weights_into_the_engine_bit_for_bit(runs):
    for r in runs["a"][1:]:
        # verify_weight_sync read each tensor back and compared it (a difference fails the run);
        # every tensor was sent (colocated engines resume their weights without content)
        assert r["sync/verified_tensors"] == NUM_TENSORS and r["sync/buckets"] == 1
        assert r["sync/collectives"] == 0  # shared memory, not the broadcast group
        assert r["sync/engines"] == 2
        assert r["mismatch/max"] < 1e-3  # trainer vs engine log-probs of the sampled tokens


def test_memory_ledger_shows_the_phases_taking_turns(runs):
    for r in runs["a"][1:]:
        # the engine generates: nothing of the actor (or the reference) on the device
        assert r["memory/actor_gb_during_rollout"] == 0.0
        assert r["memory/actor_params_gb_during_rollout"] == 0.0
        # ... and the engine holds its fp32 weights: the same bytes as the actor's fp32 parameters
        assert r["memory/engine_gb_during_rollout"] == r["memory/actor_params_gb_during_train"] > 0
        # the actor trains: the engine released everything
        assert r["memory/engine_gb_during_train"] == 0.0
        # ... and the actor holds parameters, gradients (fp32, same size) and Adam's two moments
        params = r["memory/actor_params_gb_during_train"]
        assert r["memory/actor_grads_gb_during_train"] == params
        assert r["memory/actor_optimizer_gb_during_train"] >= 2 * params
        assert (
            r["memory/actor_gb_during_train"]
            == params + r["memory/actor_grads_gb_during_train"] + r["memory/actor_optimizer_gb_during_train"]
        )
    # the host keeps what was offloaded: after the first update, parameters and Adam's moments
    for r in runs["a"][2:]:
        assert r["memory/host_backup_gb_during_rollout"] >= 3 * r["memory/actor_params_gb_during_train"]
