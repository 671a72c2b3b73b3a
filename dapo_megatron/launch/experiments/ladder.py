"""`dapo-megatron ladder`: run an ablation ladder's rungs over seeds on this machine, one run after
another, and summarise them with paired intervals (launch/experiments/ladder_summary.py).

    dapo-megatron ladder configs/ablations_tiny --seeds 3                     # -> outputs/ladder_ablations_tiny
    dapo-megatron ladder configs/ablations_tiny --seeds 3 --out DIR trainer.total_steps=40
    dapo-megatron ladder configs/ablations_tiny --rungs 2 --seeds 1 --out DIR trainer.total_steps=3   # (CI)

The rungs are the directory's `<N>_<name>.yaml` files in N order; every run is `dapo-megatron train
RUNG key=value... trainer.seed=S` with its output under OUT/runs/<rung>/seed_<S> (its log beside it,
seed_<S>.log), seeds 1..S, seed-major (all rungs of seed 1 first: a cut-off ladder still pairs whole
seeds). A seed's tiny model is built once and shared by its rungs (tiny.cache_dir=OUT/tiny_model_seed_<S>).
After every run, OUT/ablation_summary.md / .csv / .png are rewritten from the finished runs.

Rerunning the same command skips the runs that finished (OUT/runs/.../seed_<S>/ladder_done.json) and
redoes the others from scratch. Each run holds a lock (OUT/runs/<rung>/seed_<S>.lock) while it runs, so
a second `ladder` process on the same OUT takes the next free run instead (more cores: more processes).
OUT/ladder.json records what the ladder is (the rung files' text and
the overrides): an OUT holding another ladder's runs, or anything that is not a ladder, is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

from dapo_megatron.config import load_config
from dapo_megatron.launch.local.lifeline import with_lifeline
from dapo_megatron.trainer.progress_line import ProgressLine
from dapo_megatron.trainer.run_status import read_progress

MANIFEST = "ladder.json"
DONE = "ladder_done.json"
LADDER_KEYS = ("trainer.output_dir", "trainer.seed", "tiny.cache_dir")  # set per run by the ladder
RUNG_FILE = re.compile(r"^(\d+)_[\w.-]+\.yaml$")


def rung_files(ladder_dir: Path) -> list[Path]:
    """The `<N>_<name>.yaml` files of a ladder directory in N order; ValueError if none or N repeats."""
    if not ladder_dir.is_dir():
        raise ValueError(f"{ladder_dir}: not a directory of rung configs (e.g. configs/ablations_tiny)")
    found = sorted((int(m.group(1)), p) for p in ladder_dir.iterdir() if (m := RUNG_FILE.match(p.name)))
    if not found:
        raise ValueError(f"{ladder_dir}: no rung configs named <N>_<name>.yaml")
    numbers = [n for n, _ in found]
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"{ladder_dir}: two rung configs share a number ({[p.name for _, p in found]})")
    return [p for _, p in found]


class LadderManifest(TypedDict):
    """OUT/ladder.json: what a ladder directory holds, so that a second ladder never mixes with it."""

    rungs: dict[str, str]  # config stem -> the rung config's text
    overrides: list[str]  # key=value overrides given to every rung


def _manifest(rungs: list[Path], overrides: list[str]) -> LadderManifest:
    return {
        "rungs": {p.stem: p.read_text() for p in rungs},
        "overrides": overrides,
    }


def claim_out_dir(out: Path, manifest: LadderManifest) -> None:
    """Create OUT for this ladder, or accept it when it holds the same ladder; refuse anything else."""
    path = out / MANIFEST
    if path.is_file():
        try:
            held = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise ValueError(f"{path}: not JSON; move {out} aside or choose another --out") from None
        if held != manifest:
            what = [k for k in ("rungs", "overrides") if held.get(k) != manifest[k]]
            detail = (
                f"overrides {held.get('overrides')} vs {manifest['overrides']}"
                if what == ["overrides"]
                else f"rung configs {sorted(held.get('rungs', {}))} (their text differs)"
            )
            raise ValueError(
                f"{out} holds the runs of another ladder ({' and '.join(what)} differ: {detail}); "
                "choose another --out, or move that directory aside to rerun"
            )
        return
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and holds no ladder ({MANIFEST} missing); choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1))


@contextlib.contextmanager
def _flock(path: Path, *, wait: bool) -> Iterator[bool]:
    """An exclusive lock on `path` for the block (False: another process holds it and wait=False). The
    kernel drops it when the holder dies, so a killed ladder leaves no stale lock."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


def _run_command(cmd: list[str], log: Path, *, mode: str, progress_of: Path | None = None, label: str = "") -> int:
    """Run cmd with its output in log; progress_of: a run directory whose steps make a progress line
    (trainer/progress_line.py: redrawn in a terminal, one line per interval otherwise) while it runs."""
    with open(log, mode) as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        # with_lifeline: the run gets SIGTERM (and stops at the end of its step) if the ladder dies
        proc = subprocess.Popen(with_lifeline(cmd), stdout=out, stderr=subprocess.STDOUT)
    line: ProgressLine | None = None
    try:
        while proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
            run = read_progress(progress_of) if progress_of is not None else None
            if run is not None and run.step is not None and run.total_steps:
                line = line or ProgressLine(label, total=run.total_steps)
                line.update(run.step)
    except BaseException:  # as subprocess.call: the run does not outlive an interrupted ladder
        proc.kill()
        proc.wait()
        raise
    finally:
        if line is not None:
            line.close()
    return proc.returncode


