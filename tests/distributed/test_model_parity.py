"""Megatron (gloo ranks, fp32, torch attention backend) vs transformers on a tiny random Qwen2:
per-token log-probs agree within 1e-5 at TP=1, TP=2, PP=2, TP=2 x PP=2 and PP=2 x VPP=2, and with
context parallelism at CP=2, TP=2 x CP=2 (also with sequence parallel) and CP=2 x PP=2, for
unpacked [K, L] batches and for the same sequences packed into one row (block-diagonal mask,
per-sequence RoPE), with tied and untied embeddings, and for Llama.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers_tiny import save_tiny_hf

TOLERANCE = 1e-5
NUM_SEQS, SEQ_LEN = 3, 12


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf")
    return {
        "qwen2": save_tiny_hf(root / "qwen2", arch="qwen2", tied=False, num_layers=4),
        "qwen2_tied": save_tiny_hf(root / "qwen2_tied", arch="qwen2", tied=True, num_layers=4, seed=1),
        "llama": save_tiny_hf(root / "llama", arch="llama", tied=False, num_layers=4, seed=2),
        "llama3": save_tiny_hf(root / "llama3", arch="llama3", tied=False, num_layers=2, seed=3),
    }


def _megatron_on_rank(hf_dir, tp, pp, vpp, sequence_parallel=False, cp=1, seq_len=SEQ_LEN):
    from transformers import AutoConfig

    from dapo_megatron.actor.model import build_model_chunks
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.tools.parity import _comparable, _parity_batches, megatron_logprobs
    from dapo_megatron.weights.load import load_hf_into_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    seq_multiple = 2 * cp if cp > 1 else 1
    with model_parallel(tp=tp, pp=pp, cp=cp, vpp=vpp, seed=0) as layout:
        chunks = build_model_chunks(
            hf_config, attention_backend="torch", precision="fp32", sequence_parallel=sequence_parallel
        )
        load_hf_into_model(chunks, hf_dir, layout=layout, hf_config=hf_config)
        tokens, lengths, batches = _parity_batches(
            num_seqs=NUM_SEQS,
            seq_len=seq_len,
            vocab_size=hf_config.vocab_size,
            seed=0,
            device="cpu",
            seq_multiple=seq_multiple,
            row_multiple=seq_multiple * (tp if sequence_parallel else 1),
        )
        out = megatron_logprobs(chunks, batches, layout=layout, vocab_size=hf_config.vocab_size)
        return None if out is None else (tokens, lengths, _comparable(out, lengths, seq_multiple=seq_multiple))


def _reference(hf_dir, tokens, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from dapo_megatron.tools.parity import hf_logprobs

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    return hf_logprobs(model, tokens).to(torch.float32 if dtype == torch.float32 else torch.float64)


LAYOUTS = [  # (world size, tp, pp, vpp, sequence parallel)
    (2, 1, 1, None, False),  # DP=2
    (2, 2, 1, None, False),
    (2, 2, 1, None, True),  # sequence parallel: TorchRMSNorm instead of megatron's WrappedTorchNorm
    (2, 1, 2, None, False),
    (4, 2, 2, None, False),
    (4, 1, 2, 2, False),  # PP=2 x VPP=2 (DP=2): interleaved schedule, 1 layer per chunk
]


@pytest.mark.parametrize("world,tp,pp,vpp,sp", LAYOUTS, ids=lambda v: str(v))
def test_logprobs_match_transformers(rank_pool, hf_dirs, world, tp, pp, vpp, sp):
    hf_dir = str(hf_dirs["qwen2"])
    results = rank_pool(world).run(_megatron_on_rank, hf_dir, tp, pp, vpp, sp)
    _assert_matches_transformers(hf_dir, results, world=world, pp=pp)


CP_LAYOUTS = [  # (world size, tp, pp, cp, sequence parallel)
    (2, 1, 1, 2, False),
    (4, 2, 1, 2, False),
    (4, 2, 1, 2, True),  # SP inside each CP rank's chunks: rows padded to 2*cp*tp
    (4, 1, 2, 2, False),
    (4, 1, 1, 4, False),  # 8 chunks of 2 tokens per 16-token row
]
CP_SEQ_LEN = 13  # odd: lengths 13, 11, 9, none a multiple of 2*cp, so every sequence is padded


@pytest.mark.parametrize("world,tp,pp,cp,sp", CP_LAYOUTS, ids=lambda v: str(v))
def test_context_parallel_logprobs_match_transformers(rank_pool, hf_dirs, world, tp, pp, cp, sp):
    """The torch attention backend with CP: each rank holds chunks r and 2cp-1-r of every padded
    sequence, all-gathers K/V over the CP group and attends with true positions (RoPE and mask)."""
    hf_dir = str(hf_dirs["qwen2"])
    results = rank_pool(world).run(_megatron_on_rank, hf_dir, tp, pp, None, sp, cp, CP_SEQ_LEN)
    diffs = _assert_matches_transformers(hf_dir, results, world=world, pp=pp)
    print(
        f"cp layout world={world} tp={tp} pp={pp} cp={cp} sp={sp}: max |diff| vs transformers fp32 "
        f"unpacked {diffs[0]:.2e} packed {diffs[1]:.2e}"
    )


def _assert_matches_transformers(hf_dir, results, *, world, pp):
    """Every last-stage rank answers with the same values, within TOLERANCE of transformers (fp32
    and fp64), packed and unpacked; returns the (unpacked, packed) max |diff| vs fp32."""
    last_stage = [r for r in results if r is not None]
    assert len(last_stage) == world // pp  # every last-stage rank answers, the others return None
    tokens, lengths, ours = last_stage[0]
    reference = _reference(hf_dir, tokens)
    for _, _, other in last_stage[1:]:  # TP / CP / DP peers computed the same numbers
        assert torch.equal(torch.nan_to_num(other), torch.nan_to_num(ours))
    unpacked, packed = ours[0], ours[1]
    assert not torch.isnan(unpacked).any()
    unpacked_diff = (unpacked - reference).abs().max().item()
    assert unpacked_diff <= TOLERANCE
    valid = ~torch.isnan(packed)
    assert valid.sum().item() == sum(n - 1 for n in lengths)
    packed_diff = (packed[valid] - reference[valid]).abs().max().item()
    assert packed_diff <= TOLERANCE
    # packed and unpacked agree (different attention masks and RoPE paths, same maths)
    assert (packed[valid] - unpacked[valid]).abs().max().item() <= TOLERANCE
    # and against float64 transformers (the exact function), Megatron's own fp32 error is smaller
    exact = _reference(hf_dir, tokens, torch.float64)
    assert (unpacked.double() - exact).abs().max().item() <= TOLERANCE
    assert (packed.double()[valid] - exact[valid]).abs().max().item() <= TOLERANCE
    assert reference.abs().max() > 1.0  # the random model is far from uniform: a real comparison
    return unpacked_diff, packed_diff


@pytest.mark.parametrize("name,world,tp,pp", [("qwen2_tied", 2, 2, 1), ("qwen2_tied", 4, 2, 2), ("llama", 4, 2, 2)])
def test_tied_and_llama_match_transformers(rank_pool, hf_dirs, name, world, tp, pp):
    hf_dir = str(hf_dirs[name])
    results = [r for r in rank_pool(world).run(_megatron_on_rank, hf_dir, tp, pp, None) if r is not None]
    tokens, lengths, ours = results[0]
    # against float64 transformers (the exact function): only our own fp32 rounding counts. Against
    # fp32 transformers both sides' rounding adds up (1.0014e-05 at TP=2 on one 2026-11-24 machine)
    exact = _reference(hf_dir, tokens, torch.float64)
    assert (ours[0].double() - exact).abs().max().item() <= TOLERANCE
    valid = ~torch.isnan(ours[1])
    assert (ours[1].double()[valid] - exact[valid]).abs().max().item() <= TOLERANCE


def test_check_parity_cli_under_torchrun(hf_dirs, tmp_path):
    """The user-facing command, launched the way users launch it (torchrun, CP=2, an odd
    --seq-len so every sequence is padded for the CP split)."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo))
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
        str(hf_dirs["qwen2"]),
        "--tp",
        "1",
        "--pp",
        "1",
        "--cp",
        "2",
        "--seq-len",
        "15",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tp=1 pp=1 cp=2" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("max_abs_logprob_diff="), proc.stdout
    assert float(last.split("=", 1)[1]) <= TOLERANCE
    # quiet by default, as `train` (cli.BACKEND_COMMANDS; trainer/console.py: the backend warnings that cannot matter)
    for noise in (
        "Apex is not installed",
        "Transformer Engine and Apex",
        "cuda_graph_scope",
        "CUDA_DEVICE_MAX_CONNECTIONS",
    ):
        assert noise not in proc.stdout + proc.stderr, (noise, proc.stderr[-3000:])


def test_llama3_rope_scaling_matches_transformers(rank_pool, hf_dirs):
    from transformers import AutoModelForCausalLM

    from dapo_megatron.tools.parity import hf_logprobs

    hf_dir = str(hf_dirs["llama3"])
    results = [r for r in rank_pool(2).run(_megatron_on_rank, hf_dir, 2, 1, None) if r is not None]
    tokens, _, ours = results[0]
    reference = _reference(hf_dir, tokens)
    assert (ours[0] - reference).abs().max().item() <= TOLERANCE
    # the scaling matters here: the same weights with plain RoPE give clearly different log-probs
    plain = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    ).eval()
    assert (hf_logprobs(plain, tokens) - reference).abs().max().item() > 10 * TOLERANCE
