"""launch/local/ranks.py: the one line and the traceback file made from a rank's torchrun error file, as
first_cause_recorded (trainer/train.py) writes it with torch elastic's own ErrorHandler."""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dapo_megatron.launch.local.ranks import cause_line, write_cause
from dapo_megatron.trainer.train import first_cause_recorded


def test_the_recorded_cause_is_one_line_and_its_traceback_a_file(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        with first_cause_recorded():
            raise RuntimeError("2 updates in a row had a NaN/inf loss\n  or grad norm")
    except RuntimeError:
        pass
    assert error_file.is_file()
    failure = ProcessFailure(local_rank=1, pid=os.getpid(), exitcode=1, error_file=str(error_file))
    cause = tmp_path / "logs" / "ranks_error.txt"
    write_cause(failure, cause)
    assert cause_line(1, failure, cause) == (
        f"[train] the run failed on rank 1: RuntimeError: 2 updates in a row had a NaN/inf loss or grad norm "
        f"(traceback: {cause})"
    )
    text = cause.read_text()
    assert text.startswith("RuntimeError: 2 updates in a row had a NaN/inf loss\n  or grad norm\n\nTraceback")
    assert 'raise RuntimeError("2 updates in a row' in text  # the raising line, as the rank saw it


def test_a_rank_killed_by_a_signal_is_named_by_it(tmp_path):
    failure = ProcessFailure(local_rank=0, pid=4242, exitcode=-9, error_file=str(tmp_path / "none.json"))
    cause = tmp_path / "ranks_error.txt"
    write_cause(failure, cause)
    assert cause_line(0, failure, cause) == (
        f"[train] the run failed on rank 0: Signal 9 (SIGKILL) received by PID 4242 (traceback: {cause})"
    )
    assert cause.read_text().startswith("Signal 9 (SIGKILL) received by PID 4242\n(exit code -9;")
