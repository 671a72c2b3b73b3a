"""Paired measurement of what routing replay does to the trainer/engine log-prob mismatch on ONE batch.

    torchrun --nproc-per-node 2 docs/experiments/moe_routing_mismatch.py MODEL_DIR [float32|bfloat16] [EP]

Rank 0 generates 16 prompts x 8 responses of the synthetic task with the CPU engine's generator
(cpu_engine/engine.py, in process, in the given dtype) asking for the routed experts; both ranks
then compute the trainer's log-probs of the same tokens with the Megatron actor (fp32, EP as given)
twice, with actor.routing_replay off and on, and rank 0 prints |log pi_trainer - log pi_engine| over
all response tokens (mean, 99th percentile, max, tokens above 0.1) and the routing agreement. The
same batch for both, so the difference is the replay alone (docs/LOG.md, 2026-11-23).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def generate(model_dir: str, dtype: str):
    from transformers import AutoTokenizer

    from dapo_megatron.dataplane.sample import Sample
    from dapo_megatron.cpu_engine.engine import CpuEngine
    from dapo_megatron.cpu_engine.protocol import SamplingParams, SequenceRequest
    from dapo_megatron.data.tiny_model import prompt_ids, synthetic_train_eval

    engine = CpuEngine(model_dir, dtype=dtype, seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    _, held_out = synthetic_train_eval(num_train=2000, num_eval=100, difficulty=2, seed=1234, style="compact")
    seqs = []
    for i, record in enumerate(held_out[:16]):
        ids = prompt_ids(tok, record.prompt)
        params = SamplingParams(
            n=8, temperature=1.0, max_new_tokens=16, sampling_seed=1000 + i, stop_token_ids=(tok.eos_token_id,)
        )
        seqs += [SequenceRequest(ids, params, f"r{i}", j, True, return_routed_experts=True) for j in range(8)]
    engine.generate(seqs)
    return [
        Sample(
            prompt_ids=s.prompt_ids,
            response_ids=s.output_ids,
            group_index=k // 8,
            rollout_logprobs=s.output_logprobs,
            routed_experts=s.routed_experts.reshape(s.routed_experts.shape[0], -1).to(torch.uint8),
        )
        for k, s in enumerate(seqs)
        if s.output_ids
    ]


def main(argv: list[str]) -> None:
    from dapo_megatron.actor.actor import Actor
    from dapo_megatron.trainer.settings import actor_settings
    from dapo_megatron.actor.parallel import init_distributed, model_parallel
    from dapo_megatron.config import ActorConfig, Config

    model_dir, dtype, ep = argv[0], (argv[1] if len(argv) > 1 else "bfloat16"), int(argv[2]) if len(argv) > 2 else 2
    init_distributed()
    box = [generate(model_dir, dtype) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    samples = box[0]
    cfg = Config()
    cfg.actor = ActorConfig(
        ep=ep,
        attention_backend="torch",
        precision="fp32",
        micro_batch_tokens=2048,
        use_distributed_optimizer=False,
        fused_logprob=False,
        world_size=dist.get_world_size(),
    )
    cfg.rollout.return_routed_experts = True
    with model_parallel(ep=ep, seed=0) as layout:
        actor = Actor(actor_settings(cfg), model_dir, layout)
        results = {}
        for replay in (False, True):
            cfg.actor.routing_replay = replay
            out = actor.logprobs(samples)
            diff = torch.cat([(lp - torch.tensor(s.rollout_logprobs)).abs() for lp, s in zip(out.logprobs, samples)])
            results[replay] = (diff, out.routing)
    if dist.get_rank() == 0:
        print(f"engine dtype {dtype}, EP={ep}, {len(samples)} responses, {results[False][0].numel()} tokens")
        for replay, (diff, routing) in results.items():
            print(
                f"replay {'on ' if replay else 'off'}: |diff| mean {diff.mean():.2e}  p99 {diff.quantile(0.99):.2e}  "
                f"max {diff.max():.2e}  tokens > 0.1: {int((diff > 0.1).sum())}  "
                f"agreement {routing['routing/agreement']:.5f}  exact {routing['routing/exact_match']:.5f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
