"""The trainer side of test_sync_link_speed.py, run inside the trainer host's network namespace:

    python link_speed_trainer.py MODEL_DIR BUCKET_BYTES[,BUCKET_BYTES...] OUT.json URL [URL ...]

Loads the checkpoint; for each bucket size, shifts every tensor by a seeded amount (so an engine
still holding older weights is caught), lays the weights out in flat buckets as the stage exporter
does, syncs them into every engine with DistributedWeightSync (gloo, the CPU engines' backend; one
group, the trainer the only sender), then reads the first 8 rows of every tensor back from every
engine. Writes each sync's statistics and what it found to OUT.json (a list).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import torch


def exporter_buckets(weights: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The weights as a stage exporter of a one-rank trainer hands them to the driver (stage_export.py):
    flat uint8 buckets planned by plan_buckets, each tensor a view into its bucket. Filled here, before
    the sync: what the sync is measured on is the send, not this process's copies."""
    from dapo_megatron.transfer.stage_export import ExportItem, plan_buckets, views_of

    by_name = dict(weights)
    items = [ExportItem(n, (n,), (tuple(t.shape),), t.dtype, "replicated") for n, t in weights]
    out = []
    for group in plan_buckets(items, max_bytes):
        flat = torch.empty(sum(i.nbytes for i in group), dtype=torch.uint8)
        named = views_of(flat, group)
        for name, view in named:
            view.copy_(by_name[name])
        out.append(named)
    return out


async def main(model_dir: str, bucket_sizes: str, out_path: str, *urls: str) -> None:
    from safetensors.torch import load_file

    from dapo_megatron.rollout.client import EngineClient
    from dapo_megatron.transfer.weight_sync import DistributedWeightSync

    base = sorted(load_file(os.path.join(model_dir, "model.safetensors")).items())
    clients = [EngineClient(url) for url in urls]
    syncs = []
    try:
        for i, bucket_bytes in enumerate(int(b) for b in bucket_sizes.split(",")):
            gen = torch.Generator().manual_seed(5 + i)  # each sync changes every tensor again
            weights = exporter_buckets(
                [(n, t + 0.01 * torch.randn(t.shape, generator=gen)) for n, t in base], bucket_bytes
            )
            sync = DistributedWeightSync(backend="gloo", bucket_bytes=bucket_bytes, timeout_s=120)
            # as Driver.push_weights passes the exporter's buckets on: one stream of (name, view)
            stats = await sync.sync(clients, (pair for b in weights for pair in b), weight_version=f"link_speed_{i}")
            mismatched = []
            for client in clients:
                for name, tensor in (pair for b in weights for pair in b):
                    got = await client.get_weights_by_name(name, truncate_size=8)  # the first 8 rows
                    if not torch.equal(torch.tensor(got, dtype=torch.float32), tensor[:8]):
                        mismatched.append(f"{client.url}: {name}")
            await sync.close(clients)
            syncs.append(
                {
                    "bucket_bytes": bucket_bytes,
                    "seconds": stats.seconds,
                    "broadcast_seconds": stats.broadcast_seconds,
                    "answer_seconds": stats.answer_seconds,
                    "export_seconds": stats.export_seconds,
                    "payload_seconds": stats.payload_seconds,
                    "bytes": stats.bytes,
                    "buckets": stats.num_buckets,
                    "engines": stats.num_engines,
                    "checked": sum(len(b) for b in weights) * len(clients),
                    "mismatched": mismatched,
                }
            )
    finally:
        for client in clients:
            await client.close()
    with open(out_path, "w") as f:
        json.dump(syncs, f)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    asyncio.run(main(*sys.argv[1:]))
