"""`check-parity --fused-logprob`: the actor's LM head (hidden states -> dapo_kernels'
vocab-parallel fused log-prob/entropy kernel, Triton interpreter on CPU) on Megatron gloo ranks,
against transformers, for tiny models of different shapes:

  qwen2_v300       Qwen2, vocab 300, untied, 4 heads / 2 KV groups (GQA 2:1), q/k/v biases
  llama_v301_tied  Llama, vocab 301 (odd), tied embeddings, 8 heads / 2 KV groups (GQA 4:1)
  qwen2_v100_mha   Qwen2, vocab 100 (< 128: at TP=2 Megatron's padding to 256 rows leaves TP rank 1
                   with padding only), tied, MHA (4 KV heads)
  llama_v257_gqa3  Llama, hidden 96, 6 heads of 16 / 2 KV groups (GQA 3:1), vocab 257, untied
  qwen2_v8191      Qwen2, hidden 128, vocab 8191 (16 vocab tiles per TP rank in the interpreter); its
                   activations are large enough that transformers' own fp32 error reaches ~1e-5
                   (the check's limit: max(1e-5, 2x that), both reported)

Each passes at TP=2 with sequence parallelism (log-probs AND entropies within 1e-5 of float64
transformers, or 2x transformers' own fp32 error where that is larger; the fused and plain-torch
heads on the same hidden states within 4 ulps of the largest log-prob, head gradients within 1e-5
relative, the command's default limit being 1e-4), plus TP=1,
TP=2 without SP, PP=2, Megatron-LM's padding rule vs the actor's (--vocab-divisible-by 1), odd
sequence lengths under SP (rows padded to a multiple of tp) and context parallelism (CP=2). The
command itself runs under torchrun once, the way a user runs it (and the way a model written by
someone else is checked), without TRITON_INTERPRET in its environment.

    pytest tests/distributed/test_parity_fused.py -q -s      (-s prints the measured differences)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers_tiny import save_tiny_hf

TOLERANCE = 1e-5
SEQS, SEQ_LEN = 3, 16

MODELS = {
    "qwen2_v300": dict(arch="qwen2", tied=False, shape=None),
    "llama_v301_tied": dict(arch="llama", tied=True, shape=dict(vocab_size=301, num_attention_heads=8)),
    "qwen2_v100_mha": dict(arch="qwen2", tied=True, shape=dict(vocab_size=100, num_key_value_heads=4)),
    "llama_v257_gqa3": dict(
        arch="llama",
        tied=False,
        shape=dict(vocab_size=257, hidden_size=96, num_attention_heads=6, intermediate_size=160),
    ),
    "qwen2_v8191": dict(arch="qwen2", tied=False, shape=dict(vocab_size=8191, hidden_size=128, intermediate_size=256)),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity_fused")
    return {name: str(save_tiny_hf(root / name, seed=i, **spec)) for i, (name, spec) in enumerate(MODELS.items())}


def _check_rank(argv):
    from dapo_megatron.tools.parity import run_check

    return run_check(argv)


def _run(rank_pool, world, hf_dir, *extra):
    argv = ["--model", hf_dir, "--seqs", str(SEQS), "--seq-len", str(SEQ_LEN), "--fused-logprob", *extra]
    results = rank_pool(world).run(_check_rank, argv)
    assert all(r == results[0] for r in results)  # every rank returns the driver's verdict
    return results[0]


def _assert_passes(numbers, label):
    from dapo_megatron.tools.parity import failures

    print(
        f"\n[check-parity --fused-logprob] {label}: max|logprob| {numbers['max_abs_logprob']:.1f}, "
        f"logprob {numbers['logprob']:.2e} (fp32 floor {numbers['fp32_floor_logprob']:.2e}), "
        f"entropy {numbers['entropy']:.2e} (floor {numbers['fp32_floor_entropy']:.2e}), head grad rel "
        f"{numbers['grad_rel']:.2e}, fused vs torch head logprob {numbers['fused_vs_torch_logprob']:.2e} "
        f"entropy {numbers['fused_vs_torch_entropy']:.2e}"
    )
    assert failures(numbers, tolerance=TOLERANCE, grad_tolerance=1e-5) == []  # the command's grad limit: 1e-4
    assert numbers["fp32_floor_logprob"] > 0  # CPU: transformers ran in float64 and in fp32
    # the two heads see the same hidden states: they differ by fp32 summation order only, a few ulps
    # of the largest log-prob (2^-23 relative)
    ulps = 4 * numbers["max_abs_logprob"] * 2.0**-23
    assert numbers["fused_vs_torch_logprob"] <= ulps and numbers["fused_vs_torch_entropy"] <= ulps
    assert numbers["grad_rel"] > 0 and numbers["fused_vs_torch_logprob"] > 0  # two different computations


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_sequence_parallel(rank_pool, model_dirs, name):
    _assert_passes(_run(rank_pool, 2, model_dirs[name], "--tp", "2", "--sequence-parallel"), f"{name} tp=2 sp")


@pytest.mark.parametrize(
    "world,extra",
    [
        (2, ("--tp", "1")),
        (2, ("--tp", "2")),
        (2, ("--tp", "1", "--pp", "2")),
        (2, ("--tp", "2", "--sequence-parallel", "--vocab-divisible-by", "1")),
        (2, ("--tp", "2", "--sequence-parallel", "--seq-len", "15")),
        (2, ("--tp", "1", "--cp", "2", "--seq-len", "15")),
    ],
    ids=["tp1_dp2", "tp2", "pp2", "tp2_sp_actor_padding", "tp2_sp_odd_rows", "cp2"],
)
def test_other_layouts(rank_pool, model_dirs, world, extra):
    _assert_passes(_run(rank_pool, world, model_dirs["llama_v301_tied"], *extra), f"llama_v301_tied {extra}")


def test_the_megatron_logits_path_is_unchanged(rank_pool, model_dirs):
    """Without --fused-logprob: Megatron's own logits and vocab-parallel cross entropy, now with SP."""
    argv = [
        "--model",
        model_dirs["llama_v301_tied"],
        "--seqs",
        str(SEQS),
        "--seq-len",
        str(SEQ_LEN),
        "--tp",
        "2",
        "--sequence-parallel",
    ]
    numbers = rank_pool(2).run(_check_rank, argv)[0]
    assert numbers["logprob"] <= TOLERANCE
    assert numbers["entropy"] == numbers["grad_rel"] == 0.0  # not measured on this path


