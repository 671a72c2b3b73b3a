"""SGLang's /generate request shape, parsed and validated: what the CPU server accepts.

Shapes follow sglang 0.5.21 (managers/io_struct.py GenerateReqInput, sampling/sampling_params.py):
`text` or `input_ids`, single or batch; `sampling_params` one dict for all prompts or one per
prompt; `return_logprob`; `rid` (str, or one per prompt). A batch with n > 1 expands prompt-major
(prompt 0 sample 0..n-1, prompt 1 sample 0..n-1, ...), as SGLang's tokenizer manager does.

Every mistake raises RequestError naming the field, which the server turns into HTTP 400.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

# SGLang fields we accept and ignore (they do not change what a CPU engine computes).
_IGNORED_FIELDS = {"stream", "log_metrics", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"}
# return_routed_experts / routed_experts_start_len: MoE routing, rollout/routing.py
_KNOWN_FIELDS = ({"text", "input_ids", "sampling_params", "return_logprob", "rid", "return_routed_experts",
                  "routed_experts_start_len"} | _IGNORED_FIELDS)
_SAMPLING_KEYS = {
    "n", "temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos",
    "sampling_seed", "skip_special_tokens", "min_p", "stop", "no_stop_trim", "spaces_between_special_tokens",
}


class RequestError(ValueError):
    """A malformed request; `field` is the JSON path of the offending value."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True


@dataclass
class SequenceRequest:
    """One sequence to generate: one prompt x one of its n samples."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str  # the request id the client gave (abort matches it) ...
    sample_index: int  # ... and which of its n samples this is
    return_logprob: bool
    aborted: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed_experts: Any = None  # [rows, layers, topk] once generated (rollout/routing.py)


def _number(value: Any, name: str, *, kind: type, lo: float | None = None, hi: float | None = None) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise RequestError(name, f"must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(name, f"must be in [{lo}, {hi}], got {value!r}")
    return kind(value)


def parse_sampling_params(raw: Any, name: str, *, vocab_size: int) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise RequestError(name, f"must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _SAMPLING_KEYS)
    if unknown:
        raise RequestError(f"{name}.{unknown[0]}", f"unknown sampling parameter (known: {sorted(_SAMPLING_KEYS)})")
    if raw.get("stop"):
        raise RequestError(f"{name}.stop", "stop strings are not supported by the CPU engine; use stop_token_ids")
    if raw.get("min_p", 0.0) not in (0, 0.0):
        raise RequestError(f"{name}.min_p", "min_p is not supported by the CPU engine")
    p = SamplingParams()
    if "n" in raw:
        p.n = _number(raw["n"], f"{name}.n", kind=int, lo=1, hi=1024)
    if "temperature" in raw:
        p.temperature = _number(raw["temperature"], f"{name}.temperature", kind=float, lo=0.0)
    if "top_p" in raw:
        p.top_p = _number(raw["top_p"], f"{name}.top_p", kind=float, lo=1e-9, hi=1.0)
    if "top_k" in raw:
        p.top_k = _number(raw["top_k"], f"{name}.top_k", kind=int, lo=-1)
        if p.top_k == 0:
            raise RequestError(f"{name}.top_k", "must be -1 (disabled) or >= 1, got 0")
    if "max_new_tokens" in raw:
        p.max_new_tokens = _number(raw["max_new_tokens"], f"{name}.max_new_tokens", kind=int, lo=0, hi=1 << 20)
    if "stop_token_ids" in raw and raw["stop_token_ids"] is not None:
        ids = raw["stop_token_ids"]
        if not isinstance(ids, list):
            raise RequestError(f"{name}.stop_token_ids", f"must be a list of token ids, got {ids!r}")
        p.stop_token_ids = tuple(
            _number(t, f"{name}.stop_token_ids[{i}]", kind=int, lo=0, hi=vocab_size - 1) for i, t in enumerate(ids)
        )
    for flag in ("ignore_eos", "skip_special_tokens"):
        if flag in raw:
            if not isinstance(raw[flag], bool):
                raise RequestError(f"{name}.{flag}", f"must be true or false, got {raw[flag]!r}")
            setattr(p, flag, raw[flag])
    if raw.get("sampling_seed") is not None:
        p.sampling_seed = _number(raw["sampling_seed"], f"{name}.sampling_seed", kind=int, lo=-(2**63), hi=2**63 - 1)
    return p


def _token_list(value: Any, name: str, *, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise RequestError(name, "must be a non-empty list of token ids")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RequestError(f"{name}[{i}]", f"must be a token id in [0, {vocab_size}), got {t!r}")
    return value


def parse_generate(body: Any, *, vocab_size: int, tokenize) -> tuple[list[SequenceRequest], bool]:
    """Body of POST /generate -> (sequences in SGLang's output order, whether the reply is a list).

    `tokenize(text) -> list[int]`, or None when the server has no tokenizer.
    """
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - _KNOWN_FIELDS)
    if unknown:
        raise RequestError(unknown[0], f"unknown field (known: {sorted(_KNOWN_FIELDS)})")
    if body.get("stream"):
        raise RequestError("stream", "streaming is not supported by the CPU engine")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise RequestError("text/input_ids", "give exactly one of text or input_ids")
    if has_text:
        text = body["text"]
        if tokenize is None:
            raise RequestError("text", "this server has no tokenizer; send input_ids")
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise RequestError("text", "must be a non-empty string or a list of non-empty strings")
        prompts = [tokenize(t) for t in texts]
    else:
        ids = body["input_ids"]
        is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = (
            [_token_list(p, f"input_ids[{i}]", vocab_size=vocab_size) for i, p in enumerate(ids)]
            if is_batch
            else [_token_list(ids, "input_ids", vocab_size=vocab_size)]
        )
    num = len(prompts)

    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if not is_batch or len(raw_params) != num:
            raise RequestError("sampling_params", f"a list needs one entry per prompt ({num}), got {len(raw_params)}")
        params = [parse_sampling_params(r, f"sampling_params[{i}]", vocab_size=vocab_size) for i, r in enumerate(raw_params)]
    else:
        params = [parse_sampling_params(raw_params, "sampling_params", vocab_size=vocab_size)] * num

    raw_logprob = body.get("return_logprob", False)
    flags = raw_logprob if isinstance(raw_logprob, list) else [raw_logprob] * num
    if len(flags) != num or not all(isinstance(f, bool) or f is None for f in flags):
        raise RequestError("return_logprob", "must be true/false or a list of them, one per prompt")

    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        rids = [rid] if num == 1 else [f"{rid}_{i}" for i in range(num)]
    elif isinstance(rid, list) and len(rid) == num and all(isinstance(r, str) for r in rid):
        rids = rid
    else:
        raise RequestError("rid", f"must be a string or a list of {num} strings")

    routed = body.get("return_routed_experts", False)
    if not isinstance(routed, bool):
        raise RequestError("return_routed_experts", f"must be true or false, got {routed!r}")
    routed_start = body.get("routed_experts_start_len", 0)
    if isinstance(routed_start, bool) or not isinstance(routed_start, int) or routed_start < 0:
        raise RequestError("routed_experts_start_len", f"must be an integer >= 0, got {routed_start!r}")
    seqs = [
        SequenceRequest(list(prompts[i]), params[i], rids[i], j, bool(flags[i]), return_routed_experts=routed,
                        routed_experts_start_len=routed_start)
        for i in range(num)
        for j in range(params[i].n)
    ]
    # n > 1 turns a single prompt into a list reply, as in SGLang.
    return seqs, is_batch or any(p.n > 1 for p in params)
