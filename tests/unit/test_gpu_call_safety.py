"""Issue 49: a lent GPU's one call loses nothing and wastes nothing. Run for real with bash on this machine,
with stand-in plans (GPU_PLAN) and, for attention_rows, a stand-in python on PATH (PYTHON) in place of the
actor bench: a step that needs another's metric is skipped with one line naming why; `--plan --left S`
says per call which steps fit; a layout's rows and metrics reach OUT before the step's budget ends; the
junit flags and issue 49's H200 targets are read from what the steps write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_ALL = ROOT / "tests" / "gpu" / "run_all.sh"
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
import h200_targets  # noqa: E402
import step_metrics  # noqa: E402


def _run(*args, env_extra=None, timeout=60):
    env = {**os.environ, "PYTHON": sys.executable, **(env_extra or {})}
    return subprocess.run(["bash", str(RUN_ALL), *args], env=env, capture_output=True, text=True, timeout=timeout)


def _plan(tmp_path, rows) -> Path:
    plan = tmp_path / "plan.tsv"
    plan.write_text("".join(f"{c}\t{s}\t{b}\t-\t-\t-\t{n}\t{cmd}\n" for c, s, b, n, cmd in rows))
    return plan


def _results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_a_step_whose_need_is_unmet_is_skipped_with_one_line_naming_why(tmp_path):
    ipc_ok = """echo '{"cuda_ipc": true}' > "$STEP_METRICS\""""
    ipc_refused = """echo '{"passed": 1, "failed": 1, "cuda_ipc": false}' > "$STEP_METRICS"; exit 1"""
    ran = tmp_path / "ran"
    plan = _plan(
        tmp_path,
        [
            (1, "transfer_ok", 5, "-", ipc_ok),
            (1, "colocated_a", 5, "transfer_ok.cuda_ipc", f"echo a >> {ran}"),
            (1, "transfer_refused", 5, "-", ipc_refused),
            (1, "colocated_b", 5, "transfer_refused.cuda_ipc", f"echo b >> {ran}"),
            (1, "sync_b", 5, "transfer_refused.cuda_ipc,transfer_ok", f"echo c >> {ran}"),
            (1, "after_ok", 5, "transfer_ok", f"echo d >> {ran}"),
            (1, "needs_later", 5, "not_yet", f"echo e >> {ran}"),
            (1, "not_yet", 5, "-", "true"),
        ],
    )
    out = tmp_path / "out"
    proc = _run("--call", "1", str(out), env_extra={"GPU_PLAN": str(plan), "GPU_WORK": str(tmp_path / "w")})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = _results(out)
    assert [(r["step"], r["status"]) for r in lines] == [
        ("transfer_ok", "ok"),
        ("colocated_a", "ok"),
        ("transfer_refused", "failed"),
        ("colocated_b", "skipped"),
        ("sync_b", "skipped"),
        ("after_ok", "ok"),
        ("needs_later", "skipped"),
        ("not_yet", "ok"),
    ]
    assert ran.read_text().split() == ["a", "d"]  # the skipped steps' commands never ran
    notes = {r["step"]: r.get("note") for r in lines if r["status"] == "skipped"}
    refused = "needs transfer_refused.cuda_ipc: transfer_refused ended failed with cuda_ipc=false"
    assert notes == {
        "colocated_b": refused,
        "sync_b": refused,
        "needs_later": "needs not_yet: not_yet has not run earlier in this call",
    }
    assert f"==== colocated_b: skipped ({refused})" in proc.stdout
    assert all(r["seconds"] == 0 for r in lines if r["status"] == "skipped")


def test_plan_left_names_per_call_the_steps_that_fit_and_the_launch(tmp_path):
    plan = _plan(
        tmp_path,
        [
            (1, "a", 200, "-", "true"),
            (1, "b", 250, "-", "true"),
            (2, "c", 100, "-", "true"),
            (2, "d", 60, "-", "true"),
            (2, "e", 20, "-", "true"),
            (3, "f", 50, "-", "true"),
        ],
    )
    env = {"GPU_PLAN": str(plan), "GPU_START_S": "120"}
    # 900 s: start 120 -> 780; call 1 at most 540 s of steps (15 s setup + 200 + 250 = 465) + 60 s overhead
    # = 525 -> 255 left; call 2's limit 255 - 60 = 195: setup 15 + c 100 + d 60 = 175, e would end at 195
    # (fits: <=), so all three; it uses 195 + 60 = 255 -> 0 left, call 3 nothing
    proc = _run("--plan", "--left", "900", env_extra=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "left_s=900 start_s=120 (a fresh machine; GPU_START_S=0 when one is warm)",
        "call=1 run step=a budget_s=200 at_s=15",
        "call=1 run step=b budget_s=250 at_s=215",
        'call=1 launch: run(command="GPU_CALL_LIMIT_S=540 bash tests/gpu/run_all.sh --call 1 $OUT", '
        'carry=[".gpu"], timeout_s=600) uses_s<=525',
        "call=2 run step=c budget_s=100 at_s=15",
        "call=2 run step=d budget_s=60 at_s=115",
        "call=2 run step=e budget_s=20 at_s=175",
        'call=2 launch: run(command="GPU_CALL_LIMIT_S=195 bash tests/gpu/run_all.sh --call 2 $OUT", '
        'carry=[".gpu"], timeout_s=255) uses_s<=255',
        "call=3: nothing fits in the 0 s left",
        "left_after_s=0",
    ]
    # a warm machine and 300 s: call 1's limit 240: a (215) runs, b (465) is passed over
    proc = _run("--plan", "--left", "300", env_extra={**env, "GPU_START_S": "0"})
    assert "call=1 run step=a budget_s=200 at_s=15" in proc.stdout
    assert "call=1 pass step=b budget_s=250 (would end at 465 s > 240 s)" in proc.stdout
    # no machine starts with under 4 minutes left
    proc = _run("--plan", "--left", "200", env_extra=env)
    assert "no call: under 240 s left, no machine starts (device README)" in proc.stdout
    assert _run("--plan", "--left", "soon", env_extra=env).returncode == 2


