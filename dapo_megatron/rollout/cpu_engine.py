"""The generation core of the CPU rollout server: a transformers causal LM, a batched decode loop
with per-sequence seeded sampling, and in-place weight loading with name/shape checks.

Sampling (per sequence, per step), matching SGLang's default sampler (layers/sampler.py):
    logits   = model(...)[-1] in fp32
    logprobs = log_softmax(logits / T)            # the value returned in output_token_logprobs
    probs    = softmax(logits / T), then top-k, then top-p (renormalized), then a draw
so the returned log-prob is the sampled token's log-prob under the temperature-scaled distribution
BEFORE top-k/top-p truncation (SGLang returns exactly that unless SGLANG_RETURN_ORIGINAL_LOGPROB
is set). Temperature 0 is greedy and returns log_softmax(logits) (SGLang's greedy path).

Reproducibility: sample j of a request with sampling_seed s draws from torch.Generator seeded with
s + j; without a seed, from a generator seeded by the server's --seed and the request order.
Sequences of different requests share one padded forward (left padding, explicit position ids),
which changes the logits only at float rounding level (~1e-6).
"""

from __future__ import annotations

import glob
import os
import threading
from typing import Iterable

import torch

from dapo_megatron.rollout.protocol import SequenceRequest
from dapo_megatron.rollout.routing import RoutedExpertsRecorder
from dapo_megatron.weights.hf_layout import public_expert_views


class WeightError(ValueError):
    """A weight update that does not fit the served model (unknown name, wrong shape)."""


