"""Benchmark plumbing that runs without a GPU: quantiles, the results CSV, the no-GPU entry point.

Run: pytest tests/kernels/test_bench_common.py -q
"""

from __future__ import annotations

import csv

import pytest
import torch

import dapo_kernels
from dapo_kernels.bench import common, run


def test_quantiles_are_median_p20_p80():
    # inclusive interpolation over 1..5: p20 = 1 + 0.2 * 4 = 1.8, p80 = 1 + 0.8 * 4 = 4.2
    assert common.quantiles([5.0, 1.0, 3.0, 2.0, 4.0]) == pytest.approx((3.0, 1.8, 4.2))
    assert common.quantiles([7.0]) == (7.0, 7.0, 7.0)


def test_csv_header_once_then_rows(tmp_path):
    path = tmp_path / "results.csv"
    for p50 in (1.5, 2.5):
        out = common.CsvWriter(path, "policy_loss")
        out.add("fused", "fwd_bwd", "ms", "ms", "T=1024", p50, 1.0, 3.0)
        out.add("torch", "fwd_bwd", "ms", "ms", "T=1024", "oom")
        out.flush()
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == list(common.CSV_FIELDS)
    assert [(r["provider"], r["p50"], r["p20"], r["p80"]) for r in rows] == [
        ("fused", "1.5", "1", "3"),
        ("torch", "oom", "oom", "oom"),
        ("fused", "2.5", "1", "3"),
        ("torch", "oom", "oom", "oom"),
    ]
    assert rows[0]["kernel"] == "policy_loss" and rows[0]["device"] == common.device_name()


@pytest.mark.skipif(torch.cuda.is_available() or not dapo_kernels.INTERPRET, reason="the no-GPU path")
def test_bench_without_gpu_runs_the_correctness_pass(capsys):
    assert run.main(["--kernels", "logprob"]) == 0
    printed = capsys.readouterr().out
    assert "no CUDA GPU" in printed and printed.count(" ok") == 3 and "FAIL" not in printed


