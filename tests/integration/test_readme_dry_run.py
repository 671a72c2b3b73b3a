"""README's cluster "look first" command, as written there, on a machine that is not the cluster: the dry run
exits 0, says which interpreter the jobs run and how to name another, and warns that the data file is
not here; the same command without --dry-run still refuses the missing file (exit 2, nothing submitted)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_dry_run_command() -> list[str]:
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if "--dry-run" in line and "# look first" in line]
    argv = shlex.split(line.split("#", 1)[0])
    assert argv[:3] == ["dapo-megatron", "slurm", "submit"], argv
    return [sys.executable, "-m", "dapo_megatron.cli", *argv[1:]]


def test_readmes_dry_run_works_here_and_a_real_submit_still_refuses_the_missing_data():
    cmd = _readme_dry_run_command()
    data = re.search(r"train_path: (\S+)", (ROOT / "configs/runs/qwen2.5-32b_dapo.yaml").read_text())
    assert data is not None and not Path(data.group(1)).exists()  # the premise: the data is the cluster's
    dry = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "[slurm submit] the jobs run python (`python` on the PATH once the slurm.setup lines ran); another: " in (
        dry.stdout
    )
    assert f"warning: data not checked: config key 'data.train_path': {data.group(1)} is not a file" in dry.stdout
    real = subprocess.run(
        [arg for arg in cmd if arg != "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert real.returncode == 2
    assert f"config key 'data.train_path': {data.group(1)} is not a file on this machine" in real.stderr
    assert "--skip-data-check" in real.stderr and "job" not in real.stdout.lower()
