"""SGLang's own HTTP front end and weight-update logic, on CPU: what the conformance tests talk to.

    python tests/conformance/sglang_oracle.py --model-dir DIR --port P [--tp-size 2] [--context-length N]

Run as its own process (tests/conformance/conftest.py starts it): importing sglang needs a stub for
torchvision, which must not leak into the test process's transformers.

SGLang's own code, imported from the installed sglang==0.5.21 (pip install --no-deps), not copied:
  - the FastAPI `app` of sglang.srt.entrypoints.http_server: its routes, HTTP methods, status codes,
    error shapes and body parsing (GenerateReqInput, the msgspec request structs and their pydantic
    schemas, Base64Bytes);
  - TokenizerManager / TokenizerControlMixin methods bound to the stand-in below: weight updates
    (pause and model_update_lock handling, weight_version recording), begin/end_weight_update,
    abort_request, release/resume, config_value;
  - GenerateReqInput.normalize_batch_and_arguments and regenerate_rid (rid expansion for n > 1),
    TokenizerManager._validate_one_request (context length), SamplingParams(...).normalize/verify;
  - SchedulerWeightUpdaterManager: the session rule (updates only between begin and end), flush and
    weight_version after each update, release/resume of memory tags;
  - the model runner's WeightUpdater: init_custom_process_group (the weight group's rendezvous),
    receive_weights_from_distributed (per tensor and flattened_bucket), load_weights_from_distributed,
    update_weights_from_tensor; TpModelWorker.deserialize_own_rank (MultiprocessingSerializer with
    SafeUnpickler, the payload of the rank's own index);
  - Scheduler.record_weight_version_change.
Stand-ins (SGLang's engine and its scheduler process cannot run without a GPU), named as such:
  - LoopbackTokenizerManager: its communicators call the scheduler-side manager of each TP rank
    in-process instead of over ZMQ; its generate runs SGLang's normalisation and validation, then
    answers every item with a fixed token pattern (no model), in the reply shape of
    TokenizerManager._handle_batch_output; update_weights_from_disk stops before the reload (SGLang's
    loader needs its GPU model classes).
  - RecordingModel: a module with the checkpoint's parameter names and shapes; load_weights copies
    by name (SGLang's models shard and fuse there) and keeps every tensor it was given.
  - The TP ranks share this one process (threads): torch's registry of process-group names, which
    refuses a second group of the same name in one process, is told to let each rank register its own
    member of the weight group (`_allow_one_group_name_per_rank`).
Test-only routes, under /oracle/: the log of what SGLang parsed and did (with each request's Authorization
header), the model's weights, SGLang's ServerArgs parser, and SGLang's API-key middleware judging requests
under any pair of keys (/oracle/auth).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
import types
from types import SimpleNamespace

STUBBED = ("torchvision",)  # imported by sglang's vision model configs; broken beside a CPU torch


class _AnyModule(types.ModuleType):
    """A stub module whose every attribute is another stub (only module-level imports touch it)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = _AnyModule(f"{self.__name__}.{name}")
        setattr(self, name, sub)
        return sub

    def __call__(self, *args, **kwargs):
        return _AnyModule(f"{self.__name__}()")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _AnyModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install_stubs() -> None:
    # transformers caches whether torchvision exists on first use: ask it before the stub appears,
    # so transformers keeps seeing "no torchvision" (the truth) and never touches the stub
    import transformers.utils.import_utils as hf_imports

    hf_imports.is_torchvision_available()
    hf_imports.is_torchvision_greater_or_equal("0.27")
    sys.meta_path.insert(0, _StubFinder())


