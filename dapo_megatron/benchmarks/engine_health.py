"""`dapo-megatron bench engine-health`: how long a CPU engine (`serve-rollout`) takes to answer /health
while bodies just under --max-request-bytes (16 MiB) are posted to it, one after another.

A trainer's health check that waits too long declares the engine dead; the engine decodes and checks
bodies above guard.INLINE_PARSE_BYTES on a parse thread so its event loop keeps answering meanwhile.
/health itself runs a 1-token generation (SGLang's), so its idle latency is that generation's.

    dapo-megatron bench engine-health                         # tiny checkpoint, 5 bodies per kind
    dapo-megatron bench engine-health --bodies 10 --body-mb 16

Kinds of body (each parsed in full, then refused with 400, so no generation competes with /health):
  - generate-input-ids: a batch of 4,000-token prompts of input_ids whose very last id is outside the
    vocabulary: json.loads, then parse_generate's per-token check of every id;
  - generate-flat-ids: one prompt of ~4M ids (refused by the context length once decoded; the case
    docs/LOG.md measured at 0.7 s of blocked loop): json.loads of one long flat array;
  - update-tensor-string: /update_weights_from_tensor with one base64 string of the body's size, outside
    a weight-update session: json.loads of one long string only.
Per kind: /health latency p50 / p90 / max over every probe sent while bodies were in flight, the probe
count, and the mean seconds of one big request. Rows go to <results-dir>/engine_health.csv.
"""

from __future__ import annotations

import datetime
import http.client
import json
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

from dapo_megatron.benchmarks import parsers
from dapo_megatron.benchmarks.engine_abuse import _tiny_model, send, served_engine
from dapo_megatron.benchmarks.run import append_rows, check_header, results_csv

FIELDS = [
    "kind",
    "bodies",
    "body_mb",
    "big_status",
    "big_request_s",
    "health_probes",
    "health_p50_ms",
    "health_p90_ms",
    "health_max_ms",
    "label",
    "machine",
    "date",
]
PROMPT_TOKENS = 4000  # under the tiny checkpoint's 4,096-token context


def bodies(kind: str, size: int, vocab_size: int) -> tuple[str, bytes]:
    """(path, body) of `kind`, at most `size` bytes."""
    if kind == "generate-input-ids":
        prompt = "[" + ", ".join(["17"] * PROMPT_TOKENS) + "]"
        count = (size - 64) // (len(prompt) + 2)
        last = "[" + ", ".join(["17"] * (PROMPT_TOKENS - 1) + [str(vocab_size + 5)]) + "]"
        raw = (
            '{"input_ids": ['
            + ", ".join([prompt] * (count - 1) + [last])
            + '], "sampling_params": {"max_new_tokens": 1}}'
        )
        return "/generate", raw.encode()
    if kind == "generate-flat-ids":
        count = (size - 64) // 4
        return "/generate", ('{"input_ids": [' + ", ".join(["17"] * count) + "]}").encode()
    if kind == "update-tensor-string":
        head, tail = '{"serialized_named_tensors": ["', '"]}'
        return "/update_weights_from_tensor", (head + "A" * (size - len(head) - len(tail)) + tail).encode()
    raise ValueError(f"unknown kind {kind!r}")


def post(url: str, path: str, body: bytes) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status


def probe(url: str, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """GET /health back to back until stop: (start, seconds) of each."""
    while not stop.is_set():
        tic = time.perf_counter()
        status, _ = send(url, "GET", "/health", None, timeout=600)
        if status != 200:
            raise RuntimeError(f"/health answered {status}")
        out.append((tic, time.perf_counter() - tic))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(url: str, kind: str, *, count: int, size: int, vocab_size: int) -> dict:
    """`count` bodies of `kind` posted back to back while /health is probed; the latency statistics."""
    stop, lat = threading.Event(), list[tuple[float, float]]()
    prober = threading.Thread(target=probe, args=(url, stop, lat), daemon=True)
    path, body = (None, None) if kind == "idle" else bodies(kind, size, vocab_size)
    prober.start()
    tic = time.perf_counter()
    statuses, seconds = set(), []
    if kind == "idle":
        time.sleep(3.0)
    for _ in range(count if kind != "idle" else 0):
        t0 = time.perf_counter()
        assert path is not None and body is not None  # set for every kind but idle
        statuses.add(post(url, path, body))
        seconds.append(time.perf_counter() - t0)
    end = time.perf_counter()
    stop.set()
    prober.join()
    window = [s for t, s in lat if tic <= t < end]  # probes sent while bodies were in flight
    # bodies parsed faster than one probe's round trip leave no probe in the window: no latency to report
    stat = (lambda f: 1e3 * f(window)) if window else (lambda f: float("nan"))
    return {
        "kind": kind,
        "bodies": len(seconds),
        "body_mb": round(len(body) / 1e6, 2) if body else 0.0,
        "big_status": "/".join(map(str, sorted(statuses))),
        "big_request_s": statistics.mean(seconds) if seconds else 0.0,
        "health_probes": len(window),
        "health_p50_ms": stat(statistics.median),
        "health_p90_ms": stat(lambda w: percentile(w, 0.9)),
        "health_max_ms": stat(max),
    }


def main(argv: list[str] | None = None) -> int:
    ap = parsers.engine_health()  # torch-free: `bench engine-health --help` answers at once
    args = ap.parse_args(argv)
    csv_path = results_csv(args, name="engine_health")
    check_header(csv_path, FIELDS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(Path(tmp) / "model")
        vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        with served_engine(model, Path(tmp) / "engines") as (url, _proc):
            common = {
                "label": args.label,
                "machine": platform.processor() or platform.machine(),
                "date": datetime.date.today().isoformat(),
            }
            for kind in args.kinds.split(","):
                rows.append(
                    {
                        **measure(url, kind, count=args.bodies, size=int(args.body_mb * 1e6), vocab_size=vocab_size),
                        **common,
                    }
                )
    print(
        f"{'kind':<22} {'bodies':>6} {'MB':>6} {'status':>6} {'big s':>7} {'probes':>6} {'p50 ms':>8} "
        f"{'p90 ms':>8} {'max ms':>8}"
    )
    for r in rows:
        print(
            f"{r['kind']:<22} {r['bodies']:>6} {r['body_mb']:>6} {r['big_status']:>6} {r['big_request_s']:>7.2f} "
            f"{r['health_probes']:>6} {r['health_p50_ms']:>8.1f} {r['health_p90_ms']:>8.1f} {r['health_max_ms']:>8.1f}"
        )
    append_rows(csv_path, rows, fields=FIELDS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
