"""SGLang's /generate request, parsed and validated as SGLang 0.5.21 does: what the CPU engine accepts.

Read from sglang/srt/managers/io_struct.py (GenerateReqInput.normalize_batch_and_arguments),
managers/tokenizer_manager.py (_handle_batch_request, _validate_one_request) and
sampling/sampling_params.py (SamplingParams, verify):
  - `text` or `input_ids`, single or batch; `sampling_params` one dict for all prompts or one per prompt;
    `return_logprob` a flag or one per prompt (not a list when n > 1); unknown top-level fields are
    ignored (SGLang's schema ignores extras).
  - rids: a single prompt keeps its rid (a uuid if none); a batch turns rid "r" into r_0, r_1, ...,
    and a list must hold one rid per prompt; duplicates are refused. With n > 1 every sample gets a
    FRESH uuid rid (TokenizerManager._handle_batch_request, regenerate_rid): no rid the client chose
    names a sample, so /abort_request with the request's rid reaches nothing.
  - samples come out prompt-major (prompt 0 sample 0..n-1, prompt 1 ...); n > 1 turns a single prompt
    into a list reply.
  - context length: a prompt of >= context_length tokens, or prompt + max_new_tokens beyond it, is a 400
    (SGLang's messages), unless the server allows auto-truncation (the CPU engine does not).
  - sampling: temperature 0 is greedy; top_k -1 (all) or >= 1; top_p in (0, 1]. An unknown sampling
    parameter raises TypeError in SamplingParams(**...), which SGLang does not catch (HTTP 500); the CPU
    engine answers 400 naming it (a client's mistake is never a 5xx here; docs/sglang.md).
  - bounded work: a prompt's length is checked against the context before its ids are (input_ids) or
    before it is tokenized when a lower bound of its token count already exceeds it (text, min_tokens).
CPU engine differences (400 naming the field): stop strings, streaming, and the SGLang features it does
not implement (penalties, grammars, logit_bias, LoRA, multimodal, top/prompt log-probs, hidden states).

Every mistake raises RequestError (status 400) naming the field.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from dapo_megatron.rollout.sglang_api import FinishReason

if TYPE_CHECKING:
    import torch

N = TypeVar("N", int, float)

# SGLang GenerateReqInput fields that change the result and that the CPU engine does not implement:
# refused when set to anything but their default.
_UNSUPPORTED_FIELDS: dict[str, object] = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "lora_path": None,
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None, []),
    "return_hidden_states": (None, False),
    "session_params": None,
    "custom_logit_processor": None,
    "return_text_in_logprobs": (None, False),
    "return_sampling_mask": (None, False),
    "return_entropy": (None, False),
}  # (return_routed_experts / routed_experts_start_len are implemented: MoE routing, rollout/routing.py)
# SGLang SamplingParams keys the CPU engine implements ...
_SAMPLING_KEYS = {
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
}
# ... and those it refuses unless at their default (value: the defaults SGLang treats as "off")
_SAMPLING_UNSUPPORTED: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "min_new_tokens": (0, None),
    "beam_width": (None, 1),
    "json_schema": (None, ""),
    "regex": (None, ""),
    "ebnf": (None, ""),
    "structural_tag": (None, ""),
    "stop_regex": (None, "", []),
    "logit_bias": (None, {}),
    "custom_params": (None, {}),
}
# every key SGLang's SamplingParams accepts that the CPU engine knows of (any other key: SGLang's HTTP 500,
# the CPU engine's 400)
SAMPLING_PARAM_NAMES = frozenset(_SAMPLING_KEYS) | frozenset(_SAMPLING_UNSUPPORTED)


class RequestError(ValueError):
    """A malformed request; `field` is the JSON path of the offending value, `status` the HTTP status."""

    def __init__(self, field_name: str, message: str, *, status: int = 400):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.status = status


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    max_new_tokens: int = 128  # SGLang's default
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True


@dataclass
class SequenceRequest:
    """One sequence to generate: one prompt x one of its n samples."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str  # this sample's own rid (what /abort_request matches), as SGLang names it
    sample_index: int  # which of its request's n samples this is
    return_logprob: bool
    aborted: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)  # weight version that made each token
    finish_reason: FinishReason | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed_experts: torch.Tensor | None = None  # [rows, layers, topk] once generated (rollout/routing.py)


