"""Preemption: turn Slurm's signals into "checkpoint at the next step boundary, then exit".

    stop = PreemptionSignal().install()      # in every rank, before the training loop
    for step in range(start, total_steps):
        train_one_step()
        if stop.should_stop():               # collective: every rank calls it every step
            save_checkpoint(step)
            return 0                         # train.sbatch then runs `scontrol requeue`

Who sends what (slurm/_trainer_launch.sh):
  SIGUSR1  `#SBATCH --signal=B:USR1@<slurm.signal_seconds>` before the time limit -> batch script ->
           srun -> torchrun (--signals-to-handle ... SIGUSR1) -> every rank. The batch script
           requeues the job once the ranks have exited; the restart runs `train ... --resume`.
  SIGTERM  scancel, `scontrol requeue`, preemption by a higher-priority job: Slurm signals every
           process of the job and sends SIGKILL KillWait seconds later (site setting, often 30 s;
           torchrun waits up to max(signal_seconds, 30) s), so a step that ends within that time
           still gets its checkpoint.
The handlers only set a flag (nothing unsafe happens inside a signal handler). Ranks can receive the
signal at different moments, even in different steps, so `should_stop` takes the max of the flag
over all ranks (one int all-reduce): every rank sees the same answer at the same step and they
write the same checkpoint together.
"""

from __future__ import annotations

import signal
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

DEFAULT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionSignal:
    def __init__(self, signals: Sequence[signal.Signals] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None  # the first signal that arrived
        self._previous: dict[signal.Signals, Callable[..., Any] | int | None] = {}

    def install(self) -> "PreemptionSignal":
        """Register the handlers (main thread only, as Python requires). Returns self."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)
            print(f"[preemption] received {self.received.name}: checkpoint at the end of this step, then exit",
                  flush=True)

    @property
    def requested(self) -> bool:
        """This rank's flag only; use should_stop() for the decision all ranks share."""
        return self.received is not None

    def should_stop(self, group: dist.ProcessGroup | None = None) -> bool:
        """True on every rank if any rank got a signal; a collective when torch.distributed is up."""
        flag = 1 if self.requested else 0
        if dist.is_available() and dist.is_initialized():
            backend = dist.get_backend(group)
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            tensor = torch.tensor([flag], dtype=torch.int32, device=device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            flag = int(tensor.item())
        return flag == 1
