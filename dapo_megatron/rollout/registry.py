"""Engine registry: each rollout engine writes `<run_dir>/engines/<host>_<port>.json` once it serves.

Record: {"host", "port", "url", "tp_size", "model", "pid", "started_at" (ISO 8601 UTC), ...}.
A restarted engine (e.g. a requeued Slurm array task) writes its file again with a newer
`started_at`; the pool treats that as a new incarnation that must be re-synced before use. An
engine that exits (normally, Ctrl-C or SIGTERM) removes its own file with `remove_registration`,
so the directory lists only engines that may still answer.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
from pathlib import Path

_REQUIRED = ("host", "port", "url", "tp_size", "started_at")


def registration_path(register_dir: str, host: str, port: int) -> str:
    return os.path.join(register_dir, f"{host}_{port}.json")


def write_registration(register_dir: str, record: dict) -> str:
    """Write atomically (temp file + rename) so a reader never sees half a record; mode 0600."""
    missing = [k for k in _REQUIRED if k not in record]
    if missing:
        raise ValueError(f"engine registration lacks {missing}")
    os.makedirs(register_dir, mode=0o700, exist_ok=True)  # only the run's user lists the engines
    path = registration_path(register_dir, record["host"], record["port"])
    fd, tmp = tempfile.mkstemp(dir=register_dir, prefix=".tmp-", suffix=".json")
    os.fchmod(fd, 0o600)  # (mkstemp's mode already): where the run's engines listen is the run user's business
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return path


def remove_registration(path: str, *, pid: int) -> bool:
    """Delete the registration at `path` if it is still this engine's (same pid); True if removed.

    The pid check matters when a newer incarnation on the same host:port (a requeued array task)
    has already written its own record there: an old process on its way out must not delete it.
    """
    try:
        with open(path) as f:
            if json.load(f).get("pid") != pid:
                return False
        os.remove(path)
        return True
    except (OSError, json.JSONDecodeError):
        return False


def read_registrations(register_dir: str) -> list[dict]:
    """Every valid record in the directory (sorted by url); a malformed file raises ValueError."""
    records = []
    for path in sorted(glob.glob(os.path.join(register_dir, "*.json"))):
        try:
            with open(path) as f:
                rec = json.load(f)
        except FileNotFoundError:  # its engine exited (remove_registration) between glob and open
            continue
        except json.JSONDecodeError as err:
            raise ValueError(f"engine registry file {path}: not JSON ({err})") from None
        missing = [k for k in _REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"engine registry file {path}: missing keys {missing}")
        records.append(rec)
    return sorted(records, key=lambda r: r["url"])


# the launcher's engine supervisor (launch/local/supervise.py) writes these events; the pool and the driver read them
def engine_events_path(run_dir: str | Path) -> Path:
    """Where the launcher's supervisor writes its events and the driver reads them."""
    return Path(run_dir) / "logs" / "engine_restarts.jsonl"


def read_engine_events(path: str | Path) -> list[dict]:
    """The supervisor's events (a missing file: none yet)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]
