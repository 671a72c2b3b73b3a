"""`--help` on every command and subcommand of `dapo-megatron` prints its options and exits 0, before the
command imports torch, megatron-core or transformers; `--version` prints the package's version.

Each case runs in a fresh interpreter (the modules a command imports stay imported), which then reports
whether a heavy backend reached sys.modules. Speed is not asserted (no timed assertion): not importing
torch is what keeps the help under a second.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dapo_megatron import __version__, cli
from dapo_megatron.benchmarks.run import BENCHES

HEAVY = ("torch", "megatron", "transformers")
# `bench kernels` lives in dapo_kernels (kernels/bench/run.py), which imports torch at its top: its help is
# right (tested below) but pays torch's import; every other benchmark answers from benchmarks/parsers.py
BENCH_HELP_IMPORTS_TORCH = frozenset({"kernels"})

# every command, every subcommand of the commands that have them: the argv, then a word its usage must show
CASES: list[tuple[list[str], str]] = [
    *[([name, "--help"], f"dapo-megatron {name}") for name in cli.COMMANDS],
    (["config", "show", "--help"], "usage: dapo-megatron config show"),
    (["slurm", "submit", "--help"], "usage: dapo-megatron slurm submit"),
    (["slurm", "status", "--help"], "usage: dapo-megatron slurm status"),
    (["slurm", "render", "--help"], "usage: dapo-megatron slurm render"),
    (["convert", "hf-to-mcore", "--help"], "--vocab-divisible-by"),
    (["convert", "mcore-to-hf", "--help"], "--hf-config"),
    (["eval", "CONFIG", "-h"], "--checkpoint"),
    (["eval", "--compare", "--help"], "usage: dapo-megatron eval --compare"),
    (["train", "CONFIG", "key=value", "--help"], "--resume"),
    *[(["bench", name, "--help"], "usage:") for name in BENCHES],
]

_PROBE = "\n".join(
    [
        "import json, sys",
        "from dapo_megatron import cli",
        "try:",
        "    code = cli.main(sys.argv[1:])",
        "except SystemExit as done:",
        "    code = done.code or 0",
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})",
        "print(json.dumps({'code': code, 'heavy': heavy}), file=sys.stderr)",
    ]
)


def _run(argv: list[str]) -> tuple[int, str, list[str]]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    return int(report["code"]), proc.stdout, report["heavy"]


@pytest.mark.parametrize(("argv", "shows"), CASES, ids=[" ".join(a) for a, _ in CASES])
def test_help_prints_the_options_and_exits_0_before_any_heavy_import(argv, shows):
    code, out, heavy = _run(argv)
    assert code == 0, out
    assert shows in out
    assert "usage:" in out and ("-h, --help" in out or argv[:1] in (["slurm"], ["bench"]))
    if argv[0] == "bench" and len(argv) == 3 and argv[1] in BENCH_HELP_IMPORTS_TORCH:
        return
    assert heavy == [], f"{' '.join(argv)} imported {heavy[:5]} before printing its help"


def test_every_subcommand_of_slurm_and_bench_is_listed_by_its_help():
    _, slurm, _ = _run(["slurm", "--help"])
    _, bench, _ = _run(["bench", "--help"])
    assert all(name in slurm for name in ("submit", "status", "render"))
    assert all(name in bench for name in BENCHES)


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag):
    code, out, heavy = _run([flag])
    assert (code, out.strip(), heavy) == (0, f"dapo-megatron {__version__}", [])


def test_the_top_level_help_names_every_command_and_the_version_flag():
    code, out, _ = _run(["--help"])
    assert code == 0
    assert "--version" in out
    assert all(f"  {name} " in out for name in cli.COMMANDS)
