"""torchrun for the local `dapo-megatron train` (launch/local/launcher.py): the same elastic agent, which on a
rank's failure prints one line naming the cause instead of torchrun's report.

    python -m dapo_megatron.launch.local.ranks --cause-file RUN/logs/ranks_error.txt -- TORCHRUN_ARGS (--standalone ...)

A failing rank prints nothing and records its exception (type, message, traceback, time) in the error
file torchrun gives it (trainer/train.py: first_cause_recorded), before its clean-up. torchrun itself
would then print, for a run that stopped on NaN updates, six tracebacks: each rank's, its own
ChildFailedError with every rank's again, and the Root Cause block. Here the rank that recorded first
is the cause (torchrun's rule, `ChildFailedError.get_first_failure`, ties to the lower rank); its
message is the one line,
`[train] the run failed on rank R: <Type>: <message> (traceback: <cause file>)`, its whole traceback
goes to the cause file, and the exit code is 1. torchrun's own log lines (the agent's "failed
(exitcode: 1)", "Sending process N closing signal SIGTERM") are consequences of that failure and are
left out. Under Slurm the ranks run under torchrun itself, whose Root Cause block shows the same traceback.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch at run time only where torchrun runs (main): local.py imports this module's names
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

PREFIX = "[train]"
RANKS_ERROR_FILE = "ranks_error.txt"  # in <run_dir>/logs: the first failing rank's traceback


def cause_line(rank: int, failure: ProcessFailure, cause_file: Path) -> str:
    """The one line for torchrun's ProcessFailure `failure` of global rank `rank`."""
    message = failure.message
    if isinstance(message, dict):  # the error file's {"message": "Type: text", "extraInfo": {...}}
        message = message.get("message", "")
    text = " ".join(str(message).split()) or f"exit code {failure.exitcode}"  # one line, whatever the message
    return f"{PREFIX} the run failed on rank {rank}: {text} (traceback: {cause_file})"


def write_cause(failure: ProcessFailure, cause_file: Path) -> None:
    """The first failing rank's whole traceback as it recorded it (or what torchrun knows of it)."""
    data = failure.error_file_data
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        text = f"{message.get('message', '')}\n\n{message.get('extraInfo', {}).get('py_callstack', '')}"
    else:  # no error file (a rank killed by a signal): what torchrun says of it
        text = f"{failure.message}\n(exit code {failure.exitcode}; no traceback: the rank recorded no error)"
    cause_file.parent.mkdir(parents=True, exist_ok=True)
    cause_file.write_text(text)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--cause-file" or argv[2] != "--":
        raise SystemExit("usage: python -m dapo_megatron.launch.local.ranks --cause-file FILE -- TORCHRUN_ARGS...")
    cause_file, torchrun_args = Path(argv[1]), argv[3:]
    for name in list(logging.root.manager.loggerDict):  # each has its own level (elastic/utils/logging.py)
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # the failure is said below, once
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as err:
        # the first recorded, as torchrun's get_first_failure, with the lower rank first within a second (the
        # error files' timestamps are whole seconds): an error every rank raises (driver_decides) is the driver's
        failures = err.failures
        rank = min(failures, key=lambda r: (failures[r].timestamp, r))
        failure = failures[rank]
        write_cause(failure, cause_file)
        print(cause_line(rank, failure, cause_file), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
