"""The KL reference policy: the initial model, frozen, on the device only while it scores.

    ref = ReferencePolicy(actor_settings(cfg), cfg.model.path, layout)   # every rank, inside model_parallel() as layout
    out = ref.logprobs(samples)                      # onload -> Actor.logprobs -> offload

A Policy (policy.py): the same model chunks, layout and log-prob code as the trained Actor (which
is a Policy too), so its log-probs equal those of a full Actor built from the same checkpoint bit for
bit, but no DDP wrapper (no contiguous param/grad buffers, no main_grad), no optimizer and no train
step; it only runs under torch.no_grad, so no gradient is ever made (its parameters keep
requires_grad=True because ATen's matmul chooses its kernel by that flag: see policy.py). A second
full Actor cost the weights again plus an fp32 grad buffer and fp32 Adam state (about 10 GB per GPU
at 32B on the naive-GRPO rung, issue 11). Between calls its
parameters live in a host backup taken once (the weights never change, so later offloads only free
the device storage); slime and verl likewise keep the reference off the GPU outside its forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import overload

from dapo_megatron.actor.policy import LogProbs, Policy, TokenLogProbs
from dapo_megatron.actor.settings import ActorSettings
from dapo_megatron.dataplane.sample import Sample
from dapo_megatron.dataplane.share import BatchShare
from dapo_megatron.distributed.layout import ParallelLayout


class ReferencePolicy:
    def __init__(self, settings: ActorSettings, hf_dir: str | Path, layout: ParallelLayout) -> None:
        self._policy = Policy(settings, hf_dir, layout)
        self._policy.offload()

    @overload
    def logprobs(self, data: BatchShare) -> TokenLogProbs: ...
    @overload
    def logprobs(self, data: list[Sample]) -> LogProbs: ...
    def logprobs(self, data: BatchShare | list[Sample]) -> TokenLogProbs | LogProbs:
        """Actor.logprobs of the reference model (collective; same contract). The weights come onto
        the device for the call and leave after it, also when it raises."""
        self._policy.onload()
        try:
            return self._policy.logprobs(data)
        finally:
            self._policy.offload()

    def resident_bytes(self) -> dict[str, int]:
        """Device bytes held now by category (params only; zero between calls)."""
        return self._policy.resident_bytes()

    def host_backup_bytes(self) -> int:
        return self._policy.memory.host_backup_bytes()

    @property
    def model_chunks(self) -> list:
        return self._policy.model_chunks