def test_kernels_compile_for_hopper_without_a_gpu():
    """Compile mode is stricter than the interpreter: build every kernel for sm_90 with triton's
    bundled ptxas (no GPU needed) and read the SASS (cuobjdump): the tl.dot forward's K loop is
    pipelined with wgmma; the persistent TMA kernels (logprob_persistent.py) do what their design
    claims: HGMMA (wgmma) in the 16-bit matrix loops, UTMALDG (TMA tensor loads) and no cp.async for the
    operands, no local-memory spill (LDL/STL), shared memory within the H100's 227 KiB."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "dapo_kernels.bench.compile_check", "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header, *lines = proc.stdout.splitlines()
    columns = header.split()[1:-1]  # between "kernel" (a name with spaces) and "error" (empty on success)
    rows = {line.split("  ")[0].strip(): dict(zip(columns, line.split()[-len(columns) :])) for line in lines}
    bf16_fwd = next(v for k, v in rows.items() if k.startswith("logprob fwd bf16"))
    assert int(bf16_fwd["stages"]) >= 3 and bf16_fwd["wgmma"] == "True" and int(bf16_fwd["shared_KiB"]) <= 227
    tma = {k: v for k, v in rows.items() if k.startswith("tma ")}
    assert {k.split()[1] for k in tma} == {"fwd", "dlogits"} and {k.split()[2] for k in tma} == {"bf16", "fp16", "fp32"}
    for name, row in tma.items():
        assert int(row["UTMALDG"]) > 0 and int(row["LDGSTS"]) == 0, name
        assert int(row["LDL"]) == 0 and int(row["STL"]) == 0 and int(row["stack"]) == 0, name
        assert int(row["shared_KiB"]) <= 227, name
        assert (int(row["HGMMA"]) > 0) == ("fp32" not in name), name  # fp32: exact FMA dot, no wgmma


@pytest.mark.skipif(
    not dapo_kernels.INTERPRET,
    reason="the CPU dry run needs the Triton interpreter (on a GPU, run_all.sh runs the real benchmark)",
)
def test_benchmark_code_runs_on_cpu_dry_run(tmp_path):
    """The benchmark scripts themselves (not their timings) on CPU in the interpreter: a bug there
    should cost no GPU time. Every provider available here writes its rows for both modes."""
    path = tmp_path / "dry.csv"
    code = run.main(
        [
            "--cpu-dry-run",
            "--csv",
            str(path),
            "--models",
            "32x130",
            "--n",
            "20",
            "--tp",
            "2",
            "--tokens",
            "300",
            "--repeats",
            "1",
            "--providers",
            "fused,fused_cublas,fused_tma,fused_rowchunk,torch,chunked,liger",
            "--loss-providers",
            "fused,fused_two_launch,torch",
        ]
    )
    assert code == 0
    rows = list(csv.DictReader(path.open()))
    logprob_rows = {(r["provider"], r["mode"], r["metric"]) for r in rows if r["kernel"] == "linear_logprob_entropy"}
    for provider in ("fused", "fused_cublas", "fused_tma", "fused_rowchunk", "torch", "chunked"):
        for mode in ("fwd", "fwd_bwd"):
            assert {(provider, mode, m) for m in ("ms", "tflops", "pct_of_matmul")} <= logprob_rows
    # the memory formula is written next to every fwd_bwd row of the providers it models
    assert {("fused", "fwd_bwd", "extra_mem_model"), ("fused_rowchunk", "fwd_bwd", "extra_mem_model")} <= logprob_rows
    assert all(r["x"] == "N=20,H=32,V=130,tp=2" and r["device"] == "cpu" for r in rows if r["kernel"] != "policy_loss")
    loss_rows = {(r["provider"], r["mode"], r["metric"]) for r in rows if r["kernel"] == "policy_loss"}
    assert {
        ("fused", "fwd", "bandwidth"),
        ("fused", "fwd_bwd", "ms"),
        ("torch", "fwd_bwd", "bandwidth"),
        ("fused_two_launch", "fwd", "bandwidth"),
    } <= loss_rows
    with pytest.raises(ValueError, match="--csv"):
        run.main(["--cpu-dry-run"])


def test_memory_model_matches_liger_on_the_h100_and_ours_stays_below(monkeypatch):
    """Liger's formula against the six fwd+bwd rows measured on an H100 (2026-11-25, GiB above the
    inputs, issue 27), and the blocked / cublas fused heads at or under it on every default row."""
    import dapo_kernels.logprob as logprob_mod
    from dapo_kernels.bench import memory_model

    monkeypatch.setattr(logprob_mod, "CHUNK_ROW_ALIGN", 128)  # as compiled
    measured = {
        ("7b", 1, 4096): 1.12,
        ("7b", 1, 16384): 1.42,
        ("7b", 8, 16384): 0.53,
        ("32b", 1, 65536): 4.40,
        ("32b", 8, 16384): 0.63,
        ("32b", 8, 65536): 1.97,
    }
    for (model, tp, n), gib in measured.items():
        h, v = memory_model.MODELS[model]
        assert abs(memory_model.liger_bytes(n, h, v // tp) / 2**30 - gib) <= 0.011, (model, tp, n)
    rows = memory_model.rows(["7b", "32b"], [1, 4, 8], [4096, 16384, 32768, 65536])
    assert len(rows) == 24
    for row in rows:
        assert row["blocked_GiB"] <= row["liger_GiB"] and row["cublas_GiB"] <= row["liger_GiB"], row


@pytest.mark.skipif(not dapo_kernels.INTERPRET, reason="the CPU dry run needs the Triton interpreter")
def test_variants_script_times_every_chosen_variant_of_one_shape(tmp_path, capsys):
    """kernels/bench/variants_logprob.py on CPU (its code, not its timings): the matmul ceiling and every
    chosen variant in both modes land in the CSV, each of ours checked against `fused`; a name it does
    not know is refused with the list of those it does."""
    from dapo_kernels.bench import variants_logprob

    path = tmp_path / "variants.csv"
    tma = next(iter(variants_logprob.tma_variants()))
    assert variants_logprob.main(["--cpu-dry-run", "--csv", str(path), "--variants", f"fused,{tma},liger"]) == 0
    rows = list(csv.DictReader(path.open()))
    timed = {(r["provider"], r["mode"]) for r in rows if r["metric"] == "ms"}
    assert {("fused", "fwd"), ("fused", "fwd_bwd"), (tma, "fwd"), (tma, "fwd_bwd")} <= timed
    assert any(r["provider"] == "cublas_bf16_matmul" for r in rows)
    assert all(r["x"] == "N=20,H=32,V=260,tp=2" and r["device"] == "cpu" for r in rows)
    printed = capsys.readouterr().out
    assert "MISMATCH" not in printed and f"{tma}  " in printed
    with pytest.raises(ValueError, match=r"--variants: unknown \['nope'\]"):
        variants_logprob.main(["--cpu-dry-run", "--csv", str(path), "--variants", "fused,nope"])


@pytest.mark.skipif(not dapo_kernels.INTERPRET, reason="the CPU dry run needs the Triton interpreter")
def test_variants_script_runs_fused_tma_and_liger_first_and_keeps_each_variants_rows(tmp_path, monkeypatch):
    """Issue 49: the comparison the GPU call is for (fused_tma's default tiles vs Liger) comes first, and a
    variant that dies (a budget kill, a crash) leaves the rows of every variant before it in the CSV."""
    from dapo_kernels import logprob_persistent
    from dapo_kernels.bench import variants_logprob

    tma = list(variants_logprob.tma_variants())
    order = variants_logprob.default_variants()
    assert order == [tma[0], "liger", *tma[1:], "fused", "fused_cublas", "fused_rowchunk"]
    assert variants_logprob.tma_variants()[tma[0]] == logprob_persistent.hopper_configs()[0]  # fused_tma's TILES

    real = variants_logprob._time_variant

    def dies_at_fused(variant, *args, **kwargs):
        if variant == "fused":
            raise KeyboardInterrupt("the budget's kill")
        return real(variant, *args, **kwargs)

    monkeypatch.setattr(variants_logprob, "_time_variant", dies_at_fused)
    path = tmp_path / "variants.csv"
    with pytest.raises(KeyboardInterrupt):
        variants_logprob.main(["--cpu-dry-run", "--csv", str(path), "--variants", f"{tma[0]},{tma[1]},fused"])
    rows = list(csv.DictReader(path.open()))
    timed = [(r["provider"], r["mode"]) for r in rows if r["metric"] == "ms"]
    assert timed == [(tma[0], "fwd"), (tma[0], "fwd_bwd"), (tma[1], "fwd"), (tma[1], "fwd_bwd")]


@pytest.mark.skipif(not dapo_kernels.INTERPRET, reason="the CPU dry run needs the Triton interpreter")
def test_variants_script_keeps_the_other_variants_when_one_raises(tmp_path, monkeypatch):
    """A variant with a bug (fused_tma has never run on a GPU) gets an error row; Liger after it still runs."""
    from dapo_kernels.bench import variants_logprob

    tma = next(iter(variants_logprob.tma_variants()))
    real = variants_logprob._time_variant

    def tma_breaks(variant, *args, **kwargs):
        if variant == tma:
            raise RuntimeError("a TMA descriptor this triton refuses")
        return real(variant, *args, **kwargs)

    monkeypatch.setattr(variants_logprob, "_time_variant", tma_breaks)
    path = tmp_path / "variants.csv"
    assert variants_logprob.main(["--cpu-dry-run", "--csv", str(path), "--variants", f"{tma},fused"]) == 1
    rows = list(csv.DictReader(path.open()))
    assert [(r["mode"], r["p50"]) for r in rows if r["provider"] == tma] == [("fwd", "error")]
    assert {(r["mode"], r["metric"]) for r in rows if r["provider"] == "fused"} >= {
        ("fwd", "ms"),
        ("fwd_bwd", "tflops"),
    }


def test_variants_reference_is_float32_log_softmax_in_row_chunks():
    """The log-probs every variant is checked against, by hand on a tiny case: chunking changes nothing."""
    from dapo_kernels.bench import variants_logprob

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(7, 5, generator=gen).to(torch.bfloat16)
    weight = torch.randn(11, 5, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, 11, (7,), generator=gen)
    logits = hidden.double() @ weight.double().T
    want = logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    full = variants_logprob.reference_logprob(hidden, weight, targets)
    old = variants_logprob.REFERENCE_CHUNK_ROWS
    try:
        variants_logprob.REFERENCE_CHUNK_ROWS = 3
        chunked = variants_logprob.reference_logprob(hidden, weight, targets)
    finally:
        variants_logprob.REFERENCE_CHUNK_ROWS = old
    assert full.dtype == torch.float32 and torch.equal(full, chunked)
    assert torch.allclose(full.double(), want, rtol=0, atol=1e-5)
