"""The real `dapo-megatron train` on the tiny CPU config with rollout.max_staleness=1 (launcher, CPU
rollout engine, 2 gloo actor ranks, weight pushes inside a retract pause), shortened to 4 steps:
no sample staler than 1 is trained on, every step's samples are all counted in the histogram, the
first batch is on-policy (its behaviour weight is 1 up to engine/trainer numerics), batches are
generated while earlier steps train (the timeline's order), the engine's own stamps of each batch lie
inside the driver's collect of it, and the timeline PNG is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_staleness_one_run(tmp_path, tiny_cache):
    out = tmp_path / "run"  # the session's warm-started tiny model (conftest.py: tiny_cache), not a new one
    cmd = [
        sys.executable,
        "-m",
        "dapo_megatron.cli",
        "train",
        str(ROOT / "configs/runs/tiny_cpu.yaml"),
        f"trainer.output_dir={out}",
        f"tiny.cache_dir={tiny_cache}",
        "tiny.warm_start_steps=300",
        "trainer.total_steps=4",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "trainer.keep_best_checkpoint=false",
        "trainer.wandb_mode=disabled",
        "rollout.placement=disaggregated",
        "rollout.max_staleness=1",
        "algorithm.tis_cap=2.0",
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    responses = 16 * 8  # trainer.train_batch_size x rollout.n
    for r in steps:
        assert r["overlap/staleness_gt1"] == 0 and r["overlap/groups_dropped_stale"] == 0
        assert r["overlap/staleness_0"] + r["overlap/staleness_1"] == responses
        assert r["actor/num_tokens"] > 0
    # batch 0 is made by the start-up weights and trained at step 0: on-policy, weight 1 up to numerics
    assert steps[0]["overlap/staleness_0"] == responses and steps[0]["overlap/staleness_mean"] == 0
    assert abs(steps[0]["actor/tis_weight"] - 1.0) < 1e-4
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    start = {(t["phase"], t["step"]): t["start"] for t in timeline}
    for j in range(1, 4):  # batch j is requested as step j-1 starts, before its weight push
        assert start[("generate", j)] < start[("sync", j - 1)]
    assert {t["phase"] for t in timeline} >= {"engine", "generate", "wait", "train", "sync", "paused"}
    # the engine's own stamps of batch j lie inside the driver's collect of batch j (one clock here)
    gen = {t["step"]: (t["start"], t["end"]) for t in timeline if t["phase"] == "generate"}
    engine = [t for t in timeline if t["phase"] == "engine"]
    assert {t["step"] for t in engine} == set(gen) == {0, 1, 2, 3}
    for t in engine:
        assert gen[t["step"]][0] <= t["start"] < t["end"] <= gen[t["step"]][1], (t, gen[t["step"]])
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_staleness_one_survives_its_only_engine_killed(tmp_path, tiny_cache):
    """The only engine SIGKILLed once step 1 is logged, while batches are generated ahead: the launcher
    restarts it and the run ends all its steps (trainer/recovery.py: the producer's batch fails with
    NoLiveEngine, the driver re-syncs the returned engine and a new producer starts at that batch; or,
    when the kill lands in a push, the sync's own recovery), still never training on a sample staler
    than 1, every step's samples all counted."""
    from helpers_train import step_logged, step_rows, train_killing_engine

    out = tmp_path / "k"
    rc, console, _ = train_killing_engine(
        out,
        tiny_cache,
        "rollout.placement=disaggregated",
        "rollout.max_staleness=1",
        "algorithm.tis_cap=2.0",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        kills=(step_logged(1),),
    )
    assert rc == 0, console[-4000:]
    steps = step_rows(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert r["overlap/staleness_gt1"] == 0
        assert r["overlap/staleness_0"] + r["overlap/staleness_1"] == 16 * 8
    assert steps[-1]["engines/restarted_total"] == 1
    assert "Task exception was never retrieved" not in console  # the failed batch's other requests are quiet
