"""EngineClient: async HTTP client for one engine speaking SGLang's HTTP API (sglang 0.5.21's
entrypoints/http_server.py; the CPU engine of serve-rollout speaks the same).

    async with EngineClient("http://127.0.0.1:30000") as c:
        outs = await c.generate(input_ids=[[1, 2, 3]] * 2, rid=["q7-0.", "q7-1."], return_logprob=True,
                                sampling_params={"max_new_tokens": 8})
        await c.abort("q7-1.")                        # exact: one sample's own rid
        await c.begin_weight_update(); ...; await c.end_weight_update()

Every body is the JSON of one SGLang request class (managers/io_struct.py); docs/sglang.md lists the
endpoints, what we send, and the SGLang code each was checked against (tests/conformance).
Auth: `keys` (rollout/auth.py EngineKeys) puts `Authorization: Bearer <key>` on every request, the admin
key on the endpoints SGLang guards with it (auth.ENDPOINT_LEVELS), the api key on the others.
Errors: a 4xx/5xx answer raises EngineError carrying the status, the engine's URL and the server's
message; a dead engine (refused connection, reset, timeout) raises EngineUnreachable, which the pool
treats as "drop the engine and retry elsewhere".
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import cast, overload

import aiohttp

from dapo_megatron.rollout.auth import EngineKeys
from dapo_megatron.rollout.sglang_api import GenerateOutput, GenerateRequest, JsonValue, SamplingParamsArg


class EngineError(RuntimeError):
    def __init__(
        self, message: str, status: int | None = None, url: str | None = None, *, cut_urls: list[str] | None = None
    ):
        super().__init__(message)
        self.status = status
        self.url = url
        # weight sync: the engines whose begin_weight_update was cut (reset, refused, timed out), as opposed to
        # refused by the engine (transfer/weight_sync.weight_update_session, engine_push.sync_dropping_dead)
        self.cut_urls: list[str] = list(cut_urls or [])


class EngineUnreachable(EngineError):
    """The engine did not answer (connection refused/reset, timeout)."""


class SessionHolder:
    """One aiohttp session per event loop: a new one when used from another loop, so a training
    loop may call asyncio.run(...) once per step with the same pool and clients."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def get(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            if self._session is not None and not self._session.closed:
                self._session.detach()  # its loop has ended: let go without touching that loop
            # no connection limit (a rollout round keeps hundreds of requests in flight); no keep-alive
            # (force_close), so a session left behind by an ended loop holds no open socket
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            if self._loop is asyncio.get_running_loop():
                await self._session.close()
            else:
                self._session.detach()
        self._session = None


def generate_request(
    *,
    input_ids: list[int] | list[list[int]] | None = None,
    text: str | list[str] | None = None,
    sampling_params: SamplingParamsArg | None = None,
    return_logprob: bool = False,
    rid: str | list[str] | None = None,
    return_routed_experts: bool = False,
) -> GenerateRequest:
    """The /generate body: a prompt's ids or text (or a list of them), its sampling params, its rid(s)."""
    payload: GenerateRequest = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob}
    if return_routed_experts:  # MoE: meta_info.routed_experts (rollout/routing.py)
        payload["return_routed_experts"] = True
    if input_ids is not None:
        payload["input_ids"] = input_ids
    if text is not None:
        payload["text"] = text
    if rid is not None:
        payload["rid"] = rid
    return payload


