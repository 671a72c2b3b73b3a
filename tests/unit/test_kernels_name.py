"""kernels/ is the package dapo_kernels; with the repository root on sys.path (running from the
checkout) the folder is also importable as `kernels`, Hugging Face's package name. transformers probes
for that package by importing it (is_kernels_available): the probe must answer "not available" and
must not import Triton through our folder (on a machine without Triton that import fails).

    pytest tests/unit/test_kernels_name.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib.abc, json, sys

class NoTriton(importlib.abc.MetaPathFinder):  # this machine has no Triton
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton' (blocked by the test)")
        return None

if sys.argv[1] == "no-triton":
    sys.meta_path.insert(0, NoTriton())
import importlib.util
from transformers.utils.import_utils import is_kernels_available

spec = importlib.util.find_spec("kernels")
print(json.dumps({"found": spec.origin if spec else None, "available": is_kernels_available(),
                  "triton": "triton" in sys.modules, "logprob": "kernels.logprob" in sys.modules}))
"""


def _probe(mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_transformers_probe_is_not_fooled_by_the_kernels_folder():
    result = _probe("triton")
    assert result["found"] == str(REPO / "kernels" / "__init__.py")  # the folder does shadow the name...
    assert result["available"] is False  # ...but the probe sees no Hugging Face kernels package
    assert result["logprob"] is False  # and imported none of our Triton modules under that name


def test_the_probe_survives_a_machine_without_triton():
    result = _probe("no-triton")
    assert result["available"] is False and result["triton"] is False


def test_dapo_kernels_is_still_the_whole_package():
    import dapo_kernels

    assert {"linear_logprob_entropy", "policy_loss", "policy_loss_reference"} <= set(dapo_kernels.__all__)
