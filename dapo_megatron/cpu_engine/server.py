"""`dapo-megatron serve-rollout`: a CPU generation server that behaves like SGLang 0.5.21's HTTP server
wherever a client can tell (docs/sglang.md lists every endpoint, the SGLang code it follows, and the
CPU differences).

    dapo-megatron serve-rollout --model DIR --host 127.0.0.1 --port 30000 [--register-dir RUN/engines]
        [--context-length N] [--no-enable-deterministic-inference] [--config KEYS.yaml]   # serve.py

SGLang's behaviour kept here (entrypoints/http_server.py, managers/tokenizer_manager.py,
tokenizer_control_mixin.py, scheduler.py, scheduler_components/weight_updater.py):
  - /health and /health_generate answer 503 until the server has started (a 1-token warm-up
    generation), then run a 1-token generation (200 once the engine produced anything within 20 s).
  - /generate: SGLang's request shape and normalisation (protocol.py): n > 1 samples get fresh uuid
    rids; replies carry meta_info {id, finish_reason, prompt_tokens, completion_tokens, cached_tokens,
    e2e_latency and request_received_ts (SGLang sends the latter with --enable-metrics), weight_version,
    weight_versions (per-token spans of the versions that made the output),
    output_token_logprobs, and routed_experts (base64 int32 [prompt + completion - 1, layers, topk],
    rollout/routing.py) when asked of an MoE model}; a request waits while generation is paused.
  - /abort_request {rid | abort_all}: 200 with no body; a rid the server does not know is ignored; a
    known one aborts every queued or running sample whose rid starts with it (cpu_scheduler.py).
  - weight updates (/update_weights_from_distributed, /update_weights_from_tensor) only between
    /begin_weight_update and /end_weight_update (400 otherwise, SGLang's messages); they and begin/end
    wait for running requests unless generation is paused; `weight_version` sets the version every
    later reply reports; /update_weights_from_disk and /update_weight_version need no session.
  - /flush_cache: 400 while requests run or wait (the waiting ones do not count while paused).
  - /release_memory_occupation and /resume_memory_occupation {tags}: the server must be idle.
  - /pause_generation {mode: abort | retract | in_place}, /continue_generation.
  - /model_info, /server_info (and the deprecated /get_model_info, /get_server_info), /get_weights_by_name.
CPU differences, each named in docs/sglang.md: update_weights_from_tensor payloads carry shared-memory
segments instead of CUDA IPC handles (tensor_payload.py); /model_info adds "parameters" and /server_info
a "cpu_engine" section (counters, resident memory); /generate answers 503 while memory is released
(SGLang would read freed memory); a release while busy or a resume of a tag not released is a 400
(SGLang's scheduler asserts and dies); weights refuse a wrong name or shape before anything is written.
Errors: {"error": {"message", "field"}, "success": false, "message"} (a superset of SGLang's two
shapes, {"error": {"message"}} and {"success": false, "message"}).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import time
from typing import TypedDict

import torch
from aiohttp import web

from dapo_megatron.cpu_engine.engine import MEMORY_TAGS, CpuEngine, WeightError
from dapo_megatron.cpu_engine.guard import (
    Limits,
    Pauser,
    error_response,
    guard_middleware,
    is_large,
    off_loop,
    read_json,
)
from dapo_megatron.cpu_engine.protocol import RequestError, SamplingParams, SequenceRequest, parse_generate
from dapo_megatron.cpu_engine.scheduler import Batcher, RWLock
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.rollout.routing import encode_routed_experts
from dapo_megatron.transfer.tensor_payload import PayloadError, deserialize_payload, flattened_size, unflatten_bucket
from dapo_megatron.transfer.weight_group import open_weight_group

HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT's default
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


_error = error_response


def _ok(message: str, **extra) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


_json = read_json


def _field(body: dict, name: str, kind: type | tuple, *, default=..., nullable: bool = False):
    """body[name] checked like SGLang's pydantic schema: missing required field or wrong type -> 400."""
    if name not in body or (body[name] is None and nullable):
        if default is ...:
            raise RequestError(name, "missing required field")
        return default
    value = body[name]
    if (isinstance(value, bool) and kind in (int, float)) or not isinstance(value, kind):
        raise RequestError(name, f"wrong type {type(value).__name__}")
    return value