class CpuEngine:
    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0, max_batch_size: int = 64):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError):  # a weights-only directory: input_ids requests only
            self.tokenizer = None
        self.vocab_size = int(self.model.config.vocab_size)
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos = eos if eos is not None else self.model.config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        self.pad_token_id = next(iter(self.eos_token_ids), 0)
        self.max_batch_size = max_batch_size
        self.lock = threading.Lock()  # generation batches and weight writes never overlap
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._released: dict[str, torch.Tensor] | None = None  # host copies while "released"
        self.weight_version = 0
        self.routing = RoutedExpertsRecorder(self.model)  # MoE: the experts of every token (routing.py)

    # ------------------------------------------------------------------ model description
    def parameter_specs(self) -> dict[str, dict]:
        """Every name a weight update may target (state_dict keys, tied aliases included)."""
        return {
            name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for name, t in self._public_tensors().items()
        }

    def _tensors(self) -> dict[str, torch.Tensor]:
        if self._released is not None:
            return self._released
        return dict(self.model.state_dict(keep_vars=True))

    def _public_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters under the checkpoint's names: transformers 5 fuses MoE experts in memory
        (mlp.experts.gate_up_proj), SGLang and checkpoints name them per expert; the per-expert
        views write into the fused parameters (weights/hf_layout.py)."""
        return public_expert_views(self._tensors())

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ weights
    def check_weights(self, specs: Iterable[tuple[str, list[int]]]) -> None:
        """Raise WeightError naming the first tensor that does not fit; writes nothing."""
        ours = self._public_tensors()
        for name, shape in specs:
            if name not in ours:
                raise WeightError(f"unknown parameter name '{name}' (the model has {len(ours)} tensors)")
            if list(ours[name].shape) != list(shape):
                raise WeightError(f"shape mismatch for '{name}': got {list(shape)}, model has {list(ours[name].shape)}")

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors in place after checking every one of them (all or nothing)."""
        self.check_weights((n, list(t.shape)) for n, t in named)
        if self._released is not None:
            raise WeightError("weights are released; call /resume_memory_occupation first")
        ours = self._public_tensors()
        with torch.no_grad():
            for name, tensor in named:
                ours[name].data.copy_(tensor.to(ours[name].dtype))
        self.weight_version += 1

    def load_from_disk(self, model_path: str) -> int:
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
        if not files:
            raise WeightError(f"model_path: no *.safetensors files in '{model_path}'")
        named = [item for f in files for item in load_file(f).items()]
        self.load_weights(named)
        self.model_path = model_path
        return len(named)

    def weights_by_name(self, name: str, truncate_size: int) -> list:
        ours = self._public_tensors()
        if name not in ours:
            raise WeightError(f"unknown parameter name '{name}'")
        t = ours[name].detach()
        return (t[:truncate_size] if t.dim() > 0 else t).float().tolist()

    def release(self) -> None:
        """Colocation on CPU: hand the parameters' storage over to host copies (there is no device
        memory to free here; this keeps the protocol honest: no generation while released)."""
        if self._released is not None:
            return
        tensors = self._tensors()
        # keep the storage itself (tied names share it); the module's tensors become empty
        self._released = {n: t.data for n, t in tensors.items()}
        for t in tensors.values():
            t.data = torch.empty(0, dtype=t.dtype)

    def resume(self) -> None:
        if self._released is None:
            return
        held, self._released = self._released, None
        for name, t in self._tensors().items():
            t.data = held[name]

    @property
    def released(self) -> bool:
        return self._released is not None

    # ------------------------------------------------------------------ generation
    def new_generators(self, seqs: list[SequenceRequest]) -> list[torch.Generator]:
        gens = []
        for s in seqs:
            seed = s.params.sampling_seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            gens.append(torch.Generator().manual_seed((seed + s.sample_index) % 2**63))
        return gens

    @torch.no_grad()
    def generate(self, seqs: list[SequenceRequest]) -> None:
        """Fill output_ids / output_logprobs / finish_reason of every sequence (one padded batch).

        A sequence whose `aborted` flag is set (by another thread) stops at the next step with
        finish_reason {"type": "abort"}.
        """
        from transformers import DynamicCache

        if self.released:
            raise RuntimeError("weights are released")
        gens = self.new_generators(seqs)
        batch = len(seqs)
        lengths = [len(s.prompt_ids) for s in seqs]
        width = max(lengths)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for b, s in enumerate(seqs):  # left padding: every row's last prompt token is at -1
            ids[b, width - lengths[b]:] = torch.tensor(s.prompt_ids)
            mask[b, width - lengths[b]:] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        done = [False] * batch
        for b, s in enumerate(seqs):
            if s.params.max_new_tokens == 0:
                done[b], s.finish_reason = True, {"type": "length", "length": 0}
        step_input, step_pos = ids, positions
        self.routing.start(active=any(s.return_routed_experts for s in seqs), batch_size=batch)
        while not all(done):
            out = self.model(input_ids=step_input, attention_mask=mask, position_ids=step_pos,
                             past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits_BV = out.logits[:, -1, :].float()
            next_tokens = torch.full((batch,), self.pad_token_id, dtype=torch.long)
            for b, s in enumerate(seqs):
                if done[b]:
                    continue
                if s.aborted:
                    done[b], s.finish_reason = True, {"type": "abort", "message": "Abort before or during generation."}
                    continue
                token, logprob = self._sample(logits_BV[b], s, gens[b])
                next_tokens[b] = token
                s.output_ids.append(token)
                if s.return_logprob:
                    s.output_logprobs.append(logprob)
                if token in s.params.stop_token_ids or (token in self.eos_token_ids and not s.params.ignore_eos):
                    done[b], s.finish_reason = True, {"type": "stop", "matched": token}
                elif len(s.output_ids) >= s.params.max_new_tokens:
                    done[b], s.finish_reason = True, {"type": "length", "length": s.params.max_new_tokens}
            step_input = next_tokens[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
        self.routing.finish(seqs, prompt_lengths=lengths, width=width)

    @staticmethod
    def _sample(logits_V: torch.Tensor, s: SequenceRequest, gen: torch.Generator) -> tuple[int, float]:
        p = s.params
        if p.temperature == 0.0:  # greedy: SGLang reports the raw distribution's log-prob
            token = int(torch.argmax(logits_V))
            return token, float(torch.log_softmax(logits_V, -1)[token])
        scaled = logits_V / p.temperature
        logprobs = torch.log_softmax(scaled, -1)
        probs = logprobs.exp()
        if 0 < p.top_k < probs.numel():
            kth = torch.topk(probs, p.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if p.top_p < 1.0:
            # keep the smallest prefix of the sorted distribution whose mass reaches top_p
            sorted_p, order = torch.sort(probs, descending=True)
            before = sorted_p.cumsum(0) - sorted_p  # mass strictly before each token
            sorted_p = torch.where(before < p.top_p * sorted_p.sum(), sorted_p, torch.zeros_like(sorted_p))
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        token = int(torch.multinomial(probs, 1, generator=gen))
        return token, float(logprobs[token])
