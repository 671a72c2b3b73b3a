"""Run checkpoints: `<output_dir>/checkpoints/step_<N>/` = actor (Megatron distributed checkpoint with
optimizer and RNG), trainer_state.json (step, data order, sampler counters, metrics state) and hf/
(the policy as a HF checkpoint, what `eval` and the engines load).

A checkpoint is written under `step_<N>.tmp/` and renamed when complete, so a directory named
`step_<N>` is always whole: an interrupted save leaves the previous checkpoints as they were, and
`latest_checkpoint` never returns a half-written one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(output_dir: str | Path, step: int) -> Path:
    return checkpoint_root(output_dir) / f"step_{step:06d}"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def write_state(tmp_dir: Path, state: dict[str, Any]) -> None:
    (tmp_dir / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))


def read_state(ckpt_dir: str | Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / STATE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint {ckpt_dir}: cannot read {STATE_FILE}: {err}") from None


def commit(tmp_dir: Path, final_dir: Path, *, keep: int) -> None:
    """Rename a complete tmp checkpoint into place, then drop all but the newest `keep` (0 = all)."""
    if final_dir.exists():  # a re-run of the same step after a resume: replace it whole
        shutil.rmtree(final_dir)
    tmp_dir.rename(final_dir)
    if keep > 0:
        for _, old in list_checkpoints(final_dir.parent.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