class EngineClient:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 3600.0,
        sessions: SessionHolder | None = None,
        keys: EngineKeys | None = None,
    ):
        self.url = url.rstrip("/")
        self.keys = keys or EngineKeys()
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._own_sessions = sessions is None
        self._sessions = sessions or SessionHolder()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_sessions:
            await self._sessions.close()

    def _sess(self) -> aiohttp.ClientSession:
        return self._sessions.get()

    async def _request(
        self, method: str, path: str, payload: Mapping[str, object] | None = None, *, timeout_s: float | None = None
    ) -> JsonValue:
        """The answer's JSON (None for an empty body, the text for a non-JSON one)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s else self.timeout
        try:
            async with self._sess().request(
                method, self.url + path, json=payload, timeout=timeout, headers=self.keys.header_for(method, path)
            ) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    hint = ""
                    if resp.status in (401, 403):  # SGLang's auth middleware (rollout/auth.py)
                        hint = (
                            " (the engine wants an API key: engines of rollout.engine_urls take theirs from "
                            "rollout.engine_api_key_env / _file and the admin_ pair; the run's own engines "
                            "from <run_dir>/secrets/engine_auth.yaml)"
                        )
                    raise EngineError(
                        f"{self.url}{path}: HTTP {resp.status}: {body.decode(errors='replace')[:2000]}{hint}",
                        resp.status,
                        self.url,
                    )
                if not body:
                    return None
                if resp.content_type == "application/json":
                    return await resp.json()
                return body.decode(errors="replace")
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, ConnectionError) as err:
            raise EngineUnreachable(
                f"{self.url}{path}: engine unreachable ({type(err).__name__}: {err})", url=self.url
            ) from err

    # ------------------------------------------------------------------ generation
    # a batch (a list of prompts) answers one output per prompt x sample, a single prompt one output
    @overload
    async def generate(
        self,
        *,
        input_ids: list[list[int]],
        sampling_params: SamplingParamsArg | None = None,
        return_logprob: bool = False,
        rid: list[str] | None = None,
        return_routed_experts: bool = False,
    ) -> list[GenerateOutput]: ...

    @overload
    async def generate(
        self,
        *,
        text: list[str],
        sampling_params: SamplingParamsArg | None = None,
        return_logprob: bool = False,
        rid: list[str] | None = None,
        return_routed_experts: bool = False,
    ) -> list[GenerateOutput]: ...

    @overload
    async def generate(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        sampling_params: SamplingParamsArg | None = None,
        return_logprob: bool = False,
        rid: str | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateOutput: ...

    async def generate(
        self,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        text: str | list[str] | None = None,
        sampling_params: SamplingParamsArg | None = None,
        return_logprob: bool = False,
        rid: str | list[str] | None = None,
        return_routed_experts: bool = False,
    ) -> GenerateOutput | list[GenerateOutput]:
        return await self.send_generate(
            generate_request(
                input_ids=input_ids,
                text=text,
                sampling_params=sampling_params,
                return_logprob=return_logprob,
                rid=rid,
                return_routed_experts=return_routed_experts,
            )
        )

    async def send_generate(self, payload: GenerateRequest) -> GenerateOutput | list[GenerateOutput]:
        """POST /generate with a body built by generate_request (EnginePool's retries resend it)."""
        # the reply's shape is SGLang's contract (sglang_api.py), not checked here
        return cast("GenerateOutput | list[GenerateOutput]", await self._request("POST", "/generate", payload))

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """POST /abort_request. SGLang answers 200 with no body whether or not anything matched: the
        aborted request's own reply (finish_reason "abort") is the only confirmation."""
        payload: dict[str, object] = {"abort_all": abort_all}
        if rid is not None:
            payload["rid"] = rid
        await self._request("POST", "/abort_request", payload, timeout_s=30)

    async def pause_generation(self, mode: str = "abort") -> JsonValue:
        """POST /pause_generation: "abort" (abort everything in flight, answer once it has returned),
        "retract" (running requests go back to the queue, their KV cache freed, recomputed on continue)
        or "in_place" (requests keep their KV cache and resume where they stopped). New requests wait
        until continue_generation."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation: mode must be abort, retract or in_place, got {mode!r}")
        return await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> JsonValue:
        return await self._request("POST", "/continue_generation", {})

    # ------------------------------------------------------------------ weights
    async def flush_cache(self) -> JsonValue:
        """POST /flush_cache; SGLang refuses (400) while any request runs or waits."""
        return await self._request("POST", "/flush_cache")

    async def begin_weight_update(self) -> JsonValue:
        """Opens the weight-update session: SGLang refuses update_weights_from_distributed/_tensor (400)
        outside one. One session at a time per engine."""
        return await self._request("POST", "/begin_weight_update", {})

    async def end_weight_update(self) -> JsonValue:
        """Closes the session (the engine runs its post-load processing)."""
        return await self._request("POST", "/end_weight_update", {})

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> JsonValue:
        return await self._request(
            "POST",
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> JsonValue:
        return await self._request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
        weight_version: str | None = None,
    ) -> JsonValue:
        """One bucket; the tensors follow as broadcasts from rank 0 of the group: one per tensor, or
        one for the whole bucket with load_format "flattened_bucket". Needs an open session."""
        return await self._request(
            "POST",
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "flush_cache": flush_cache,
                "load_format": load_format,
                "weight_version": weight_version,
            },
        )

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> JsonValue:
        """One bucket as one payload per engine TP rank (tensor_payload.serialize_for_engine_rank).
        Needs an open session."""
        return await self._request(
            "POST",
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": serialized_named_tensors,
                "load_format": load_format,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            },
        )

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None) -> JsonValue:
        return await self._request(
            "POST", "/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version}
        )

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> JsonValue:
        return await self._request("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def release_memory(self, tags: list[str] | None = None) -> JsonValue:
        """POST /release_memory_occupation {tags}: "weights", "kv_cache" (None: all). The engine must
        be idle. Without a CPU backup the weights' content is gone: resume, then sync them again."""
        return await self._request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> JsonValue:
        return await self._request("POST", "/resume_memory_occupation", {"tags": tags})

    # ------------------------------------------------------------------ info
    async def health(self, *, timeout_s: float = 30.0) -> bool:
        """GET /health: 200 once the server has started and a 1-token generation works (503 before)."""
        try:
            await self._request("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    async def model_info(self) -> dict:
        return cast(dict, await self._request("GET", "/model_info"))  # a JSON object (SGLang's /model_info)

    async def server_info(self) -> dict:
        return cast(dict, await self._request("GET", "/server_info"))  # a JSON object (SGLang's /server_info)