def _number(
    value: object, name: str, *, kind: type[N], lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> N:
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise RequestError(name, f"must be {'a number' if kind is float else 'an integer'}, got {value!r}")
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        raise RequestError(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
    return kind(value)


def parse_sampling_params(raw: object, name: str, *, vocab_size: int) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise RequestError(name, f"must be an object, got {type(raw).__name__}")
    for key, value in raw.items():
        if key in _SAMPLING_UNSUPPORTED:
            if value not in _SAMPLING_UNSUPPORTED[key]:
                raise RequestError(f"{name}.{key}", "is not supported by the CPU engine")
        elif key not in _SAMPLING_KEYS:
            # SGLang: SamplingParams(**params) raises TypeError, uncaught by its handler -> HTTP 500; a
            # client's typo is not a server fault: 400 here (docs/sglang.md, CPU differences)
            raise RequestError(f"{name}.{key}", "unexpected keyword argument (not an SGLang sampling parameter)")
    if raw.get("stop"):
        raise RequestError(f"{name}.stop", "stop strings are not supported by the CPU engine; use stop_token_ids")
    if raw.get("min_p") not in (None, 0, 0.0):
        raise RequestError(f"{name}.min_p", "min_p is not supported by the CPU engine")
    p = SamplingParams()
    if raw.get("n") is not None:
        p.n = _number(raw["n"], f"{name}.n", kind=int, lo=1, hi=1024)
    if raw.get("temperature") is not None:
        p.temperature = _number(raw["temperature"], f"{name}.temperature", kind=float, lo=0.0)
    if raw.get("top_p") is not None:
        p.top_p = _number(raw["top_p"], f"{name}.top_p", kind=float, lo=0.0, hi=1.0, lo_open=True)
    if raw.get("top_k") is not None:
        p.top_k = _number(raw["top_k"], f"{name}.top_k", kind=int, lo=-1)
        if p.top_k == 0:
            raise RequestError(f"{name}.top_k", "must be -1 (disable) or at least 1, got 0")
    if raw.get("max_new_tokens") is not None:
        p.max_new_tokens = _number(raw["max_new_tokens"], f"{name}.max_new_tokens", kind=int, lo=0, hi=1 << 20)
    if raw.get("stop_token_ids") is not None:
        ids = raw["stop_token_ids"]
        if not isinstance(ids, list):
            raise RequestError(f"{name}.stop_token_ids", f"must be a list of token ids, got {ids!r}")
        p.stop_token_ids = tuple(
            _number(t, f"{name}.stop_token_ids[{i}]", kind=int, lo=0, hi=vocab_size - 1) for i, t in enumerate(ids)
        )
    for flag in ("ignore_eos", "skip_special_tokens"):
        if raw.get(flag) is not None:
            if not isinstance(raw[flag], bool):
                raise RequestError(f"{name}.{flag}", f"must be true or false, got {raw[flag]!r}")
            setattr(p, flag, raw[flag])
    if raw.get("sampling_seed") is not None:
        p.sampling_seed = _number(raw["sampling_seed"], f"{name}.sampling_seed", kind=int, lo=-(2**63), hi=2**63 - 1)
    return p


def _token_list(value: object, name: str, *, vocab_size: int, context_length: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise RequestError(
            name, "input_ids cannot be empty" if value == [] else "must be a non-empty list of token ids"
        )
    if len(value) >= context_length:  # before looking at a million ids one by one (SGLang's message)
        check_context_length(len(value), 0, context_length=context_length, name=name)
    # every id an int (bool is its own type) in range: decided by C builtins, 5x faster than the loop below,
    # which finds the first bad id for the message when this says no (a large body is checked on the
    # engine's parse thread: the shorter it holds the GIL, the sooner /health gets it, guard.py)
    if set(map(type, value)) == {int} and min(value) >= 0 and max(value) < vocab_size:
        return value
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RequestError(f"{name}[{i}]", f"must be a token id in [0, {vocab_size}), got {t!r}")
    return value


def _check_unsupported(body: dict) -> None:
    for key, defaults in _UNSUPPORTED_FIELDS.items():
        allowed = defaults if isinstance(defaults, tuple) else (defaults,)
        if key in body and body[key] not in allowed:
            raise RequestError(key, "is not supported by the CPU engine")
    if body.get("stream"):
        raise RequestError("stream", "streaming is not supported by the CPU engine")
    if body.get("logprob_start_len") not in (None, -1):
        raise RequestError("logprob_start_len", "prompt log-probs are not supported by the CPU engine (use -1)")


def check_context_length(prompt_len: int, max_new_tokens: int, *, context_length: int, name: str) -> None:
    """SGLang's TokenizerManager._validate_one_request (no auto-truncation), same messages."""
    if prompt_len >= context_length:
        raise RequestError(
            name,
            f"The input ({prompt_len} tokens) is longer than the model's context length ({context_length} tokens).",
        )
    if prompt_len + max_new_tokens > context_length:
        raise RequestError(
            name,
            f"Requested token count exceeds the model's maximum context length of {context_length} "
            f"tokens. You requested a total of {prompt_len + max_new_tokens} tokens: {prompt_len} "
            f"tokens from the input messages and {max_new_tokens} tokens for the completion.",
        )


def _rids(rid: object, *, num_prompts: int, is_batch: bool) -> list[str]:
    """One rid per prompt, as GenerateReqInput._normalize_rid leaves them (before n > 1 expansion)."""
    if not is_batch:
        if rid is None:
            return [uuid.uuid4().hex]
        if not isinstance(rid, str):
            raise RequestError("rid", "The rid should be a string or a list of strings.")
        return [rid]
    if rid is None:
        return [uuid.uuid4().hex for _ in range(num_prompts)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(num_prompts)]
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != num_prompts:
            raise RequestError("rid", "The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rid)) != len(rid):
            duplicates = sorted({r for r in rid if rid.count(r) > 1})
            raise RequestError("rid", f"Duplicate request IDs detected within the request: {duplicates}")
        return rid
    raise RequestError("rid", "The rid should be a string or a list of strings.")


def parse_generate(
    body: object, *, vocab_size: int, tokenize, context_length: int, min_tokens=None, pause=None
) -> tuple[list[SequenceRequest], bool]:
    """Body of POST /generate -> (sequences in SGLang's output order, whether the reply is a list).

    `tokenize(text) -> list[int]`, or None when the server has no tokenizer; `min_tokens(text) -> int`, a
    lower bound of len(tokenize(text)) known without tokenizing (token_bound.py), or None. `pause()` is
    called between two prompts' checks (the engine's parse thread hands the GIL over there: guard.Pauser).
    The checks run in SGLang's order, so that a body with two faults gets SGLang's error.
    """
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    _check_unsupported(body)
    texts, prompts, is_batch = _prompt_inputs(
        body, tokenize=tokenize, vocab_size=vocab_size, context_length=context_length, pause=pause
    )
    num = len(texts) if texts is not None else len(prompts)
    params = _per_prompt_sampling_params(body.get("sampling_params"), num=num, is_batch=is_batch, vocab_size=vocab_size)
    n = params[0].n
    flags = _logprob_flags(body.get("return_logprob", False), num=num, n=n)
    batch = is_batch or n > 1  # n > 1 turns a single prompt into a batch of one (_handle_parallel_sampling)
    rids = _rids(body.get("rid"), num_prompts=num, is_batch=batch)
    if texts is not None:  # tokenized last, and only prompts that may fit (SGLang tokenizes first: same 400 either way)
        prompts = _tokenized(
            texts, params, is_batch=is_batch, tokenize=tokenize, min_tokens=min_tokens, context_length=context_length
        )
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        check_context_length(
            len(prompt),
            p.max_new_tokens,
            context_length=context_length,
            name=f"input_ids[{i}]" if is_batch else "input_ids",
        )
    routed, routed_start = _routed_experts_options(body)
    return [
        # n > 1: every sample gets a fresh uuid rid (regenerate_rid), none of the client's
        SequenceRequest(
            list(prompts[i]),
            params[i],
            rids[i] if n == 1 else uuid.uuid4().hex,
            j,
            bool(flags[i]),
            return_routed_experts=routed,
            routed_experts_start_len=routed_start,
        )
        for i in range(num)
        for j in range(n)
    ], batch


def _prompt_inputs(
    body: dict, *, tokenize, vocab_size: int, context_length: int, pause
) -> tuple[list[str] | None, list[list[int]], bool]:
    """(texts, [], is_batch) for text prompts (tokenized later: _tokenized), or (None, checked token
    lists, is_batch) for input_ids. Exactly one of text / input_ids."""
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
        return texts, [], is_batch
    ids = body["input_ids"]
    is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)

    def checked(i: int, p: object) -> list[int]:
        if pause is not None:
            pause()
        return _token_list(p, f"input_ids[{i}]", vocab_size=vocab_size, context_length=context_length)

    if is_batch:
        return None, [checked(i, p) for i, p in enumerate(ids)], True
    return None, [_token_list(ids, "input_ids", vocab_size=vocab_size, context_length=context_length)], False


def _per_prompt_sampling_params(
    raw_params: object, *, num: int, is_batch: bool, vocab_size: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: a list (one entry each, the same n) or one dict for all."""
    if not isinstance(raw_params, list):
        return [parse_sampling_params(raw_params, "sampling_params", vocab_size=vocab_size)] * num
    if not is_batch or len(raw_params) != num:
        raise RequestError("sampling_params", f"a list needs one entry per prompt ({num}), got {len(raw_params)}")
    params = [
        parse_sampling_params(r, f"sampling_params[{i}]", vocab_size=vocab_size) for i, r in enumerate(raw_params)
    ]
    if len({p.n for p in params}) > 1:
        raise RequestError(
            "sampling_params", "The parallel_sample_num should be the same for all samples in sample params."
        )
    return params


def _logprob_flags(raw_logprob: object, *, num: int, n: int) -> list[bool | None]:
    """return_logprob per prompt (one flag for all, or a list: not with n > 1, as SGLang)."""
    if isinstance(raw_logprob, list):
        if n > 1:
            raise RequestError("return_logprob", "Cannot use list return_logprob with parallel_sample_num > 1")
        flags = raw_logprob
    else:
        flags = [raw_logprob] * num
    if len(flags) != num or not all(isinstance(f, bool) or f is None for f in flags):
        raise RequestError("return_logprob", "must be true/false or a list of them, one per prompt")
    return flags


def _tokenized(
    texts: list[str], params: list[SamplingParams], *, is_batch: bool, tokenize, min_tokens, context_length: int
) -> list[list[int]]:
    """The text prompts' token ids; a text that cannot fit the context (by a lower bound of its tokens,
    known without tokenizing) or that is not valid Unicode is refused before the tokenizer sees it."""
    prompts = []
    for i, (t, p) in enumerate(zip(texts, params)):
        name = f"text[{i}]" if is_batch else "text"
        lower = min_tokens(t) if min_tokens is not None else 0
        if lower >= context_length or lower + p.max_new_tokens > context_length:
            raise RequestError(
                name,
                f"The input ({len(t)} characters, at least {lower} tokens) is longer than "
                f"the model's context length ({context_length} tokens) allows with "
                f"max_new_tokens={p.max_new_tokens}.",
            )
        try:  # JSON can carry lone surrogates ("\ud800"), which no tokenizer takes (TypeError in `tokenizers`)
            t.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RequestError(name, f"not valid Unicode text (lone surrogate at character {err.start})") from None
        prompts.append(tokenize(t))
    return prompts


def _routed_experts_options(body: dict) -> tuple[bool, int]:
    routed = body.get("return_routed_experts", False)
    if not isinstance(routed, bool):
        raise RequestError("return_routed_experts", f"must be true or false, got {routed!r}")
    routed_start = body.get("routed_experts_start_len", 0)
    if isinstance(routed_start, bool) or not isinstance(routed_start, int) or routed_start < 0:
        raise RequestError("routed_experts_start_len", f"must be an integer >= 0, got {routed_start!r}")
    return routed, routed_start
