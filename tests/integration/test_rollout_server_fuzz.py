"""Malformed requests to a real `serve-rollout` process (loopback only): a few hundred seeded bodies
made by breaking a valid /generate body field by field (wrong types, out-of-range numbers, nested
junk, missing and unknown keys, non-JSON bytes). Every answer is a 4xx whose JSON error names the
field, or a 200 with well-formed outputs; the server stays up and generates the same greedy tokens
as before the fuzzing.

The one 5xx allowed is SGLang's own: an unknown sampling_params key makes SGLang's
SamplingParams(**params) raise TypeError, which its /generate handler does not catch (HTTP 500).
The CPU engine answers the same status so that a client sees what SGLang would send (docs/sglang.md);
the test asserts that such a 500 names that key and that nothing else is a 5xx."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

import pytest
from rollout_helpers import ServerProcess, make_tiny_checkpoint

from dapo_megatron.cpu_engine.protocol import SAMPLING_PARAM_NAMES

NUM_BODIES = 300
VALID = {"input_ids": [1, 17, 42, 99], "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}}
JUNK = [None, True, False, 0, -1, 1, 2, 7, 255, 10**9, -(10**12), 1.5, -0.5, float("nan"), "", "x", "17",
        [], [1], [1, 2], ["a"], [[1]], [None], {}, {"a": 1}, {"max_new_tokens": "x"}, [{"x": 1}], "\u00e9\u4e2d"]


def post(url: str, body: bytes) -> tuple[int, object]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, raw


def mutate(rng: random.Random) -> tuple[bytes, str]:
    """One malformed (or occasionally still valid) body and what was broken, for the failure message."""
    body = json.loads(json.dumps(VALID))
    kind = rng.randrange(7)
    if kind == 0:  # a top-level field of the wrong shape
        key = rng.choice(["input_ids", "text", "rid", "return_logprob", "sampling_params", "logprob_start_len",
                          "return_routed_experts", "routed_experts_start_len", "stream"])
        body[key] = rng.choice(JUNK)
        what = f"{key}={body[key]!r}"
    elif kind == 1:  # a sampling parameter of the wrong type or range
        key = rng.choice(sorted(SAMPLING_PARAM_NAMES))
        body["sampling_params"][key] = rng.choice(JUNK)
        what = f"sampling_params.{key}={body['sampling_params'][key]!r}"
    elif kind == 2:  # token ids out of the vocabulary or not ints
        body["input_ids"] = [rng.choice([1, 5, -1, 300, 10**6, 2.5, "a", None, [1]]) for _ in range(rng.randint(1, 4))]
        what = f"input_ids={body['input_ids']!r}"
    elif kind == 3:  # a batch whose lists disagree
        body["input_ids"] = [[1, 2]] * rng.randint(1, 3)
        body["sampling_params"] = [dict(VALID["sampling_params"])] * rng.randint(0, 3)
        body["rid"] = rng.choice([None, "r", ["a"], ["a", "a"], ["a", "b"], ["a", "b", "c"]])
        what = f"batch of {len(body['input_ids'])}, {len(body['sampling_params'])} params, rid {body['rid']!r}"
    elif kind == 4:  # text prompts of the wrong type (the case that once reached the tokenizer)
        del body["input_ids"]
        body["text"] = rng.choice([5, ["a", 3], [["a"]], {"t": "a"}, [None], "", [""], "ok"])
        what = f"text={body['text']!r}"
    elif kind == 5:  # the body itself
        raw = rng.choice([b"", b"{", b"[]", b"null", b"17", b'"text"', b"\xff\xfe", b'{"input_ids": [1,]}'])
        return raw, f"raw {raw!r}"
    else:  # required parts missing or doubled
        rng.choice([lambda: body.pop("input_ids"), lambda: body.update(text="hi"),
                    lambda: body["sampling_params"].update(n=rng.choice([0, -2, 1.5, "2"]))])()
        what = f"structure {body!r}"
    return json.dumps(body).encode(), what


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_fuzz")
    proc = ServerProcess(make_tiny_checkpoint(root / "model", seed=0), root / "engines", log_path=root / "server.log")
    yield proc
    proc.kill()


def greedy(url: str) -> list[int]:
    body = {"input_ids": [1, 17, 42, 99, 7], "sampling_params": {"max_new_tokens": 5, "temperature": 0.0,
                                                                 "ignore_eos": True}}
    status, out = post(url + "/generate", json.dumps(body).encode())
    assert status == 200, out
    return out["output_ids"]


def test_fuzzed_generate_bodies_are_4xx_naming_the_field_and_the_server_still_generates(server):
    before = greedy(server.url)
    rng = random.Random(1234)
    answered = {}
    for index in range(NUM_BODIES):
        raw, what = mutate(rng)
        status, out = post(server.url + "/generate", raw)
        answered[status] = answered.get(status, 0) + 1
        case = f"body {index} ({what}): HTTP {status} {out!r}"[:400]
        if status == 200:
            outputs = out if isinstance(out, list) else [out]
            assert all(isinstance(o.get("output_ids"), list) and "meta_info" in o for o in outputs), case
            continue
        assert isinstance(out, dict) and isinstance(out.get("error"), dict), case
        field = out["error"].get("field")
        assert field and field in out["error"]["message"], case
        if status >= 500:  # SGLang's own 500 for an unknown sampling parameter, and nothing else
            assert status == 500 and field.startswith("sampling_params.") \
                and field.split(".", 1)[1] not in SAMPLING_PARAM_NAMES, case
        else:
            assert status == 400, case
    assert answered.get(400, 0) > NUM_BODIES // 2, answered  # the bodies really were malformed
    assert greedy(server.url) == before
