"""The JSON bodies of SGLang's HTTP API that this project sends and reads, as types (sglang 0.5.21:
managers/io_struct.py GenerateReqInput, managers/tokenizer_manager.py's reply dicts, managers/
schedule_batch.py FINISH_*.to_json, utils/weight_versions.py). The CPU engine (cpu_engine/) answers
with the same shapes, so both sides of the wire share these.

A reply's meta_info carries more keys than listed here when SGLang runs with metrics or speculative
decoding; the ones below are those the rollout reads or the CPU engine writes. `JsonValue` is for the
bodies whose schema is the caller's (raw YAML/JSON, the admin endpoints' free-form answers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias, TypedDict

# raw JSON as json.loads returns it
JsonValue: TypeAlias = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject = dict[str, JsonValue]

# GenerateReqInput.sampling_params: one dict, or one per prompt (SGLang's SamplingParams field names:
# n, temperature, top_p, top_k, min_p, max_new_tokens, stop_token_ids, ignore_eos, sampling_seed, ...).
# A Mapping of objects: callers build these as dict literals, and the engine validates every value.
SamplingParamsArg: TypeAlias = Mapping[str, object] | Sequence[Mapping[str, object]]


class _FinishReasonBase(TypedDict):
    type: str  # "stop" | "length" | "abort"


class FinishReason(_FinishReasonBase, total=False):
    """FINISH_MATCHED_TOKEN/_STR ("stop", matched), FINISH_LENGTH ("length", length), FINISH_ABORT
    ("abort", message, status_code, err_type)."""

    matched: int | str | None
    length: int
    message: str | None
    status_code: int | None
    err_type: str | None


class WeightVersionSpan(TypedDict):
    """The output tokens [start, end) one weight version made (utils/weight_versions.py)."""

    version: str
    start: int
    end: int


class MetaInfo(TypedDict, total=False):
    id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    request_received_ts: float  # with --enable-metrics (the CPU engine always sends it)
    weight_version: str
    weight_versions: list[WeightVersionSpan]
    # with return_logprob: (logprob, token id, token text or None) per output token
    output_token_logprobs: list[tuple[float, int, str | None]]
    routed_experts: str  # with return_routed_experts on a MoE model: base64 int32 (rollout/routing.py)


class GenerateOutput(TypedDict):
    """One sample's reply from POST /generate (a batch request answers a list of these)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class GenerateRequest(TypedDict, total=False):
    """The body EngineClient.generate sends (GenerateReqInput's fields we use)."""

    text: str | list[str]
    input_ids: list[int] | list[list[int]]
    sampling_params: SamplingParamsArg
    return_logprob: bool
    rid: str | list[str]
    return_routed_experts: bool
