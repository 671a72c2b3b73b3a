"""tests/gpu/run_all.sh, the budgeted GPU check (issue 33), run for real with bash on this machine: the
committed plan's calls and budgets (--plan), and the runner on a stand-in plan whose steps are short shell
commands: a step over its budget is killed (its children too) and recorded as timeout, a failing step is
recorded and the later ones run, a step whose budget would end past the call's limit is not started, and
each step's JSON line is on disk before the next step starts. Also tests/gpu/record_plan.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_ALL = ROOT / "tests" / "gpu" / "run_all.sh"
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import record_plan  # noqa: E402


def _run(*args, env_extra=None, timeout=60):
    env = dict(os.environ, PYTHON=sys.executable, **(env_extra or {}))
    return subprocess.run(["bash", str(RUN_ALL), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _plan_lines(stdout: str):
    steps = [m.groups() for m in re.finditer(r"^call=(\d+) step=(\w+) budget_s=(\d+)", stdout, re.M)]
    totals = {int(c): int(t) for c, t in re.findall(r"^call=(\d+) total_s=(\d+)$", stdout, re.M)}
    return [(int(c), s, int(b)) for c, s, b in steps], totals


def test_plan_call_1_is_issue_41s_unproven_and_measured_steps_within_540_s_less_setup_and_margin():
    proc = _run("--plan")
    assert proc.returncode == 0, proc.stderr
    steps, totals = _plan_lines(proc.stdout)
    # call 1 (issue 41): preflight, the colocated path end to end and its sync speed at the 1.5B shape, the
    # varlen attention (its tests, then its rows beside sdpa), the LM-head variants vs Liger, the loss rows
    assert [s for c, s, _ in steps if c == 1] == [
        "preflight",
        "transfer_tests",
        "e2e_colocated",
        "sync_bench",
        "attention_varlen_tests",
        "attention_rows",
        "kernel_variants_logprob",
        "loss_rows",
    ]
    # call 2: the steps the first H100 run (2026-11-26) passed (regression), the full quick kernel table with
    # the 32B row, the targets, the FP8 reload
    assert [s for c, s, _ in steps if c == 2] == [
        "actor_tests",
        "e2e_bf16",
        "kernel_bench",
        "kernel_targets",
        "sglang_fp8",
    ]
    # calls 3-4: never run on a GPU (kernel and attention tests, flex rows; fp32, overlapped, MoE e2e)
    assert [s for c, s, _ in steps if c == 3] == [
        "kernel_tests",
        "attention_tests",
        "attention_rows_flex",
        "actor_tests_rest",
    ]
    assert [s for c, s, _ in steps if c == 4] == ["e2e_fp32", "e2e_overlapped", "e2e_moe"]
    for call in totals:  # each total is the sum of its steps; + 15 s of wheels + 30 s of margin <= 540 s
        assert totals[call] == sum(b for c, _, b in steps if c == call) <= 540 - 15 - 30, call
    # the steps that need CUDA IPC are skipped when transfer_tests found it refused (issue 49)
    needs = dict(re.findall(r"^call=\d+ step=(\w+) .* needs=(\S+)$", proc.stdout, re.M))
    assert needs == {"e2e_colocated": "transfer_tests.cuda_ipc", "sync_bench": "transfer_tests.cuda_ipc"}
    # every step of the plan is a function of the runner
    script = RUN_ALL.read_text()
    assert all(f"step_{s}()" in script for _, s, _ in steps), [s for _, s, _ in steps if f"step_{s}()" not in script]


def test_plan_over_the_limit_or_malformed_is_refused(tmp_path):
    plan = tmp_path / "plan.tsv"
    plan.write_text("1\ta\t250\t-\t-\t-\t-\ttrue\n1\tb\t250\t-\t-\t-\t-\ttrue\n")
    proc = _run("--plan", env_extra={"GPU_PLAN": str(plan)})  # 500 s: within 540, not with 45 s kept back
    assert proc.returncode == 1 and "call=1 total_s=500" in proc.stdout
    assert "total_s=500 + 15 s setup + 30 s margin is over the call limit of 540 s" in proc.stderr
    plan.write_text("# comment\n1\ta\tsoon\t-\t-\t-\t-\ttrue\n")
    proc = _run("--plan", env_extra={"GPU_PLAN": str(plan)})
    assert proc.returncode == 2 and f"{plan}:2:" in proc.stderr and "got: 1 a soon" in proc.stderr


def test_runner_kills_overruns_records_failures_skips_what_cannot_fit(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    late = work / "late_child"
    never = work / "never_started"
    steps = [
        ("metrics", 5, """echo '{"tokens_per_s": 1234.5}' > "$STEP_METRICS\""""),
        # sleeps past its 1 s budget; its child would write a file at 3 s if the kill missed it
        ("overrun", 1, f"(sleep 3; touch {late}) & sleep 30"),
        ("fails", 5, "echo about to fail; exit 3"),
        ("too_long", 100, f"touch {never}"),  # 100 s cannot fit in the 20 s limit: never started
        # runs after the skip; passes only if the earlier steps' lines were on disk when it started
        ("sees_earlier_lines", 5, """test "$(wc -l < "$OUT/results.jsonl")" -eq 4"""),
    ]
    plan = tmp_path / "plan.tsv"
    plan.write_text(
        "# stand-in plan\n"
        + "".join(f"1\t{n}\t{b}\t-\t-\t-\t-\t{c}\n" for n, b, c in steps)
        + "2\tother_call\t5\t-\t-\t-\t-\texit 9\n"
    )
    start = time.monotonic()
    proc = _run(
        "--call", "1", str(out), env_extra={"GPU_PLAN": str(plan), "GPU_CALL_LIMIT_S": "20", "GPU_WORK": str(work)}
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout + proc.stderr  # not every step passed
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["step"], r["status"]) for r in lines] == [
        ("metrics", "ok"),
        ("overrun", "timeout"),
        ("fails", "failed"),
        ("too_long", "skipped"),
        ("sees_earlier_lines", "ok"),
    ]
    by_step = {r["step"]: r for r in lines}
    assert by_step["metrics"]["metrics"] == {"tokens_per_s": 1234.5}
    assert by_step["overrun"]["rc"] == 124 and 1.0 <= by_step["overrun"]["seconds"] < 5
    assert by_step["fails"]["rc"] == 3 and by_step["fails"]["metrics"] == {}
    assert by_step["too_long"]["seconds"] == 0 and "limit 20 s" in by_step["too_long"]["note"]
    assert all(r["call"] == 1 and r["budget_s"] == b for r, (_, b, _) in zip(lines, steps))
    assert not never.exists() and elapsed < 15  # the 30 s sleep was cut at 1 s
    assert "about to fail" in (out / "call1.log").read_text()
    time.sleep(max(0.0, 4.0 - elapsed))
    assert not late.exists()  # the timed-out step's background child went with it


