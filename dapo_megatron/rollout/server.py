"""`dapo-megatron serve-rollout`: a CPU generation server speaking SGLang's HTTP API.

    dapo-megatron serve-rollout --model DIR --host 127.0.0.1 --port 30000 [--register-dir RUN/engines]

Endpoints (request/response shapes of sglang 0.5.21, entrypoints/http_server.py + io_struct.py):
  POST /generate                        text | input_ids (single or batch), sampling_params
                                        (n, temperature, top_p, top_k, max_new_tokens, stop_token_ids,
                                        ignore_eos, sampling_seed), return_logprob, rid,
                                        return_routed_experts, routed_experts_start_len (MoE)
        -> {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
            "completion_tokens", "output_token_logprobs": [[logprob, token_id, null], ...],
            "routed_experts": base64 int32 [prompt + completion - 1, layers, topk] (rollout/routing.py)}}
           (a list of those for a batch or n > 1, prompt-major)
  POST /abort_request                   {"rid": ...} or {"abort_all": true}
  GET|POST /flush_cache                 no prefix cache on CPU: succeeds, nothing to drop
  POST /init_weights_update_group       {master_address, master_port, rank_offset, world_size,
                                        group_name, backend}: joins a gloo group (rank = rank_offset)
  POST /update_weights_from_distributed {names, dtypes, shapes, group_name}: checks every name and
                                        shape first (400 naming the tensor), then receives one
                                        broadcast per tensor from rank 0, in order, as SGLang does
  POST /destroy_weights_update_group    {group_name}
  POST /update_weights_from_disk        {model_path}: every *.safetensors file of that directory
  POST /update_weights_from_tensor      {serialized_named_tensors: [base64 str]}. CPU difference:
                                        SGLang's items are MultiprocessingSerializer (CUDA IPC handle)
                                        pickles; here each item is base64(torch.save(list of
                                        (name, tensor))), tensors by value, read with weights_only=True
  POST /release_memory_occupation, /resume_memory_occupation: the weights move to host copies
                                        and back (nothing to free on CPU); /generate answers 503
                                        while released
  GET /health, /health_generate (one real 1-token generation), /get_model_info (SGLang's fields
  plus "parameters": {name: {shape, dtype}}, our handshake for weight sync), /get_server_info
  (counters: requests, sequences, aborted rids), GET|POST /get_weights_by_name {name, truncate_size}.

Concurrent /generate requests are grouped: a worker thread takes every waiting sequence (up to
--max-batch-size) into one padded decode loop. Bad requests get 400 with {"error": {"message",
"field"}}; the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import io
import json
import os
import signal
import socket
import threading
import time
from collections import deque

import torch
from aiohttp import web

from dapo_megatron.rollout.cpu_engine import CpuEngine, WeightError
from dapo_megatron.rollout.protocol import RequestError, SequenceRequest, parse_generate
from dapo_megatron.rollout.registry import remove_registration, write_registration
from dapo_megatron.rollout.routing import encode_routed_experts


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "field": field}, "success": False,
                              "message": message}, status=status)


class _Batcher:
    """Groups waiting sequences into padded batches on one worker thread."""

    def __init__(self, engine: CpuEngine):
        self.engine = engine
        self.pending: deque[tuple[SequenceRequest, asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self.running: list[SequenceRequest] = []
        # rids aborted before their /generate arrived (the abort overtook the request on the wire)
        self.tombstones: deque[str] = deque(maxlen=10000)
        self.cond = threading.Condition()
        threading.Thread(target=self._loop, name="generate-worker", daemon=True).start()

    def submit(self, seqs: list[SequenceRequest]) -> list[asyncio.Future]:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in seqs]
        with self.cond:
            for s in seqs:
                s.aborted = s.rid in self.tombstones
            self.pending.extend(zip(seqs, futs, [loop] * len(seqs)))
            self.cond.notify()
        return futs

    def abort(self, rid: str | None, abort_all: bool) -> list[str]:
        hit = []
        with self.cond:
            for s in [p[0] for p in self.pending] + self.running:
                if abort_all or s.rid == rid or (rid and s.rid.startswith(rid + "_")):
                    s.aborted = True
                    hit.append(s.rid)
            if rid and not hit:
                self.tombstones.append(rid)
        return hit

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.pending:
                    self.cond.wait()
                take = []
                while self.pending and len(take) < self.engine.max_batch_size:
                    take.append(self.pending.popleft())
                self.running = [t[0] for t in take]
            seqs = [t[0] for t in take]
            live = [s for s in seqs if not s.aborted]
            for s in seqs:
                if s.aborted:
                    s.finish_reason = {"type": "abort", "message": "Abort before or during generation."}
            error: Exception | None = None
            try:
                if live:
                    with self.engine.lock:
                        self.engine.generate(live)
            except Exception as err:  # noqa: BLE001 - reported to the waiting requests
                error = err
            with self.cond:
                self.running = []
            for s, fut, loop in take:
                loop.call_soon_threadsafe(_resolve, fut, s, error)


def _resolve(fut: asyncio.Future, seq: SequenceRequest, error: Exception | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(seq)


class RolloutServer:
    def __init__(self, engine: CpuEngine, *, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.batcher = _Batcher(engine)
        self.groups: dict[str, object] = {}  # group_name -> ProcessGroupGloo
        self.stats = {"num_requests": 0, "num_sequences": 0, "num_aborted": 0, "aborted_rids": [],
                      "num_weight_updates": 0}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 34)
        r = app.router
        r.add_route("*", "/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_route("*", "/release_memory_occupation", self.release)
        r.add_route("*", "/resume_memory_occupation", self.resume)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_route("*", "/get_weights_by_name", self.weights_by_name)
        return app

    @staticmethod
    async def _json(request: web.Request, *, optional: bool = False) -> dict:
        raw = await request.read()
        if not raw and optional:
            return {}
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as err:
            raise RequestError("body", f"not valid JSON ({err.msg} at char {err.pos})") from None
        if not isinstance(body, dict):
            raise RequestError("body", "must be a JSON object")
        return body

    @staticmethod
    def _require(body: dict, name: str, kind: type | tuple) -> object:
        if name not in body:
            raise RequestError(name, "missing required field")
        value = body[name]
        if isinstance(value, bool) and kind is int or not isinstance(value, kind):
            raise RequestError(name, f"wrong type {type(value).__name__}")
        return value

    # ------------------------------------------------------------------ generation
    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            tokenize = self.engine.tokenize if self.engine.tokenizer is not None else None
            seqs, as_list = parse_generate(body, vocab_size=self.engine.vocab_size, tokenize=tokenize)
        except RequestError as err:
            return _error(400, str(err), err.field)
        if self.engine.released:
            return _error(503, "weights are released (release_memory_occupation); resume first")
        self.stats["num_requests"] += 1
        self.stats["num_sequences"] += len(seqs)
        tic = time.perf_counter()
        futs = self.batcher.submit(seqs)
        try:
            done = await asyncio.gather(*futs)
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            for s in seqs:
                s.aborted = True
            raise
        except Exception as err:  # noqa: BLE001
            return _error(500, f"generation failed: {err}")
        latency = time.perf_counter() - tic
        outs = [self._output(s, latency) for s in done]
        return web.json_response(outs if as_list else outs[0])

    def _output(self, s: SequenceRequest, latency: float) -> dict:
        meta = {
            "id": s.rid if s.params.n == 1 else f"{s.rid}_{s.sample_index}",
            "finish_reason": s.finish_reason,
            "prompt_tokens": len(s.prompt_ids),
            "completion_tokens": len(s.output_ids),
            "cached_tokens": 0,
            "e2e_latency": latency,
            "weight_version": str(self.engine.weight_version),
        }
        if s.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.output_logprobs, s.output_ids)]
        if s.routed_experts is not None:  # a dense model records none and, like SGLang, sends none
            meta["routed_experts"] = encode_routed_experts(s.routed_experts)
        text = self.engine.decode(s.output_ids, s.params.skip_special_tokens)
        return {"text": text, "output_ids": s.output_ids, "meta_info": meta}

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            rid, abort_all = body.get("rid"), body.get("abort_all", False)
            if not isinstance(abort_all, bool):
                raise RequestError("abort_all", f"must be true or false, got {abort_all!r}")
            if not abort_all and not (isinstance(rid, str) and rid):
                raise RequestError("rid", "give a request id, or abort_all: true")
        except RequestError as err:
            return _error(400, str(err), err.field)
        hit = self.batcher.abort(rid, abort_all)
        self.stats["num_aborted"] += len(hit)
        self.stats["aborted_rids"] = (self.stats["aborted_rids"] + ([rid] if rid else ["*"]))[-10000:]
        return web.json_response({"success": True, "num_aborted": len(hit)})

    # ------------------------------------------------------------------ weights
    async def _run_locked(self, fn, *args):
        def call():
            with self.engine.lock:
                return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(None, call)

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n(The CPU engine keeps no prefix cache between requests.)\n")

    async def init_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            address = self._require(body, "master_address", str)
            port = self._require(body, "master_port", int)
            rank_offset = self._require(body, "rank_offset", int)
            world_size = self._require(body, "world_size", int)
            group_name = body.get("group_name", "weight_update_group")
            backend = body.get("backend", "nccl")  # SGLang's default; a CPU engine can only join gloo
            if backend != "gloo":
                raise RequestError("backend", f"this CPU engine joins gloo groups only, got {backend!r} "
                                              "(DistributedWeightSync(backend='gloo'))")
            if not 1 <= rank_offset < world_size:
                raise RequestError("rank_offset", f"must be in [1, world_size={world_size}), got {rank_offset}")
            if group_name in self.groups:
                raise RequestError("group_name", f"group '{group_name}' exists; destroy it first")
        except RequestError as err:
            return _error(400, str(err), err.field)
        from dapo_megatron.rollout.weight_sync import open_weight_group

        try:
            pg = await asyncio.get_running_loop().run_in_executor(
                None, lambda: open_weight_group(backend="gloo", master_address=address, master_port=port,
                                                rank=rank_offset, world_size=world_size, group_name=group_name))
        except Exception as err:  # noqa: BLE001
            return _error(400, f"Failed to initialize custom process group: {err}")
        self.groups[group_name] = pg
        return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request, optional=True)
        except RequestError as err:
            return _error(400, str(err), err.field)
        name = body.get("group_name", "weight_update_group")
        if self.groups.pop(name, None) is None:
            return _error(400, f"group_name: the group '{name}' does not exist", "group_name")
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            names = self._require(body, "names", list)
            dtypes = self._require(body, "dtypes", list)
            shapes = self._require(body, "shapes", list)
            group_name = body.get("group_name", "weight_update_group")
            if not len(names) == len(dtypes) == len(shapes):
                raise RequestError("names", f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
            if group_name not in self.groups:
                raise RequestError("group_name", f"no group '{group_name}'; call /init_weights_update_group first")
            torch_dtypes = []
            for i, d in enumerate(dtypes):
                dt = getattr(torch, str(d).removeprefix("torch."), None)
                if not isinstance(dt, torch.dtype):
                    raise RequestError(f"dtypes[{i}]", f"unknown dtype {d!r}")
                torch_dtypes.append(dt)
            self.engine.check_weights(zip(names, shapes))
        except (RequestError, WeightError) as err:
            return _error(400, str(err), getattr(err, "field", "names"))
        pg = self.groups[group_name]

        def receive_and_load():
            tensors = []
            for shape, dt in zip(shapes, torch_dtypes):
                t = torch.empty(shape, dtype=dt)
                pg.broadcast(t, 0).wait()  # one broadcast per tensor, in order (SGLang's protocol)
                tensors.append(t)
            self.engine.load_weights(list(zip(names, tensors)))

        try:
            await self._run_locked(receive_and_load)
        except Exception as err:  # noqa: BLE001
            return _error(400, f"Failed to update parameter online: {err}")
        self.stats["num_weight_updates"] += 1
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def update_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            path = self._require(body, "model_path", str)
            if not os.path.isdir(path):
                raise RequestError("model_path", f"no such directory '{path}'")
            count = await self._run_locked(self.engine.load_from_disk, path)
        except (RequestError, WeightError) as err:
            return _error(400, str(err), getattr(err, "field", "model_path"))
        self.stats["num_weight_updates"] += 1
        return web.json_response({"success": True, "message": f"Succeeded to update model weights ({count} tensors).",
                                  "num_paused_requests": 0})

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            items = self._require(body, "serialized_named_tensors", list)
            named: list = []
            for i, item in enumerate(items[:1]):  # one copy per TP rank; a CPU engine has one rank
                try:
                    obj = torch.load(io.BytesIO(base64.b64decode(item, validate=True)), weights_only=True)
                except Exception as err:  # noqa: BLE001
                    raise RequestError(f"serialized_named_tensors[{i}]",
                                       f"not base64 of torch.save([(name, tensor), ...]): {err}") from None
                if not isinstance(obj, list) or not all(
                        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in obj):
                    raise RequestError(f"serialized_named_tensors[{i}]", "must hold a list of (name, tensor)")
                named.extend((str(n), t) for n, t in obj)
            await self._run_locked(self.engine.load_weights, named)
        except (RequestError, WeightError) as err:
            return _error(400, str(err), getattr(err, "field", "serialized_named_tensors"))
        self.stats["num_weight_updates"] += 1
        return web.json_response({"success": True, "message": "Success"})

    async def release(self, request: web.Request) -> web.Response:
        await self._run_locked(self.engine.release)
        return web.json_response({"success": True})

    async def resume(self, request: web.Request) -> web.Response:
        await self._run_locked(self.engine.resume)
        return web.json_response({"success": True})

    async def weights_by_name(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request, optional=True) if request.can_read_body else dict(request.query)
            name = self._require(body, "name", str)
            size = int(body.get("truncate_size", 100))
            return web.json_response(self.engine.weights_by_name(name, size))
        except (RequestError, WeightError, ValueError) as err:
            return _error(400, str(err), getattr(err, "field", "name"))

    # ------------------------------------------------------------------ info
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.engine.released:
            return web.Response(status=503)
        from dapo_megatron.rollout.protocol import SamplingParams

        seq = SequenceRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0), "HEALTH_CHECK", 0, False)
        await asyncio.gather(*self.batcher.submit([seq]))
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.model.config
        return web.json_response({
            "model_path": self.engine.model_path,
            "served_model_name": self.model_name,
            "tokenizer_path": self.engine.model_path if self.engine.tokenizer is not None else None,
            "is_generation": True,
            "weight_version": str(self.engine.weight_version),
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
            "parameters": self.engine.parameter_specs(),
        })

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.stats, "engine": "dapo-megatron-cpu", "tp_size": 1,
                                  "max_batch_size": self.engine.max_batch_size, "pid": os.getpid()})


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _serve(server: RolloutServer, *, host: str, port: int, model: str, register_dir: str) -> None:
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    url = f"http://{host}:{port}"
    print(f"serve-rollout: serving {model} at {url}", flush=True)
    # SIGTERM (what the launcher, scancel and `kill` send) ends the wait below like Ctrl-C does, so the
    # `finally` runs: the registration goes away with the engine instead of pointing at a dead port
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    registration = ""
    try:
        if register_dir:  # only once the socket accepts connections
            registration = write_registration(register_dir, {
                "host": host, "port": port, "url": url, "tp_size": 1, "model": model, "pid": os.getpid(),
                "engine": "cpu", "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            })
        await stop.wait()
        print("serve-rollout: stopping", flush=True)
    finally:
        if registration:
            remove_registration(registration, pid=os.getpid())
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dapo-megatron serve-rollout", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF checkpoint directory (config + safetensors [+ tokenizer])")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 = pick a free port (written to the registry)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0, help="seeds requests that carry no sampling_seed")
    ap.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded together")
    ap.add_argument("--register-dir", default="", help="write <host>_<port>.json here once serving")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.model):
        raise ValueError(f"--model: no such directory '{args.model}'")
    if args.threads:
        torch.set_num_threads(args.threads)
    port = args.port or _free_port(args.host)
    engine = CpuEngine(args.model, dtype=args.dtype, seed=args.seed, max_batch_size=args.max_batch_size)
    server = RolloutServer(engine, model_name=os.path.basename(os.path.normpath(args.model)))

    asyncio.run(_serve(server, host=args.host, port=port, model=args.model, register_dir=args.register_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
