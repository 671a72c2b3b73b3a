"""A CPU engine started with keys (`serve-rollout --config` of the run's secret, as our launchers start
every engine), over real HTTP:

  - a request without the admin key cannot change the weights (in a session, by tensor or from disk),
    release memory, pause, or abort another client's request: each answers 401 {"error": "Unauthorized"}
    and afterwards the weights read back unchanged, the memory is still resident and the victim's
    request finishes by length, not by abort;
  - the same requests with our client (EngineClient(keys=...)) pass;
  - with only the api key (admin key set and different), the admin endpoints are still refused while
    /generate passes; /health and /ready answer without any key (k8s probes, SGLang's open prefixes);
  - LocalEngines (the local launcher) gives its engines the secret file and the registry files are 0600.
"""

from __future__ import annotations

import asyncio
import json
import stat

import pytest
import torch

from dapo_megatron.rollout.auth import EngineKeys, ensure_secret_file, run_secret_path
from dapo_megatron.rollout.client import EngineClient, EngineError
from dapo_megatron.transfer.tensor_payload import serialize_for_engine_rank
from rollout_helpers import ServerProcess, make_tiny_checkpoint, request_json

API, ADMIN = "api-key-for-generate", "admin-key-for-weights"
PARAM = "model.layers.0.mlp.up_proj.weight"


def call(url: str, path: str, body=None, *, key: str | None = None, method: str = "POST"):
    return request_json(url + path, None if body is None else json.dumps(body).encode(), key=key, method=method)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("auth") / "model", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    """api key and admin key differ: every SGLang rule shows (normal vs admin endpoints)."""
    root = tmp_path_factory.mktemp("auth_engine")
    config = root / "keys.yaml"
    config.write_text(f'api-key: "{API}"\nadmin-api-key: "{ADMIN}"\n')
    config.chmod(0o600)
    proc = ServerProcess(
        model_dir, root / "engines", log_path=root / "server.log", extra_args=("--config", str(config))
    )
    yield proc.url
    proc.kill()


def weights(url: str) -> list:
    status, out = call(url, "/get_weights_by_name", {"name": PARAM, "truncate_size": 4}, key=ADMIN)
    assert status == 200, out
    return out


def test_without_the_admin_key_nothing_changes_weights_memory_or_requests(engine, model_dir):
    before = weights(engine)
    new = [(PARAM, torch.full((4, 4), 0.5))]  # refused before its shape is ever looked at
    for key in (None, "wrong", API):  # no key, a wrong key, the api key (not enough for admin endpoints)
        for path, body in [
            ("/begin_weight_update", {}),
            ("/update_weights_from_tensor", {"serialized_named_tensors": [serialize_for_engine_rank(new)]}),
            ("/update_weights_from_disk", {"model_path": str(model_dir)}),
            (
                "/init_weights_update_group",
                {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo"},
            ),
            ("/update_weight_version", {"new_version": "evil"}),
            ("/release_memory_occupation", {"tags": ["weights"]}),
            ("/pause_generation", {"mode": "abort"}),
            ("/abort_request", {"abort_all": True}),
            ("/flush_cache", None),
        ]:
            assert call(engine, path, body, key=key) == (401, {"error": "Unauthorized"}), (key, path)
    info = call(engine, "/server_info", method="GET", key=API)[1]["cpu_engine"]
    assert info["released_tags"] == [] and info["num_weight_updates"] == 0 and not info["weight_update_session_open"]
    assert info["resident_memory_bytes"]["weights"] > 0 and not info["is_paused"]
    assert weights(engine) == before
    assert call(engine, "/model_info", method="GET", key=API)[1]["weight_version"] == "default"


def test_an_abort_without_the_key_does_not_reach_the_victims_request(engine):
    async def scenario():
        async with EngineClient(engine, keys=EngineKeys(API, ADMIN)) as victim:
            task = asyncio.create_task(
                victim.generate(
                    input_ids=[1, 2, 3],
                    rid="victim",
                    sampling_params={"max_new_tokens": 120, "ignore_eos": True, "temperature": 0.0},
                )
            )
            while not (await victim.server_info())["cpu_engine"]["running"]:  # until it decodes
                await asyncio.sleep(0.02)
            await victim.pause_generation("in_place")  # parked mid-way: an abort that passed would end it
            running = (await victim.server_info())["cpu_engine"]["running"]
            for key in (None, API):
                async with EngineClient(engine, keys=EngineKeys(api_key=key)) as attacker:
                    with pytest.raises(EngineError) as info:
                        await attacker.abort("victim")
                    assert info.value.status == 401 and "API key" in str(info.value)
            await victim.continue_generation()
            return running, await task

    running, out = asyncio.run(scenario())
    assert [r["rid"] for r in running] == ["victim"] and running[0]["completion_tokens"] < 120
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["meta_info"]["completion_tokens"] == 120


def test_our_client_with_the_keys_passes_everywhere_and_probes_need_none(engine, model_dir):
    async def scenario():
        async with EngineClient(engine, keys=EngineKeys(API, ADMIN)) as c:
            out = await c.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
            await c.begin_weight_update()
            await c.end_weight_update()
            await c.update_weights_from_disk(str(model_dir), weight_version="v2")
            await c.flush_cache()
            await c.pause_generation("in_place")
            await c.continue_generation()
            await c.abort(abort_all=True)
            info = await c.server_info()
            assert (await c.model_info())["weight_version"] == "v2"
            return out, info

    out, info = asyncio.run(scenario())
    assert len(out["output_ids"]) == 2 and info["cpu_engine"]["num_weight_updates"] == 1
    for path in ("/health", "/health_generate", "/ready"):
        assert call(engine, path, method="GET")[0] == 200, path
    # the api key alone: /generate passes (NORMAL), the admin endpoints do not (ADMIN_OPTIONAL wants the admin key)
    assert call(engine, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, key=API)[0] == 200
    assert call(engine, "/generate", {"input_ids": [1]}, key=ADMIN)[0] == 401  # and the admin key is not the api key
    assert call(engine, "/generate", {"input_ids": [1]})[0] == 401


def test_local_launcher_starts_engines_that_require_the_run_secret(model_dir, tmp_path):
    from dapo_megatron.launch.local.engines import LocalEngines

    secret = run_secret_path(tmp_path)
    keys = ensure_secret_file(secret)
    assert keys.api_key == keys.admin_api_key and len(keys.api_key) == 64
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
    with LocalEngines(
        str(model_dir), num_engines=1, register_dir=str(tmp_path / "engines"), auth_file=secret
    ) as engines:
        url = engines.urls[0]
        registration = next((tmp_path / "engines").glob("*.json"))
        assert stat.S_IMODE(registration.stat().st_mode) == 0o600
        assert keys.api_key not in " ".join(engines.procs[0].args)  # never on the command line (`ps`)
        assert call(url, "/generate", {"input_ids": [1]})[0] == 401
        assert call(url, "/release_memory_occupation", {}, key="nope")[0] == 401
        status, out = call(
            url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, key=keys.api_key
        )
        assert status == 200 and len(out["output_ids"]) == 1
