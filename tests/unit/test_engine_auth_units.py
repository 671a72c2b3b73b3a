"""rollout/auth.py and its config keys without a server: SGLang's decisions on hand-picked cases (the full
comparison with SGLang's own code is tests/conformance/test_engine_auth_sglang.py), the run's secret file
(0600 in a 0700 folder, created once, reused, the same for racing processes), the keys of user-started
engines (environment variable or file, clear errors naming the config key), the launchers' command lines
(the key never on argv), serve-rollout's --config, and the token lower bound that lets the CPU engine
refuse huge prompts without tokenizing them (never above the true count)."""

from __future__ import annotations

import random
import stat
import threading

import pytest

from dapo_megatron.config import load_config
from dapo_megatron.rollout.auth import (
    EngineKeys,
    decide,
    ensure_secret_file,
    keys_from_config,
    read_secret_file,
    run_secret_path,
)


@pytest.mark.parametrize(
    "method, path, header, api, admin, want",
    [
        ("POST", "/generate", None, None, None, None),  # no keys: all open
        ("POST", "/generate", None, "A", None, 401),
        ("POST", "/generate", "Bearer A", "A", None, None),
        ("POST", "/generate", "bearer A", "A", None, None),  # the scheme in any case
        ("POST", "/generate", "Bearer  A", "A", None, 401),  # exactly one space
        ("POST", "/generate", "A", "A", None, 401),  # no scheme
        ("POST", "/generate", None, None, "B", None),  # admin key only: NORMAL endpoints stay open
        ("POST", "/generate", "Bearer B", "A", "B", 401),  # the admin key is not the api key
        ("POST", "/update_weights_from_tensor", "Bearer A", "A", "B", 401),  # ... nor the api key the admin key
        ("POST", "/update_weights_from_tensor", "Bearer B", "A", "B", None),
        ("POST", "/update_weights_from_tensor", "Bearer A", "A", None, None),  # no admin key: the api key
        ("GET", "/release_memory_occupation", None, None, "B", 401),
        ("GET", "/update_weights_from_tensor", None, None, "B", None),  # wrong method: NORMAL, then 405
        ("GET", "/health", None, "A", "B", None),
        ("GET", "/health_generate", None, "A", "B", None),
        ("GET", "/ready", None, "A", "B", None),
        ("OPTIONS", "/generate", None, "A", "B", None),
        ("GET", "/nope", None, "A", None, 401),  # unknown path: NORMAL
        (
            "POST",
            "/abort_request",
            "Bearer é",
            "A",
            "B",
            401,
        ),  # non-ASCII (SGLang's compare_digest raises: a 500 there)
    ],
)
def test_decisions(method, path, header, api, admin, want):
    assert decide(method, path, header, api_key=api, admin_api_key=admin) == want


def test_client_header_per_endpoint_and_keys_never_printed():
    keys = EngineKeys("A", "B")
    assert keys.header_for("POST", "/generate") == {"Authorization": "Bearer A"}
    assert keys.header_for("POST", "/abort_request") == {"Authorization": "Bearer B"}
    assert EngineKeys(None, "B").header_for("POST", "/generate") == {"Authorization": "Bearer B"}  # harmless: open
    assert EngineKeys().header_for("POST", "/generate") == {}
    assert "A" not in repr(keys).replace("EngineKeys", "").replace("api_key", "").replace("admin_api_key", "")


def test_the_run_secret_is_private_created_once_and_shared(tmp_path):
    path = run_secret_path(tmp_path / "run")
    results: list[EngineKeys] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_secret_file(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.api_key for r in results}) == 1  # every racing process reads the same key
    keys = results[0]
    assert keys.api_key == keys.admin_api_key and len(keys.api_key) == 64 and not keys.api_key.startswith("-")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ensure_secret_file(path) == keys  # a requeue / --resume reuses it
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp files left
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_secret_file(path)
    # a key argparse would take for an option (SGLang reads --config through argv) is refused, naming the file
    path.write_text('api-key: "-abc"\n')
    path.chmod(0o600)
    with pytest.raises(ValueError, match="may not start with '-'"):
        read_secret_file(path)


def rollout(tmp_path, **overrides):
    items = [f"rollout.{k}={v}" for k, v in overrides.items()]
    return load_config(None, [f"trainer.output_dir={tmp_path}", *items]).rollout


def test_user_keys_from_an_environment_variable_or_a_file(tmp_path, monkeypatch):
    url = "rollout.engine_urls=[http://h:1]"
    monkeypatch.setenv("MY_ENGINE_KEY", "s3cret")
    r = load_config(None, [url, "rollout.engine_api_key_env=MY_ENGINE_KEY"]).rollout
    assert keys_from_config(r) == EngineKeys("s3cret", None)
    key_file = tmp_path / "admin.key"
    key_file.write_text("adm1n\n")
    key_file.chmod(0o600)
    r = load_config(None, [url, f"rollout.engine_admin_api_key_file={key_file}"]).rollout
    assert keys_from_config(r) == EngineKeys(None, "adm1n")
    assert keys_from_config(load_config(None, [url]).rollout) == EngineKeys()  # engines without keys