STAND_IN_PYTHON = """#!/usr/bin/env bash
# the actor bench: append one row per layout to --csv; the DAPO layout then hangs past the step's budget
if [ "$1 $2" = "-m dapo_megatron.benchmarks.actor" ]; then
  csv=$(printf '%s\\n' "$@" | sed -n '/^--csv$/{n;p}')
  [ -f "$csv" ] || echo "tokens_per_micro_batch,attention_kernel,packing,status,step_s_p50,tokens_per_s,\
tflops_per_gpu,mfu,host_syncs,peak_mem_gib" > "$csv"
  if printf '%s\\n' "$@" | grep -qx dapo; then sleep 60; fi
  echo "22528,sdpa,equal,ok,1.0,22528.0,300.0,0.31,0,31.0" >> "$csv"
  echo "22528,varlen,equal,ok,0.9,25031.0,333.0,0.34,0,30.5" >> "$csv"
  exit 0
fi
exec {python} "$@"
"""


def test_attention_rows_first_layout_reaches_out_before_the_budget_ends(tmp_path):
    """The real step function (plan command "-", env ready): the first layout's rows are in OUT and its
    metrics in the results line although the second layout was killed at the budget."""
    stand_in = tmp_path / "python3"
    stand_in.write_text(STAND_IN_PYTHON.replace("{python}", sys.executable))
    stand_in.chmod(0o755)
    plan = _plan(tmp_path, [(1, "attention_rows", 4, "-", "-")])
    out = tmp_path / "out"
    env = {"GPU_PLAN": str(plan), "GPU_WORK": str(tmp_path / "w"), "PYTHON": str(stand_in), "DAPO_GPU_ENV_READY": "1"}
    proc = _run("--call", "1", str(out), env_extra=env)
    (line,) = _results(out)
    assert line["status"] == "timeout", proc.stdout + proc.stderr
    rows = (out / "attention_rows.csv").read_text().splitlines()
    assert [r.split(",")[1] for r in rows[1:]] == ["sdpa", "varlen"]
    assert line["metrics"]["equal_22528_varlen"]["mfu"] == 0.34
    assert line["metrics"]["equal_22528_sdpa"]["step_s_p50"] == 1.0


def test_junit_flags_name_a_part_of_a_pytest_step(tmp_path):
    (tmp_path / "test_parts.py").write_text(
        "import pytest\n"
        "def test_cuda_ipc_sync(): pass\n"
        "def test_ipc_release(): pass\n"
        "def test_nccl_collective(): assert 0\n"
        "@pytest.mark.skip\n"
        "def test_gloo_skipped(): pass\n"
    )
    xml = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "-o", "addopts=",
         str(tmp_path / "test_parts.py")],
        cwd=tmp_path, capture_output=True, timeout=120,
    )  # fmt: skip
    got = step_metrics.junit(str(xml), {"cuda_ipc": "ipc", "nccl": "nccl", "gloo": "gloo", "none": "zzz"})
    # ipc: both passed; nccl failed; gloo skipped (not a pass); zzz matched nothing (not proven)
    assert got == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1, "cuda_ipc": True, "nccl": False,
                   "gloo": False, "none": False}  # fmt: skip
    assert step_metrics.junit(str(tmp_path / "missing.xml"), {"cuda_ipc": "ipc"}) == {
        "junit": "missing",
        "cuda_ipc": False,
    }


def _csv(path: Path, header: str, rows: list[str]) -> None:
    path.write_text(header + "\n" + "".join(r + "\n" for r in rows))


KERNEL_HEADER = "kernel,provider,mode,metric,unit,x,p50,p20,p80,device,date"