def run_rung(config: Path, run_dir: Path, *, seed: int, overrides: list[str], cache: Path) -> float:
    """One `dapo-megatron train` run (from scratch); returns its wall time. RuntimeError names the log.
    The seed's tiny model is built first under a lock, so that two ladder processes never build it at once."""
    log = run_dir.with_suffix(".log")
    settings = [*overrides, f"trainer.output_dir={run_dir}", f"trainer.seed={seed}", f"tiny.cache_dir={cache}"]
    tic = time.monotonic()
    with _flock(cache.with_suffix(".lock"), wait=True):
        built = (cache / "tiny_model" / "warm" / "build.json").is_file()  # train checks it matches its config
        prepare = [sys.executable, "-m", "dapo_megatron.launch.prepare", str(config), *settings]
        code = 0 if built else _run_command(prepare, log, mode="w")
    if code == 0:
        cmd = [sys.executable, "-m", "dapo_megatron.cli", "train", str(config), *settings, "--overwrite"]
        label = f"[ladder] {config.stem} seed {seed}:"
        code = _run_command(cmd, log, mode="a" if not built else "w", progress_of=run_dir, label=label)
    wall = time.monotonic() - tic
    if code != 0:
        raise RuntimeError(f"{config.stem}, seed {seed}: `dapo-megatron train` exited with {code}; see {log}")
    (run_dir / DONE).write_text(json.dumps({"seed": seed, "config": str(config), "wall_s": wall}))
    return wall


def finished_runs(out: Path, rungs: list[Path], seeds: list[int]) -> list[tuple[str, dict[int, Path]]]:
    return [
        (p.stem, {s: d for s in seeds if ((d := out / "runs" / p.stem / f"seed_{s}") / DONE).is_file()}) for p in rungs
    ]


def summarise(out: Path, rungs: list[Path], seeds: list[int]) -> list[Path]:
    # torch (the eval maths), not megatron; here, so that `ladder --help` imports none of it
    from dapo_megatron.launch.experiments.ladder_summary import ladder_summary, write_summary

    runs = finished_runs(out, rungs, seeds)
    done = sum(len(d) for _, d in runs)
    note = "" if done == len(rungs) * len(seeds) else f"PARTIAL: {done} of {len(rungs) * len(seeds)} runs finished."
    return write_summary(out, ladder_summary(runs), runs, note=note)


def run_ladder(out: Path, rungs: list[Path], seeds: list[int], overrides: list[str]) -> list[Path]:
    """Every (seed, rung) run not finished before, seed-major; the summary rewritten after each. A run
    another ladder process is running (its lock is held) is left to it: two processes on one OUT share
    the work (a machine with cores to spare)."""
    for seed in seeds:
        for config in rungs:
            run_dir = out / "runs" / config.stem / f"seed_{seed}"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            with _flock(run_dir.parent / f"seed_{seed}.lock", wait=False) as mine:
                if (run_dir / DONE).is_file() or not mine:
                    why = "done before" if (run_dir / DONE).is_file() else "running in another ladder process"
                    print(f"[ladder] {config.stem} seed {seed}: {why}, skipped", flush=True)
                    continue
                print(f"[ladder] {config.stem} seed {seed}: running (log {run_dir.with_suffix('.log')})", flush=True)
                cache = out / f"tiny_model_seed_{seed}"
                wall = run_rung(config, run_dir, seed=seed, overrides=overrides, cache=cache)
            print(f"[ladder] {config.stem} seed {seed}: {wall:.0f} s", flush=True)
            summarise(out, rungs, seeds)
    return summarise(out, rungs, seeds)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dapo-megatron ladder", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("ladder_dir", help="a directory of <N>_<name>.yaml rung configs")
    parser.add_argument("overrides", nargs="*", help="section.key=value, applied to every rung")
    parser.add_argument("--seeds", type=int, default=3, help="trainer.seed = 1..SEEDS (default 3)")
    parser.add_argument("--rungs", type=int, default=0, help="only the first RUNGS rungs (default: all)")
    parser.add_argument("--out", default="", help="output directory (default outputs/ladder_<dir name>)")
    args = parser.parse_intermixed_args(argv)
    if args.seeds < 1 or args.rungs < 0:
        raise ValueError(f"--seeds {args.seeds} must be >= 1 and --rungs {args.rungs} >= 0")
    for item in args.overrides:
        if "=" not in item or item.split("=", 1)[0] in LADDER_KEYS:
            raise ValueError(f"override {item!r}: give section.key=value, other than {', '.join(LADDER_KEYS)}")
    ladder_dir = Path(args.ladder_dir)
    rungs = rung_files(ladder_dir)[: args.rungs or None]
    out = Path(args.out or f"outputs/ladder_{ladder_dir.resolve().name}")
    for config in rungs:  # a bad key or value stops here, naming it, before any directory or run is made
        load_config(config, list(args.overrides))
    claim_out_dir(out, _manifest(rungs, list(args.overrides)))
    seeds = list(range(1, args.seeds + 1))
    tic = time.monotonic()
    paths = run_ladder(out, rungs, seeds, list(args.overrides))
    print((out / "ablation_summary.md").read_text(), end="")
    wrote = ", ".join(map(str, paths))
    print(f"[ladder] {len(rungs)} rungs x {len(seeds)} seeds in {time.monotonic() - tic:.0f} s; wrote {wrote}")
    return 0
