"""The local launcher's wait for its rollout engines (launch/local/launcher.py LocalProcesses): a progress
line of the engines up while it waits; an engine that exits first, or one that never registers, is named
with the engines up, the time waited, its log's path and the log's last lines. Real processes: two real
CPU engines (`dapo-megatron serve-rollout` on a random-init tiny model), a real engine on an empty model
directory, and a Python process that prints a line and never registers."""

from __future__ import annotations

import re
import sys

import pytest

from dapo_megatron.data.tiny_model import build_tiny_model
from dapo_megatron.launch.local.launcher import LocalProcesses
from dapo_megatron.trainer.progress_line import INTERVAL_ENV


def test_two_engines_start_with_a_line_of_the_engines_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(INTERVAL_ENV, "0")  # a line at every look (the default: one per 15 s)
    model = build_tiny_model(tmp_path / "m", seed=0)
    with LocalProcesses(tmp_path / "logs") as procs:
        urls = procs.start_cpu_engines(model, num=2, register_dir=tmp_path / "engines", seed=0)
    assert len(urls) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[train] rollout:")]
    counts = [int(re.match(r"\[train\] rollout: (\d)/2 engines up \(", line).group(1)) for line in lines]
    # from none up to both, never down; the last look saw both
    assert counts[0] == 0 and counts[-1] == 2 and counts == sorted(counts), lines


def test_an_engine_that_exits_first_is_named_with_its_log(tmp_path):
    (tmp_path / "empty_model").mkdir()
    with LocalProcesses(tmp_path / "logs") as procs, pytest.raises(RuntimeError) as err:
        procs.start_cpu_engines(tmp_path / "empty_model", num=1, register_dir=tmp_path / "engines")
    message = str(err.value)
    log = tmp_path / "logs" / "engine_0.log"
    head = message.splitlines()[0]
    assert re.fullmatch(
        rf"rollout engine engine_0 exited with code 2 before registering \(0 of 1 engines up after \d+ s\); "
        rf"its log \({re.escape(str(log))}\) ends with:",
        head,
    ), head
    assert message.splitlines()[1:] == log.read_text().splitlines()[-20:]  # the log's last lines, as they are


def test_an_engine_that_never_registers_is_named_at_the_deadline(tmp_path):
    with LocalProcesses(tmp_path / "logs") as procs:
        proc = procs.start(
            "engine_0", [sys.executable, "-c", "print('loading weights', flush=True); import time; time.sleep(60)"]
        )
        with pytest.raises(TimeoutError) as err:
            procs._wait_for_registrations([("engine_0", proc)], register_dir=tmp_path / "engines", timeout_s=3)
    assert str(err.value) == (
        f"0 of 1 rollout engines registered in {tmp_path / 'engines'} within 3 s; not up: engine_0 (log "
        f"{tmp_path / 'logs' / 'engine_0.log'}, ending with:\nloading weights)"
    )