def test_runner_records_a_step_as_it_finishes_even_if_the_call_is_cut_off(tmp_path):
    """The device tool kills a command at its limit: the steps finished before that are already on disk."""
    out = tmp_path / "out"
    plan = tmp_path / "plan.tsv"
    plan.write_text("1\tquick\t5\t-\t-\t-\t-\ttrue\n1\tslow\t60\t-\t-\t-\t-\tsleep 60\n")
    env = dict(os.environ, PYTHON=sys.executable, GPU_PLAN=str(plan), GPU_WORK=str(tmp_path / "work"))
    proc = subprocess.Popen(
        ["bash", str(RUN_ALL), "--call", "1", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        results = out / "results.jsonl"
        while time.monotonic() < deadline and not (results.exists() and results.read_text().strip()):
            time.sleep(0.1)
        assert proc.poll() is None  # still inside the slow step
        assert [json.loads(line)["step"] for line in results.read_text().splitlines()] == ["quick"]
    finally:
        os.killpg(proc.pid, 9)  # the cut-off
        proc.wait()


def test_record_plan_replaces_estimates_with_measured_seconds(tmp_path):
    plan = tmp_path / "plan.tsv"
    plan.write_text(
        "# header kept\n1\tpreflight\t30\t-\t-\t-\t-\t-\n1\tlong\t100\t-\t-\t-\t-\t-\n"
        "1\tcut\t50\t-\t-\t-\t-\t-\n2\tlater\t40\t-\t-\t-\tcut\t-\n"
        "2\tshort\t60\t-\t-\t-\t-\t-\n"
    )
    results = [
        {"step": "preflight", "status": "ok", "seconds": 12.34, "metrics": {"gpu": "NVIDIA H100 80GB HBM3"}},
        {"step": "long", "status": "ok", "seconds": 200.0, "metrics": {}},
        {"step": "cut", "status": "timeout", "seconds": 50.0, "metrics": {}},
        {"step": "later", "status": "skipped", "seconds": 0, "metrics": {}},
        {"step": "short", "status": "ok", "seconds": 20.0, "metrics": {}},
    ]
    lines = record_plan.record(plan, results, device=None, date="2026-11-26")
    rows = [line.split("\t") for line in plan.read_text().splitlines()]
    assert rows[0] == ["# header kept"]
    # 12.34 s: +15 s beats x1.25 -> 27.34, up to 30; 200 s: x1.25 = 250; 20 s: +15 -> 35 (an ok step may shrink)
    assert rows[1] == ["1", "preflight", "30", "12.3", "NVIDIA H100 80GB HBM3", "2026-11-26", "-", "-"]
    assert rows[2] == ["1", "long", "250", "200.0", "NVIDIA H100 80GB HBM3", "2026-11-26", "-", "-"]
    assert rows[3] == ["1", "cut", "50", "-", "-", "-", "-", "-"]
    assert rows[4] == ["2", "later", "40", "-", "-", "-", "cut", "-"]  # skipped: left alone, its needs kept
    assert rows[5] == ["2", "short", "35", "20.0", "NVIDIA H100 80GB HBM3", "2026-11-26", "-", "-"]
    assert any("cut: TIMEOUT" in line for line in lines)
    # 330 + 15 + 30 > 540? no; call 2: 75
    assert "call 1: total_s 330" in lines and "call 2: total_s 75" in lines
    proc = _run("--plan", env_extra={"GPU_PLAN": str(plan)})  # the runner reads the recorded plan
    assert "call=1 step=long budget_s=250 source=measured(NVIDIA_H100_80GB_HBM3,2026-11-26)" in proc.stdout
    with pytest.raises(ValueError, match="pass --device"):
        record_plan.record(plan, results[1:], device=None, date="2026-11-26")


def test_record_plan_a_failed_step_never_shrinks_its_budget(tmp_path):
    """Issue 49: transfer_tests failing at 12 s had cut its budget from 50 to 30. A failed step's seconds are
    not its length: they may raise the budget (a failure after 100 s of a 50 s budget's estimate), never
    lower it, and the measured columns keep the last ok run's seconds."""
    plan = tmp_path / "plan.tsv"
    plan.write_text(
        "1\ttransfer_tests\t50\t32.6\tNVIDIA H100 80GB HBM3\t2026-11-26\t-\t-\n1\tslow_fail\t50\t-\t-\t-\t-\t-\n"
    )
    results = [
        {"step": "transfer_tests", "status": "failed", "seconds": 12.0, "metrics": {}},
        {"step": "slow_fail", "status": "failed", "seconds": 100.0, "metrics": {}},
    ]
    lines = record_plan.record(plan, results, device="NVIDIA H200", date="2026-11-28")
    rows = [line.split("\t") for line in plan.read_text().splitlines()]
    assert rows[0] == ["1", "transfer_tests", "50", "32.6", "NVIDIA H100 80GB HBM3", "2026-11-26", "-", "-"]
    assert rows[1] == ["1", "slow_fail", "125", "-", "-", "-", "-", "-"]  # 100 x 1.25
    assert "transfer_tests: FAILED after 12.0 s (not its length) -> budget_s kept at 50" in lines
    assert "slow_fail: FAILED after 100.0 s (not its length) -> budget_s raised to 125" in lines


def test_step_metrics_read_what_the_steps_write(tmp_path):
    """The key numbers of a results line: pytest's own junit file (1 pass, 1 failure, 1 skip), the verdicts
    that dapo_kernels.bench.targets prints, and the actor bench's rows by attention kernel."""
    import step_metrics

    from dapo_kernels.bench import common, targets

    (tmp_path / "test_three.py").write_text(
        "import pytest\ndef test_a(): pass\ndef test_b(): assert 0\n@pytest.mark.skip\ndef test_c(): pass\n"
    )
    xml = tmp_path / "junit.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={xml}",
            "-o",
            "addopts=",
            str(tmp_path / "test_three.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    assert step_metrics.junit(str(xml)) == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1}

    kernels = tmp_path / "kernels.csv"
    x = "N=4096,H=3584,V=152064,tp=1"
    rows = [("fused", "fwd", "tflops", 452), ("liger", "fwd", "tflops", 308)]
    kernels.write_text(
        ",".join(common.CSV_FIELDS)
        + "\n"
        + "".join(
            f'linear_logprob_entropy,{p},{m},{k},,"{x}",{v},{v},{v},NVIDIA H100 80GB HBM3,2026-11-26\n'
            for p, m, k, v in rows
        )
    )
    text, _ = targets.report(kernels)
    (tmp_path / "targets.txt").write_text(text)
    assert step_metrics.targets(str(tmp_path / "targets.txt")) == {
        "T1": "PASS",
        "T2": "NOT MEASURED",
        "T3": "NOT MEASURED",
        "T4": "NOT MEASURED",
        "T5": "NOT MEASURED",
    }

    rows_csv = tmp_path / "attention_rows.csv"
    rows_csv.write_text(
        "tokens_per_micro_batch,attention_kernel,packing,status,step_s_p50,tokens_per_s,tflops_per_gpu,mfu,"
        "host_syncs,peak_mem_gib\n"
        "22528,sdpa,equal,ok,1.078,20898.0,315.2,0.3187,0,31.77\n24576,varlen,dapo,ok,0.7,35108.6,250.0,0.2528,0,30\n"
    )
    assert step_metrics.attention_rows(str(rows_csv)) == {
        "equal_22528_sdpa": {"status": "ok", "step_s_p50": 1.078, "tokens_per_s": 20898.0, "tflops_per_gpu": 315.2,
                             "mfu": 0.3187, "host_syncs": 0, "peak_mem_gib": 31.77},
        "dapo_24576_varlen": {"status": "ok", "step_s_p50": 0.7, "tokens_per_s": 35108.6, "tflops_per_gpu": 250.0,
                              "mfu": 0.2528, "host_syncs": 0, "peak_mem_gib": 30},
    }  # fmt: skip

    bench = tmp_path / "actor.csv"
    bench.write_text(
        "tokens_per_micro_batch,attention_kernel,status,step_s_p50,tokens_per_s,mfu,peak_mem_gib,recompute\n"
        "4096,sdpa,ok,0.5,65536.0,0.41,30.2,full\n16384,sdpa,oom,,,,79.1,full\n4096,flex,ok,0.4,8e4,0.5,30,full\n"
    )
    assert step_metrics.csv_rows(str(bench), "sdpa") == {
        "4096": {
            "status": "ok",
            "step_s_p50": 0.5,
            "tokens_per_s": 65536.0,
            "mfu": 0.41,
            "peak_mem_gib": 30.2,
            "recompute": "full",
        },
        "16384": {
            "status": "oom",
            "step_s_p50": "",
            "tokens_per_s": "",
            "mfu": "",
            "peak_mem_gib": 79.1,
            "recompute": "full",
        },
    }