# ----------------------------------------------------------------------------------------- model
def build_recording_model(model_dir: str):
    import torch
    from safetensors import safe_open

    class RecordingModel(torch.nn.Module):
        """Stand-in for an SGLang model: the checkpoint's parameters; load_weights copies by name."""

        def __init__(self):
            super().__init__()
            self.params: dict[str, torch.Tensor] = {}
            for fname in sorted(os.listdir(model_dir)):
                if fname.endswith(".safetensors"):
                    with safe_open(os.path.join(model_dir, fname), "pt") as f:
                        for key in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                            self.params[key] = f.get_tensor(key).clone()
            self.loads: list[list[tuple[str, str, list[int]]]] = []

        def load_weights(self, named_tensors):
            named = list(named_tensors)
            for name, tensor in named:
                if name not in self.params:
                    raise KeyError(f"no parameter named {name}")
                if list(tensor.shape) != list(self.params[name].shape):
                    raise ValueError(f"{name}: shape {list(tensor.shape)} != {list(self.params[name].shape)}")
            for name, tensor in named:
                self.params[name] = tensor.detach().clone()
            self.loads.append([(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named])

        def get_weights_by_name(self, name, truncate_size=100, tp_size=1):
            return self.params[name][:truncate_size].tolist()

    return RecordingModel()


# -------------------------------------------------------------------------------------- scheduler
def build_rank(*, tp_rank: int, model_dir: str, world_group, log: list):
    """One engine TP rank: SGLang's WeightUpdater and SchedulerWeightUpdaterManager around a
    RecordingModel (each rank joins a weight group as rank_offset + tp_rank, as in SGLang)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter

    model = build_recording_model(model_dir)
    runner = SimpleNamespace(tp_rank=tp_rank, model=model)
    runner.weight_updater = WeightUpdater(
        tp_rank=tp_rank,
        device="cpu",
        gpu_id=0,
        model_config=SimpleNamespace(model_path=model_dir),
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda *a, **k: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: runner,
    )
    runner.weight_exporter = SimpleNamespace(get_weights_by_name=model.get_weights_by_name)
    worker = SimpleNamespace(model_runner=runner, weight_update_runners=lambda: [("target", runner)])
    for method in (
        "init_weights_update_group",
        "destroy_weights_update_group",
        "deserialize_own_rank",
        "get_weights_by_name",
    ):
        setattr(worker, method, types.MethodType(getattr(TpModelWorker, method), worker))

    scheduler = SimpleNamespace(
        waiting_queue=[],
        chunked_req=None,
        hisparse_coordinator=None,
        _engine_paused=False,
        disaggregation_mode=None,
        collect_inflight_reqs=lambda: set(),
    )
    scheduler.record_weight_version_change = types.MethodType(Scheduler.record_weight_version_change, scheduler)

    def flush_cache(empty_cache: bool = True) -> bool:
        log.append({"event": "flush_cache", "rank": tp_rank})
        return True

    manager = SchedulerWeightUpdaterManager(
        tp_worker=worker,
        draft_worker=None,
        tp_cpu_group=world_group,
        memory_saver_adapter=TorchMemorySaverAdapter.create(enable=False),
        flush_cache=flush_cache,
        is_fully_idle=lambda **kw: True,
        scheduler=scheduler,
    )
    return SimpleNamespace(model=model, runner=runner, manager=manager, worker=worker)


# ------------------------------------------------------------------------------- tokenizer side
def build_tokenizer_manager(*, ranks: list, server_args, context_length: int, vocab_size: int, log: list):
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
    from sglang.srt.managers.tokenizer_manager import ServerStatus, TokenizerManager
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.utils.aio_rwlock import RWLock

    class LoopbackTokenizerManager:
        """Stand-in for TokenizerManager (SGLang's real methods are bound onto it below)."""

        def __init__(self):
            self.server_args = server_args
            self.server_status = ServerStatus.Up
            self.gracefully_exit = False
            self.is_generation = True
            self.model_path = server_args.model_path
            self.served_model_name = server_args.model_path
            self.is_pause = False
            self.is_pause_cond = asyncio.Condition()
            self.model_update_lock = RWLock()
            self.mm_processor = None
            self.rid_to_state: dict[str, object] = {}
            self.context_len = context_length
            self.num_reserved_tokens = 0
            self.validate_total_tokens = True
            self.allow_auto_truncate = False
            self.enable_metrics = False
            self.vocab_size = vocab_size
            with open(os.path.join(server_args.model_path, "config.json")) as config_file:
                hf = json.load(config_file)
            self.model_config = SimpleNamespace(
                vocab_size=vocab_size,
                is_image_understandable_model=False,
                is_audio_understandable_model=False,
                hf_config=SimpleNamespace(model_type=hf.get("model_type"), architectures=hf.get("architectures")),
            )
            self.last_receive_tstamp = 0.0
            self.startup_time = time.time()

        def auto_create_handle_loop(self):
            pass

        def _dispatch_to_scheduler(self, req):
            if isinstance(req, AbortReq):
                log.append({"event": "abort_to_scheduler", "rid": req.rid, "abort_all": req.abort_all})

        async def _async_dispatch_to_scheduler(self, req):
            log.append({"event": "to_scheduler", "type": type(req).__name__, "mode": getattr(req, "mode", None)})

        async def _wait_for_model_update_from_disk(self, obj):
            # stand-in for the scheduler's reload (DefaultModelLoader needs SGLang's GPU model classes)
            log.append({"event": "update_weights_from_disk", "body": _describe(obj)})
            return True, "Succeeded to update model weights.", 0

        async def get_internal_state(self):
            return [{"memory_usage": {"weight": 0.0, "kvcache": 0.0}}]

        async def generate_request(self, obj, request=None):
            obj.normalize_batch_and_arguments()  # SGLang's own normalisation (raises ValueError)
            items = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
            entry = {
                "event": "generate",
                "is_single": obj.is_single,
                "batch_size": obj.batch_size,
                "parallel_sample_num": obj.parallel_sample_num,
                "items": [],
            }
            outs = []
            for item in items:
                ids = item.input_ids
                TokenizerManager._validate_one_request(self, item, ids)  # context length (ValueError)
                params = SamplingParams(**item.sampling_params)  # unknown key: TypeError, as in SGLang
                params.normalize(None)
                params.verify(self.vocab_size)
                samples = obj.parallel_sample_num
                for _ in range(samples):
                    rid = item.rid if samples == 1 else item.regenerate_rid()  # SGLang's own n > 1 rids
                    entry["items"].append(
                        {
                            "rid": rid,
                            "input_ids": list(ids),
                            "sampling_params": dict(item.sampling_params),
                            "return_logprob": item.return_logprob,
                        }
                    )
                    outs.append(self._answer(rid, ids, params, item.return_logprob))
            log.append(entry)
            self.last_receive_tstamp = time.time()
            yield outs[0] if obj.is_single else outs

        def _answer(self, rid, ids, params, return_logprob):
            """A fixed token pattern in the reply shape of TokenizerManager._handle_batch_output."""
            n = int(params.max_new_tokens)
            tokens = [(ids[-1] + 1 + i) % self.vocab_size for i in range(n)]
            meta = {
                "id": rid,
                "finish_reason": {"type": "length", "length": n},
                "prompt_tokens": len(ids),
                "weight_version": self.config_value("weight_version"),
                "completion_tokens": n,
                "cached_tokens": 0,
            }
            if return_logprob:
                meta["output_token_logprobs"] = [(-1.0, t, None) for t in tokens]
            return {"text": "", "output_ids": tokens, "meta_info": meta}

    tm = LoopbackTokenizerManager()
    for name in (
        "abort_request",
        "record_config_updates",
        "config_value",
        "pause_generation",
        "continue_generation",
        "_validate_token_ids_logprob",
        "update_weights_from_disk",
    ):
        setattr(tm, name, types.MethodType(getattr(TokenizerManager, name), tm))
    for name in (
        "update_weights_from_distributed",
        "update_weights_from_tensor",
        "init_weights_update_group",
        "destroy_weights_update_group",
        "begin_weight_update",
        "end_weight_update",
        "_weight_update_session_call",
        "_update_weight_version_if_provided",
        "release_memory_occupation",
        "resume_memory_occupation",
        "flush_cache",
        "get_weights_by_name",
    ):
        setattr(tm, name, types.MethodType(getattr(TokenizerControlMixin, name), tm))

    def fan_out(method: str):
        async def communicator(obj):
            log.append({"event": method, "body": _describe(obj)})
            loop = asyncio.get_running_loop()
            # every TP rank's scheduler runs the request (each in its own process in SGLang: here each on
            # its own thread, so that collectives between the ranks and the trainer can complete)
            outs = await asyncio.gather(*(loop.run_in_executor(None, getattr(r.manager, method), obj) for r in ranks))
            log.append({"event": method + ":done", "results": [_describe(o) for o in outs]})
            return outs[:1]  # only TP rank 0's scheduler answers the tokenizer manager

        return communicator

    for method in (
        "update_weights_from_distributed",
        "init_weights_update_group",
        "destroy_weights_update_group",
        "update_weights_from_tensor",
        "begin_weight_update",
        "end_weight_update",
        "release_memory_occupation",
        "resume_memory_occupation",
        "get_weights_by_name",
    ):
        setattr(tm, method + "_communicator", fan_out(method))

    async def flush_cache_communicator(obj):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        log.append({"event": "flush_cache", "rank": "all"})
        return [FlushCacheReqOutput(success=True)]

    tm.flush_cache_communicator = flush_cache_communicator
    return tm


def _describe(obj) -> dict:
    import msgspec

    out = {}
    for field in msgspec.structs.fields(type(obj)):
        value = getattr(obj, field.name)
        if field.name == "serialized_named_tensors":
            value = [len(v) for v in value]
        out[field.name] = value if isinstance(value, (str, int, float, bool, type(None), list, dict)) else repr(value)
    return out


class RecordHttp:
    """ASGI wrapper: logs every request's path, JSON body and response status (test-only)."""

    def __init__(self, app, log: list):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/oracle/"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization")
        entry = {
            "event": "http",
            "method": scope["method"],
            "path": scope["path"],
            "body": None,
            "status": None,
            "authorization": authorization.decode("latin-1") if authorization is not None else None,
        }
        chunks: list[bytes] = []

        async def recv():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    raw = b"".join(chunks)
                    entry["body"] = json.loads(raw) if raw else None
            return message

        async def snd(message):
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            await send(message)

        self.log.append(entry)
        await self.app(scope, recv, snd)


async def judge_auth(app, *, api_key, admin_api_key, method: str, path: str, authorization) -> dict:
    """Run one request through the middleware SGLang installs for --api-key / --admin-api-key (captured from
    add_api_key_middleware, resolving levels against `app`'s routes), in front of a handler that answers nothing."""
    from sglang.srt.utils.auth import add_api_key_middleware

    class Capture:
        def add_middleware(self, cls, **kwargs):
            self.cls, self.kwargs = cls, kwargs

    capture = Capture()
    add_api_key_middleware(capture, api_key=api_key, admin_api_key=admin_api_key)
    reached, sent = [], []

    async def handler(scope, receive, send):
        reached.append(True)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    middleware = capture.cls(
        handler, api_key=capture.kwargs["api_key"], admin_api_key=capture.kwargs["admin_api_key"], fastapi_app=app
    )
    headers = [] if authorization is None else [(b"authorization", authorization.encode("latin-1"))]
    await middleware(
        {
            "type": "http",
            "method": method,
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": headers,
            "scheme": "http",
            "server": ("127.0.0.1", 80),
            "client": ("127.0.0.1", 1),
            "http_version": "1.1",
        },
        receive,
        send,
    )
    if reached:
        return {"passed": True}
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"passed": False, "status": status, "body": json.loads(raw)}