def test_h200_targets_judged_from_a_calls_out_folder(tmp_path):
    """Hand-made outputs of one call: each target's verdict and the numbers it names."""
    out = tmp_path
    preflight = {"gpu": "NVIDIA H200", "copy_gb_per_s": 4300.0, "matmul_bf16_tflops": 790.0}
    (out / "results.jsonl").write_text(
        json.dumps({"step": "preflight", "status": "ok", "metrics": preflight})
        + "\n"
        + json.dumps({"step": "e2e_colocated", "status": "ok", "metrics": {"gain": 0.41}})
        + "\n"
    )
    sync_header = "bench,bytes,sync_s_p50,gb_per_s,export_s,ipc_s,engine_s,session_s,read_back,device"
    _csv(out / "colocated_sync.csv", sync_header,
         ["colocated_sync,3087007744,0.25,12.3,0.002,0.01,0.2,0.03,equal,NVIDIA H200"])  # fmt: skip
    _csv(out / "attention_rows.csv", "tokens_per_micro_batch,attention_kernel,packing,status,mfu",
         ["22528,sdpa,equal,ok,0.33", "22528,varlen,equal,ok,0.41", "24576,sdpa,dapo,ok,0.36",
          "24576,varlen,dapo,ok,0.39"])  # fmt: skip
    x7, x32 = "N=16384,H=3584,V=152064,tp=8", "N=65536,H=5120,V=152064,tp=1"
    lm = "linear_logprob_entropy_variants"
    _csv(out / "variants_logprob.csv", KERNEL_HEADER, [
        f'{lm},tma0_128x256x64h,fwd,tflops,TFLOP/s,"{x7}",560,,,NVIDIA H200,2026-11-29',
        f'{lm},liger,fwd,tflops,TFLOP/s,"{x7}",580,,,NVIDIA H200,2026-11-29',
        f'{lm},tma0_128x256x64h,fwd_bwd,tflops,TFLOP/s,"{x7}",600,,,NVIDIA H200,2026-11-29',
        f'{lm},liger,fwd_bwd,tflops,TFLOP/s,"{x7}",520,,,NVIDIA H200,2026-11-29',
        f'{lm},fused,fwd_bwd,tflops,TFLOP/s,"{x32}",640,,,NVIDIA H200,2026-11-29',
        f'{lm},tma0_128x256x64h,fwd_bwd,tflops,TFLOP/s,"{x32}",660,,,NVIDIA H200,2026-11-29',
        f'{lm},liger,fwd_bwd,tflops,TFLOP/s,"{x32}",670,,,NVIDIA H200,2026-11-29',
    ])  # fmt: skip
    _csv(out / "variants_policy_loss.csv", KERNEL_HEADER, [
        "policy_loss,persistent,fwd_bwd,pct_of_copy,%,T=16777216,84,,,NVIDIA H200,2026-11-29",
        "policy_loss,fused,fwd_bwd,pct_of_copy,%,T=16777216,55,,,NVIDIA H200,2026-11-29",
        "policy_loss,torch,fwd,ms,ms,T=65536,0.001,,,NVIDIA H200,2026-11-29",
        "policy_loss,persistent,fwd,ms,ms,T=65536,0.018,,,NVIDIA H200,2026-11-29",
        "policy_loss,persistent,fwd_bwd,ms,ms,T=65536,0.052,,,NVIDIA H200,2026-11-29",
    ])  # fmt: skip
    text, statuses = h200_targets.judge_out_dir(out)
    assert statuses == ["PASS", "PASS", "FAIL", "FAIL", "PASS", "FAIL"], text
    assert "dapo 24576 tokens: varlen MFU 0.39 (sdpa 0.36)" in text
    assert f"variants_logprob.csv {x7} fwd: fused_tma 560 vs liger 580 TFLOP/s" in text
    assert "tma0_128x256x64h 660 TFLOP/s (8NHV), 495 on 6NHV" in text  # the best of ours, Liger not counted
    assert "16777216 tokens fwd_bwd: persistent 84% of the run's copy" in text
    # torch's 1 us is not a candidate; 52 us fwd_bwd misses 40
    assert "65536 tokens fwd: persistent 18.0 us (<= 20)" in text and "persistent 52.0 us (<= 40)" in text
    assert "p50 0.25 s, 12.3 GB/s, read-back equal" in text
    # 2 x 3,087,007,744 bytes at 4,300 GB/s = 1.44 ms
    assert "floor 1.4 ms at this call's 4300 GB/s copy" in text
    assert text.splitlines()[0].endswith(f"ceilings measured by preflight: {json.dumps(preflight)}")
    _, statuses = h200_targets.judge_out_dir(tmp_path / "nothing")  # an empty call: nothing judged
    assert statuses == ["NOT RUN"] * 6


def test_preflight_ceilings_count_a_copy_twice_and_a_matmul_as_2_n_cubed():
    import preflight

    # 1 GiB copied in 0.5 ms: 2 x 1,073,741,824 B / 0.5 ms = 4,294.97 GB/s; 8192^3 x 2 in 1.4 ms = 785.4 TFLOP/s
    got = preflight.ceilings_from(copy_bytes=1 << 30, copy_s=0.5e-3, matmul_n=8192, matmul_s=1.4e-3)
    assert got == {"copy_gb_per_s": 4295.0, "matmul_bf16_tflops": 785.4}
