"""API keys against SGLang 0.5.21's own middleware (sglang/srt/utils/auth.py add_api_key_middleware and
decide_request_auth, with the @auth_level of every route of its FastAPI app), run in the oracle process.

What each test asserts:
  - our decision function (rollout/auth.py `decide`, which the CPU engine's middleware calls) gives
    SGLang's answer (pass, or the same status and body) for every endpoint our client calls or the CPU
    engine serves, the open probes, an unknown path, a known path with another method and OPTIONS,
    under every key configuration (none, api only, admin only, both different, both equal) and a dozen
    Authorization headers (right / wrong key, scheme case, double space, no scheme, empty);
  - every request our client sends (each public EngineClient method) carries a header SGLang's
    middleware lets through under each key configuration the client can be given, and no header when
    it has no key;
  - a CPU engine started with both keys answers, over real HTTP, what SGLang's middleware answers for
    all those requests: the same 401 and body where SGLang refuses, never 401 where SGLang lets through;
  - SGLang's ServerArgs parser reads the run's secret file (the launcher's --config) as --api-key and
    --admin-api-key, so the key never appears on the command line.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from dapo_megatron.rollout.auth import (
    ADMIN_OPTIONAL,
    ENDPOINT_LEVELS,
    EngineKeys,
    decide,
    ensure_secret_file,
    level_of,
    refusal_body,
)
from dapo_megatron.rollout.client import EngineClient
from dapo_megatron.rollout.sglang_launcher import SGLangSettings, sglang_command

A, B = "key-A-0123456789", "key-B-9876543210"
KEY_CONFIGS = [(None, None), (A, None), (None, B), (A, B), (A, A)]
HEADERS = [
    None,
    f"Bearer {A}",
    f"Bearer {B}",
    f"bearer {A}",
    f"BEARER {B}",
    f"Bearer  {A}",
    f"Basic {A}",
    A,
    "Bearer",
    "Bearer ",
    "Bearer wrong",
    f"Bearer {A} ",
]
PATHS = sorted({path for _, path in ENDPOINT_LEVELS} | {"/health", "/health_generate", "/ready", "/metrics", "/nope"})
METHODS = ["GET", "POST", "PUT", "OPTIONS"]


def sglang_judges(oracle: str, api_key, admin_api_key, cases: list[dict]) -> list[dict]:
    data = json.dumps({"api_key": api_key, "admin_api_key": admin_api_key, "cases": cases}).encode()
    req = urllib.request.Request(oracle + "/oracle/auth", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def all_cases() -> list[dict]:
    return [{"method": m, "path": p, "authorization": h} for p in PATHS for m in METHODS for h in HEADERS]


@pytest.mark.parametrize("api_key, admin_api_key", KEY_CONFIGS)
def test_our_decisions_are_sglangs(oracle, api_key, admin_api_key):
    cases = all_cases()
    want = sglang_judges(oracle, api_key, admin_api_key, cases)
    refused = 0
    for case, sglang in zip(cases, want):
        ours = decide(case["method"], case["path"], case["authorization"], api_key=api_key, admin_api_key=admin_api_key)
        if sglang["passed"]:
            assert ours is None, (case, sglang)
        else:
            refused += 1
            assert (ours, refusal_body(ours)) == (sglang["status"], sglang["body"]), case
    if api_key or admin_api_key:  # the configuration guards something: the comparison saw refusals
        assert refused > 100


def client_calls() -> list[tuple[str, dict]]:
    """Every public request method of EngineClient, with arguments."""
    calls = [
        ("generate", {"input_ids": [1, 2]}),
        ("send_generate", {"payload": {"input_ids": [1, 2]}}),
        ("abort", {"rid": "r"}),
        ("pause_generation", {}),
        ("continue_generation", {}),
        ("flush_cache", {}),
        ("begin_weight_update", {}),
        ("end_weight_update", {}),
        ("init_weights_update_group", {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2}),
        ("destroy_weights_update_group", {}),
        ("update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]}),
        ("update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
        ("update_weights_from_disk", {"model_path": "/m"}),
        ("get_weights_by_name", {"name": "w"}),
        ("release_memory", {}),
        ("resume_memory", {}),
        ("health", {}),
        ("model_info", {}),
        ("server_info", {}),
    ]
    public = {
        name
        for name, fn in inspect.getmembers(EngineClient, inspect.iscoroutinefunction)
        if not name.startswith("_") and name != "close"
    }
    assert {name for name, _ in calls} == public, "a new client method: add it here"
    return calls


async def record_client_requests(keys: EngineKeys) -> list[dict]:
    seen: list[dict] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append(
            {"method": request.method, "path": request.path, "authorization": request.headers.get("Authorization")}
        )
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with EngineClient(f"http://127.0.0.1:{port}", keys=keys) as client:
            for name, kwargs in client_calls():
                await getattr(client, name)(**kwargs)
    finally:
        await runner.cleanup()
    return seen


@pytest.mark.parametrize("api_key, admin_api_key", KEY_CONFIGS)
def test_every_client_request_passes_sglangs_middleware(oracle, api_key, admin_api_key):
    sent = asyncio.run(record_client_requests(EngineKeys(api_key, admin_api_key)))
    assert len(sent) == len(client_calls())
    if not (api_key or admin_api_key):
        assert all(s["authorization"] is None for s in sent)
    verdicts = sglang_judges(oracle, api_key, admin_api_key, sent)
    assert all(v["passed"] for v in verdicts), [(s, v) for s, v in zip(sent, verdicts) if not v["passed"]]
    # and the same requests under keys the client does not hold are refused: the header is what let them in
    if api_key or admin_api_key:
        other = sglang_judges(oracle, api_key and "other-api", admin_api_key and "other-admin", sent)
        guarded = [s for s, v in zip(sent, other) if not v["passed"]]
        # everything but /health when an api key is set; only the admin endpoints with an admin key alone
        expect = {
            s["path"]
            for s in sent
            if s["path"] != "/health" and (api_key or level_of(s["method"], s["path"]) == ADMIN_OPTIONAL)
        }
        assert {s["path"] for s in guarded} == expect


@pytest.fixture(scope="module")
def keyed_cpu_engine(tiny_model, tmp_path_factory):
    from rollout_helpers import ServerProcess

    root = tmp_path_factory.mktemp("keyed_cpu_engine")
    proc = ServerProcess(
        tiny_model, root / "engines", log_path=root / "server.log", extra_args=("--api-key", A, "--admin-api-key", B)
    )
    yield proc.url
    proc.kill()


def test_cpu_engine_answers_sglangs_auth_over_http(oracle, keyed_cpu_engine):
    cases = [c for c in all_cases() if c["authorization"] != f"Bearer {A} "]  # urllib strips the trailing space
    want = sglang_judges(oracle, A, B, cases)
    mismatches = []
    for case, sglang in zip(cases, want):
        headers = {} if case["authorization"] is None else {"Authorization": case["authorization"]}
        # a body no handler accepts ("{"): a request that passes changes nothing; its status only tells it passed
        req = urllib.request.Request(keyed_cpu_engine + case["path"], data=b"{", method=case["method"], headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                status, body = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, body = err.code, err.read()
        if sglang["passed"] and status in (401, 403):
            mismatches.append((case, sglang, status))
        elif not sglang["passed"] and (status, json.loads(body)) != (sglang["status"], sglang["body"]):
            mismatches.append((case, sglang, status, body[:200]))
    assert not mismatches, mismatches[:10]


def test_sglang_reads_the_keys_from_the_run_secret(oracle, tmp_path):
    secret = tmp_path / "secrets" / "engine_auth.yaml"
    keys = ensure_secret_file(secret)
    argv = sglang_command(SGLangSettings(model_path="/ckpt/qwen", auth_file=str(secret), python="python3"))
    assert keys.api_key not in " ".join(argv) and argv[argv.index("--config") + 1] == str(secret)
    data = json.dumps({"argv": argv[3:], "fields": ["api_key", "admin_api_key", "model_path"]}).encode()
    req = urllib.request.Request(
        oracle + "/oracle/server_args", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        parsed = json.loads(resp.read())
    assert parsed == {"api_key": keys.api_key, "admin_api_key": keys.admin_api_key, "model_path": "/ckpt/qwen"}
