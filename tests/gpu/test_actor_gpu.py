"""The actor on a GPU (bf16, NCCL, one process): log-probs of a tiny Qwen2 match transformers at
bf16 tolerance, a train step runs the fused kernels and moves the weights, the compiled fused head
and loss (and actor.head_loss=one_pass) equal the plain-torch ones in fp32, `check-parity --fused-logprob`
passes, and the Qwen2.5-1.5B benchmark (dapo_megatron/benchmarks/actor.py) produces sane numbers.

    tests/gpu/run_all.sh --call 1 OUT   (step actor_tests; call 3: actor_tests_rest)
    pytest -m gpu tests/gpu/test_actor_gpu.py
"""

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers_tiny)


def _single_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from dapo_megatron.actor.parallel import init_distributed

    init_distributed()


def test_bf16_logprobs_match_transformers_and_a_step_trains(tmp_path):
    from transformers import AutoModelForCausalLM

    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.config import ActorConfig, Config
    from dapo_megatron.dataplane.sample import Sample
    from dapo_megatron.trainer.settings import actor_settings
    from helpers_tiny import save_tiny_hf

    _single_process_group()
    hf_dir = save_tiny_hf(tmp_path / "qwen", arch="qwen2")
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            prompt_ids=torch.randint(5, 300, (6,), generator=gen).tolist(),
            response_ids=torch.randint(5, 300, (9,), generator=gen).tolist(),
            group_index=i,
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(6)
    ]
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).cuda().eval()
    want = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
            logp = torch.log_softmax(hf(ids).logits[0].double(), -1)[len(s.prompt_ids) - 1 : -1]
            want.append(logp.gather(1, ids[0, len(s.prompt_ids) :, None])[:, 0].float().cpu())
    cfg = Config()
    cfg.actor = ActorConfig(attention_backend="torch", precision="bf16", micro_batch_tokens=64)
    cfg.trainer.lr, cfg.trainer.warmup_steps = 1e-3, 0
    with model_parallel(tp=1, seed=1) as layout:
        actor = Actor(actor_settings(cfg), hf_dir, layout)
        out = actor.logprobs(samples)
        for got, ref in zip(out.logprobs, want):
            # bf16 weights and activations: ~1e-2 absolute on log-probs of a few nats
            torch.testing.assert_close(got, ref, atol=0.15, rtol=0)  # CPU bf16 TP=2 measured 0.078
        for s, lp in zip(samples, out.logprobs):
            s.old_logprobs = lp.tolist()
        before = {k: v.float().clone() for k, v in actor.iter_hf_weights()}
        metrics = actor.train(samples, step=0)
        after = {k: v.float() for k, v in actor.iter_hf_weights()}
    assert metrics["update_skipped"] == 0 and abs(metrics["ratio_mean"] - 1) < 1e-2  # on-policy
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-4


def test_bench_reports_throughput_and_mfu(tmp_path):
    from dapo_megatron.benchmarks import actor as bench

    _single_process_group()
    csv_path = tmp_path / "actor_bench.csv"
    # two layers keep the test short; the full 28-layer numbers come from run_all.sh's bench run
    assert (
        bench.main(
            [
                "--tokens",
                "4096",
                "--layers",
                "2",
                "--steps",
                "2",
                "--micro-batches",
                "2",
                "--csv",
                str(csv_path),
                "--checkpoint-dir",
                str(tmp_path / "ckpt"),
            ]
        )
        == 0
    )
    import csv

    (row,) = list(csv.DictReader(csv_path.open()))
    assert float(row["tokens_per_s"]) > 0 and 0 < float(row["mfu"]) < 1


