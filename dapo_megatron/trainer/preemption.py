"""Preemption: turn Slurm's warnings into "checkpoint at the next step boundary, then exit".

    stop = PreemptionSignal().install()      # in every rank, before the training loop
    for step in range(start, total_steps):
        train_one_step()
        if stop.should_stop():               # collective: every rank calls it every step
            save_checkpoint(step)
            return 0                         # train.sbatch then runs `scontrol requeue`

A stop is requested by either
  the request file  $DAPO_PREEMPT_FILE exists. `#SBATCH --signal=B:USR1@<slurm.signal_seconds>`
                    sends USR1 to the batch script only, whose trap creates this file (on the shared
                    run directory, so ranks on every node see it); the script requeues the job once
                    the ranks have exited, and the restart runs `train ... --resume`. The signal is
                    not forwarded: a signal sent through srun reaches every process of the step, and
                    helpers that do not expect it (Megatron's checkpoint writer processes, data
                    loader workers) die of it, in the middle of the very checkpoint it asked for.
  the local launcher `dapo-megatron train` by hand writes the signal it got (SIGINT: Ctrl-C, or SIGTERM)
                    into the request file it names in $DAPO_PREEMPT_FILE (launch/local/stop.py); the
                    driver then ends with the one line "stopped at step N (SIGTERM): checkpoint ...;
                    continue with --resume" (stop_line).
  SIGUSR1 / SIGTERM sent to a rank (by hand, by torchrun forwarding its own signal, or by Slurm on
                    scancel, `scontrol requeue` or preemption, which signals every process of the
                    job and sends SIGKILL KillWait seconds later, often 30 s).
The handlers only set a flag (nothing unsafe happens inside a signal handler). Ranks can see a
request at different moments, even in different steps, so `should_stop` takes the max of the flag
over all ranks (one int all-reduce): every rank answers the same at the same step and they write
the same checkpoint together.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

from dapo_megatron.distributed import collectives as coll

DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
PREEMPT_FILE_ENV = "DAPO_PREEMPT_FILE"  # set by slurm/_trainer_launch.sh


class PreemptionSignal:
    def __init__(self, signals: Sequence[signal.Signals] = DEFAULT_SIGNALS, *, request_file: str | None = None) -> None:
        self.signals = tuple(signals)
        self.request_file = os.environ.get(PREEMPT_FILE_ENV, "") if request_file is None else request_file
        self.received: signal.Signals | None = None  # the first signal that arrived
        self._previous: dict[signal.Signals, Callable[[int, FrameType | None], object] | int | None] = {}

    def install(self) -> PreemptionSignal:
        """Register the handlers (main thread only, as Python requires). Returns self."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            print(
                f"[preemption] received {self.received.name}: checkpoint at the end of this step, then exit", flush=True
            )

    @property
    def requested(self) -> bool:
        """This rank's view only (a signal or the request file); use should_stop() for the shared decision."""
        return self.received is not None or bool(self.request_file and os.path.exists(self.request_file))

    @property
    def launcher_signal(self) -> str:
        """The signal the local launcher wrote into the request file ("SIGINT", "SIGTERM"); "" for
        Slurm's empty request file, no file or none read."""
        try:
            return Path(self.request_file).read_text().strip() if self.request_file else ""
        except OSError:
            return ""

    @property
    def reason(self) -> str:
        if self.received is not None:
            return self.received.name
        return f"request file {self.request_file}" if self.requested else "another rank"

    def stop_line(self, step: int, checkpoint: Path) -> str:
        """What the driver prints once the stop's checkpoint is written: for a local run the line the
        user acts on, for a Slurm job what its log needs (the job's script requeues it)."""
        named = self.launcher_signal
        if named:
            return f"stopped at step {step} ({named}): checkpoint {checkpoint}; continue with --resume"
        return (
            f"[train] {self.received.name if self.received else 'signal'}: checkpoint of step {step} written; "
            "exiting so the job can be requeued"
        )

    def should_stop(self, group: dist.ProcessGroup | None = None) -> bool:
        """True on every rank if any rank has a request; a collective when torch.distributed is up."""
        flag = 1 if self.requested else 0
        if dist.is_available() and dist.is_initialized():
            tensor = torch.tensor([flag], dtype=torch.int32)
            coll.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            flag = int(tensor.item())
        return flag == 1
