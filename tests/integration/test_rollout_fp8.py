"""rollout.quantization=fp8 end to end on real components (issue 14 part B, docs/fp8.md): a Megatron
actor (2 gloo ranks), a real serve-rollout process started from modelopt's block-FP8 export of the same model,
and a plain fp32 serve-rollout beside it. Two syncs (before and after one training step), each through
the per-sync converter (Fp8SyncConverter, what Driver.push_weights applies) inside SGLang's
weight-update session (DistributedWeightSync).

After every sync the FP8 engine holds float8_e4m3fn weights and fp32 128 x 128 block scales (its
/model_info) whose bytes and scales are modelopt's quantization of the actor's weights, and whose
dequantized values lie within the FP8 error bound of the actor's. The FP8 engine's log-probs (SGLang's GEMM
numerics: fp8 weights and dynamic fp8 activations) differ from the actor's far more than the fp32
engine's do (the quantization really happened), and truncated importance sampling with those
log-probs bounds the update: min(exp(old - engine), tis_cap) <= tis_cap on every token, and the
actor's loss equals a float64 reference computed with those weights.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout_helpers import ServerProcess, make_tiny_checkpoint

pytest.importorskip(
    "modelopt.torch.quantization", reason="nvidia-modelopt not installed (pip install -e '.[modelopt]')"
)

from dapo_megatron.dataplane.sample import Sample  # noqa: E402

PROMPTS = [[1, 17, 42, 99, 7, 250], [1, 5, 6], [1, 200, 201, 202, 203, 204, 205, 9], [1, 33, 34]]
TIS_CAP = 1.0  # the smallest allowed cap: every token whose engine prob exceeds the trainer's is clamped


def _cfg():
    from dapo_megatron.config import ActorConfig, Config

    cfg = Config()
    cfg.actor = ActorConfig(
        tp=1,
        attention_backend="torch",
        precision="fp32",
        micro_batch_tokens=256,
        use_distributed_optimizer=False,
        fused_logprob=False,
        fused_policy_loss=False,
    )
    cfg.rollout.temperature = 1.0
    cfg.algorithm.tis_cap = TIS_CAP
    cfg.trainer.lr, cfg.trainer.warmup_steps = 1e-2, 0
    return cfg


async def _engine_state(client, names: list[str]) -> dict[str, torch.Tensor]:
    """What the engine holds now, read back over HTTP (/get_weights_by_name: values as floats)."""
    out = {}
    for name in names:
        values = await client.get_weights_by_name(name, truncate_size=1 << 20)
        out[name] = torch.tensor(values, dtype=torch.float64)
    return out


def _rank(fp8_dir: str, hf_dir: str, fp8_url: str, plain_url: str):
    """Every rank: sync, sample from both engines, score, train one step with TIS, sync again.
    Rank 0 talks to the engines; both ranks take part in the collectives."""
    import torch.distributed as dist

    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.actor.parallel import model_parallel
    from dapo_megatron.quant.fp8_sync import Fp8SyncConverter
    from dapo_megatron.rollout.client import EngineClient
    from dapo_megatron.trainer.settings import actor_settings
    from dapo_megatron.transfer.weight_sync import DistributedWeightSync

    rank = dist.get_rank()
    conv = Fp8SyncConverter.from_checkpoint(fp8_dir)
    result = {"syncs": []}
    with model_parallel(tp=1, seed=7) as layout:
        actor = Actor(actor_settings(_cfg()), hf_dir, layout)

        def sync(step: int):
            """The actor's weights (fp32, as iter_hf_weights yields them) and, on rank 0, what the FP8
            engine holds after the converted sync and the converter's own output."""
            actor_w = {n: t.detach().clone() for n, t in actor.iter_hf_weights()}
            if rank != 0:
                return None

            async def push():
                async with EngineClient(fp8_url) as fp8, EngineClient(plain_url) as plain:
                    for client, named in ((fp8, conv.convert(actor_w.items())), (plain, actor_w.items())):
                        s = DistributedWeightSync(master_address="127.0.0.1", backend="gloo", bucket_bytes=50_000)
                        await s.sync([client], named, weight_version=f"step_{step}")
                        await s.close([client])
                    info = await fp8.model_info()
                    sent = dict(conv.convert(actor_w.items()))
                    held = await _engine_state(fp8, list(sent))
                    return {"actor": actor_w, "sent": sent, "held": held, "params": info["parameters"]}

            return asyncio.run(push())

        result["syncs"].append(sync(0))
        outs = None
        if rank == 0:

            async def sample():
                params = {"max_new_tokens": 12, "sampling_seed": 5, "ignore_eos": True}
                async with EngineClient(fp8_url) as fp8, EngineClient(plain_url) as plain:
                    return (
                        await fp8.generate(input_ids=PROMPTS, return_logprob=True, sampling_params=params),
                        await plain.generate(input_ids=PROMPTS, return_logprob=True, sampling_params=params),
                    )

            outs = asyncio.run(sample())
        box = [outs]
        dist.broadcast_object_list(box, src=0)
        fp8_outs, plain_outs = box[0]

        def lps(o):
            return [x[0] for x in o["meta_info"]["output_token_logprobs"]]

        samples = [
            Sample(
                prompt_ids=p,
                response_ids=o["output_ids"],
                group_index=i // 2,
                advantage=[1.0, -1.0][i % 2],
                rollout_logprobs=lps(o),
            )
            for i, (p, o) in enumerate(zip(PROMPTS, fp8_outs))
        ]
        plain_samples = [
            Sample(prompt_ids=p, response_ids=o["output_ids"], group_index=i)
            for i, (p, o) in enumerate(zip(PROMPTS, plain_outs))
        ]
        old = actor.logprobs(samples).logprobs
        plain_actor = actor.logprobs(plain_samples).logprobs
        for s, lp in zip(samples, old):
            s.old_logprobs = lp.tolist()
        metrics = actor.train(samples, step=0)
        result["syncs"].append(sync(1))
        result.update(
            metrics=metrics,
            samples=samples,
            plain_engine=[torch.tensor(lps(o), dtype=torch.float64) for o in plain_outs],
            plain_actor=[t.double() for t in plain_actor],
        )
    return result


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from dapo_megatron.quant.fp8_export import export_fp8_checkpoint

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("rollout_fp8")
    # hidden and FFN whole FP8 blocks: the engine's GEMM quantizes activations per 128 input channels and
    # refuses other input dims (as SGLang's does); k/v keep a partial block of rows (64 of 128)
    model_dir = make_tiny_checkpoint(root / "model", seed=0, shape={"hidden_size": 128, "intermediate_size": 256})
    fp8_dir = export_fp8_checkpoint(model_dir, root / "fp8", dtype=torch.bfloat16)
    fp8 = ServerProcess(fp8_dir, root / "engines", log_path=root / "fp8.log")
    try:
        plain = ServerProcess(model_dir, root / "engines", log_path=root / "plain.log", seed=1)
    except BaseException:
        fp8.kill()
        raise
    yield model_dir, fp8_dir, fp8, plain
    fp8.kill()
    plain.kill()


