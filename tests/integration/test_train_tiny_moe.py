"""The real `dapo-megatron train configs/runs/tiny_cpu_moe.yaml`, unshortened: a tiny Qwen3-MoE trained
with expert parallelism (EP=2 over 2 gloo ranks) and rollout routing replay against the CPU engine.
It must learn the embedded task (held-out avg@8 up by >= 30 points over the config's 60 steps), log the routing
agreement every step, keep the trainer's old log-probs within the dense run's tolerance of the
engine's (tests/integration/test_train_tiny.py: mismatch/max < 1e-3), and write HF checkpoints in
the public per-expert layout that transformers loads. Minutes on 2 cores: marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(
    3600
)  # the MoE warm start (1000 supervised steps) dominates: 80 s alone, 20+ min on a busy machine
def test_tiny_moe_run_learns_with_routing_replay(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "train",
        str(ROOT / "configs/runs/tiny_cpu_moe.yaml"),
        f"trainer.output_dir={out}",
        "trainer.wandb_mode=disabled",
        # evals (100 problems x 8 samples each) and checkpoints at 0, 30, 60 only: CI time
        "trainer.eval_every=30",
        "trainer.save_every=30",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=5400)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/avg@k"] for r in rows if "eval/avg@k" in r]
    assert rows[0]["step"] == 0 and len(evals) == 3  # steps 0, 30, 60
    assert evals[-1] - evals[0] >= 0.30, evals
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 60
    for r in steps:
        # 2 sparse layers x (prompt + response - 1) tokens of 128 responses, all reported by the engine
        assert r["routing/token_layers"] > 2 * 128 * 8
        assert 0.9 <= r["routing/agreement"] <= 1.0 and 0.0 <= r["routing/exact_match"] <= 1.0
        assert r["mismatch/max"] < 1e-3
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    hf_dir = out / "checkpoints" / "step_000060" / "hf"
    names = set()
    for path in hf_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as handle:
            names.update(handle.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert AutoModelForCausalLM.from_pretrained(hf_dir).config.model_type == "qwen3_moe"