class ServerStats(TypedDict):
    """The counters /server_info reports (beside SGLang's own fields)."""

    num_requests: int
    num_sequences: int
    num_aborted: int
    aborted_rids: list[str]  # the last 10,000
    num_weight_updates: int


class RolloutServer:
    def __init__(self, engine: CpuEngine, *, model_name: str, seed: int = 0, limits: Limits | None = None):
        self.engine = engine
        self.limits = limits or Limits()  # API keys and the body size limit (guard.py)
        self.model_name = model_name
        self.seed = seed
        self.batcher = Batcher(engine)
        self.model_update_lock = RWLock()
        self.status = "Starting"  # SGLang's ServerStatus: Starting until the warm-up generation is done
        self.is_pause = False  # the tokenizer-side pause (every mode): new requests wait
        self.pause_cond = asyncio.Condition()
        self.live_rids: set[str] = set()  # SGLang's rid_to_state: rids an abort can name
        self.session_open = False
        # fault tests only (never set by the product): keep each weight-update session open this long after
        # it begins, so that a test can act while a sync is in flight (a tiny model's session lasts ~0.1 s)
        self.session_hold_s = float(os.environ.get("DAPO_CPU_ENGINE_SESSION_HOLD_S") or 0)
        self.groups: dict[str, object] = {}  # group_name -> ProcessGroup
        self.stats: ServerStats = {
            "num_requests": 0,
            "num_sequences": 0,
            "num_aborted": 0,
            "aborted_rids": [],
            "num_weight_updates": 0,
        }

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.limits.max_request_bytes, middlewares=[guard_middleware(self.limits)]
        )
        r = app.router
        for path, handler in [
            ("/generate", self.generate),
            ("/abort_request", self.abort_request),
            ("/begin_weight_update", self.begin_weight_update),
            ("/end_weight_update", self.end_weight_update),
            ("/init_weights_update_group", self.init_group),
            ("/destroy_weights_update_group", self.destroy_group),
            ("/update_weights_from_distributed", self.update_from_distributed),
            ("/update_weights_from_tensor", self.update_from_tensor),
            ("/update_weights_from_disk", self.update_from_disk),
            ("/update_weight_version", self.update_weight_version),
            ("/pause_generation", self.pause_generation),
            ("/continue_generation", self.continue_generation),
        ]:
            r.add_post(path, handler)
        r.add_put("/generate", self.generate)
        for path, handler in [
            ("/flush_cache", self.flush_cache),
            ("/release_memory_occupation", self.release),
            ("/resume_memory_occupation", self.resume),
            ("/get_weights_by_name", self.weights_by_name),
        ]:
            r.add_get(path, handler)
            r.add_post(path, handler)
        for path, handler in [
            ("/health", self.health),
            ("/health_generate", self.health),
            ("/ready", self.ready),
            ("/model_info", self.model_info),
            ("/get_model_info", self.model_info),
            ("/server_info", self.server_info),
            ("/get_server_info", self.server_info),
        ]:
            r.add_get(path, handler)
        return app

    # ------------------------------------------------------------------ generation
    async def _wait_not_paused(self) -> None:
        async with self.pause_cond:
            await self.pause_cond.wait_for(lambda: not self.is_pause)

    async def run_sequences(self, seqs: list[SequenceRequest]) -> list[SequenceRequest]:
        """What one /generate does once parsed: register the rids, wait out a pause, hold the reader
        side of the model-update lock while the scheduler runs the sequences."""
        rids = {s.rid for s in seqs}
        self.live_rids |= rids
        try:
            await self._wait_not_paused()
            async with self.model_update_lock.reader():
                futs = self.batcher.submit(seqs)
                try:
                    return list(await asyncio.gather(*futs))
                except asyncio.CancelledError:  # the client went away: stop spending compute on it
                    self.batcher.cancel(seqs)
                    raise
        finally:
            self.live_rids -= rids

    async def generate(self, request: web.Request) -> web.Response:
        # SGLang stamps a request when its TokenizerManager receives it (time_stats.set_created_time):
        # e2e_latency and request_received_ts count from here, parsing included
        received, tic = time.time(), time.perf_counter()
        try:
            body = await _json(request)
            e = self.engine
            tokenize = e.tokenize if e.tokenizer is not None else None
            parse = functools.partial(
                parse_generate,
                body,
                vocab_size=e.vocab_size,
                tokenize=tokenize,
                context_length=e.context_length,
                min_tokens=e.min_tokens,
                pause=Pauser() if is_large(request) else None,
            )
            # a text prompt is tokenized on a worker thread (the tokenizer lets go of the GIL): /health and
            # other requests are served meanwhile; prompts sure to exceed the context never get there.
            # Token ids are checked one by one: on the parse pool when the body is large (guard.off_loop)
            seqs, as_list = (
                await asyncio.get_running_loop().run_in_executor(None, parse)
                if "text" in body
                else await off_loop(request, parse)
            )
        except RequestError as err:
            return _error(err.status, str(err), err.field)
        refusal = self._not_serving()
        if refusal:
            return _error(409, refusal)
        self.stats["num_requests"] += 1
        self.stats["num_sequences"] += len(seqs)
        try:
            done = await self.run_sequences(seqs)
        except Exception as err:  # noqa: BLE001
            return _error(500, f"generation failed: {err}")
        latency = time.perf_counter() - tic
        outs = [self._output(s, latency, received) for s in done]
        return web.json_response(outs if as_list else outs[0])

    def _not_serving(self) -> str:
        """Why the engine cannot generate now ("" when it can): memory released, or weights resumed and
        not yet written again. SGLang would sample from freed or stale memory; the CPU engine answers 409."""
        e = self.engine
        if e.released:
            return (
                f"memory is released ({sorted(e.released_tags)}): call /resume_memory_occupation, then sync the "
                "weights, before /generate"
            )
        if e.unsynced:
            return (
                f"weights were resumed after a release and {len(e.unsynced)} parameter tensors have not been "
                "written since (their content is undefined): sync the weights (update_weights_from_tensor / "
                "_distributed / _disk) before /generate"
            )
        return ""

    def _output(self, s: SequenceRequest, latency: float, received: float) -> dict:
        # versions: per-token spans as sglang/srt/utils/weight_versions.py reports them
        spans: list[dict] = []
        for i, version in enumerate(s.output_versions):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": version, "start": i, "end": i + 1})
        if not spans:
            spans = [{"version": self.engine.weight_version, "start": 0, "end": 0}]
        meta = {
            "id": s.rid,
            "finish_reason": s.finish_reason,
            "prompt_tokens": len(s.prompt_ids),
            "completion_tokens": len(s.output_ids),
            "cached_tokens": 0,
            "e2e_latency": latency,
            "request_received_ts": received,
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
        }
        if s.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.output_logprobs, s.output_ids)]
        if s.routed_experts is not None:  # a dense model records none and, like SGLang, sends none
            meta["routed_experts"] = encode_routed_experts(s.routed_experts)
        text = self.engine.decode(s.output_ids, s.params.skip_special_tokens)
        return {"text": text, "output_ids": s.output_ids, "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            rid = _field(body, "rid", str, default="", nullable=True)
            abort_all = _field(body, "abort_all", bool, default=False)
        except RequestError as err:
            return _error(400, str(err), err.field)
        self._abort(rid=rid, abort_all=abort_all)
        return web.Response(status=200)

    def _abort(self, *, rid: str = "", abort_all: bool = False) -> list[str]:
        # TokenizerManager.abort_request: an empty rid without abort_all, or a rid it does not hold, is ignored
        if not abort_all and (not rid or rid not in self.live_rids):
            return []
        hit = self.batcher.abort(rid=rid, abort_all=abort_all)
        self.stats["num_aborted"] += len(hit)
        self.stats["aborted_rids"] = (self.stats["aborted_rids"] + hit)[-10000:]
        return hit

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request, optional=True)
            mode = _field(body, "mode", str, default="abort")
            if mode not in ("abort", "retract", "in_place"):
                raise RequestError("mode", f"must be abort, retract or in_place, got {mode!r}")
        except RequestError as err:
            return _error(400, str(err), err.field)
        async with self.pause_cond:
            self.is_pause = True
        if mode == "abort":  # TokenizerManager.pause_generation: abort all until no request holds the lock
            while True:
                self._abort(abort_all=True)
                if self.model_update_lock.readers == 0:
                    break
                await asyncio.sleep(0.05)
        else:  # returns once the running batch is parked between two steps
            await asyncio.get_running_loop().run_in_executor(None, self.batcher.set_pause, mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.batcher.set_pause(None)
        async with self.pause_cond:
            self.is_pause = False
            self.pause_cond.notify_all()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    # ------------------------------------------------------------------ weights
    async def _run_locked(self, fn, *args):
        """fn on a worker thread, holding the engine lock (no decode step in between)."""

        def call():
            with self.engine.lock:
                return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(None, call)

    def _update_lock(self):
        """The writer side of the model-update lock, or nothing while paused (SGLang's
        _weight_update_session_call: the paused requests still hold the reader side)."""
        return contextlib.nullcontext() if self.is_pause else self.model_update_lock.writer()

    def _versioned(self, message: str, weight_version: str | None) -> str:
        if weight_version is not None:
            self.engine.weight_version = weight_version
            message += f" Weight version updated to {weight_version}."
        return message

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        async with self._update_lock():
            if self.session_open:
                return _error(400, "a weight-update session is already open; call end_weight_update() first")
            self.session_open = True
        if self.session_hold_s:
            await asyncio.sleep(self.session_hold_s)
        return _ok("Success")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        async with self._update_lock():
            if not self.session_open:
                return _error(400, "no weight-update session is open; call begin_weight_update() first")
            self.session_open = False
        return _ok("Success")

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            address = _field(body, "master_address", str)
            port = _field(body, "master_port", int)
            rank_offset = _field(body, "rank_offset", int)
            world_size = _field(body, "world_size", int)
            group_name = _field(body, "group_name", str, default="weight_update_group")
            backend = _field(body, "backend", str, default="nccl")  # SGLang's default
            if backend != "gloo":
                raise RequestError(
                    "backend",
                    f"this CPU engine joins gloo groups only, got {backend!r} "
                    "(it says so in /server_info cpu_engine.weight_group_backend)",
                )
            if not 1 <= rank_offset < world_size:
                raise RequestError("rank_offset", f"must be in [1, world_size={world_size}), got {rank_offset}")
            if group_name in self.groups:
                raise RequestError("group_name", f"group '{group_name}' exists; destroy it first")
        except RequestError as err:
            return _error(400, str(err), err.field)

        try:
            pg = await asyncio.get_running_loop().run_in_executor(
                None,
                lambda: open_weight_group(
                    backend="gloo",
                    master_address=address,
                    master_port=port,
                    rank=rank_offset,
                    world_size=world_size,
                    group_name=group_name,
                ),
            )
        except Exception as err:  # noqa: BLE001
            return _error(400, f"Failed to initialize custom process group: {err}.")
        self.groups[group_name] = pg
        return _ok("Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request, optional=True)
            name = _field(body, "group_name", str, default="weight_update_group")
        except RequestError as err:
            return _error(400, str(err), err.field)
        if self.groups.pop(name, None) is None:
            return _error(400, "The group to be destroyed does not exist.", "group_name")
        return _ok("Succeeded to destroy custom process group.")

    @staticmethod
    def _common_update_fields(body: dict) -> tuple[bool, str | None, str | None]:
        flush = _field(body, "flush_cache", bool, default=True)
        version = _field(body, "weight_version", str, default=None, nullable=True)
        load_format = _field(body, "load_format", str, default=None, nullable=True)
        return flush, version, load_format

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            names = _field(body, "names", list)
            dtypes = _field(body, "dtypes", list)
            shapes = _field(body, "shapes", list)
            group_name = _field(body, "group_name", str, default="weight_update_group")
            _, version, load_format = self._common_update_fields(body)
        except RequestError as err:
            return _error(400, str(err), err.field)
        async with self._update_lock():
            if not self.session_open:
                return _error(
                    400,
                    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
                )
            try:
                specs = self._specs(names, dtypes, shapes, load_format, group_name)
            except RequestError as err:
                return _error(400, f"Failed to receive weights: {err}", err.field)
            pg = self.groups[group_name]

            def receive():  # SGLang's order: receive the whole bucket, then load it
                if load_format == "flattened_bucket":
                    flat = torch.empty(flattened_size(specs), dtype=torch.uint8)
                    coll.pg_broadcast(pg, flat, src=0)  # one collective for the bucket
                    return unflatten_bucket(flat, specs)
                received = []
                for name, dt, shape in specs:
                    t = torch.empty(shape, dtype=dt)
                    coll.pg_broadcast(pg, t, src=0)  # one collective per tensor, in order
                    received.append((name, t))
                return received

            try:
                named = await asyncio.get_running_loop().run_in_executor(None, receive)
            except Exception as err:  # noqa: BLE001
                return _error(400, f"Failed to receive weights: {err}")
            try:
                await self._run_locked(self.engine.load_weights, named)
            except WeightError as err:  # nothing was written (the engine checks every tensor first)
                return _error(400, f"Failed to update parameter online: {err}", "names")
            self.stats["num_weight_updates"] += 1
            return _ok(self._versioned("Succeeded to update parameter online.", version))

    def _specs(self, names, dtypes, shapes, load_format, group_name) -> list[tuple[str, torch.dtype, list[int]]]:
        if not len(names) == len(dtypes) == len(shapes):
            raise RequestError("names", f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        if load_format not in (None, "flattened_bucket"):
            raise RequestError("load_format", f"Unknown load_format={load_format}")
        if group_name not in self.groups:
            raise RequestError(
                "group_name",
                f"Group {group_name} not in {sorted(self.groups)}. Please call `init_weights_update_group` first.",
            )
        specs = []
        for i, (name, d, shape) in enumerate(zip(names, dtypes, shapes)):
            dt = getattr(torch, str(d), None)
            if not isinstance(dt, torch.dtype):
                raise RequestError(f"dtypes[{i}]", f"unknown dtype {d!r}")
            if not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
                raise RequestError(f"shapes[{i}]", f"must be a list of sizes, got {shape!r}")
            specs.append((str(name), dt, shape))
        return specs

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            payloads = _field(body, "serialized_named_tensors", list)
            _, version, load_format = self._common_update_fields(body)
            if not payloads or not all(isinstance(p, str) for p in payloads):
                raise RequestError("serialized_named_tensors", "must hold one base64 payload per engine TP rank")
            if load_format not in (None, "direct"):
                raise RequestError(
                    "load_format", f"the CPU engine reads lists of (name, tensor) only, got {load_format!r}"
                )
        except RequestError as err:
            return _error(400, str(err), err.field)
        async with self._update_lock():
            if not self.session_open:
                return _error(
                    400, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
                )
            try:
                # this engine is TP rank 0: its own entry only
                # base64 and unpickling of a large payload on the parse pool (the writer lock is held throughout);
                # a CUDA payload (IPC handles, small) is opened here, on the thread that always opened them
                if self.engine.device.type == "cuda":
                    named = deserialize_payload(payloads[0], cuda=True)
                else:
                    named = await off_loop(request, deserialize_payload, payloads[0])
                await self._run_locked(self.engine.load_weights, named)
            except PayloadError as err:
                return _error(400, f"serialized_named_tensors[0]: {err}", "serialized_named_tensors[0]")
            except WeightError as err:
                return _error(400, str(err), "serialized_named_tensors[0]")
            self.stats["num_weight_updates"] += 1
            return _ok(self._versioned("Success", version))

    async def update_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            path = _field(body, "model_path", str)
            version = _field(body, "weight_version", str, default=None, nullable=True)
            if not os.path.isdir(path):
                raise RequestError("model_path", f"no such directory '{path}'")
        except RequestError as err:
            return _error(400, str(err), err.field)
        async with self._update_lock():
            try:
                count = await self._run_locked(self.engine.load_from_disk, path)
            except WeightError as err:
                return _error(400, str(err), "model_path")
            self.stats["num_weight_updates"] += 1
            message = self._versioned(f"Succeeded to update model weights ({count} tensors).", version)
        return web.json_response({"success": True, "message": message, "num_paused_requests": 0})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request)
            version = _field(body, "new_version", str)
            abort_all = _field(body, "abort_all_requests", bool, default=True)
        except RequestError as err:
            return _error(400, str(err), err.field)
        if abort_all:
            self._abort(abort_all=True)
        self.engine.weight_version = version
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    async def weights_by_name(self, request: web.Request) -> web.Response:
        try:
            body = await _json(request, optional=True) if request.can_read_body else dict(request.query)
            name = _field(body, "name", str)
            size = body.get("truncate_size", 100)
            size = int(size) if isinstance(size, str) else _field(body, "truncate_size", int, default=100)
            return web.json_response(self.engine.weights_by_name(name, size))
        except (RequestError, WeightError, ValueError) as err:
            return _error(400, str(err), getattr(err, "field", "name"))

    # ------------------------------------------------------------------ memory and cache
    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            timeout = float(request.query.get("timeout", 0.0))
            if not math.isfinite(timeout):  # nan would never end the wait below
                raise ValueError
        except ValueError:
            return _error(400, "timeout: must be a finite number of seconds", "timeout")
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:  # Scheduler.flush_cache: only when idle (waiting requests do not count while paused)
            if self.batcher.is_fully_idle(ignore_waiting=self.batcher.paused is not None):
                return web.Response(text=FLUSHED)
            if time.monotonic() >= deadline:
                message = "Timed out waiting for idle state." if timeout > 0 else "Flush cache failed.\n"
                return web.Response(text=message, status=400)
            await asyncio.sleep(0.05)

    @staticmethod
    def _tags(body: dict) -> list[str]:
        tags = _field(body, "tags", list, default=None, nullable=True)
        if not tags:
            return list(MEMORY_TAGS)  # SGLang: None or [] means every tag
        if not all(isinstance(t, str) for t in tags):
            raise RequestError("tags", f"must be a list of strings, got {tags!r}")
        return tags

    async def release(self, request: web.Request) -> web.Response:
        try:
            tags = self._tags(await _json(request, optional=True))
        except RequestError as err:
            return _error(400, str(err), err.field)
        if not self.batcher.is_fully_idle(ignore_waiting=self.batcher.paused is not None):
            return _error(400, "release_memory_occupation should be called only when server is idle.")
        await self._run_locked(self.engine.release, tags)
        return web.json_response(None)

    async def resume(self, request: web.Request) -> web.Response:
        try:
            tags = self._tags(await _json(request, optional=True))
        except RequestError as err:
            return _error(400, str(err), err.field)
        missing = [t for t in tags if t not in self.engine.released_tags]
        if missing:
            return _error(
                400, f"tags {missing} are not released (released: {sorted(self.engine.released_tags)})", "tags"
            )
        await self._run_locked(self.engine.resume, tags)
        return web.json_response(None)

    # ------------------------------------------------------------------ info
    async def health(self, request: web.Request) -> web.Response:
        """SGLang's health_generate: 503 while starting, else a 1-token generation; 200 as the
        engine finished anything (this request or another) within the timeout."""
        if self.status != "Up" or self._not_serving():
            return web.Response(status=503)
        tic = time.monotonic()
        seq = SequenceRequest(
            [0], SamplingParams(max_new_tokens=1, temperature=0.0), f"HEALTH_CHECK_{time.time_ns()}", 0, False
        )
        task = asyncio.ensure_future(self.run_sequences([seq]))
        try:
            while time.monotonic() < tic + HEALTH_CHECK_TIMEOUT_S:
                if task.done() or self.batcher.last_finish > tic:
                    return web.Response(status=200)
                await asyncio.sleep(0.05)
            return web.Response(status=503)
        finally:
            if not task.done():
                task.cancel()  # run_sequences drops it from the scheduler

    async def ready(self, request: web.Request) -> web.Response:
        """SGLang's /ready (TokenizerManager.is_ready): 200 when new requests are served now: started, not
        paused; the CPU engine adds: weights resident and synced since a release (503 otherwise)."""
        ok = self.status == "Up" and not self.is_pause and not self._not_serving()
        return web.Response(status=200 if ok else 503)

    async def warm_up(self) -> None:
        """The server's first 1-token generation (SGLang's _wait_and_warmup); then it is Up."""
        seq = SequenceRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0), "WARMUP", 0, False)
        await self.run_sequences([seq])
        self.status = "Up"

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.model.config
        return web.json_response(
            {
                "model_path": self.engine.model_path,
                "served_model_name": self.model_name,
                "tokenizer_path": self.engine.model_path if self.engine.tokenizer is not None else None,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "load_format": "auto",
                "model_type": getattr(cfg, "model_type", None),
                "architectures": getattr(cfg, "architectures", None),
                "parameters": self.engine.parameter_specs(),  # CPU extra: the names and shapes a sync may target
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        e = self.engine
        gb = 1024**3
        return web.json_response(
            {
                # a few of SGLang's ServerArgs fields (server_info is ServerArgs.resolved_dict() + state)
                "model_path": e.model_path,
                "tp_size": 1,
                "dp_size": 1,
                "context_length": e.context_length,
                "random_seed": self.seed,
                "enable_deterministic_inference": e.deterministic,
                "max_running_requests": e.max_batch_size,
                "weight_version": e.weight_version,
                "device": e.device.type,
                "cpu_engine_device": str(e.device),
                "quantization": "fp8" if e.fp8 else None,
                "version": "dapo-megatron cpu engine (sglang 0.5.21 protocol)",
                "internal_states": [
                    {
                        "memory_usage": {  # SGLang's build_memory_usage shape, in GB
                            "weight": round(e.loaded_weight_bytes / gb, 3),
                            "kvcache": 0.0,
                            "token_capacity": 0,
                            "graph": {},
                        }
                    }
                ],
                "cpu_engine": {  # CPU extra: counters and what is resident now (release frees it)
                    **self.stats,
                    **self.batcher.counts(),
                    "pid": os.getpid(),
                    "status": self.status,
                    "is_paused": self.is_pause,
                    "weight_update_session_open": self.session_open,
                    "released_tags": sorted(e.released_tags),
                    "weight_group_backend": "gloo",  # the only one it joins (init_group); the trainer follows it
                    "resident_memory_bytes": {"weights": e.resident_weight_bytes(), "kv_cache": e.kv_cache_bytes},
                    # CPU extra: what a GEMM of an fp8 Linear computes (cpu_engine/fp8_gemm.py, SGLang's numerics)
                    "fp8_gemm": (
                        "w8a8 block fp8: weights 128x128 blocks, activations quantized dynamically per token "
                        "x 128 channels"
                        if e.fp8
                        else None
                    ),
                },
            }
        )
