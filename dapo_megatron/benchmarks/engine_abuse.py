"""`dapo-megatron bench engine-abuse`: a CPU engine (`serve-rollout`) under hostile input, the way issue 28
found it answering 500s and growing to 18 GiB: thousands of garbage bodies over every route (count of
5xx answers: must be 0), then the large bodies one at a time (50 MB of nested '[', 50 M characters of
text, 50 MB of input_ids, non-UTF-8 bytes), each with the server's peak resident memory, its answer and
how long /health and a small /generate took meanwhile.

    dapo-megatron bench engine-abuse                                    # tiny checkpoint, default limit
    dapo-megatron bench engine-abuse --bodies-per-endpoint 300 --big-mb 50 --max-request-mb 64

`--max-request-mb` above the big bodies makes the server read and parse them (what the limit otherwise
refuses at once with 413). Rows go to <results-dir>/engine_abuse.csv. The garbage generator below is the
one tests/integration/test_rollout_server_fuzz.py runs in CI (fewer bodies there).
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import json
import platform
import random
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from dapo_megatron.benchmarks import parsers
from dapo_megatron.benchmarks.run import append_rows, results_csv
from dapo_megatron.data.tiny_model import build_tiny_tokenizer
from dapo_megatron.rollout.registry import read_registrations

# every route of the CPU engine with the JSON fields its handler reads (garbage is built from these)
ENDPOINTS: list[tuple[str, str, tuple[str, ...]]] = [
    (
        "POST",
        "/generate",
        (
            "input_ids",
            "text",
            "sampling_params",
            "rid",
            "return_logprob",
            "stream",
            "return_routed_experts",
            "routed_experts_start_len",
            "logprob_start_len",
        ),
    ),
    ("POST", "/abort_request", ("rid", "abort_all")),
    ("POST", "/begin_weight_update", ()),
    ("POST", "/end_weight_update", ()),
    (
        "POST",
        "/init_weights_update_group",
        ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
    ),
    ("POST", "/destroy_weights_update_group", ("group_name",)),
    (
        "POST",
        "/update_weights_from_distributed",
        ("names", "dtypes", "shapes", "group_name", "flush_cache", "load_format", "weight_version"),
    ),
    (
        "POST",
        "/update_weights_from_tensor",
        ("serialized_named_tensors", "load_format", "flush_cache", "weight_version"),
    ),
    ("POST", "/update_weights_from_disk", ("model_path", "weight_version")),
    ("POST", "/update_weight_version", ("new_version", "abort_all_requests")),
    ("POST", "/pause_generation", ("mode",)),
    ("POST", "/continue_generation", ()),
    ("POST", "/flush_cache", ()),
    ("POST", "/release_memory_occupation", ("tags",)),
    ("POST", "/resume_memory_occupation", ("tags",)),
    ("POST", "/get_weights_by_name", ("name", "truncate_size")),
    ("GET", "/get_weights_by_name", ("name", "truncate_size")),
    ("GET", "/flush_cache", ()),
]
GET_QUERIES = [
    "",
    "?timeout=abc",
    "?timeout=nan",
    "?timeout=1e999",
    "?timeout=-5",
    "?name=x&truncate_size=-1",
    "?name=model.norm.weight&truncate_size=99999999999999999999",
    "?name=model.norm.weight&truncate_size=x",
    "?name=%ff%fe",
    "?truncate_size=1",
]
JUNK: list[object] = [  # any JSON value, and some that no JSON holds
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    255,
    10**30,
    -(10**12),
    1.5,
    -0.0,
    1e308,
    "",
    "x",
    "17",
    "\u00e9\u4e2d",
    "/",
    "weights",
    "abort",
    "model.norm.weight",
    [],
    [1],
    [-1],
    [1, 2],
    ["a"],
    [["a"]],
    [[1]],
    [None],
    [{}],
    {},
    {"a": 1},
    {"max_new_tokens": "x"},
    {"n": 10**9},
    {"temprature": 1},
    [[1, 2], [3]],
    ["weights", 3],
]
RAW = [
    b"",
    b"{",
    b"[]",
    b"null",
    b"17",
    b'"x"',
    b"\xff\xfe\x00",
    b"\x80abc",
    '{"a": "\u00e9"}'.encode("latin-1"),
    b'{"input_ids": [1,]}',
    b"\xef\xbb\xbf{}",
    b"[" * 5000,
    b'{"a":' * 3000,
    b"NaN",
    b"Infinity",
    b'{"a": NaN}',
    b'{"truncate_size": 1e999}',
    b'{"text": "\\ud800"}',
    b'{"rid": "\\udfff", "input_ids": [1]}',
    b'{"model_path": "\\ud800"}',
    b'{"name": "\\ud800"}',
    b'{"tags": ["\\ud800"]}',
    b"\x00" * 100,
]


def garbage(rng: random.Random, fields: tuple[str, ...]) -> bytes:
    """One body a client might send: raw junk, random bytes, junk values under the handler's own field names,
    or a body that was JSON until it was cut or had a byte changed."""
    kind = rng.randrange(5)
    if kind == 0:
        return rng.choice(RAW)
    if kind == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    body = {key: rng.choice(JUNK) for key in fields if rng.random() < 0.6}
    if rng.random() < 0.2:
        body[rng.choice(["x", "sampling_params", "tags", "name"])] = rng.choice(JUNK)
    raw = json.dumps(body).encode()
    if kind == 2 or len(raw) < 2:
        return raw
    cut = rng.randrange(1, len(raw))
    return raw[:cut] if kind == 3 else raw[:cut] + bytes([rng.choice([0xFF, 0xC3, 0x00, 0x5B])]) + raw[cut + 1 :]


def send(
    url: str, method: str, path: str, body: bytes | None, *, timeout: float = 300.0, headers: dict | None = None
) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url + path, data=body, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def restore(url: str, model_dir: str) -> None:
    """Undo what a garbage body that happened to be valid did: resume released memory (then reload the
    weights from disk: their content is gone), continue a pause, close a weight-update session."""
    info = json.loads(send(url, "GET", "/server_info", None)[1])["cpu_engine"]
    if info["released_tags"]:
        send(url, "POST", "/resume_memory_occupation", json.dumps({"tags": info["released_tags"]}).encode())
        send(url, "POST", "/update_weights_from_disk", json.dumps({"model_path": model_dir}).encode())
    if info["is_paused"]:
        send(url, "POST", "/continue_generation", b"{}")
    if info["weight_update_session_open"]:
        send(url, "POST", "/end_weight_update", b"{}")


def garbage_run(url: str, model_dir: str, *, per_endpoint: int, seed: int) -> dict[int, int]:
    """per_endpoint garbage bodies to every route; returns {status: count}. The weight-update routes get theirs
    inside an open session (so the payload parsing is reached), the others outside."""
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    failures: list[str] = []
    for method, path, fields in ENDPOINTS:
        in_session = path in ("/update_weights_from_tensor", "/update_weights_from_distributed")
        for _ in range(per_endpoint):
            if in_session:
                send(url, "POST", "/begin_weight_update", b"{}")
            if method == "GET":
                status, out = send(url, "GET", path + rng.choice(GET_QUERIES), None)
            else:
                raw = garbage(rng, fields)
                status, out = send(url, method, path, raw)
            statuses[status] = statuses.get(status, 0) + 1
            if status >= 500:
                failures.append(f"{method} {path}: HTTP {status} {out[:200]!r}")
            if status == 200 or in_session:
                restore(url, model_dir)
    if failures:
        print("\n".join(failures[:20]))
    return statuses


class PeakRSS:
    """Samples a process's resident memory every 10 ms while the block runs; .peak in bytes."""

    def __init__(self, pid: int):
        import psutil

        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.01)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def probe_latencies(url: str, stop: threading.Event, out: dict) -> None:
    """While a big request runs: the slowest /health and small /generate (seconds)."""
    small = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}).encode()
    while not stop.is_set():
        for key, args in (("health_s", ("GET", "/health", None)), ("small_generate_s", ("POST", "/generate", small))):
            tic = time.perf_counter()
            send(url, *args, timeout=600)
            out[key] = max(out.get(key, 0.0), time.perf_counter() - tic)