def test_check_parity_fused_cli_under_torchrun(model_dirs, tmp_path):
    """The user-facing command on a model it has never seen, launched as users launch it: the
    command turns the Triton interpreter on itself (no TRITON_INTERPRET in the environment)."""
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--standalone",  # a free port: another test may run torchrun beside it (pytest -n 2)
        "-m",
        "dapo_megatron.cli",
        "check-parity",
        "--model",
        model_dirs["llama_v257_gqa3"],
        "--tp",
        "2",
        "--sequence-parallel",
        "--fused-logprob",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any("runs the Triton kernels in the interpreter" in line for line in lines)
    assert any("head=fused" in line for line in lines)
    assert lines[-1].startswith("max_abs_logprob_diff=") and float(lines[-1].split("=", 1)[1]) <= TOLERANCE
    entropy_line = next(line for line in lines if line.startswith("max_abs_entropy_diff="))
    assert float(entropy_line.split()[0].split("=", 1)[1]) <= TOLERANCE


def test_verdict_and_argument_errors(model_dirs):
    from transformers import AutoConfig

    from dapo_megatron.tools import parity, parity_args

    ok = dict(logprob=9e-6, entropy=2e-6, grad_rel=3e-7, fused_vs_torch_logprob=1e-6, fused_vs_torch_entropy=5e-7)
    assert parity.failures(ok, tolerance=1e-5, grad_tolerance=1e-4) == []
    bad = parity.failures(dict(ok, entropy=2e-5, grad_rel=float("nan")), tolerance=1e-5, grad_tolerance=1e-4)
    assert [b.split()[0] for b in bad] == ["entropy", "grad_rel"]  # a NaN fails, it is not skipped
    # above the tolerance but within 2x transformers' own fp32 error on this model: passes
    noisy = dict(ok, logprob=3.4e-5, fp32_floor_logprob=3.3e-5)
    assert parity.failures(noisy, tolerance=1e-5, grad_tolerance=1e-4) == []
    assert parity.failures(dict(noisy, logprob=7e-5), tolerance=1e-5, grad_tolerance=1e-4) == [
        "logprob 7.000e-05 > 6.6e-05"
    ]
    # the heads on the same hidden states are held to the tolerance itself
    assert parity.failures(dict(ok, fused_vs_torch_entropy=3e-5), tolerance=1e-5, grad_tolerance=1e-4) == [
        "fused_vs_torch_entropy 3.000e-05 > 1e-05"
    ]
    with pytest.raises(ValueError, match="--sequence-parallel needs --tp > 1"):
        parity_args.parse(["--model", "m", "--sequence-parallel"])
    with pytest.raises(ValueError, match="--vocab-divisible-by must be >= 1"):
        parity_args.parse(["--model", "m", "--vocab-divisible-by", "0"])
    config = AutoConfig.from_pretrained(model_dirs["llama_v257_gqa3"])  # 6 heads, 2 KV groups
    parity._check_model_fits_layout(config, tp=2, model="m")
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by --tp 3"):
        parity._check_model_fits_layout(config, tp=3, model="m")
