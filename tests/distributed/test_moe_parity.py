"""Megatron (gloo ranks, fp32, torch attention backend) vs transformers on tiny random Qwen3 (QK-norm,
head_dim 24 != hidden / heads) and Qwen3-MoE (4 experts, top-2, one dense layer): per-token
log-probs agree within 1e-5 at TP=1, EP=2, TP=2 and PP=2 (and TP=2 x EP=2 with ETP=1), unpacked and
packed; and the user-facing `check-parity --ep 2` under torchrun."""

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
    root = tmp_path_factory.mktemp("tiny_qwen3")
    return {
        "qwen3": save_tiny_hf(root / "qwen3", arch="qwen3", num_layers=4),
        "qwen3_moe": save_tiny_hf(root / "qwen3_moe", arch="qwen3_moe", num_layers=4, seed=4),
        # norm_topk_prob=False: megatron's pre-softmax routing (probabilities not renormalised)
        "qwen3_moe_unnormed": save_tiny_hf(
            root / "qwen3_moe_un", arch="qwen3_moe", num_layers=2, seed=5, norm_topk_prob=False
        ),
    }


def megatron_logprobs_on_rank(hf_dir, tp, pp, ep, etp=None):
    from transformers import AutoConfig

    from dapo_megatron.actor.model import build_model_chunks
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.tools.parity import _comparable, _parity_batches, megatron_logprobs
    from dapo_megatron.weights.load import load_hf_into_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    with model_parallel(tp=tp, pp=pp, ep=ep, etp=etp, seed=0) as layout:
        chunks = build_model_chunks(hf_config, attention_backend="torch", precision="fp32")
        load_hf_into_model(chunks, hf_dir, layout=layout, hf_config=hf_config)
        # (local experts per layer, rows of one expert's fc1) on this rank
        fc1 = {n: p for n, p in chunks[0].named_parameters() if ".experts." in n and "linear_fc1" in n}
        layers = {n.split(".mlp.")[0] for n in fc1}
        experts = (len(fc1) // max(len(layers), 1), next(iter(fc1.values())).shape[0] if fc1 else 0)
        tokens, lengths, batches = _parity_batches(
            num_seqs=NUM_SEQS, seq_len=SEQ_LEN, vocab_size=hf_config.vocab_size, seed=0, device="cpu"
        )
        out = megatron_logprobs(chunks, batches, layout=layout, vocab_size=hf_config.vocab_size)
        return experts, (None if out is None else (tokens, lengths, _comparable(out, lengths)))


def reference_logprobs(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    from dapo_megatron.tools.parity import hf_logprobs

    return hf_logprobs(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), tokens)


LAYOUTS = [  # (checkpoint, world, tp, pp, ep, etp)
    ("qwen3", 2, 1, 1, 1, None),
    ("qwen3", 2, 2, 1, 1, None),
    ("qwen3", 2, 1, 2, 1, None),
    ("qwen3_moe", 2, 1, 1, 1, None),
    ("qwen3_moe", 2, 1, 1, 2, None),
    ("qwen3_moe", 2, 2, 1, 1, None),
    ("qwen3_moe", 2, 1, 2, 1, None),
    ("qwen3_moe", 2, 2, 1, 2, 1),
    ("qwen3_moe", 4, 1, 2, 2, None),
    ("qwen3_moe_unnormed", 2, 1, 1, 2, None),
]


@pytest.mark.parametrize("name,world,tp,pp,ep,etp", LAYOUTS, ids=lambda v: str(v))
def test_logprobs_match_transformers(rank_pool, hf_dirs, name, world, tp, pp, ep, etp):
    hf_dir = str(hf_dirs[name])
    results = rank_pool(world).run(megatron_logprobs_on_rank, hf_dir, tp, pp, ep, etp)
    last_stage = [r[1] for r in results if r[1] is not None]
    assert len(last_stage) == world // pp
    tokens, lengths, ours = last_stage[0]
    reference = reference_logprobs(hf_dir, tokens)
    for _, _, other in last_stage[1:]:  # TP / DP / EP peers computed the same numbers
        assert torch.equal(torch.nan_to_num(other), torch.nan_to_num(ours))
    unpacked, packed = ours[0], ours[1]
    valid = ~torch.isnan(packed)
    assert (unpacked - reference).abs().max().item() <= TOLERANCE
    assert (packed[valid] - reference[valid]).abs().max().item() <= TOLERANCE
    assert reference.abs().max() > 1.0  # the random model is far from uniform: a real comparison
    if name.startswith("qwen3_moe"):
        # each rank holds 4 / ep experts per sparse layer, each expert's fc1 [gate; up] split over etp
        assert {r[0] for r in results} == {(4 // ep, 2 * 32 // (etp or tp))}


def test_routing_matters_in_the_moe_checkpoint(hf_dirs):
    """The comparison above is only meaningful if the router decides something: forcing experts
    0 and 1 everywhere changes transformers' log-probs by far more than the tolerance."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.tools.parity import hf_logprobs

    hf_dir = str(hf_dirs["qwen3_moe"])
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    normal = hf_logprobs(model, tokens)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.weight.data.zero_()  # all logits equal: top-k picks experts 0 and 1
    assert (hf_logprobs(model, tokens) - normal).abs().max().item() > 100 * TOLERANCE


def test_check_parity_cli_with_expert_parallel(hf_dirs, tmp_path):
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
        str(hf_dirs["qwen3_moe"]),
        "--ep",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ep=2" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("max_abs_logprob_diff=") and float(last.split("=", 1)[1]) <= TOLERANCE
