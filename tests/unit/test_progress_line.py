"""trainer/progress_line.py: count, rate and time left of a long phase; redrawn in place on a terminal, one
plain line per interval otherwise (a Slurm log or logs/train.log stays readable)."""

from __future__ import annotations

import io

from dapo_megatron.trainer.progress_line import ProgressLine, duration


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
