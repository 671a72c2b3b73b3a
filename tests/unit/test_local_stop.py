"""launch/local/stop.py with real signals to this process: the first Ctrl-C / SIGTERM becomes the ranks'
stop request (the request file names it), the second raises StopNow, and the line for a stop at once
names the checkpoint after which steps are lost (the whole path runs in test_train_tiny.py)."""

from __future__ import annotations

import os
import signal

import pytest

from dapo_megatron.launch.local.stop import LocalStop, StopNow, stopped_at_once
from dapo_megatron.trainer.preemption import PREEMPT_FILE_ENV, PreemptionSignal


def test_first_signal_requests_a_stop_the_second_stops_at_once(tmp_path, capsys):
    request = tmp_path / "stop_request"
    request.write_text("SIGINT")  # left by an earlier run: must not stop this one
    before = signal.getsignal(signal.SIGINT)
    with LocalStop(request) as stop:
        assert not request.exists() and stop.rank_env() == {PREEMPT_FILE_ENV: str(request)}
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop.exit_code == 143
        assert request.read_text() == "SIGTERM"
        # what a rank reads: the launcher's signal, and the line the driver prints
        ranks_view = PreemptionSignal(signals=(), request_file=str(request))
        assert ranks_view.requested and ranks_view.launcher_signal == "SIGTERM"
        assert ranks_view.stop_line(7, tmp_path / "checkpoints" / "step_000007") == (
            f"stopped at step 7 (SIGTERM): checkpoint {tmp_path}/checkpoints/step_000007; continue with --resume"
        )
        with pytest.raises(StopNow) as second:
            os.kill(os.getpid(), signal.SIGINT)
        assert second.value.signum == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before and not request.exists()
    assert "[train] SIGTERM: the step in flight finishes and is checkpointed" in capsys.readouterr().err


def test_slurms_empty_request_file_keeps_the_requeue_line(tmp_path):
    request = tmp_path / "preempt-123"
    request.touch()  # slurm/_trainer_launch.sh's trap
    line = PreemptionSignal(signals=(), request_file=str(request)).stop_line(3, tmp_path / "step_000003")
    assert line == "[train] signal: checkpoint of step 3 written; exiting so the job can be requeued"


def test_a_stop_at_once_names_what_is_lost(tmp_path, capsys):
    assert stopped_at_once(StopNow(signal.SIGINT), tmp_path) == 130
    assert (
        capsys.readouterr().err
        == "stopped at once (SIGINT): no checkpoint was written, so nothing of this run is kept\n"
    )
    (tmp_path / "checkpoints" / "step_000003").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000003" / "trainer_state.json").write_text('{"step": 3}')  # a finished one
    (tmp_path / "checkpoints" / "step_000004.tmp").mkdir()  # being written when the ranks were killed: not kept
    assert stopped_at_once(StopNow(signal.SIGTERM), tmp_path) == 143
    assert capsys.readouterr().err == (
        f"stopped at once (SIGTERM): the steps after {tmp_path}/checkpoints/step_000003 "
        "are lost; continue from it with --resume\n"
    )
