"""trainer/progress_line.py: count, rate and time left of a long phase; redrawn in place on a terminal, one
plain line per interval otherwise (a Slurm log or logs/train.log stays readable)."""

from __future__ import annotations

import io
import time

import pytest

from dapo_megatron.trainer.progress_line import INTERVAL_ENV, ProgressLine, ProgressLines, duration, rate, ticking


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_one_line_per_interval():
    out, clock = io.StringIO(), _Clock()
    line = ProgressLine("[train] model: warm start", total=1000, out=out, interval_s=15.0, clock=clock)
    for done, now in ((100, 110.0), (200, 120.0), (250, 124.0), (400, 140.0)):
        clock.now = now
        line.update(done)
    line.close()
    # 200 steps at 20 s: 10/s, 800 left = 80 s; 400 at 40 s: 10/s, 600 left = 60 s; the others inside the interval
    assert out.getvalue().splitlines() == [
        "[train] model: warm start 200/1000 steps (10.0/s, 20 s, 1 min 20 s left)",
        "[train] model: warm start 400/1000 steps (10.0/s, 40 s, 1 min 00 s left)",
    ]


def test_a_terminal_redraws_one_line_and_erases_it_at_the_end():
    out, clock = _Terminal(), _Clock()
    line = ProgressLine("[ladder] 0_naive_grpo seed 1:", total=40, out=out, clock=clock)
    clock.now = 101.0
    line.update(10)
    clock.now = 101.05  # within the redraw interval: skipped
    line.update(11)
    clock.now = 102.0
    line.update(40)
    line.close()
    assert out.getvalue() == (
        "\r\x1b[K[ladder] 0_naive_grpo seed 1: 10/40 steps (10.0/s, 1 s, 3 s left)"
        "\r\x1b[K[ladder] 0_naive_grpo seed 1: 40/40 steps (20.0/s, 2 s)"
        "\r\x1b[K"
    )


def test_durations():
    assert [duration(s) for s in (8, 125, 3840)] == ["8 s", "2 min 05 s", "1 h 04 min"]


def test_a_count_without_a_known_end_and_rates_in_thousands():
    out, clock = io.StringIO(), _Clock()
    line = ProgressLine(
        "[checkpoint] resuming: loading step_000004/actor:",
        total=None,
        unit="MB read",
        out=out,
        interval_s=15.0,
        clock=clock,
    )
    clock.now = 116.0
    line.update(1200)
    assert out.getvalue() == "[checkpoint] resuming: loading step_000004/actor: 1200 MB read (75.0/s, 16 s)\n"
    assert [rate(r) for r in (12.5, 41_300.0, 2_100_000.0)] == ["12.5/s", "41.3K/s", "2.1M/s"]


def test_one_line_per_label():
    out = io.StringIO()
    lines = ProgressLines("[data]", unit="rows", out=out, interval_s=0.0)
    lines("data.train_path", 4096, 10000)
    lines("data.train_path", 10000, 10000)
    lines("data.eval_path", 100, 100)
    assert [d.split(" (")[0] for d in out.getvalue().splitlines()] == [
        "[data] data.train_path: 4096/10000 rows",
        "[data] data.train_path: 10000/10000 rows",
        "[data] data.eval_path: 100/100 rows",
    ]


def test_ticking_counts_from_a_thread_while_the_block_runs():
    out = io.StringIO()
    line = ProgressLine("[checkpoint] step 4: writing step_000004:", total=10, unit="MB", out=out, interval_s=0.0)
    with ticking(line, lambda: 7):
        assert _wait_for_line(out)
    assert out.getvalue().splitlines()[0].startswith("[checkpoint] step 4: writing step_000004: 7/10 MB (")
    count = len(out.getvalue().splitlines())
    time.sleep(0.3)
    assert len(out.getvalue().splitlines()) == count  # the thread stopped with the block


def _wait_for_line(out: io.StringIO, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(out.getvalue())


def test_the_interval_from_the_environment(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "60")
    assert ProgressLine("x", total=1).interval_s == 60.0
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    with pytest.raises(ValueError, match=r"\$DAPO_PROGRESS_INTERVAL_S='soon': seconds between two progress lines"):
        ProgressLine("x", total=1)
