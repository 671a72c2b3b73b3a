"""The generation core of the CPU rollout server: a transformers causal LM, a batched decode loop with
seeded sampling that can pause between steps, in-place weight loading with name/shape checks, and
memory release/resume that really frees the weights' storage.

Sampling (per sequence, per step), matching SGLang's default sampler (layers/sampler.py):
    logits   = model(...)[-1] in fp32
    logprobs = log_softmax(logits / T)            # the value returned in output_token_logprobs
    probs    = softmax(logits / T), then top-k, then top-p (renormalized), then a draw
so the returned log-prob is the sampled token's log-prob under the temperature-scaled distribution
BEFORE top-k/top-p truncation (SGLang returns exactly that unless SGLANG_RETURN_ORIGINAL_LOGPROB
is set). Temperature 0 is greedy and returns log_softmax(logits) (SGLang's greedy path).

Seeds: the engine behaves as SGLang launched with --enable-deterministic-inference (its default,
`deterministic=True`; sampling_batch_info.py): every sample draws from a generator seeded with its
request's sampling_seed (42 when the request has none), so the n samples of one request with one seed
are identical, and per-sample seeds need per-sample items. With deterministic=False, sampling_seed is
ignored (SGLang's default mode) and draws come from the server's --seed and the request order.
Sequences of different requests share one padded forward (left padding, explicit position ids),
which changes the logits only at float rounding level (~1e-6).

Memory (SGLang's release/resume_memory_occupation, scheduler_components/weight_updater.py): releasing
"weights" frees every parameter's storage (buffers such as rotary tables are kept, as SGLang stashes
and restores them); resuming allocates them again with undefined content, as torch_memory_saver
without --enable-weights-cpu-backup does: SGLang then expects a weight sync. The CPU engine fills
the resumed parameters with NaN so that a missing refill cannot go unnoticed. "kv_cache" holds
nothing between batches on CPU (the KV cache lives only while a batch decodes).
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from dapo_megatron.cpu_engine.fp8 import is_fp8_checkpoint, load_fp8_model
from dapo_megatron.cpu_engine.protocol import SequenceRequest
from dapo_megatron.cpu_engine.token_bound import max_chars_per_token
from dapo_megatron.rollout.routing import RoutedExpertsRecorder
from dapo_megatron.rollout.sglang_api import FinishReason
from dapo_megatron.weights.hf_layout import public_expert_views

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

UNSEEDED_DETERMINISTIC_SEED = 42  # SGLang's seed for requests without one under deterministic inference
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES


class WeightError(ValueError):
    """A weight update that does not fit the served model (unknown name, wrong shape)."""


class DecodeHooks(Protocol):
    """What the decode loop asks its scheduler (server._Batcher) between steps."""

    def pause_mode(self) -> str | None: ...  # None, "retract" or "in_place"

    def wait_while_paused(self) -> None: ...  # releases the engine lock while waiting; returns on any change

    def finished(self, seq: SequenceRequest) -> None: ...


class CpuEngine:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_batch_size: int = 64,
        deterministic: bool = True,
        context_length: int = 0,
        device: str = "cpu",
    ):
        from transformers import AutoTokenizer

        self.model_path = model_path
        self.dtype = getattr(torch, dtype)
        # where the weights and the KV cache live: "cpu", or a CUDA device so that on one GPU the
        # colocated path runs for real (CUDA IPC payloads, release/resume of real device memory);
        # sampling stays on the host with the same generators, so draws do not depend on the device
        self.device = _serving_device(device)
        self.fp8 = is_fp8_checkpoint(model_path)
        if self.fp8 and self.device.type != "cpu":
            raise ValueError(
                f"--device {device}: the block-FP8 engine computes SGLang's FP8 GEMM on the CPU only "
                "(cpu_engine/fp8_gemm.py); serve an FP8 checkpoint with --device cpu"
            )
        self.model = _load_model(model_path, dtype=self.dtype, device=self.device, fp8=self.fp8)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError):  # a weights-only directory: input_ids requests only
            self.tokenizer = None
        # the most characters one token stands for (token_bound.py): prompts sure to exceed the context are
        # refused before tokenizing
        self.max_chars_per_token = max_chars_per_token(self.tokenizer) if self.tokenizer is not None else None
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = _context_length(cfg, requested=context_length)
        self.eos_token_ids = _eos_token_ids(self.model)
        self.pad_token_id = next(iter(self.eos_token_ids), 0)
        self.max_batch_size = max_batch_size
        self.deterministic = deterministic
        self.lock = threading.Lock()  # decode steps and weight writes never overlap
        self._seed_rng = torch.Generator().manual_seed(seed)
        self.weight_version = "default"  # SGLang's --weight-version default
        self.routing = RoutedExpertsRecorder(self.model)  # MoE: the experts of every token (routing.py)
        self.released_tags: set[str] = set()
        # after a resume of "weights", the regions of parameters not written since (NaN until a sync covers
        # them): while any is left the engine refuses /generate and /health says 503 (weights_ready)
        self.unsynced: set[tuple] = set()
        self._param_specs = {n: (list(p.shape), p.dtype) for n, p in self._public_tensors().items()}
        self._param_shapes = [(p, list(p.shape)) for p in self.model.parameters()]  # tied: listed once
        self.loaded_weight_bytes = self.resident_weight_bytes()
        self.kv_cache_bytes = 0  # the live DynamicCache of the batch decoding now (0 when idle)

    # ------------------------------------------------------------------ model description
    def parameter_specs(self) -> dict[str, dict]:
        """Every name a weight update may target (state_dict keys, tied aliases included)."""
        return {
            name: {"shape": shape, "dtype": str(dtype).removeprefix("torch.")}
            for name, (shape, dtype) in self._param_specs.items()
        }

    def _tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict(keep_vars=True))

    def _public_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters under the checkpoint's names: transformers 5 fuses MoE experts in memory
        (mlp.experts.gate_up_proj), SGLang and checkpoints name them per expert; the per-expert
        views write into the fused parameters (weights/hf_layout.py)."""
        return public_expert_views(self._tensors())

    def resident_weight_bytes(self) -> int:
        """Bytes of the parameters' storages (each shared storage once: tied weights)."""
        seen, total = set(), 0
        for p in self.model.parameters():
            storage = p.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def tokenize(self, text: str) -> list[int]:
        # as SGLang 0.5.21 tokenizes a text prompt (tokenizer_manager.py: `self.tokenizer(tokenizer_input)`,
        # the tokenizer's default special tokens: Llama 3's <|begin_of_text|>; none for Qwen)
        return self.tokenizer(text)["input_ids"]

    def min_tokens(self, text: str) -> int:
        """A lower bound of len(tokenize(text)) computed without tokenizing (0 when none is known)."""
        return -(-len(text) // self.max_chars_per_token) if self.max_chars_per_token else 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ weights
    def check_weights(self, specs: Iterable[tuple[str, list[int]]]) -> None:
        """Raise WeightError naming the first tensor that does not fit; writes nothing."""
        for name, shape in specs:
            if name not in self._param_specs:
                raise WeightError(f"unknown parameter name '{name}' (the model has {len(self._param_specs)} tensors)")
            if list(self._param_specs[name][0]) != list(shape):
                raise WeightError(
                    f"shape mismatch for '{name}': got {list(shape)}, model has {self._param_specs[name][0]}"
                )

    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors in place after checking every one of them (all or nothing)."""
        self.check_weights((n, list(t.shape)) for n, t in named)
        if "weights" in self.released_tags:
            raise WeightError("weights are released; call /resume_memory_occupation first")
        ours = self._public_tensors()
        for name, tensor in named:
            # float8 bytes mean nothing without their scale, and a float8 parameter takes only float8 values
            # scaled by the trainer's converter: a bf16/fp32 tensor cast here would skip the scale
            if (tensor.dtype == torch.float8_e4m3fn) != (ours[name].dtype == torch.float8_e4m3fn):
                raise WeightError(
                    f"dtype mismatch for '{name}': got {str(tensor.dtype).removeprefix('torch.')}, the "
                    f"engine holds {str(ours[name].dtype).removeprefix('torch.')} (an FP8 engine takes "
                    "the block-FP8 weights of rollout.quantization=fp8; a plain one takes none)"
                )
        with torch.no_grad():
            for name, tensor in named:
                ours[name].data.copy_(tensor.to(ours[name].dtype))
        if self.unsynced:
            self.unsynced.difference_update(_region(ours[name]) for name, _ in named)

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

    # ------------------------------------------------------------------ memory
    def release(self, tags: list[str]) -> None:
        """Free the storage behind these tags (see the module docstring). Caller ensures idleness."""
        if "weights" in tags and "weights" not in self.released_tags:
            for p in self.model.parameters():  # tied names share one Parameter: freed once
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # back to the device, as SGLang's torch_memory_saver pauses them
        self.released_tags.update(tags)

    def resume(self, tags: list[str]) -> None:
        if "weights" in tags and "weights" in self.released_tags:
            for p, shape in self._param_shapes:
                p.data = torch.full(shape, float("nan"), dtype=p.dtype, device=self.device)  # undefined: sync next
            params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
            self.unsynced = {
                _region(t) for t in self._public_tensors().values() if t.untyped_storage().data_ptr() in params
            }
        self.released_tags.difference_update(tags)

    @property
    def released(self) -> bool:
        return bool(self.released_tags & {"weights", "kv_cache"})

    @property
    def weights_ready(self) -> bool:
        """Memory resident and every parameter written since the last resume (SGLang generates from
        whatever the resumed memory holds; the CPU engine refuses instead of sampling from NaN)."""
        return not self.released and not self.unsynced

    # ------------------------------------------------------------------ generation
    def new_generators(self, seqs: list[SequenceRequest]) -> list[torch.Generator]:
        gens = []
        for s in seqs:
            if self.deterministic:
                seed = s.params.sampling_seed if s.params.sampling_seed is not None else UNSEEDED_DETERMINISTIC_SEED
            else:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            gens.append(torch.Generator().manual_seed(seed % 2**63))
        return gens

    def _forward(self, rows: list[list[int]], cache=None, mask=None, positions=None):
        """Prefill (cache None: left-padded rows) or one decode step (rows of one token each)."""
        from transformers import DynamicCache

        if cache is None:
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for b, r in enumerate(rows):  # left padding: every row's last token is at -1
                ids[b, width - len(r) :] = torch.tensor(r)
                mask[b, width - len(r) :] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = DynamicCache()
        else:
            ids = torch.tensor([[r[-1]] for r in rows], dtype=torch.long)
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )
        self.kv_cache_bytes = sum(t.numel() * t.element_size() for t in _cache_tensors(out.past_key_values))
        return out.logits[:, -1, :].float().cpu(), out.past_key_values, mask, positions

    @torch.no_grad()
    def generate(self, seqs: list[SequenceRequest], hooks: DecodeHooks) -> None:
        """Fill output_ids / output_logprobs / finish_reason of every sequence (one padded batch); call
        hooks.finished(seq) as each one ends. Between steps the loop honours a pause: "in_place" keeps
        the KV cache, "retract" drops it and recomputes it from prompt + output on continue (with the
        weights of then), as SGLang's scheduler does. A sequence whose `aborted` flag is set (by
        another thread) ends at the next step boundary with finish_reason {"type": "abort"}."""
        if self.released:
            raise RuntimeError("memory is released (release_memory_occupation); resume first")
        gens = self.new_generators(seqs)
        done = [False] * len(seqs)

        prefill_lengths, width = [0] * len(seqs), 0

        def finish(b: int, reason: FinishReason) -> None:
            done[b], seqs[b].finish_reason = True, reason
            self.routing.take(seqs[b], row=b, prefill_length=prefill_lengths[b], width=width)
            hooks.finished(seqs[b])

        for b, s in enumerate(seqs):
            if s.params.max_new_tokens == 0:
                finish(b, {"type": "length", "length": 0})
        logits = cache = mask = positions = None
        try:
            while True:
                retracted = False
                while True:  # step boundary: aborts, then pauses
                    for b, s in enumerate(seqs):
                        if not done[b] and s.aborted:
                            finish(b, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
                    mode = hooks.pause_mode()
                    if mode is None or all(done):
                        break
                    retracted |= mode == "retract"
                    if retracted:
                        cache = None  # freed: recomputed from prompt + output on continue
                        self.kv_cache_bytes = 0
                    hooks.wait_while_paused()
                if all(done):
                    return
                if logits is None or retracted:
                    rows = [s.prompt_ids + s.output_ids for s in seqs]
                    prefill_lengths, width = [len(r) for r in rows], max(len(r) for r in rows)
                    self.routing.start(active=any(s.return_routed_experts for s in seqs), batch_size=len(seqs))
                    logits, cache, mask, positions = self._forward(rows)
                else:
                    logits, cache, mask, positions = self._forward(
                        [s.prompt_ids + s.output_ids for s in seqs], cache, mask, positions
                    )
                self._append_sampled_tokens(seqs, done, logits, gens, finish)
        finally:
            self.kv_cache_bytes = 0
            self.routing.stop()

    def _append_sampled_tokens(
        self,
        seqs: list[SequenceRequest],
        done: list[bool],
        logits: torch.Tensor,
        gens: list[torch.Generator],
        finish: Callable[[int, FinishReason], None],
    ) -> None:
        """One decode step's sampling: a token (and its log-prob) for every unfinished row, and the
        rows that stop (a stop or EOS token, or max_new_tokens reached) finished."""
        for b, s in enumerate(seqs):
            if done[b]:
                continue
            token, logprob = self._sample(logits[b], s, gens[b])
            s.output_ids.append(token)
            s.output_versions.append(self.weight_version)
            if s.return_logprob:
                s.output_logprobs.append(logprob)
            if token in s.params.stop_token_ids or (token in self.eos_token_ids and not s.params.ignore_eos):
                finish(b, {"type": "stop", "matched": token})
            elif len(s.output_ids) >= s.params.max_new_tokens:
                finish(b, {"type": "length", "length": s.params.max_new_tokens})

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


def _serving_device(device: str) -> torch.device:
    """--device as a torch device: the CPU, or a CUDA device that exists here."""
    where = torch.device(device)
    if where.type == "cuda" and not (torch.cuda.is_available() and (where.index or 0) < torch.cuda.device_count()):
        raise ValueError(
            f"--device {device}: no such CUDA device here "
            f"({torch.cuda.device_count() if torch.cuda.is_available() else 0} visible)"
        )
    if where.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    return where


def _load_model(model_path: str, *, dtype: torch.dtype, device: torch.device, fp8: bool) -> PreTrainedModel:
    """The checkpoint's transformers model in eval mode, its parameters and buffers on `device`."""
    from transformers import AutoModelForCausalLM

    if fp8:  # block-FP8 export: fp8 weights + block scales, SGLang's w8a8 GEMM (cpu_engine/fp8.py)
        model = load_fp8_model(model_path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    for p in model.parameters():
        # each parameter in storage of its own, as after a resume: CPU GEMV kernels pick their path by
        # memory alignment (~1e-6 log-prob differences), so release/resume must not change it; this
        # also detaches the weights from the checkpoint's memory-mapped file
        p.data = p.data.to(device).clone(memory_format=torch.contiguous_format)
    for b in model.buffers():  # rotary inverse frequencies
        b.data = b.data.to(device)
    return model


def _context_length(hf_config: PretrainedConfig, *, requested: int) -> int:
    """--context-length (0: the model's max_position_embeddings), refused above the model's as SGLang does."""
    model_len = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
    allow_longer = os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "").lower() in ("1", "true")
    if requested and model_len and requested > model_len and not allow_longer:
        # as SGLang's ModelConfig._derive_context_length refuses to start
        raise ValueError(
            f"--context-length {requested} is greater than the model's max_position_embeddings "
            f"{model_len}; to allow it, set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"
        )
    return requested or model_len or (1 << 20)


def _eos_token_ids(model: PreTrainedModel) -> set[int]:
    """The ids that end a sample: the generation config's eos_token_id, else the model config's."""
    eos = model.generation_config.eos_token_id if model.generation_config else None
    eos = eos if eos is not None else model.config.eos_token_id
    return set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))


def _cache_tensors(cache) -> list[torch.Tensor]:
    """The key/value tensors of a transformers DynamicCache (layers of keys/values)."""
    out = []
    for layer in getattr(cache, "layers", []):
        for attr in ("keys", "values"):
            t = getattr(layer, attr, None)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _region(t: torch.Tensor) -> tuple:
    """Which bytes a (view of a) parameter covers: tied names share one region, MoE experts' views differ."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
