"""What the CPU engine checks before a handler runs: the API keys (SGLang's decisions, rollout/auth.py) and the
size of the body; and how a body becomes JSON without a 5xx for any bytes a client can send.

    app = web.Application(client_max_size=limits.max_request_bytes, middlewares=[guard_middleware(limits)])
    body = await read_json(request)   # RequestError (400 / 413) naming "body" for anything but a JSON value

Order of the checks, each before any byte of the body is read:
  1. auth: 401 {"error": "Unauthorized"}, exactly SGLang's middleware (decide_request_auth);
  2. Content-Length above --max-request-bytes: 413 at once (the body is never read). A body without a
     Content-Length (chunked) is read up to the limit and refused there (aiohttp's client_max_size),
     so no request holds more than the limit in memory.
Then read_json: bytes that are not UTF-8 (json.loads would raise UnicodeDecodeError), JSON nested deeper
than the parser's recursion allows (RecursionError), and any other malformed JSON are a 400 naming "body".
SGLang has no body limit (FastAPI reads any body; its JSON errors are 400 or 422): the limit and these
400s are CPU differences a client sees only with bodies SGLang would choke on (docs/sglang.md).

Bodies above INLINE_PARSE_BYTES are decoded on a one-thread parse pool instead of the event loop, and
handlers run their own checks of such bodies there too (off_loop: parse_generate's per-token checks,
update_weights_from_tensor's unpickling): the loop keeps answering /health and small requests meanwhile,
where a 16 MB /generate body used to hold it for 0.7 s (docs/LOG.md, `dapo-megatron bench engine-health`).
json.loads alone would not do: it holds the GIL from first byte to last, so the pool decodes with
loads_yielding (json's own scanners, one container element at a time; same value, same errors), and the
parse thread hands the GIL over every 0.5 ms of work (Pauser; else each GIL acquisition of the loop or of
a decode step waits a 5 ms switch interval: /health took 330 ms instead of 52 ms). Small
bodies stay inline (the thread hop costs more than their parse); the same function maps errors for both,
so the statuses and messages do not depend on the size.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aiohttp import web

from dapo_megatron.cpu_engine.protocol import RequestError
from dapo_megatron.rollout.auth import decide, refusal_body

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # ~15x the largest body a rollout sends (64 prompts x 22K token ids)
INLINE_PARSE_BYTES = 256 << 10  # decoded on the event loop up to this size (~2 ms of json.loads here)
BODY_BYTES = "dapo_body_bytes"  # request key: the size of the body read_json read
_parse_pool: ThreadPoolExecutor | None = None


def parse_pool() -> ThreadPoolExecutor:
    """One thread: large bodies are decoded one at a time, as they were on the loop, so at most one
    body's parsed objects are being built at once (the peak memory issue 28 bounded stays bounded)."""
    global _parse_pool
    if _parse_pool is None:
        _parse_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-parse")
    return _parse_pool


def is_large(request: web.Request) -> bool:
    return request.get(BODY_BYTES, 0) > INLINE_PARSE_BYTES


async def off_loop(request: web.Request, fn, *args, **kwargs):
    """fn(*args, **kwargs) on the parse pool when the request's body was large, else inline (same
    result, same exceptions)."""
    if is_large(request):
        return await asyncio.get_running_loop().run_in_executor(parse_pool(), functools.partial(fn, *args, **kwargs))
    return fn(*args, **kwargs)


@dataclass(frozen=True)
class Limits:
    api_key: str | None = None
    admin_api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


def error_response(status: int, message: str, field: str | None = None) -> web.Response:
    """The CPU engine's error shape: a superset of SGLang's {"error": {"message"}} and {"success", "message"}."""
    return web.json_response(
        {"error": {"message": message, "field": field}, "success": False, "message": message}, status=status
    )


def too_large(limit: int, size: int | None = None) -> RequestError:
    got = f"{size} bytes" if size is not None else "a body"
    return RequestError("body", f"{got} exceed the server's --max-request-bytes={limit} (HTTP 413)", status=413)


def guard_middleware(limits: Limits):
    @web.middleware
    async def guard(request: web.Request, handler):
        status = decide(
            request.method,
            request.path,
            request.headers.get("Authorization"),
            api_key=limits.api_key,
            admin_api_key=limits.admin_api_key,
        )
        if status is not None:
            return web.json_response(refusal_body(status), status=status)
        size = request.content_length
        if size is not None and size > limits.max_request_bytes:
            err = too_large(limits.max_request_bytes, size)
            return error_response(err.status, str(err), err.field)
        return await handler(request)

    return guard


async def read_json(request: web.Request, *, optional: bool = False) -> dict:
    """The body as a JSON object ({} for an empty optional one); RequestError for anything else."""
    try:
        raw = await request.read()  # at most client_max_size bytes, then HTTPRequestEntityTooLarge
    except web.HTTPRequestEntityTooLarge:
        raise too_large(getattr(request, "_client_max_size", 0)) from None  # aiohttp keeps the limit private
    request[BODY_BYTES] = len(raw)
    return await off_loop(request, decode_json, raw, optional=optional, yielding=is_large(request))


