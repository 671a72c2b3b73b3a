"""Per-stage weight export (transfer/stage_export.py): on gloo ranks, the driver receives every HF
tensor bit-identical to the checkpoint, in buckets that follow the plan; only each stage's exporter
materialises a full tensor (its TP peers and the other DP replicas: none); the exporter never holds
more than two buckets; the HF checkpoint written by the stages (one shard set per stage, one index)
reloads bit for bit, in transformers too."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers_tiny import save_tiny_hf


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage_export")
    return {
        "qwen2": save_tiny_hf(root / "qwen2", arch="qwen2", tied=False, num_layers=4),
        "tied_bf16": save_tiny_hf(root / "tied", arch="qwen2", tied=True, num_layers=4, seed=3, dtype=torch.bfloat16),
    }


def _hf_state(hf_dir):
    state = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def _export_on_rank(hf_dir, tp, pp, bucket_bytes, save_to, vpp=None):
    import torch.distributed as dist
    from transformers import AutoConfig

    from dapo_megatron.actor import parallel
    from dapo_megatron.actor.model import build_model_chunks
    from dapo_megatron.transfer.stage_export import StageExporter, gather_manifests, weights_for_driver
    from dapo_megatron.transfer.stage_save import save_hf_by_stage
    from dapo_megatron.weights import load_hf_into_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    precision = "bf16" if hf_config.dtype == torch.bfloat16 else "fp32"
    with parallel.model_parallel(tp=tp, pp=pp, vpp=vpp) as layout:
        # as the Actor builds it: no vocabulary padding beyond a multiple of tp (a padded vocabulary's
        # gathered shards would be larger than the full tensor the bucket plan counts)
        chunks = build_model_chunks(hf_config, attention_backend="torch", precision=precision, vocab_divisible_by=1)
        load_hf_into_model(chunks, hf_dir, layout=layout, hf_config=hf_config)
        exporter = StageExporter(chunks, hf_config, layout, bucket_bytes=bucket_bytes)
        manifests = gather_manifests(exporter)
        received, sizes = [], []
        for bucket in weights_for_driver(exporter, manifests):
            received += [(name, tensor.clone()) for name, tensor in bucket]
            sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        stats = exporter.stats
        save_hf_by_stage(
            StageExporter(chunks, hf_config, layout, bucket_bytes=bucket_bytes),
            hf_config,
            save_to,
            max_shard_bytes=3 * bucket_bytes,
            copy_from=hf_dir,
        )
        plan = [[item.nbytes for item in items] for items in exporter.plan]
        return {
            "rank": dist.get_rank(),
            "received": received,
            "largest": stats.largest_tensor,
            "peak_held": stats.peak_held,
            "largest_bucket": stats.largest_bucket,
            "plan": plan,
            "exporter": exporter.is_exporter,
            "stage": layout.pp_rank,
            "received_buckets": sizes,
        }


LAYOUTS = [
    ("qwen2", 4, 2, 2, None),
    ("qwen2", 2, 2, 1, None),
    ("qwen2", 2, 1, 2, None),
    ("qwen2", 4, 1, 2, None),
    ("qwen2", 4, 1, 2, 2),
    ("tied_bf16", 4, 2, 2, None),
]


@pytest.mark.parametrize("name,world,tp,pp,vpp", LAYOUTS, ids=lambda v: str(v))
def test_driver_receives_every_tensor_and_only_exporters_materialise(
    rank_pool, hf_dirs, tmp_path, name, world, tp, pp, vpp
):
    reference = _hf_state(hf_dirs[name])
    bucket = 40_000  # bytes: several buckets per stage, the embedding (~80 KB fp32) alone in its own
    results = rank_pool(world).run(_export_on_rank, str(hf_dirs[name]), tp, pp, bucket, str(tmp_path / "hf"), vpp)
    driver = results[0]
    names = [n for n, _ in driver["received"]]
    assert len(names) == len(set(names)) and set(names) == set(reference)
    for tensor_name, tensor in driver["received"]:
        assert tensor.dtype == reference[tensor_name].dtype
        assert torch.equal(tensor, reference[tensor_name]), tensor_name
    largest_full = max(t.numel() * t.element_size() for t in reference.values())
    # whole buckets reach the driver, each within the bound unless one parameter alone exceeds it
    assert len(driver["received_buckets"]) > 2 * pp
    assert all(size <= max(bucket, largest_full) for size in driver["received_buckets"])
    for r in results:
        if r["rank"] != 0:
            assert r["received"] == []  # only the driver gets tensors
        if r["exporter"]:
            assert 0 < r["largest"] <= largest_full
            # at most bucket k's flat buffer and bucket k+1's gathered shards (plus 16-byte alignment)
            assert r["peak_held"] <= 2 * r["largest_bucket"] + 1024, (r["peak_held"], r["largest_bucket"])
        else:
            assert r["largest"] == 0 and r["peak_held"] == 0  # TP peers only send their shards
    # buckets follow the greedy rule: each but the last of a stage could not take the next parameter
    for r in (r for r in results if r["exporter"]):
        flat = list(r["plan"])
        for this, nxt in zip(flat, flat[1:]):
            assert sum(this) + nxt[0] > bucket or len(this) == 0
    # the checkpoint the stages wrote: every stage's shards, one index, bit-identical tensors
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files and len(files) >= pp
    assert files[-1].endswith(f"-of-{len(files):05d}.safetensors")
    written = _hf_state(out)
    assert set(written) == set(reference)
    assert all(torch.equal(written[k], reference[k]) and written[k].dtype == reference[k].dtype for k in reference)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in reference.values())
    assert (out / "config.json").is_file() and not list(tmp_path.glob(".hf.tmp*"))


def test_the_stage_checkpoint_loads_in_transformers(rank_pool, hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    rank_pool(4).run(_export_on_rank, str(hf_dirs["qwen2"]), 2, 2, 40_000, str(tmp_path / "hf"))
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    want = AutoModelForCausalLM.from_pretrained(hf_dirs["qwen2"], dtype=torch.float32).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