def post_streamed(url: str, path: str, chunks, *, length: int | None) -> tuple[int, bytes]:
    """POST a body given as chunks, with Content-Length or (length None) chunked transfer encoding."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    headers = {"Content-Type": "application/json"}
    if length is not None:
        headers["Content-Length"] = str(length)
    conn.request("POST", path, body=chunks, headers=headers, encode_chunked=length is None)
    resp = conn.getresponse()
    return resp.status, resp.read()


def big_bodies(mb: int) -> dict[str, tuple[int, object]]:
    """name -> (Content-Length, an iterable of chunks), generated on the fly (the client holds little)."""
    n = mb * 1_000_000

    def repeat(head: bytes, unit: bytes, tail: bytes, count: int):
        yield head
        block = unit * 65536
        for _ in range(count // 65536):
            yield block
        yield unit * (count % 65536) + tail

    ids = n // 2
    return {
        f"{mb}MB nested '['": (n, repeat(b"", b"[", b"", n)),
        f"{mb}M chars of text": (n + 11, repeat(b'{"text": "', b"a", b'"}', n)),
        f"{mb}MB of input_ids": (2 * ids + 15, repeat(b'{"input_ids": [', b"1,", b"1]}", ids - 1)),
        f"{mb}MB non-UTF-8": (n, repeat(b"", b"\xff", b"", n)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = parsers.engine_abuse()  # torch-free: `bench engine-abuse --help` answers at once
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _tiny_model(Path(tmp) / "model")
        limit = ["--max-request-bytes", str(args.max_request_mb * 1_000_000)] if args.max_request_mb else []
        with served_engine(model, Path(tmp) / "engines", limit) as (url, proc):
            rows = _measure(url, proc.pid, model, args)
    fields = [
        "case",
        "status",
        "count",
        "seconds",
        "peak_rss_mb",
        "health_s",
        "small_generate_s",
        "limit_mb",
        "machine",
        "date",
    ]
    print(
        f"{'case':<32} {'status':>10} {'count':>6} {'s':>7} {'peak RSS MB':>12} {'/health s':>10} {'small gen s':>12}"
    )
    for r in rows:
        print(
            f"{r['case']:<32} {r['status']:>10} {r['count']:>6} {r['seconds']:>7.2f} {r['peak_rss_mb']:>12.0f} "
            f"{r['health_s']:>10.2f} {r['small_generate_s']:>12.2f}"
        )
    append_rows(results_csv(args, name="engine_abuse"), rows, fields=fields)
    return 0


@contextlib.contextmanager
def served_engine(model: str, register_dir: Path, extra_args: Sequence[str] = (), *, log_path: Path | None = None):
    """(url, process) of a one-thread `serve-rollout` of model, once it has registered; terminated on exit.
    log_path: the engine's stdout and stderr go there (else nowhere), and a start that fails says why with
    the log's last lines."""
    import subprocess
    import sys

    log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dapo_megatron.cli",
            "serve-rollout",
            "--model",
            model,
            "--register-dir",
            str(register_dir),
            "--threads",
            "1",
            *extra_args,
        ],
        stdout=log or subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while not (recs := [r for r in _records(read_registrations, register_dir) if r["pid"] == proc.pid]):
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else "not registered in 300 s"
                raise RuntimeError(f"serve-rollout did not start ({why}){_log_tail(log_path)}")
            time.sleep(0.2)
        yield recs[0]["url"], proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # a hung engine must not hold the caller past its budget
            proc.kill()
            proc.wait(10)
        if log:
            log.close()