def test_offload_frees_cuda_memory_and_onload_restores_bit_for_bit(tmp_path):
    """actor/offload.py on CUDA (bf16 + distributed optimizer): torch's allocated memory drops by what
    the ledger says was freed (up to the caching allocator's 512-byte rounding per block), and
    onload brings every parameter, fp32 master shard and Adam moment back bit for bit."""
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.offload import actor_tensors, storages_by_category
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.config import ActorConfig, Config
    from dapo_megatron.dataplane.sample import Sample
    from dapo_megatron.trainer.settings import actor_settings
    from helpers_tiny import save_tiny_hf

    _single_process_group()
    hf_dir = save_tiny_hf(tmp_path / "qwen", arch="qwen2")
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            prompt_ids=torch.randint(5, 300, (6,), generator=gen).tolist(),
            response_ids=torch.randint(5, 300, (9,), generator=gen).tolist(),
            group_index=i,
            advantage=1.0 if i % 2 else -1.0,
            old_logprobs=[-5.0] * 9,
        )
        for i in range(6)
    ]
    cfg = Config()
    cfg.actor = ActorConfig(attention_backend="torch", precision="bf16", micro_batch_tokens=64)
    cfg.trainer.lr, cfg.trainer.warmup_steps = 1e-3, 0
    with model_parallel(tp=1, seed=1) as layout:
        actor = Actor(actor_settings(cfg), hf_dir, layout)
        actor.train(samples, step=0)
        tensors = actor_tensors(actor.model_chunks, actor.optimizer)
        snapshot = [
            t.detach().reshape(-1).view(torch.uint8).clone()
            for c in ("params", "optimizer")
            for t in tensors[c]
            if t.is_cuda
        ]
        storages = storages_by_category(tensors, device="cuda")
        held = actor.resident_bytes()
        assert held["params"] > 0 and held["grads"] > 0 and held["optimizer"] > 0
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        actor.offload()
        dropped = before - torch.cuda.memory_allocated()
        assert actor.resident_bytes() == {"params": 0, "grads": 0, "optimizer": 0}
        freed = sum(held.values())
        count = sum(len(s) for s in storages.values())
        assert freed <= dropped <= freed + 512 * count, (freed, dropped, count)
        actor.onload()
        restored = [
            t.detach().reshape(-1).view(torch.uint8)
            for c in ("params", "optimizer")
            for t in actor_tensors(actor.model_chunks, actor.optimizer)[c]
            if t.is_cuda
        ]
        assert len(restored) == len(snapshot)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, restored))
        assert actor.train(samples, step=1)["update_skipped"] == 0


def _samples_with_rl_fields(hf_dir, *, num=8, seed=3):
    """Random prompts/responses with old log-probs 0.3 nats off the model's (clipping happens)."""
    from transformers import AutoModelForCausalLM

    from dapo_megatron.dataplane.sample import Sample

    gen = torch.Generator().manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    samples = []
    for i in range(num):
        prompt = torch.randint(5, 300, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
        response = torch.randint(5, 300, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([prompt + response])).logits[0], -1)[len(prompt) - 1 : -1]
        lp = logp.gather(1, torch.tensor(response)[:, None])[:, 0]
        samples.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                group_index=i // 2,
                advantage=[1.5, -1.0, 0.5, -1.5][i % 4],
                old_logprobs=(lp + 0.3 * torch.randn(lp.shape, generator=gen)).tolist(),
            )
        )
    return samples


