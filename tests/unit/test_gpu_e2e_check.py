"""tests/gpu/e2e_learning.py, the learning check of run_all.sh's e2e steps, on hand-written curves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import e2e_learning  # noqa: E402


def _run(tmp_path, evals: list[tuple[int, float]], **kw) -> int:
    rows = [{"step": s, "eval/avg@k": a, "time/step_s": 0.4} for s, a in evals]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [str(tmp_path), "--min-gain", str(kw.get("gain", 0.30))] + (
        ["--within", str(kw["within"])] if "within" in kw else []
    )
    return e2e_learning.main(args)


def test_gain_is_best_within_the_window_minus_step_zero(tmp_path):
    assert _run(tmp_path, [(0, 0.25), (10, 0.50), (20, 0.56), (30, 0.40)]) == 0  # +31 points at step 20
    assert _run(tmp_path, [(0, 0.25), (10, 0.50), (20, 0.54), (30, 0.54)]) == 1  # +29 points
    assert _run(tmp_path, [(0, 0.25), (10, 0.30), (40, 0.90)], within=30) == 1  # too late
    assert _run(tmp_path, [(10, 0.9)]) == 1  # no step-0 baseline