def _log_tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not Path(path).is_file():
        return ""
    tail = Path(path).read_text(errors="replace").splitlines()[-lines:]
    return f"; the last {len(tail)} lines of {path}:\n" + "\n".join(tail)


def _records(read, path):
    try:
        return read(path)
    except (FileNotFoundError, ValueError):
        return []


def _tiny_model(out: Path) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    tok = build_tiny_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _measure(url: str, pid: int, model: str, args) -> list[dict]:
    common = {
        "limit_mb": args.max_request_mb or 16.78,
        "machine": platform.processor() or platform.machine(),
        "date": datetime.date.today().isoformat(),
    }
    rows = []
    with PeakRSS(pid) as rss:
        tic = time.perf_counter()
        statuses = garbage_run(url, model, per_endpoint=args.bodies_per_endpoint, seed=args.seed)
        seconds = time.perf_counter() - tic
    total = sum(statuses.values())
    rows.append(
        {
            "case": f"garbage x{total} ({len(ENDPOINTS)} routes)",
            "status": "5xx",
            "count": sum(c for s, c in statuses.items() if s >= 500),
            "seconds": seconds,
            "peak_rss_mb": rss.peak / 1e6,
            "health_s": 0.0,
            "small_generate_s": 0.0,
            **common,
        }
    )
    print(f"garbage statuses: {dict(sorted(statuses.items()))}")
    for name, (length, chunks) in big_bodies(args.big_mb).items():
        for framing in ("content-length", "chunked"):
            stop, lat = threading.Event(), dict[str, list[float]]()
            prober = threading.Thread(target=probe_latencies, args=(url, stop, lat), daemon=True)
            with PeakRSS(pid) as rss:
                prober.start()
                tic = time.perf_counter()
                try:
                    status: int | str
                    status, _ = post_streamed(
                        url, "/generate", chunks, length=length if framing == "content-length" else None
                    )
                except (ConnectionError, http.client.HTTPException) as err:  # the server answered and closed first
                    status = f"closed ({type(err).__name__})"
                seconds = time.perf_counter() - tic
                stop.set()
                prober.join()
            _, chunks = big_bodies(args.big_mb)[name]  # a fresh generator for the next framing
            rows.append(
                {
                    "case": f"{name} ({framing})",
                    "status": status,
                    "count": 1,
                    "seconds": seconds,
                    "peak_rss_mb": rss.peak / 1e6,
                    "health_s": lat.get("health_s", 0.0),
                    "small_generate_s": lat.get("small_generate_s", 0.0),
                    **common,
                }
            )
    return rows