def test_fused_actor_equals_torch_actor_fp32(tmp_path):
    """The compiled fused head and loss (actor.fused_logprob / fused_policy_loss) against the
    plain-torch ones in fp32 at TP=1: log-probs and entropies within 1e-5, every stat, and the
    weights after one step within 1e-6 (the CPU suite checks TP=2 and sequence parallelism in the
    interpreter: tests/distributed/test_actor_fused.py)."""
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.config import ActorConfig, Config
    from dapo_megatron.trainer.settings import actor_settings
    from helpers_tiny import save_tiny_hf

    _single_process_group()
    hf_dir = save_tiny_hf(tmp_path / "llama", arch="llama", tied=True, shape=dict(vocab_size=301))
    samples = _samples_with_rl_fields(hf_dir)
    runs = {}
    for fused in (False, True):
        cfg = Config()
        cfg.actor = ActorConfig(
            attention_backend="torch",
            precision="fp32",
            micro_batch_tokens=40,
            use_distributed_optimizer=False,
            fused_logprob=fused,
            fused_policy_loss=fused,
        )
        cfg.trainer.lr, cfg.trainer.warmup_steps = 1e-3, 0
        with model_parallel(tp=1, seed=7) as layout:
            actor = Actor(actor_settings(cfg), hf_dir, layout)
            for group in actor.optimizer.param_groups:
                group["eps"] = 1e-4  # see tests/distributed/test_actor_train.py
            out = actor.logprobs(samples)
            metrics = actor.train(samples, step=0)
            runs[fused] = (out, metrics, {k: v.float().cpu() for k, v in actor.iter_hf_weights()})
    (ref, m_ref, w_ref), (got, m_got, w_got) = runs[False], runs[True]
    for a, b in zip(got.logprobs + got.entropies, ref.logprobs + ref.entropies):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for key in (
        "loss",
        "clipfrac_low",
        "clipfrac_high",
        "dualclip_frac",
        "approx_kl",
        "ratio_mean",
        "ratio_max",
        "entropy",
        "num_tokens",
    ):
        assert m_got[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-6), key
    for name, w in w_ref.items():
        torch.testing.assert_close(w_got[name], w, atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_one_pass_head_loss_actor_equals_separate_fp32(tmp_path):
    """actor.head_loss=one_pass compiled (linear_dapo_loss: Triton logits + softmax statistics, cuBLAS
    gradients) against the separate plain-torch head and loss in fp32 at TP=1 over 2-3 micro-batches: the same
    old-log-prob pass bit for bit, every logged statistic and the weights after one step within the bounds of
    test_fused_actor_equals_torch_actor_fp32 (the CPU suite checks TP=2, SP, CP=2, PP=2 and the weighted
    objectives in the interpreter: tests/distributed/test_actor_head_loss.py)."""
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.config import ActorConfig, Config
    from dapo_megatron.trainer.settings import actor_settings
    from helpers_tiny import save_tiny_hf

    _single_process_group()
    hf_dir = save_tiny_hf(tmp_path / "llama", arch="llama", tied=True, shape=dict(vocab_size=301))
    samples = _samples_with_rl_fields(hf_dir)
    runs = {}
    for head_loss in ("separate", "one_pass"):
        cfg = Config()
        cfg.actor = ActorConfig(
            attention_backend="torch",
            precision="fp32",
            micro_batch_tokens=40,
            use_distributed_optimizer=False,
            fused_logprob=False,
            fused_policy_loss=False,
            head_loss=head_loss,
        )
        cfg.trainer.lr, cfg.trainer.warmup_steps = 1e-3, 0
        with model_parallel(tp=1, seed=7) as layout:
            actor = Actor(actor_settings(cfg), hf_dir, layout)
            for group in actor.optimizer.param_groups:
                group["eps"] = 1e-4  # see tests/distributed/test_actor_train.py
            out = actor.logprobs(samples)
            metrics = actor.train(samples, step=0)
            runs[head_loss] = (out, metrics, {k: v.float().cpu() for k, v in actor.iter_hf_weights()})
    (ref, m_ref, w_ref), (got, m_got, w_got) = runs["separate"], runs["one_pass"]
    for a, b in zip(got.logprobs + got.entropies, ref.logprobs + ref.entropies):
        # Actor.logprobs does not depend on actor.head_loss (two builds of one model: bit for bit on the CPU)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert m_got["num_micro_batches"] >= 2 and set(m_got) == set(m_ref)
    for key in (
        "loss",
        "clipfrac_low",
        "clipfrac_high",
        "dualclip_frac",
        "approx_kl",
        "ratio_mean",
        "ratio_max",
        "entropy",
        "num_tokens",
        "grad_norm",
    ):
        assert m_got[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-6), key
    for name, w in w_ref.items():
        torch.testing.assert_close(w_got[name], w, atol=1e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_check_parity_fused_logprob_on_gpu(tmp_path):
    """`check-parity --fused-logprob` with the compiled kernels (one process, NCCL) on an
    odd-vocabulary tied Llama: log-probs and entropies vs transformers within the defaults."""
    from dapo_megatron.tools import parity
    from helpers_tiny import save_tiny_hf

    _single_process_group()
    hf_dir = save_tiny_hf(
        tmp_path / "llama", arch="llama", tied=True, shape=dict(vocab_size=301, num_attention_heads=8)
    )
    numbers = parity.run_check(["--model", str(hf_dir), "--fused-logprob", "--seq-len", "32"])
    print(numbers)
    assert parity.failures(numbers, tolerance=1e-5, grad_tolerance=1e-4) == []
