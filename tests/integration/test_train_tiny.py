"""The real `dapo-megatron train` on the tiny CPU config: launcher, CPU rollout engine, 2 gloo actor
ranks under torchrun, weight sync, checkpoints, resume; shortened to a few steps.

One tiny model is built and warm-started once for the module (tiny.cache_dir) and shared by:
  A  an uninterrupted 4-step run (checkpoint at steps 2 and 4)
  B  the same run stopped after step 2, then `--resume`d to step 4
A's steps 3-4 must equal B's, and A's per-step rewards must equal the golden curve in
tests/assets/tiny_golden.json (regenerate with DAPO_UPDATE_GOLDEN=1 after a deliberate change of the
maths, and say why in the commit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_train import EXACT_KEYS, FLOAT_KEYS, train_tiny

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "assets" / "tiny_golden.json"


@pytest.fixture(scope="module")
def runs(tiny_run_a):
    """A (conftest.py's tiny_run_a) and B: A's run stopped by SIGTERM after its first step (the stop
    request finishes the step in flight, checkpoints it and exits 143), then `--resume`d to step 4.
    One stopped-and-resumed run serves both the resume test (B's steps equal A's) and the SIGTERM
    test, which reads what the stop left in runs["stop"] (issue 42 item 9: one run, not two)."""
    root, cache, uninterrupted = tiny_run_a["root"], tiny_run_a["cache"], tiny_run_a["a"]  # conftest.py
    stop = stop_by_sigterm_then_resume(root / "b", cache)
    return {
        "root": root,
        "cache": cache,
        "a": uninterrupted,
        "b_first": stop["first"],
        "b": stop["resumed"],
        "stop": stop,
    }


def stop_by_sigterm_then_resume(out: Path, cache: Path) -> dict:
    """helpers_train.train_tiny's run with trainer.total_steps=4, sent SIGTERM once step 1 is in
    metrics.jsonl; its console, exit code, process family and survivors recorded; then resumed with
    `train CONFIG --resume key=value ...` (the flag before the overrides: issue 35 item 7) to step 4."""
    import signal
    import time

    import psutil

    cmd = [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "train",
        str(ROOT / "configs/runs/tiny_cpu.yaml"),
        f"trainer.output_dir={out}",
        f"tiny.cache_dir={cache}",
        "tiny.warm_start_steps=300",
        "trainer.eval_every=4",
        "trainer.save_every=2",
        "trainer.keep_checkpoints=2",
        "trainer.wandb_mode=disabled",
        "trainer.total_steps=4",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    console = out.parent / f"{out.name}_stopped_console.txt"
    with open(console, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    metrics = out / "metrics.jsonl"

    def first_step_logged() -> bool:
        return metrics.is_file() and any(json.loads(line)["step"] >= 1 for line in metrics.read_text().splitlines())

    deadline = time.monotonic() + 300
    while not first_step_logged() and time.monotonic() < deadline:
        assert proc.poll() is None, f"train exited before its first step:\n{console.read_text()[-3000:]}"
        time.sleep(0.2)
    assert first_step_logged(), "no step finished within 300 s"
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    status = [sys.executable, "-m", "dapo_megatron.cli", "status", str(out)]
    live = subprocess.run(status, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)  # while it runs
    t_signal = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=300)
    seconds = time.monotonic() - t_signal
    survivors = [p for p in family[1:] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    first = [json.loads(line) for line in metrics.read_text().splitlines()]
    resumed = subprocess.run(
        [*cmd[:5], "--resume", *cmd[5:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return {
        "out": out,
        "family": family,
        "rc": rc,
        "seconds": seconds,
        "console": console.read_text(),
        "survivors": [(p.pid, p.cmdline()[:4]) for p in survivors],
        "first": first,
        "resumed": [json.loads(line) for line in metrics.read_text().splitlines()],
        "resumed_output": resumed.stdout + resumed.stderr,
        "pid": proc.pid,
        "status_live": live.stdout + live.stderr,
        "status_done": subprocess.run(status, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60).stdout,
    }


def test_status_while_it_runs_and_the_log_across_a_resume(runs):
    """`dapo-megatron status` on the stopped-and-resumed run B: live (its launcher holds the lock) with its
    step and that step's tokens/s while it ran; finished after the resume. logs/train.log holds both
    starts' consoles, the second's header naming --resume."""
    stop, out = runs["stop"], runs["root"] / "b"
    live = stop["status_live"].splitlines()
    assert live[0].startswith(f"run {out}: live (local: pid {stop['pid']} on "), stop["status_live"]
    step = int(live[1].split()[1])
    assert live[1] == f"  step:        {step} of 4" and 1 <= step <= 4
    record = next(r for r in stop["first"] if r["step"] == step)

    def rate(value: float) -> str:  # as the status prints it: 812, 3.5K
        return f"{value / 1e3:.1f}K" if value >= 1e3 else f"{value:.0f}"

    keys = (("rollout", "throughput/rollout_tok_s"), ("train", "throughput/train_tok_s"))
    rates = [f"{name} {rate(record[key])} tok/s" for name, key in keys]
    assert live[2].endswith("; " + ", ".join(rates)), live[2]
    assert stop["status_done"].splitlines()[:2] == [f"run {out}: finished", "  step:        4 of 4"]
    log = (out / "logs" / "train.log").read_text().splitlines()
    headers = [line for line in log if line.startswith("===== ")]
    assert len(headers) == 2 and " --resume " in headers[1] and " --resume " not in headers[0]
    second = log[log.index(headers[1]) :]
    stopped_at = runs["b_first"][-1]["step"]  # the SIGTERM's step in flight, checkpointed: 1-3 with the load
    assert f"[train] resuming {out} from step {stopped_at} of 4 (step_{stopped_at:06d})" in second
    assert any(line.lstrip().startswith("1/4 ") for line in log[: log.index(headers[1])])  # the first start's table
    assert any(line.lstrip().startswith("4/4 ") for line in second) and "[train] done." in "\n".join(second)
    # the stop's checkpoint and the resume's load, each said in one line with its step and directory
    ckpt = out / "checkpoints" / f"step_{stopped_at:06d}"
    saved = [
        line for line in log[: log.index(headers[1])] if line.startswith(f"[checkpoint] step {stopped_at} saved: ")
    ]
    assert len(saved) == 1 and " MB in " in saved[0] and saved[0].endswith(f": {ckpt}"), saved
    loaded = [line for line in second if line.startswith(f"[checkpoint] resumed step {stopped_at} from {ckpt} (")]
    assert len(loaded) == 1 and " files): verified in " in loaded[0] and " s, actor loaded in " in loaded[0], loaded


def test_metrics_are_written_and_sane(runs):
    evals, steps = runs["a"][0], runs["a"][1:]
    assert evals["step"] == 0 and 0 < evals["eval/avg@k"] < 1 and evals["eval/num_prompts"] == 100
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        # 16 prompts x 8 responses per step, each response at most 16 tokens (the cap)
        assert r["sampler/groups_kept"] == 16 and r["sampler/rounds"] >= 1
        assert 0 < r["acc/mean"] < 1  # dynamic sampling keeps only mixed groups
        assert -2.0 <= r["reward/mean"] <= 1.0  # +-1 correctness plus at most -1 overlong penalty
        assert 0 < r["response_length/mean"] <= r["response_length/max"] <= 16
        assert r["actor/num_updates"] == 2  # 16 prompts / mini_batch_size 8
        assert r["actor/nonfinite"] == 0 and r["actor/grad_norm"] > 0
        # trainer log-probs vs the engine's on the same tokens: same fp32 weights after every sync
        assert r["mismatch/max"] < 1e-3
        assert r["actor/ratio_max"] >= 1.0 - 1e-6
    run_dir = runs["root"] / "a"
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    # keep_checkpoints=2 (step 2 stays for test_resume_skips_a_damaged_checkpoint); the best eval's
    # (keep_best_checkpoint) is step 4's; nothing half-written left
    assert ckpts == ["best.json", "step_000002", "step_000004"]
    assert json.loads((run_dir / "checkpoints" / "best.json").read_text()) == {
        "step": 4,
        "eval": steps[-1]["eval/avg@k"],
    }
    assert (run_dir / "checkpoints" / "step_000004" / "hf" / "config.json").is_file()
    assert (run_dir / "curves.png").stat().st_size > 0


def test_console_output(runs):
    """Start-up phase lines, a step table within 120 columns, no backend warning or loading bar, and a
    closing summary that names the run directory, the curves, the evals and the checkpoints."""
    run_dir = runs["root"] / "a"
    text = (run_dir / "console.txt").read_text()
    lines = text.splitlines()
    for phase in ("model", "rollout", "actor"):
        assert sum(line.startswith(f"[train] {phase}: ") for line in lines) >= 1, phase
    table = [line for line in lines if line.split()[:1] and "/4" in line.split()[0]]
    assert [line.split()[0] for line in table] == ["0/4", "1/4", "2/4", "3/4", "4/4"]
    assert max(len(line) for line in table) <= 120
    assert len({len(line.split()) for line in table}) == 1  # the same columns in every row
    assert "UserWarning" not in text and "Loading weights" not in text
    # every checkpoint said once, when it is in place: its step, size, files and directory
    saved = [line for line in lines if line.startswith("[checkpoint] step ") and " saved: " in line]
    assert [line.split(" saved: ")[0] for line in saved] == ["[checkpoint] step 2", "[checkpoint] step 4"]
    for step, line in zip((2, 4), saved):
        assert " MB in " in line and line.endswith(f": {run_dir / 'checkpoints' / f'step_{step:06d}'}"), line
    evals = [r for r in runs["a"] if "eval/avg@k" in r]
    assert f"[train] done. run directory: {run_dir}" in lines
    assert f"  curves:       {run_dir / 'curves.png'}" in lines
    assert (
        f"  final eval:   avg@8 {evals[-1]['eval/avg@k']:.1%} at step 4, pass@8 {evals[-1]['eval/pass@k']:.1%}" in lines
    )
    assert f"  checkpoints:  step_000002, step_000004 in {run_dir / 'checkpoints'}" in lines
    assert (
        f"  best ckpt:    {run_dir / 'checkpoints' / 'step_000004'} (eval {evals[-1]['eval/avg@k']:.1%}, "
        "kept by trainer.keep_best_checkpoint)" in lines
    )
    # resuming the finished run: nothing to do, said at once
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dapo_megatron.cli",
            "train",
            str(ROOT / "configs/runs/tiny_cpu.yaml"),
            f"trainer.output_dir={run_dir}",
            "trainer.total_steps=4",
            "--resume",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "already at step 4 of 4 (trainer.total_steps): nothing to do" in proc.stdout


def test_resume_continues_as_if_never_stopped(runs):
    a, b = runs["a"], runs["b"]
    # B stopped by SIGTERM after step 1 was logged: the step in flight finished (test_sigterm_... below)
    stopped_at = runs["b_first"][-1]["step"]
    assert 1 <= stopped_at < 4 and [r["step"] for r in runs["b_first"]] == list(range(stopped_at + 1))
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]  # the resumed run's file reads as one run
    for ra, rb in zip(a, b):
        for key in EXACT_KEYS + ("eval/avg@k",):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
        for key in FLOAT_KEYS if ra["step"] else ():
            # the same tokens through the same deterministic gloo/fp32 maths: identical to the bit
            assert ra[key] == rb[key], (ra["step"], key, ra[key], rb[key])


def test_resume_skips_a_damaged_checkpoint_and_names_the_file(runs):
    """A copy of run A whose newest checkpoint lost its largest actor shard (truncated to 0 bytes):
    --resume names that file, sets step 4 aside, resumes from step 2, and retrains steps 3-4 exactly
    as the uninterrupted run did."""
    import shutil

    src, dst = runs["root"] / "a", runs["root"] / "damaged"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("engines", "logs"))
    shards = [p for p in (dst / "checkpoints" / "step_000004" / "actor").rglob("*") if p.is_file()]
    biggest = max(shards, key=lambda p: p.stat().st_size)
    biggest.write_bytes(b"")
    log = dst / "resume.log"
    rows = train_tiny(dst, runs["cache"], "trainer.total_steps=4", "--resume", log=log)  # A's warm start: a cache hit
    said = log.read_text()
    assert f"{biggest}: 0 bytes" in said and "resuming from step_000002" in said, said[-3000:]
    assert (dst / "checkpoints" / "step_000004.corrupt").is_dir()
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for ra, rd in zip(runs["a"][3:], rows[3:]):
        for key in EXACT_KEYS + FLOAT_KEYS:
            assert ra[key] == rd[key], (ra["step"], key)


@pytest.mark.parametrize(
    "label,override,under",
    [("tp2", "actor.tp=2", "TP=2 PP=1 CP=1 DP=1"), ("pp2", "actor.pp=2", "TP=1 PP=2 CP=1 DP=1")],
    ids=["tensor-parallel", "pipeline-parallel"],
)
def test_resume_under_another_parallel_layout_trains_on(runs, label, override, under):
    """A copy of run A (TP=1 x DP=2) cut back to its step-2 checkpoint, resumed under actor.tp=2 (DP=1) and
    under actor.pp=2: the launcher says the layout change in one line, the checkpoint reshards (model,
    optimizer, RNG re-derived), and the run trains on. The weights the engine receives at step 3 are the saved
    ones exactly (resharding moves values: tests/distributed/test_actor_reshard.py), so step 3 samples the same
    tokens with the same data cursor as A: its rollout metrics equal A's; the lr schedule continues (A's
    lr at steps 3 and 4); the run ends with an eval of step 4."""
    import shutil

    src, dst = runs["root"] / "a", runs["root"] / label
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("engines", "logs"))
    shutil.rmtree(dst / "checkpoints" / "step_000004")
    log = dst / "resume.log"
    rows = train_tiny(dst, runs["cache"], "trainer.total_steps=4", override, "--resume", log=log)
    said = log.read_text()
    assert (
        f"[train] resuming step 2 saved at TP=1 PP=1 CP=1 DP=2 under {under}: resharding (model and "
        "optimizer through megatron's global-shape checkpoint, RNG states re-derived from trainer.seed)"
    ) in said, said[-3000:]
    assert f"RNG states of TP=1 PP=1 CP=1 DP=2 do not map to {under}" in said
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    a = {r["step"]: r for r in runs["a"]}
    for key in EXACT_KEYS:
        assert rows[3][key] == a[3][key], key
    for step in (3, 4):
        assert rows[step]["actor/lr"] == a[step]["actor/lr"], step
        assert rows[step]["actor/grad_norm"] > 0 and rows[step].get("actor/update_skipped", 0) == 0
    assert "eval/avg@k" in rows[4]
    meta = json.loads((dst / "checkpoints" / "step_000004" / "actor" / "actor_state.json").read_text())
    sizes = dict(item.split("=") for item in under.lower().split())
    assert {k: meta["layout"][k] for k in sizes} == {k: int(v) for k, v in sizes.items()}
    assert meta["optimizer_format"] == "fully_reshardable"


def numerics_fingerprint() -> str:
    """The bits this machine's floating point gives for the computations a tiny run is made of: a
    fixed fp32 matmul + log-softmax, and 3 steps of the warm start itself (tiny Qwen2 forward,
    backward, AdamW) in a temporary directory, hashed with torch's CPU kernel path. A matmul alone was
    not enough: two machines agreed on it and still warm-started to different models (the 300-step
    warm start is chaotic: docs/LOG.md, 2026-11-22), hence different, equally valid, reward curves."""
    import hashlib
    import tempfile

    import torch
    from safetensors.torch import load_file

    from dapo_megatron.data.tiny_model import build_tiny_model, warm_start

    h = hashlib.sha256(torch.backends.cpu.get_cpu_capability().encode())
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 512, generator=g), torch.randn(512, 64, generator=g)
    h.update(torch.log_softmax(a @ b, dim=-1).numpy().tobytes())
    with tempfile.TemporaryDirectory() as tmp:
        prompts = [f"What is {i} + {2 * i + 1}?" for i in range(8)]
        answers = [str(3 * i + 1) for i in range(8)]
        warm = warm_start(
            build_tiny_model(tmp, seed=0),
            tmp,
            prompts=prompts,
            answers=answers,
            steps=3,
            batch_size=4,
            lr=1e-3,
            seed=0,
            label_smoothing=0.1,
        )
        weights = load_file(str(warm / "model.safetensors"))
        for name in sorted(weights):
            h.update(weights[name].numpy().tobytes())
    return "v2-" + h.hexdigest()[:16]


def test_golden_reward_curve(runs):
    """Golden curves are kept per numerics fingerprint: on a machine whose floating point matches one
    that made a golden curve, the curve must be reproduced exactly (a change of the maths shows up)."""
    curve = [{k: r[k] for k in EXACT_KEYS} for r in runs["a"][1:]]
    goldens = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
    fingerprint = numerics_fingerprint()
    if os.environ.get("DAPO_UPDATE_GOLDEN"):
        goldens[fingerprint] = curve
        GOLDEN.write_text(json.dumps(goldens, indent=1) + "\n")
    if fingerprint not in goldens:
        pytest.skip(
            f"no golden curve for this machine's floating point (fingerprint {fingerprint}; known: "
            f"{sorted(goldens)}): run with DAPO_UPDATE_GOLDEN=1 on it to record one"
        )
    assert curve == goldens[fingerprint]


def test_eval_files_agree_with_metrics(tiny_run_a):
    """Every eval of the run (steps 0 and 4) wrote <run_dir>/evals/step_N.json, and metrics.jsonl's eval/*
    values are that file's numbers; the file's per-problem records add up to its summary."""
    from dapo_megatron.algo.eval_stats import pass_at_k
    from dapo_megatron.trainer.evaluation.report import read_eval_file, report_metrics

    run_dir = tiny_run_a["root"] / "a"
    rows = [r for r in tiny_run_a["a"] if "eval/avg@k" in r]
    assert [r["step"] for r in rows] == [0, 4]
    assert sorted(p.name for p in (run_dir / "evals").iterdir()) == ["step_000000.json", "step_000004.json"]
    for row in rows:
        (report,) = read_eval_file(run_dir / "evals" / f"step_{row['step']:06d}.json").values()
        logged = {k: v for k, v in row.items() if k.startswith("eval/")}
        assert report_metrics(report) == logged  # the same keys, the same floats
        assert report["step"] == row["step"] and report["k"] == 8 and report["num_prompts"] == 100
        problems = report["problems"]
        assert [p["index"] for p in problems] == list(range(100))
        assert all(
            p["n"] == 8
            and sum(p["answers"].values()) == 8
            and 0 <= p["truncated"] <= 8
            and 0 < p["mean_response_tokens"] <= 16
            and p["data_source"] == "math_dapo"
            for p in problems
        )
        assert sum(p["correct"] for p in problems) / 800 == pytest.approx(report["avg@k"], abs=1e-12)
        correct = [[1.0] * p["correct"] + [0.0] * (8 - p["correct"]) for p in problems]
        for j in (1, 2, 4, 8):
            assert report[f"pass@{j}"] == pytest.approx(float(pass_at_k(correct, k=j).mean()), abs=1e-12)
        assert report["pass@k"] == report["pass@8"] and report["pass@1"] == pytest.approx(report["avg@k"], abs=1e-12)
        low, high = report["avg@k_ci95"]
        assert low < report["avg@k"] < high and report["interval"]["resamples"] == 2000
        assert 0 <= report["maj@k"] <= 1
        print(
            f"step {row['step']}: avg@8 {report['avg@k']:.4f} [{low:.4f}, {high:.4f}] maj@8 {report['maj@k']:.4f} "
            f"pass@8 {report['pass@8']:.4f}"
        )


def test_eval_command_reproduces_the_training_eval(tiny_run_a):
    """`dapo-megatron eval` on the step-4 checkpoint's HF export samples the same requests (same
    seeds) from the same weights the engines had at step 4: the same numbers and the same per-problem
    answers as the run's evals/step_000004.json, and `eval --compare` finds no difference between them."""
    run_dir = tiny_run_a["root"] / "a"
    out = run_dir / "eval_step4.json"
    cmd = [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "eval",
        str(ROOT / "configs/runs/tiny_cpu.yaml"),
        f"trainer.output_dir={run_dir}",
        "--checkpoint",
        str(run_dir / "checkpoints" / "step_000004"),
        "--output",
        str(out),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    logged = tiny_run_a["a"][-1]
    assert result["k"] == 8 and result["num_prompts"] == 100 and result["step"] == 4
    assert type(result["k"]) is int and type(result["num_prompts"]) is int  # counts, not the logged floats
    assert result["avg@k"] == logged["eval/avg@k"]
    assert result["pass@k"] == logged["eval/pass@k"]
    assert result["avg@k_ci95"] == [logged["eval/avg@k_ci95_low"], logged["eval/avg@k_ci95_high"]]
    trained = json.loads((run_dir / "evals" / "step_000004.json").read_text())
    assert result["problems"] == trained["problems"]
    compare = [sys.executable, "-m", "dapo_megatron.cli", "eval", "--compare"]
    proc = subprocess.run(compare + [str(out), str(run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "B-A +0.0% [+0.0%, +0.0%] (95% paired bootstrap, 100 problems): no clear difference" in proc.stdout

    # two eval sets (data.eval_sets): the held-out problems 0-49 and 50-99 as files. Set "first" is asked
    # the same requests as problems 0-49 (same rids and seeds): the same records; "second" the same problems
    from dapo_megatron.config import load_config
    from dapo_megatron.data.datasets import train_and_eval_sets

    (held_out,) = train_and_eval_sets(load_config(ROOT / "configs/runs/tiny_cpu.yaml").data)[1].values()
    files = {}
    for name, part in (("first", held_out[:50]), ("second", held_out[50:])):
        files[name] = run_dir / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r.to_row()) + "\n" for r in part))
    two = run_dir / "eval_step4_two_sets.json"
    proc = subprocess.run(
        cmd[:5] + [f"data.eval_sets={{first: {files['first']}, second: {files['second']}}}"] + cmd[5:-1] + [str(two)],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    sets = json.loads(two.read_text())["sets"]
    assert list(sets) == ["first", "second"] and [sets[n]["num_prompts"] for n in sets] == [50, 50]
    assert sets["first"]["problems"] == trained["problems"][:50]
    assert [p["prompt_hash"] for p in sets["second"]["problems"]] == [
        p["prompt_hash"] for p in trained["problems"][50:]
    ]
    proc = subprocess.run(compare + [str(out), str(two)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "none in common" in proc.stderr, proc.stderr[-2000:]


def test_sigterm_is_a_stop_request_then_resume_continues(runs):
    """SIGTERM to a local `train` (what a terminal close or `kill` sends) is a stop request like Slurm's
    preemption (launch/local/stop.py): the step in flight finishes and is checkpointed, one line says
    so, the command exits 143 with no traceback, and no process of the run is left (engine, torchrun,
    ranks, Megatron's checkpoint helpers). Then `--resume` (a flag before an override: issue 35 item 7)
    continues from that checkpoint, with no FutureWarning from megatron's checkpoint loading.
    The run is B of the `runs` fixture (stopped after step 1 was logged, resumed to step 4), whose
    resumed steps test_resume_continues_as_if_never_stopped compares with A's."""
    import re

    stop = runs["stop"]
    out, text = stop["out"], stop["console"]
    assert len(stop["family"]) >= 5  # launcher, engine, torchrun and 2 ranks
    assert stop["rc"] == 143, text[-4000:]
    stops = re.findall(r"^stopped at step (\d+) \(SIGTERM\): checkpoint (\S+); continue with --resume$", text, re.M)
    assert len(stops) == 1, text[-4000:]
    step, checkpoint = int(stops[0][0]), Path(stops[0][1])
    assert "Traceback" not in text, text[-6000:]
    # the step in flight was finished, not dropped: the signal came after step 1 had logged
    assert step >= 1 and checkpoint == out / "checkpoints" / f"step_{step:06d}" and (checkpoint / "actor").is_dir()
    # steps 1..step after the step-0 eval (eval_every=4 evaluates the warm start first)
    assert [r["step"] for r in stop["first"]] == list(range(step + 1))
    assert not stop["survivors"], stop["survivors"]
    seconds = stop["seconds"]
    print(f"\n[stop request] SIGTERM after step 1 logged -> exit 143 in {seconds:.1f} s, checkpoint step {step}")

    # `train CONFIG --resume key=value ...`: the flag before the overrides (refused before issue 35)
    assert [r["step"] for r in runs["b"]] == list(range(5))  # continued from step+1 to step 4
    assert (out / "checkpoints" / "step_000004").is_dir()  # the resumed run's own checkpoint
    assert "FutureWarning" not in stop["resumed_output"], stop["resumed_output"][-6000:]