@pytest.fixture(scope="module")
def run(rank_pool, engines):
    model_dir, fp8_dir, fp8, plain = engines
    return rank_pool(2).run(_rank, str(fp8_dir), str(model_dir), fp8.url, plain.url)[0]


def test_engine_holds_float8_within_fp8_error_of_the_actor_after_every_sync(run):
    """Bound from the format, with s the element's block scale. The actor's fp32 weight is cast to bf16
    (unit roundoff 2**-8), divided by the scale (in bf16 for a one-block weight, whose scale modelopt
    squeezes to 0-dim: a second 2**-8; in fp32 otherwise), then cast to E4M3 (4 bits of precision: 2**-4
    for normals; below the smallest normal 2**-6 the step is 2**-9, half of it 2**-10 absolute, times s).
    (1 + 2**-8)**2 (1 + 2**-4) - 1 < 2**-4 + 2**-7 + 2**-10, so
        |dequant - w| <= max(|w| (2**-4 + 2**-7 + 2**-10), s 2**-10 + |w| (2**-7 + 2**-10))."""
    from dapo_megatron.quant.fp8_format import BLOCK, dequantize_block_fp8

    for sync in run["syncs"]:
        actor, sent, held, params = sync["actor"], sync["sent"], sync["held"], sync["params"]
        fp8_names = [n for n, t in sent.items() if t.dtype == torch.float8_e4m3fn]
        assert len(fp8_names) == 2 * 7  # every Linear of the 2 layers but lm_head (modelopt's exclude list)
        for name in fp8_names:
            module = name.removesuffix(".weight")
            assert params[name]["dtype"] == "float8_e4m3fn"
            scale = sent[f"{module}.weight_scale_inv"]
            n, k = sent[name].shape
            blocks = [-(-n // BLOCK), -(-k // BLOCK)]  # ceil: a partial last block has a scale too
            assert params[f"{module}.weight_scale_inv"] == {"shape": blocks, "dtype": "float32"}
            assert list(scale.shape) == blocks
            # the engine holds exactly what modelopt's quantization of the actor's weights is
            assert torch.equal(held[name], sent[name].double())
            assert torch.equal(held[f"{module}.weight_scale_inv"], scale.double())
            w = actor[name].double()
            deq = dequantize_block_fp8(sent[name], scale, dtype=torch.float64)
            s_full = scale.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
            a, err = w.abs(), (deq - w).abs()
            bound = torch.maximum(a * (2**-4 + 2**-7 + 2**-10), s_full * 2**-10 + a * (2**-7 + 2**-10))
            assert bool((err <= bound).all()), name
            assert err.max() > 0  # it is quantized, not a copy
        for name, t in sent.items():  # the rest: bf16 values of the actor's, held in the engine's fp32
            if t.dtype != torch.float8_e4m3fn and not name.endswith("_scale_inv"):
                assert torch.equal(held[name], actor[name].to(torch.bfloat16).double()), name
    before, after = run["syncs"][0]["actor"], run["syncs"][1]["actor"]
    moved = max(float((after[n] - before[n]).abs().max()) for n in before)
    assert moved > 1e-3  # the second sync carried the trained weights
    assert any(
        not torch.equal(run["syncs"][0]["sent"][n], run["syncs"][1]["sent"][n])
        for n in run["syncs"][0]["sent"]
        if n.endswith("proj.weight")
    )


def test_fp8_mismatch_exceeds_fp32_engine_and_tis_bounds_the_update(run):
    samples, metrics = run["samples"], run["metrics"]
    fp8_diff = torch.cat(
        [
            (
                torch.tensor(s.old_logprobs, dtype=torch.float64)
                - torch.tensor(s.rollout_logprobs, dtype=torch.float64)
            ).abs()
            for s in samples
        ]
    )
    plain_diff = torch.cat([(a - e).abs() for a, e in zip(run["plain_actor"], run["plain_engine"])])
    assert plain_diff.max() < 1e-4  # same fp32 weights: rounding only
    assert fp8_diff.mean() > 100 * plain_diff.mean() and fp8_diff.mean() > 1e-3
    # TIS per token: min(pi_old / pi_engine, cap); with cap 1 some tokens are clamped, some are not
    tis = [
        torch.clamp(
            torch.exp(
                torch.tensor(s.old_logprobs, dtype=torch.float64)
                - torch.tensor(s.rollout_logprobs, dtype=torch.float64)
            ),
            max=TIS_CAP,
        )
        for s in samples
    ]
    flat = torch.cat(tis)
    assert bool((flat <= TIS_CAP).all()) and (flat == TIS_CAP).any() and (flat < TIS_CAP).any()
    # the first update is on-policy (ratio 1, no clipping), so the token-mean loss is
    #   sum_t tis_t * (-A_s) / tokens
    ref = sum(float((-s.advantage * t).sum()) for s, t in zip(samples, tis)) / flat.numel()
    assert metrics["num_tokens"] == flat.numel() and metrics["update_skipped"] == 0
    assert metrics["loss"] == pytest.approx(ref, rel=1e-5, abs=1e-7)
    assert metrics["tis_weight"] == pytest.approx(float(flat.mean()), rel=1e-5)
