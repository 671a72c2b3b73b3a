"""The real `dapo-megatron train configs/runs/tiny_cpu_fp8.yaml`, shortened to 1 step: the launcher
exports the base model with modelopt (128 x 128 block FP8, SGLang's `fp8` layout) into
<output_dir>/rollout_fp8 and starts the CPU engine from it,
the driver converts every sync (a plain fp32 sync into that engine is refused: dtype mismatch), and
the engine's log-probs carry the FP8 weight error. The 60-step learning curve is in docs/benchmarks.md.

Shortened as test_train_tiny.py is, and more: a 20-step warm start (answers mostly wrong) with dynamic
sampling off, so that every generated group trains and each step syncs; the fp32 run of
test_train_tiny.py keeps mismatch/max < 1e-3 on the same loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "modelopt.torch.quantization", reason="nvidia-modelopt not installed (pip install -e '.[modelopt]')"
)

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_fp8_run_serves_modelopt_fp8_and_syncs_fp8(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "train",
        str(ROOT / "configs/runs/tiny_cpu_fp8.yaml"),
        f"trainer.output_dir={out}",
        f"tiny.cache_dir={tmp_path / 'cache'}",
        "tiny.warm_start_steps=20",
        "trainer.total_steps=1",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "trainer.wandb_mode=disabled",
        "algorithm.dynamic_sampling=false",
        "trainer.train_batch_size=8",
        "trainer.mini_batch_size=4",
        "rollout.gen_batch_size=8",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "[train] fp8: block-FP8 checkpoint (modelopt) for the engines in" in proc.stdout
    quant = json.loads((out / "rollout_fp8" / "config.json").read_text())["quantization_config"]
    assert quant == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "ignored_layers": ["lm_head", "model.embed_tokens"],
    }
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    r = rows[0]
    assert r["actor/num_updates"] == 2 and r["actor/nonfinite"] == 0
    # FP8 weights in the engine: far above the fp32 engine's < 1e-3 (test_train_tiny.py)
    assert r["mismatch/max"] > 1e-2 and r["mismatch/mean"] > 1e-4
    # TIS (tis_cap 2.0) is on: its mean weight is reported and bounded by the cap
    assert 0 < r["actor/tis_weight"] <= 2.0
    # the step's sync went through the driver's converter into the fp8 engine (fp32 tensors are refused
    # there): exactly the bytes of the export's tensors (same names, dtypes, shapes)
    from safetensors.torch import load_file

    export = {k: v for f in sorted((out / "rollout_fp8").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert r["sync/gb"] * 1e9 == pytest.approx(sum(t.numel() * t.element_size() for t in export.values()), rel=1e-12)
