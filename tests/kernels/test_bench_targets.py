"""Issue 27's target checker (kernels/bench/targets.py) on hand-written CSVs: the H100 run the issue
quotes must fail every target it missed, a run that meets them must pass, and what a --quick run
does not cover must read NOT MEASURED, never PASS.

Run: pytest tests/kernels/test_bench_targets.py -q
"""

from __future__ import annotations

import re

from dapo_kernels.bench import common, targets

H100 = "NVIDIA H100 80GB HBM3"
X7_16K = "N=16384,H=3584,V=152064,tp=1"
X7_4K = "N=4096,H=3584,V=152064,tp=1"
X32_64K = "N=65536,H=5120,V=152064,tp=1"


def _write(path, rows, device=H100, date="2026-11-25"):
    """rows: (kernel, provider, mode, metric, x, p50)."""
    new = not path.exists()
    with path.open("a") as f:
        if new:
            f.write(",".join(common.CSV_FIELDS) + "\n")
        for kernel, provider, mode, metric, x, p50 in rows:
            f.write(f'{kernel},{provider},{mode},{metric},,"{x}",{p50},{p50},{p50},{device},{date}\n')


def _lm(provider, mode, x, tflops, mem=None):
    rows = [("linear_logprob_entropy", provider, mode, "tflops", x, tflops)]
    if mem is not None:
        rows.append(("linear_logprob_entropy", provider, mode, "peak_extra_mem", x, mem))
    return rows


def _issue_run():
    """Two rows of issue 27's H100 table (fused, liger) and its policy-loss numbers."""
    return [
        *_lm("fused", "fwd", X7_4K, 452),
        *_lm("liger", "fwd", X7_4K, 308),
        *_lm("fused", "fwd_bwd", X7_4K, 413, 4.34),
        *_lm("liger", "fwd_bwd", X7_4K, 223, 1.12),
        *_lm("fused", "fwd", X32_64K, 443),
        *_lm("liger", "fwd", X32_64K, 678),
        *_lm("fused", "fwd_bwd", X32_64K, 470, 6.65),
        *_lm("liger", "fwd_bwd", X32_64K, 630, 4.40),
        ("policy_loss", "fused", "fwd", "pct_of_copy", "T=16777216", 30),
        ("policy_loss", "fused", "fwd", "ms", "T=65536", 0.32),
    ]


def _status(text):
    """{target number: PASS | FAIL | NOT} from the verdict lines (the indented detail lines are not verdicts)."""
    return {m[2]: m[1] for m in re.finditer(r"^(PASS|FAIL|NOT) +(?:MEASURED +)?T(\d) ", text, flags=re.M)}


def test_the_issues_h100_run_fails_every_target(tmp_path):
    path = tmp_path / "kernels.csv"
    _write(path, _issue_run())
    text, ok = targets.report(path)
    assert not ok
    assert _status(text) == {"1": "FAIL", "2": "FAIL", "3": "FAIL", "4": "FAIL", "5": "FAIL"}
    # T1 names the losing row with both numbers; the winning 4K rows are listed as ok
    assert "FAIL N=65536,H=5120,V=152064,tp=1 fwd: fused 443 vs liger 678" in text
    assert "ok   N=4096,H=3584,V=152064,tp=1 fwd_bwd: fused 413 vs liger 223" in text
    assert "fused 470 TFLOP/s (target 650)" in text
    assert "fused fwd: 320.0 us" in text
    assert "candidate default (wins T1 and T3 on every measured shape): none" in text


def test_a_run_meeting_the_targets_passes_and_names_the_winner(tmp_path):
    path = tmp_path / "kernels.csv"
    rows = []
    for x in (X7_16K, X32_64K):
        rows += _lm("liger", "fwd", x, 640) + _lm("liger", "fwd_bwd", x, 630, 4.40)
        rows += _lm("fused", "fwd", x, 600) + _lm("fused", "fwd_bwd", x, 610, 1.0)  # slower: not the winner
        rows += _lm("fused_cublas", "fwd", x, 700) + _lm("fused_cublas", "fwd_bwd", x, 660, 4.40)  # equal memory: ok
    rows += [
        ("policy_loss", "fused", "fwd", "pct_of_copy", "T=16777216", 70.0),
        ("policy_loss", "fused", "fwd", "ms", "T=65536", 0.040),
    ]
    _write(path, rows)
    text, ok = targets.report(path)
    assert ok, text
    assert _status(text) == {"1": "PASS", "2": "PASS", "3": "PASS", "4": "PASS", "5": "PASS"}
    # T3 takes the least memory among ours (fused 1.0 GB) but the candidate must win T1 too
    assert "ok   N=16384,H=3584,V=152064,tp=1: fused 1.00 GB vs liger 4.40 GB" in text
    assert "candidate default (wins T1 and T3 on every measured shape): fused_cublas" in text


def test_a_quick_run_leaves_the_32b_and_loss_targets_not_measured(tmp_path):
    path = tmp_path / "kernels.csv"
    _write(path, _lm("liger", "fwd", X7_16K, 633) + _lm("fused", "fwd", X7_16K, 700))
    _write(path, _lm("fused", "fwd", X7_16K, 900), device="cpu")  # interpreter dry runs never count
    text, ok = targets.report(path)
    assert not ok
    assert _status(text) == {"1": "PASS", "2": "NOT", "3": "NOT", "4": "NOT", "5": "NOT"}
    assert "fused 700 vs liger 633" in text


def test_the_newest_row_of_a_key_wins_and_devices_are_not_mixed(tmp_path):
    path = tmp_path / "kernels.csv"
    _write(path, _lm("liger", "fwd", X7_16K, 633) + _lm("fused", "fwd", X7_16K, 426))
    _write(path, _lm("fused", "fwd", X7_16K, 650))  # a later run of the same shape
    _write(
        path,
        _lm("liger", "fwd", X7_16K, 900) + _lm("fused", "fwd", X7_16K, 100),
        device="NVIDIA H200",
        date="2026-11-20",
    )
    text, _ = targets.report(path)
    assert f"({H100})" in text and "fused 650 vs liger 633" in text  # the newest date's device
    text, _ = targets.report(path, device="NVIDIA H200")
    assert "FAIL N=16384,H=3584,V=152064,tp=1 fwd: fused 100 vs liger 900" in text


def test_an_oom_row_does_not_count_as_a_measurement(tmp_path):
    path = tmp_path / "kernels.csv"
    _write(path, _lm("liger", "fwd_bwd", X32_64K, 630, 4.40) + _lm("fused", "fwd_bwd", X32_64K, "oom"))
    text, _ = targets.report(path)
    assert _status(text)["1"] == "NOT" and _status(text)["2"] == "NOT"