@pytest.mark.parametrize(
    "overrides, env, message",
    [
        (["rollout.engine_api_key_env=UNSET_KEY_VAR"], {}, "rollout.engine_api_key_env.*UNSET_KEY_VAR is not set"),
        (["rollout.engine_api_key_env=EMPTY_KEY_VAR"], {"EMPTY_KEY_VAR": ""}, "is not set or empty"),
        (["rollout.engine_api_key_env=SPACE_KEY_VAR"], {"SPACE_KEY_VAR": "a b"}, "without spaces"),
        (["rollout.engine_admin_api_key_file=/no/such/file"], {}, "rollout.engine_admin_api_key_file.*no such file"),
    ],
)
def test_user_key_mistakes_name_the_config_key(overrides, env, message, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = load_config(None, ["rollout.engine_urls=[http://h:1]", *overrides]).rollout
    with pytest.raises(ValueError, match=message):
        keys_from_config(r)


def test_readable_key_file_is_refused(tmp_path):
    key_file = tmp_path / "k"
    key_file.write_text("k3y")
    key_file.chmod(0o644)
    r = load_config(None, ["rollout.engine_urls=[http://h:1]", f"rollout.engine_api_key_file={key_file}"]).rollout
    with pytest.raises(ValueError, match="rollout.engine_api_key_file.*chmod 600"):
        keys_from_config(r)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["rollout.engine_urls=[http://h:1]", "rollout.engine_api_key_env=K", "rollout.engine_api_key_file=/k"],
            "not both",
        ),
        (
            ["rollout.engine_urls=[http://h:1]", "rollout.engine_api_key_env=sk-abc-123"],
            "NAME of an environment variable",
        ),
        (["rollout.engine_api_key_env=K"], "only with rollout.engine_urls"),
        (["rollout.engine_admin_api_key_file=/k"], "only with rollout.engine_urls"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_launchers_pass_the_secret_file_never_the_key(tmp_path):
    from dapo_megatron.launch.slurm import colocated, render
    from dapo_megatron.rollout.sglang_launcher import SGLangSettings, sglang_command

    secret = str(run_secret_path(tmp_path))
    argv = sglang_command(SGLangSettings(model_path="/m", auth_file=secret))
    assert argv[argv.index("--config") + 1] == secret
    with pytest.raises(ValueError, match="second --config"):
        sglang_command(SGLangSettings(model_path="/m", auth_file=secret, extra_args=("--config", "x.yaml")))
    for engine in ("cpu", "sglang"):
        cfg = load_config(
            None,
            [
                f"trainer.output_dir={tmp_path}",
                f"rollout.engine={engine}",
                "model.path=/m",
                "rollout.placement=colocated",
            ],
        )
        cmd = colocated.engine_commands(cfg, host="n1")[0]
        flag = "--config" if engine == "cpu" else "--auth-file"
        assert cmd[cmd.index(flag) + 1] == secret, cmd
        script = render.render_rollout_array(cfg, register_dir=f"{tmp_path}/engines")
        assert f"AUTH_FILE={secret}" in script and '--auth-file "$AUTH_FILE"' in script


def test_serve_rollout_config_file_is_sglangs_format(tmp_path):
    import argparse

    from dapo_megatron.cpu_engine.serve import _with_config_file

    ap = argparse.ArgumentParser()
    for flag in ("--api-key", "--admin-api-key", "--port", "--config"):
        ap.add_argument(flag)
    ap.add_argument("--enable-deterministic-inference", action=argparse.BooleanOptionalAction, default=True)
    path = tmp_path / "c.yaml"
    path.write_text('api-key: "A"\nadmin_api_key: "B"\nport: 5\nenable-deterministic-inference: false\n')
    args = ap.parse_args(_with_config_file(ap, ["--config", str(path), "--port", "7"]))
    assert (args.api_key, args.admin_api_key, args.port, args.enable_deterministic_inference) == ("A", "B", "7", False)
    path.write_text("api-kee: A\n")
    with pytest.raises(ValueError, match="no option --api-kee"):
        _with_config_file(ap, ["--config", str(path)])


def test_token_lower_bound_never_exceeds_the_true_count(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from transformers import AutoTokenizer

    from dapo_megatron.cpu_engine.token_bound import max_chars_per_token
    from dapo_megatron.data.tiny_model import build_tiny_tokenizer
    from rollout_helpers import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path)
    rng = random.Random(0)
    alphabet = "ab \n1234567890" + "éü中文한국어" + "\u1100\u1161\u11a8" + "e\u0301" + "<|im_start|></s>"
    for tok in (AutoTokenizer.from_pretrained(tmp_path), build_tiny_tokenizer()):
        bound = max_chars_per_token(tok)
        assert bound is not None and bound >= 1
        for _ in range(200):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400))) + "a" * rng.choice([0, 1000])
            assert -(-len(text) // bound) <= len(tok(text, add_special_tokens=False)["input_ids"]), text[:80]