def request_fields(app) -> dict[str, list[str]]:
    """For each route of the app: the field names of the request class its body is parsed into."""
    import dataclasses

    import msgspec

    out = {}
    for route in app.routes:
        dependant = getattr(route, "dependant", None)
        for param in getattr(dependant, "body_params", []) or []:
            cls = getattr(param.field_info, "annotation", None) or getattr(param, "type_", None)
            if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
                out[route.path] = [f.name for f in msgspec.structs.fields(cls)]
            elif dataclasses.is_dataclass(cls):
                out[route.path] = [f.name for f in dataclasses.fields(cls)]
    return out


def _allow_one_group_name_per_rank() -> None:
    """Each SGLang TP rank is its own process, registering the weight group under one name; here the
    ranks are threads of one process, so a duplicate name is expected (and only the name registry of
    torch's functional collectives, which nothing here uses, is skipped)."""
    import torch.distributed.distributed_c10d as c10d

    register, unregister = c10d._register_process_group, c10d._unregister_process_group

    def register_once(group_name, pg):
        try:
            register(group_name, pg)
        except (RuntimeError, ValueError) as err:
            if "already registered" not in str(err):
                raise

    def unregister_once(group_name):
        try:
            unregister(group_name)
        except (RuntimeError, ValueError, KeyError):
            pass

    c10d._register_process_group = register_once
    c10d._unregister_process_group = unregister_once


