"""The trainer side of test_weight_sync_two_hosts.py, run inside the trainer's network namespace:

    python two_host_trainer.py ENGINE_URL MODEL_DIR OUT.json

Syncs a changed copy of the model into the engine (DistributedWeightSync, master address chosen by
weight_group.trainer_address), reads every tensor back from the engine and compares it bit for bit,
then checks that a loopback master address (what trainer/driver.py passed before) fails with an error naming
the engine (after the group timeout, 30 s here) instead of hanging.
Writes what it found to OUT.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import torch


async def main(url: str, model_dir: str, out_path: str) -> None:
    from transformers import AutoModelForCausalLM

    from dapo_megatron.rollout.client import EngineClient, EngineError
    from dapo_megatron.transfer.weight_group import trainer_address
    from dapo_megatron.transfer.weight_sync import DistributedWeightSync

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    weights = list(model.state_dict().items())
    result: dict = {
        "routed_address": trainer_address(engine_urls=[url], backend="gloo", environ={}),
        "ifname_address": trainer_address(engine_urls=[url], backend="gloo"),
    }
    async with EngineClient(url) as client:
        sync = DistributedWeightSync(backend="gloo", bucket_bytes=128 * 1024, timeout_s=120)
        stats = await sync.sync([client], iter(weights), weight_version="two_hosts")
        result.update(group_address=sync.address, buckets=stats.num_buckets, collectives=stats.num_collectives)
        mismatched = []
        for name, tensor in weights:
            got = torch.tensor(await client.get_weights_by_name(name, truncate_size=1 << 20), dtype=torch.float32)
            if not torch.equal(got, tensor):
                mismatched.append(name)
        result.update(checked=len(weights), mismatched=mismatched)
        await sync.close([client])
        loopback = DistributedWeightSync(master_address="127.0.0.1", backend="gloo", timeout_s=30)
        try:
            await loopback.sync([client], iter(weights), weight_version="never")
            result["loopback_error"] = None
        except EngineError as err:
            result["loopback_error"] = str(err)
        result["sessions_left_open"] = (await client.server_info())["cpu_engine"]["weight_update_session_open"]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    asyncio.run(main(*sys.argv[1:4]))
