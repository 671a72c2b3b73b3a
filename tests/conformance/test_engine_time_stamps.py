"""The engines' own time stamps in the step timeline (trainer/timeline.py "engine" lane) read the fields SGLang
0.5.21 really sends: its APIServerReqTimeStats (srt/observability/req_time_stats.py) builds them, in a
process of its own (torchvision stubbed as for the oracle), and rollout/sampler.py: engine_span must
turn them into [request_received_ts, request_finished_ts]; the CPU engine sends the same two fields
(tests/integration/test_rollout_server.py's replies carry them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SCRIPT = """
import json, sys
sys.path.insert(0, {here!r})
import sglang_oracle
sglang_oracle.install_stubs()
from sglang.srt.observability.req_time_stats import APIServerReqTimeStats

stats = APIServerReqTimeStats()
stats.set_created_time(1000.0)       # perf_counter seconds, as TokenizerManager stamps them
stats.set_first_token_time(1000.5)
stats.set_finished_time(1002.25)
meta = dict(stats.convert_to_output_meta_info())   # what --enable-metrics adds to meta_info
meta["e2e_latency"] = stats.get_e2e_latency()      # always in meta_info of a finished request
print("META" + json.dumps(meta))
"""


def test_engine_span_reads_sglangs_own_request_stamps(sglang_installed):
    from dapo_megatron.rollout.sampler import engine_span

    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(here=str(HERE))], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(next(line[4:] for line in proc.stdout.splitlines() if line.startswith("META")))
    assert meta["e2e_latency"] == 2.25
    start, end = engine_span({"meta_info": meta}, received=0.0)
    assert start == meta["request_received_ts"] and abs(end - meta["request_finished_ts"]) < 1e-6
    # without --enable-metrics SGLang sends e2e_latency alone: the span ends when the reply arrived
    assert engine_span({"meta_info": {"e2e_latency": meta["e2e_latency"]}}, received=50.0) == (47.75, 50.0)
