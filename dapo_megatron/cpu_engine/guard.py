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
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web

from dapo_megatron.cpu_engine.protocol import RequestError
from dapo_megatron.rollout.auth import decide, refusal_body

DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # ~15x the largest body a rollout sends (64 prompts x 22K token ids)


@dataclass(frozen=True)
class Limits:
    api_key: str | None = None
    admin_api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


def error_response(status: int, message: str, field: str | None = None) -> web.Response:
    """The CPU engine's error shape: a superset of SGLang's {"error": {"message"}} and {"success", "message"}."""
    return web.json_response({"error": {"message": message, "field": field}, "success": False,
                              "message": message}, status=status)


def too_large(limit: int, size: int | None = None) -> RequestError:
    got = f"{size} bytes" if size is not None else "a body"
    return RequestError("body", f"{got} exceed the server's --max-request-bytes={limit} (HTTP 413)", status=413)


def guard_middleware(limits: Limits):
    @web.middleware
    async def guard(request: web.Request, handler):
        status = decide(request.method, request.path, request.headers.get("Authorization"),
                        api_key=limits.api_key, admin_api_key=limits.admin_api_key)
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
    if not raw and optional:
        return {}
    try:
        body = json.loads(raw)
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