def decode_json(raw: bytes, *, optional: bool = False, yielding: bool = False) -> dict:
    """read_json's decoding of the bytes (on the loop or the parse pool, the same errors either way).
    yielding: json.loads in pieces that let go of the GIL in between (loads_yielding)."""
    if not raw and optional:
        return {}
    try:
        body = loads_yielding(raw) if yielding else json.loads(raw)
    except json.JSONDecodeError as err:
        raise RequestError("body", f"not valid JSON ({err.msg} at char {err.pos})") from None
    except UnicodeDecodeError as err:
        raise RequestError("body", f"not UTF-8 text (byte {err.start}: {err.reason})") from None
    except RecursionError:
        raise RequestError("body", "JSON nested too deeply (no SGLang request nests more than 4 levels)") from None
    if body is None and optional:
        return {}
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    return body


# ----------------------------------------------------------------------------- json.loads in pieces
_DECODER = json.JSONDecoder()
# json's private parts (typeshed does not declare them): the same objects json.loads itself uses
_WHITESPACE = json.decoder.WHITESPACE  # type: ignore[attr-defined]
_C_SCAN = _DECODER.scan_once  # type: ignore[attr-defined]  # the C scanner (json's own, as json.loads uses it)
_SPLIT_DEPTH = 3  # containers this shallow are walked in Python; deeper ones go to the C scanner whole
_WS = " \t\n\r"
_FLAT_PIECE = 1 << 16  # characters of a flat array decoded per C call (~1 ms here)


class Pauser:
    """Called between pieces of work on the parse thread: every YIELD_S of work it hands the GIL over at
    once (time.sleep(0)). Without it, a thread that wants the GIL (the event loop, the decode step
    between two torch ops) waits a whole switch interval (5 ms) each time: /health took 330 ms instead
    of 52 ms while a 16 MB body was decoded (the GIL convoy)."""

    YIELD_S = 0.0005

    def __init__(self):
        self.last = time.perf_counter()

    def __call__(self) -> None:
        now = time.perf_counter()
        if now - self.last > self.YIELD_S:
            time.sleep(0)
            self.last = time.perf_counter()


def _flat_array(s: str, idx: int, pause=None):
    """The array of scalars at s[idx] ("["), as the C scanner would return it, decoded in pieces of about
    _FLAT_PIECE characters cut at commas. Only arrays of numbers and literals are cut (a string could hold
    a comma or a bracket); anything a piece does not decode cleanly goes to the C scanner whole, which
    then raises json's own error with json's own position."""
    close = s.find("]", idx)
    if close < 0 or close - idx <= _FLAT_PIECE or any(s.find(c, idx + 1, close) >= 0 for c in '"[{'):
        return _C_SCAN(s, idx)
    values: list = []
    start = idx + 1
    while True:
        cut = s.find(",", min(start + _FLAT_PIECE, close), close)
        end = close if cut < 0 else cut
        piece = "[" + s[start:end] + "]"
        try:
            part, n = _C_SCAN(piece, 0)
        except (StopIteration, ValueError):
            return _C_SCAN(s, idx)  # malformed: json's error and position
        if n != len(piece) or not part:  # "[1 2]"-like rest, or an empty piece ("[1,]", "[1,,2]")
            return _C_SCAN(s, idx)
        values.extend(part)
        if pause is not None:
            pause()
        if cut < 0:
            return values, close + 1
        start = cut + 1


def loads_yielding(raw: bytes):
    """json.loads(raw), same value and same exceptions, but never one long C call: json.loads holds the
    GIL from its first byte to its last (16 MB of input_ids: 0.7 s), so a parse thread would still stop
    the event loop. Objects and arrays of containers down to _SPLIT_DEPTH are walked by json's own
    pure-Python JSONObject / JSONArray (the interpreter can switch threads between their elements); each
    element, and every array of scalars (a prompt's token ids), is one call of json's C scanner. A
    16 MB batch of prompts thus holds the GIL one prompt at a time, and a flat array of numbers longer
    than _FLAT_PIECE characters (one prompt of millions of ids) a piece of it at a time (_flat_array)."""
    text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # what json.loads does with bytes
    memo: dict = {}
    pause = Pauser()

    def scanner(depth: int):
        def scan_once(s: str, idx: int):
            char = s[idx : idx + 1]
            if depth >= _SPLIT_DEPTH or char not in ("{", "["):
                return _C_SCAN(s, idx)
            if char == "[":
                j = idx + 1
                while s[j : j + 1] in _WS and j < len(s):
                    j += 1
                if s[j : j + 1] not in ("[", "{"):  # an array of scalars (or empty, or malformed)
                    return _flat_array(s, idx, pause)
                return json.decoder.JSONArray((s, idx + 1), scanner(depth + 1))  # type: ignore[attr-defined]
            return json.decoder.JSONObject(  # type: ignore[attr-defined]
                (s, idx + 1), True, scanner(depth + 1), None, None, memo
            )

        def scan_and_yield(s: str, idx: int):
            value = scan_once(s, idx)
            pause()
            return value

        return scan_and_yield if depth > 0 else scan_once

    # JSONDecoder.decode and raw_decode, with the scanner above
    idx = _WHITESPACE.match(text, 0).end()
    try:
        obj, end = scanner(0)(text, idx)
    except StopIteration as err:
        raise json.JSONDecodeError("Expecting value", text, err.value) from None
    end = _WHITESPACE.match(text, end).end()
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return obj
