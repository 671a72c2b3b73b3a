"""Malformed and hostile requests to a real `serve-rollout` process (loopback only): no client input gets a
5xx (issue 28 found 487 of 5,100 garbage bodies answered 500, a 50 MB body growing the server to 18 GiB).

  - a few hundred seeded /generate bodies made by breaking a valid one field by field (wrong types,
    out-of-range numbers, nested junk, missing and unknown keys, non-JSON bytes): every answer is a 400
    whose JSON error names the field, or a 200 with well-formed outputs (an unknown sampling parameter
    included: SGLang answers 500 there, the CPU engine 400, docs/sglang.md);
  - garbage on every route (benchmarks/engine_abuse.py's generator, fewer bodies than its 5,100): no 5xx,
    and the server generates the same greedy tokens afterwards;
  - the issue's bodies, scaled to CI: non-UTF-8 bytes, deeply nested '[', text far beyond the context
    (refused by the token lower bound, without tokenizing), a million input_ids (refused by length before
    each id is checked), lone surrogates, 1e999 where an integer belongs: all 400 naming the body or field;
  - a body above --max-request-bytes (the default, 16 MiB) is refused with 413 before it is read: the
    server answers a request whose headers promise limit + 1 bytes without waiting for any of them, and a
    chunked body is cut off at the limit;
  - a large body is decoded and checked off the event loop (guard.off_loop): a /health sent while 15 MB of
    input_ids are being checked is answered before that body's 400 (it used to wait for the whole parse),
    and the large bodies' malformations (bad JSON, non-UTF-8, too deep) get the small bodies' 400s.
The full-size run (5,100 bodies, 50 MB bodies, peak memory) is `dapo-megatron bench engine-abuse`
(docs/benchmarks.md).
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dapo_megatron.benchmarks.engine_abuse import garbage_run, post_streamed
from dapo_megatron.cpu_engine.guard import DEFAULT_MAX_REQUEST_BYTES, INLINE_PARSE_BYTES
from dapo_megatron.cpu_engine.protocol import SAMPLING_PARAM_NAMES
from rollout_helpers import ServerProcess, make_tiny_checkpoint, request_json

NUM_BODIES = 300
VALID = {"input_ids": [1, 17, 42, 99], "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}}
JUNK = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    7,
    255,
    10**9,
    -(10**12),
    1.5,
    -0.5,
    float("nan"),
    "",
    "x",
    "17",
    [],
    [1],
    [1, 2],
    ["a"],
    [[1]],
    [None],
    {},
    {"a": 1},
    {"max_new_tokens": "x"},
    [{"x": 1}],
    "\u00e9\u4e2d",
]


def post(url: str, body: bytes) -> tuple[int, object]:
    return request_json(url, body)


def mutate(rng: random.Random) -> tuple[bytes, str]:
    """One malformed (or occasionally still valid) body and what was broken, for the failure message."""
    body = json.loads(json.dumps(VALID))
    kind = rng.randrange(7)
    if kind == 0:  # a top-level field of the wrong shape
        key = rng.choice(
            [
                "input_ids",
                "text",
                "rid",
                "return_logprob",
                "sampling_params",
                "logprob_start_len",
                "return_routed_experts",
                "routed_experts_start_len",
                "stream",
            ]
        )
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
        rng.choice(
            [
                lambda: body.pop("input_ids"),
                lambda: body.update(text="hi"),
                lambda: body["sampling_params"].update(n=rng.choice([0, -2, 1.5, "2"])),
            ]
        )()
        what = f"structure {body!r}"
    return json.dumps(body).encode(), what


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout_fuzz")
    proc = ServerProcess(make_tiny_checkpoint(root / "model", seed=0), root / "engines", log_path=root / "server.log")
    proc.model_dir = str(root / "model")
    yield proc
    proc.kill()


def greedy(url: str) -> list[int]:
    body = {
        "input_ids": [1, 17, 42, 99, 7],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
    }
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
        assert status == 400, case  # never a 5xx (an unknown sampling parameter included: SGLang's is a 500)
    assert answered.get(400, 0) > NUM_BODIES // 2, answered  # the bodies really were malformed
    assert greedy(server.url) == before


def test_garbage_on_every_route_is_never_a_5xx(server):
    before = greedy(server.url)
    statuses = garbage_run(server.url, server.model_dir, per_endpoint=40, seed=7)
    assert not {s: c for s, c in statuses.items() if s >= 500}, statuses
    assert statuses.get(400, 0) > 300, statuses  # mostly refused: the bodies really were garbage
    assert greedy(server.url) == before


ISSUE_BODIES = [
    # (what, body, field the error names)
    ("non-UTF-8 bytes", b'{"input_ids": [1], "rid": "\xff\xfe"}', "body"),
    ("raw non-UTF-8", b"\xff\xfe\xfd" * 1000, "body"),
    ("1 MB of nested '['", b"[" * 1_000_000, "body"),
    ("nested objects", b'{"a":' * 100_000, "body"),
    ("text far beyond the context", json.dumps({"text": "a" * 2_000_000}).encode(), "text"),
    ("a million input_ids", json.dumps({"input_ids": [1] * 1_000_000}).encode(), "input_ids"),
    (
        "unknown sampling parameter",
        json.dumps({"input_ids": [1], "sampling_params": {"temprature": 1.0}}).encode(),
        "sampling_params.temprature",
    ),
    ("lone surrogate in text", b'{"text": "ab\\ud800"}', "text"),
    ("1e999 truncate_size", b'{"name": "model.norm.weight", "truncate_size": 1e999}', "truncate_size"),
    # above guard.INLINE_PARSE_BYTES (decoded on the parse thread): the same answers as small bodies
    ("1 MB of non-UTF-8", b"\xff\xfe\xfd" * 350_000, "body"),
    ("1 MB of JSON cut short", json.dumps({"input_ids": [1] * 300_000}).encode()[:-5], "body"),
    ("1 MB of JSON, not an object", json.dumps([1] * 300_000).encode(), "body"),
    (
        "600 KB of input_ids, one outside the vocabulary",  # 200-token prompts: the tiny model's context is 256
        json.dumps({"input_ids": [[1] * 200] * 999 + [[1] * 199 + [10**6]]}).encode(),
        "input_ids[999][199]",
    ),
]


@pytest.mark.parametrize("what, body, field", ISSUE_BODIES, ids=[c[0] for c in ISSUE_BODIES])
def test_the_issues_bodies_are_400_naming_what_is_wrong(server, what, body, field):
    path = "/get_weights_by_name" if "truncate_size" in what else "/generate"
    status, out = post(server.url + path, body)
    assert status == 400 and out["error"]["field"] == field, (what, status, out)
    assert field in out["error"]["message"]


def test_large_and_small_bodies_get_the_same_errors(server):
    """The same malformation inline (small) and on the parse thread (large, padded with whitespace JSON
    ignores): the same status and message, positions shifted by the padding only."""
    pad = b" " * (INLINE_PARSE_BYTES + 1)
    for small in (
        b'{"input_ids": [1,]}',
        b"[1, 2]",
        b'{"input_ids": [1], "rid": "\xff"}',
        b"[" * 5000,
        json.dumps({"input_ids": [1, 17, 10**6]}).encode(),
        json.dumps({"text": 5}).encode(),
    ):
        got = [post(server.url + "/generate", body) for body in (small, pad + small)]
        (s1, o1), (s2, o2) = got
        shift = str(len(pad))
        assert s1 == s2 == 400 and o1["error"]["field"] == o2["error"]["field"], (small, got)
        if "at char" in o1["error"]["message"]:  # json's position counts the padding
            pos = int(o1["error"]["message"].rsplit("at char ", 1)[1].rstrip(")"))
            assert o2["error"]["message"] == o1["error"]["message"].replace(
                f"at char {pos}", f"at char {pos + int(shift)}"
            )
        elif "byte " in o1["error"]["message"]:
            pos = int(o1["error"]["message"].split("byte ", 1)[1].split(":")[0])
            assert o2["error"]["message"] == o1["error"]["message"].replace(f"byte {pos}", f"byte {pos + int(shift)}")
        else:
            assert o1 == o2, (small, got)


def test_health_is_answered_while_a_large_body_is_checked(server):
    """A /health sent while a 15 MB /generate body is decoded and checked is answered before that body's
    400: the event loop answers meanwhile. Before the parse moved off the loop, /health waited for the
    whole parse and came second. 440K prompts of 8 ids: per-prompt work makes the parse take 2-6 s here,
    far longer than the 0.2 s the test waits before sending /health."""
    vocab = json.loads((Path(server.model_dir) / "config.json").read_text())["vocab_size"]
    prompt = [17] * 8
    count = 15_000_000 // (4 * len(prompt) + 2)
    body = json.dumps(
        {"input_ids": [prompt] * (count - 1) + [prompt[:-1] + [vocab]], "sampling_params": {"max_new_tokens": 1}}
    ).encode()
    assert INLINE_PARSE_BYTES < len(body) < DEFAULT_MAX_REQUEST_BYTES
    assert greedy(server.url)  # warm
    host, port = server.url.removeprefix("http://").split(":")
    answered: list[tuple[str, int]] = []

    def health():
        answered.append(("health", send_request(server.url, "GET", "/health")))

    with socket.create_connection((host, int(port)), timeout=300) as sock:
        sock.sendall(
            f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        # sendall returns once the kernel holds the rest (a few MB at most): the server reads it within
        # milliseconds and then decodes for seconds; /health goes out inside that window
        time.sleep(0.2)
        prober = threading.Thread(target=health)
        prober.start()
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    answered.append(("generate", int(reply.split(b" ", 2)[1])))
    prober.join(300)
    error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
    assert error["field"] == f"input_ids[{count - 1}][{len(prompt) - 1}]", error
    assert answered == [("health", 200), ("generate", 400)]


def send_request(url: str, method: str, path: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, method=method), timeout=300) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_non_finite_flush_timeout_is_400(server):
    for value in ("nan", "inf", "x"):
        status, out = post(server.url + f"/flush_cache?timeout={value}", b"")
        assert status == 400 and out["error"]["field"] == "timeout", (value, status, out)


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        # headers only: a server that read the body first would wait for bytes that never come
        sock.sendall(
            f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {DEFAULT_MAX_REQUEST_BYTES + 1}\r\n\r\n".encode()
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    error = json.loads(body)["error"]
    assert error["field"] == "body" and str(DEFAULT_MAX_REQUEST_BYTES) in error["message"]

    def just_over():  # chunked: no length up front, so the server reads up to the limit and stops there
        block = b"[" * 65536
        for _ in range(DEFAULT_MAX_REQUEST_BYTES // 65536):
            yield block
        yield b"[" * (DEFAULT_MAX_REQUEST_BYTES % 65536 + 1)

    try:
        status, raw = post_streamed(server.url, "/generate", just_over(), length=None)
        assert status == 413 and json.loads(raw)["error"]["field"] == "body", (status, raw[:300])
    except ConnectionResetError:  # the server answered 413 and closed while the rest was still being sent
        pass
    assert greedy(server.url)  # and it still serves