# ------------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--context-length", type=int, default=256)
    ap.add_argument("--ready-file", required=True)
    args = ap.parse_args()
    install_stubs()

    import torch
    import torch.distributed as dist
    import uvicorn
    from sglang.srt.entrypoints import http_server
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(
        [
            "--model-path",
            args.model_dir,
            "--tp-size",
            str(args.tp_size),
            "--context-length",
            str(args.context_length),
            "--device",
            "cpu",
        ]
    )
    publish(server_args, role="test")
    _allow_one_group_name_per_rank()
    # SGLang's weight updater asserts a default process group (its TP group) exists: a world of one
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    log: list = []
    ranks = [
        build_rank(tp_rank=r, model_dir=args.model_dir, world_group=dist.group.WORLD, log=log)
        for r in range(args.tp_size)
    ]
    with open(os.path.join(args.model_dir, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    tm = build_tokenizer_manager(
        ranks=ranks, server_args=server_args, context_length=args.context_length, vocab_size=vocab_size, log=log
    )
    http_server.set_global_state(
        http_server._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={})
    )
    app = http_server.app

    @app.get("/oracle/log")
    async def oracle_log():
        return json.loads(json.dumps(log, default=repr))

    @app.get("/oracle/weights")
    async def oracle_weights(rank: int = 0):
        model = ranks[rank].model
        return {
            "params": {
                n: {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "b64": base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode(),
                }
                for n, t in model.params.items()
            },
            "loads": model.loads,
        }

    @app.get("/oracle/request_fields")
    async def oracle_request_fields():
        return request_fields(app)

    @app.get("/oracle/safe_unpickler_globals")
    async def oracle_safe_globals():
        from sglang.srt.utils.common import SafeUnpickler

        return sorted([m, n] for m, n in SafeUnpickler.ALLOWED_GLOBALS)

    @app.post("/oracle/server_args")
    async def oracle_server_args(body: dict):
        parsed = prepare_server_args(body["argv"])  # SGLang's own CLI parser (sglang serve / launch_server)
        return {name: getattr(parsed, name) for name in body["fields"]}

    @app.post("/oracle/auth")
    async def oracle_auth(body: dict):
        """SGLang's own API-key middleware (add_api_key_middleware, with the route levels of this app) on
        each case, under the given keys: {"passed": true} or the status and JSON body it answers."""
        return [
            await judge_auth(app, api_key=body["api_key"], admin_api_key=body["admin_api_key"], **case)
            for case in body["cases"]
        ]

    @app.post("/oracle/reset_log")
    async def oracle_reset_log():
        log.clear()
        return {}

    config = uvicorn.Config(RecordHttp(app, log), host="127.0.0.1", port=args.port, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)

    def announce():
        while not server.started:
            threading.Event().wait(0.05)
        with open(args.ready_file, "w") as f:
            f.write("ready")

    threading.Thread(target=announce, daemon=True).start()
    server.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
