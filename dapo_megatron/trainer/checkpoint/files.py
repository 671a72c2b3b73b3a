"""Run checkpoints: `<output_dir>/checkpoints/step_<N>/` = actor (Megatron distributed checkpoint with
optimizer and RNG), trainer_state.json (step, data order, sampler counters, metrics state) and hf/
(the policy as a HF checkpoint, what `eval` and the engines load).

A checkpoint is written under `step_<N>.tmp/` and renamed when complete, so a directory named
`step_<N>` is always whole: an interrupted save leaves the previous checkpoints as they were, and
`latest_checkpoint` never returns a half-written one.

Whole is not intact: a disk or file system can still lose or truncate a file later. So the last file
written before the rename is `manifest.json` (every other file's size and CRC-32), and `--resume`
takes the newest checkpoint that verifies against it (`newest_valid_checkpoint`): a checkpoint that
does not is named with the first bad file, renamed `step_<N>.corrupt` (kept for inspection, never
listed again), and the previous one is tried. The ranks share the hashing (file i goes to rank
i % world), so a 32B checkpoint's hundreds of GB are read in parallel, not by rank 0 alone.

With trainer.keep_best_checkpoint, `checkpoints/best.json` = {"step", "eval"} names the checkpoint
whose eval (the held-out avg@k logged at its step, stored as trainer_state's "eval") is the best so
far; rotation (trainer.keep_checkpoints) keeps it besides the newest ones.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypedDict, TypeVar, cast

from dapo_megatron.config import RawJson
from dapo_megatron.distributed import collectives as coll
from dapo_megatron.distributed.driver_decides import driver_decides
from dapo_megatron.trainer.checkpoint.progress import CheckpointTimes, saved_line, tree_bytes
from dapo_megatron.trainer.checkpoint.write_failure import CheckpointWriteError, remove_partial, write_failure_message
from dapo_megatron.transfer.stage_export import actor_exporter, covers_layout
from dapo_megatron.transfer.stage_save import save_hf_by_stage
from dapo_megatron.weights import save_hf_checkpoint

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
CORRUPT_SUFFIX = ".corrupt"
BEST_FILE = "best.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
T = TypeVar("T")


class DriverState(TypedDict):
    """The driver's part of trainer_state.json (Driver.state_dict): its data order and request counter."""

    prompts: dict[str, int]  # data/stream.py PromptStream.state_dict: epoch, cursor
    num_requests: int  # the sampler's request counter (request ids and per-sample seeds go on from it)


class TrainerStateJson(TypedDict):
    """trainer_state.json as written (TrainerState.to_json)."""

    step: int
    driver: DriverState | None
    nonfinite_in_row: int
    eval: float | None


class FileEntry(TypedDict):
    """One file of manifest.json: its size and CRC-32 (8 hex digits)."""

    bytes: int
    crc32: str


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


@dataclass(frozen=True)
class TrainerState:
    """What trainer_state.json holds for the loop (the actor's own state is in actor/): the format of
    every checkpoint so far, {"step", "driver", "nonfinite_in_row", "eval"}, read and written as is."""

    step: int = 0  # updates done: the loop continues with step + 1
    nonfinite_in_row: int = 0  # NaN/inf updates in a row up to `step` (trainer/nonfinite.py)
    eval: float | None = None  # the headline avg@k logged at `step`, if it evaluated (keep_best_checkpoint)
    driver: DriverState | None = None  # the driver's data order and request counter (Driver.state_dict)

    def to_json(self) -> TrainerStateJson:
        return {"step": self.step, "driver": self.driver, "nonfinite_in_row": self.nonfinite_in_row, "eval": self.eval}

    @classmethod
    def from_json(cls, raw: RawJson, *, source: str | Path) -> TrainerState:
        """A checkpoint's state; ValueError naming the file and key when one is missing or not a number."""
        try:
            score = raw.get("eval")
            return cls(
                step=int(raw["step"]),
                nonfinite_in_row=int(raw.get("nonfinite_in_row", 0)),
                eval=float(score) if isinstance(score, (int, float)) else None,
                driver=raw.get("driver"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: not a trainer state ({type(err).__name__}: {err})") from None


def write_state(tmp_dir: Path, state: TrainerStateJson) -> None:
    (tmp_dir / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))


def read_trainer_state(ckpt_dir: str | Path) -> TrainerState:
    return TrainerState.from_json(read_state(ckpt_dir), source=Path(ckpt_dir) / STATE_FILE)


def read_state(ckpt_dir: str | Path) -> RawJson:
    """trainer_state.json as parsed, before TrainerState.from_json checks it."""
    path = Path(ckpt_dir) / STATE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint {ckpt_dir}: cannot read {STATE_FILE}: {err}") from None


def best_checkpoint(output_dir: str | Path) -> tuple[int, float, Path] | None:
    """(step, eval, directory) of the best-eval checkpoint recorded in checkpoints/best.json, if any."""
    path = checkpoint_root(output_dir) / BEST_FILE
    if not path.is_file():
        return None
    try:
        best = json.loads(path.read_text())
        step, score = int(best["step"]), float(best["eval"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a best-checkpoint record ({err})") from None
    found = dict(list_checkpoints(output_dir))
    return (step, score, found[step]) if step in found else None


def _update_best(final_dir: Path, step: int) -> None:
    score = read_state(final_dir).get("eval")
    if not isinstance(score, (int, float)):
        return  # no eval at this step
    current = best_checkpoint(final_dir.parent.parent)
    if current is not None and current[1] >= score:
        return  # the earliest of equal bests stays
    path = final_dir.parent / BEST_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "eval": float(score)}))
    tmp.replace(path)


def commit(tmp_dir: Path, final_dir: Path, *, keep: int, keep_best: bool = False) -> None:
    """Rename a complete tmp checkpoint into place, then drop all but the newest `keep` (0 = all)
    and, with keep_best, the best-eval one (BEST_FILE)."""
    if final_dir.exists():  # a re-run of the same step after a resume: replace it whole
        shutil.rmtree(final_dir)
    tmp_dir.rename(final_dir)
    match = _STEP_DIR.match(final_dir.name)
    if keep_best and match:
        _update_best(final_dir, int(match.group(1)))
    best = best_checkpoint(final_dir.parent.parent) if keep_best else None
    if keep > 0:
        for step, old in list_checkpoints(final_dir.parent.parent)[:-keep]:
            if best is None or step != best[0]:
                shutil.rmtree(old, ignore_errors=True)


# --- manifest: sizes and checksums, written last, verified on resume ----------------------------------


def file_crc32(path: Path, *, chunk_bytes: int = 16 << 20) -> str:
    """CRC-32 of a file, read in chunks (detects truncation and bit rot; not a security hash)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def checkpoint_files(ckpt_dir: Path) -> list[str]:
    """Every file below ckpt_dir (relative, sorted), except the manifest itself."""
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def describe_files(ckpt_dir: Path, names: list[str]) -> dict[str, FileEntry]:
    return {name: {"bytes": (ckpt_dir / name).stat().st_size, "crc32": file_crc32(ckpt_dir / name)} for name in names}


def check_files(ckpt_dir: Path, expected: dict[str, FileEntry]) -> list[str]:
    """Problems of these manifest entries, cheapest test first: missing, wrong size, wrong checksum."""
    problems = []
    for name, want in expected.items():
        path = ckpt_dir / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != want["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, the manifest says {want['bytes']}")
        elif file_crc32(path) != want["crc32"]:
            problems.append(f"{path}: checksum {file_crc32(path)} != {want['crc32']} in the manifest")
    return problems


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value: T) -> list[T]:
    """Every rank's `value`, in rank order."""
    if _world()[1] == 1:
        return [value]
    out: list[object] = [None] * _world()[1]
    coll.all_gather_object(out, value)
    return cast(list[T], out)  # all_gather_object put a rank's `value` in every slot


def write_manifest(ckpt_dir: Path) -> None:
    """Collective (every rank, after every rank has written its files): rank r checksums files
    r, r + world, ...; rank 0 writes manifest.json with all of them."""
    rank, world = _world()
    names = driver_decides(lambda: checkpoint_files(ckpt_dir))  # one listing of the shared directory
    entries: dict[str, FileEntry] = {}
    for part in _gather(describe_files(ckpt_dir, names[rank::world])):
        entries.update(part)
    if rank == 0:
        tmp = ckpt_dir / (MANIFEST_FILE + ".tmp")
        tmp.write_text(json.dumps({"files": entries}, indent=1, sort_keys=True))
        tmp.rename(ckpt_dir / MANIFEST_FILE)


def _read_manifest(ckpt_dir: Path) -> dict[str, FileEntry] | str:
    """The manifest's entries, "absent", or the reason it cannot be read."""
    try:
        return json.loads((ckpt_dir / MANIFEST_FILE).read_text())["files"]
    except FileNotFoundError:
        return "absent"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{ckpt_dir / MANIFEST_FILE}: unreadable ({err})"


def checkpoint_bytes(ckpt_dir: Path) -> tuple[int, int]:
    """(bytes, files) of a finished checkpoint, from its manifest (the manifest itself left out), else
    from a walk of its directory (an older checkpoint): what the save and resume lines say."""
    manifest = _read_manifest(ckpt_dir)
    if isinstance(manifest, dict):
        return sum(int(entry["bytes"]) for entry in manifest.values()), len(manifest)
    return tree_bytes(ckpt_dir)


def verify_checkpoint(ckpt_dir: Path) -> list[str]:
    """Collective: every problem of the checkpoint against its manifest (the same list on every rank;
    empty = intact). A checkpoint without a manifest (written before manifests existed) is accepted
    with a printed warning: there is nothing to verify it against."""
    rank, world = _world()
    manifest = driver_decides(lambda: _read_manifest(ckpt_dir))
    if manifest == "absent":
        if rank == 0:
            print(f"[checkpoint] {ckpt_dir} has no {MANIFEST_FILE} (an older checkpoint): not verified", flush=True)
        return []
    if isinstance(manifest, str):
        return [manifest]
    names = sorted(manifest)
    problems = check_files(ckpt_dir, {n: manifest[n] for n in names[rank::world]})
    return sorted(p for part in _gather(problems) for p in part)


def newest_valid_checkpoint(output_dir: str | Path, *, log: Callable[[str], None] = print) -> Path:
    """Collective: the newest checkpoint that verifies. Each one that does not is named with its first
    problem, set aside as step_<N>.corrupt (rank 0) and the previous one is tried. Raises ValueError
    (naming the reason) when there is none: --resume never silently starts from nothing."""
    rank, _ = _world()
    found = driver_decides(lambda: list_checkpoints(output_dir))
    if not found:
        raise ValueError(
            f"--resume: no checkpoint in {checkpoint_root(output_dir)} (a complete "
            f"step_<N>/ with {STATE_FILE}); run without --resume to start this run from the beginning"
        )
    rejected: list[str] = []
    for _step, path in reversed(found):
        problems = verify_checkpoint(path)
        if not problems:
            if rejected and rank == 0:
                log(f"[checkpoint] resuming from {path.name} instead: {len(rejected)} newer checkpoint(s) set aside")
            return path
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        rejected.append(f"{path.name}: {problems[0]}{more}")

        def set_aside(path=path, why=f"{problems[0]}{more}") -> None:
            log(
                f"[checkpoint] {path} is damaged: {why}; "
                f"keeping it as {path.name}{CORRUPT_SUFFIX} and trying the previous checkpoint"
            )
            path.rename(path.with_name(path.name + CORRUPT_SUFFIX))

        driver_decides(set_aside)  # every rank waits for the rename before verifying the previous one
    raise ValueError(
        "--resume: every checkpoint failed verification (each is kept as step_<N>.corrupt); "
        "refusing to start from nothing:\n  " + "\n  ".join(rejected)
    )


def _save_hf(cfg, actor, roles, out_dir: Path) -> None:
    """Collective: the HF checkpoint written by the pipeline stages (transfer/stage_save.py), or, for
    expert-parallel layouts the stage export does not cover yet, streamed to the driver through
    iter_hf_weights (every rank walks it in step)."""
    if covers_layout(actor.layout):
        save_hf_by_stage(
            actor_exporter(actor, bucket_bytes=cfg.rollout.weight_bucket_mb << 20),
            actor.hf_config,
            out_dir,
            copy_from=cfg.model.path,
        )
        return
    named = actor.iter_hf_weights()
    if roles.driver:
        save_hf_checkpoint(named, actor.hf_config, out_dir, copy_from=cfg.model.path)
    else:
        for _ in named:
            pass


def save_step(cfg, actor, driver, roles, *, state: TrainerState) -> None:
    """All ranks: write checkpoints/step_<state.step>.tmp (actor; HF weights written by each pipeline
    stage; the driver's state_dict into `state`), then the driver renames it into place."""
    import torch.distributed as dist

    final = step_dir(cfg.trainer.output_dir, state.step)
    tmp = final.with_name(final.name + ".tmp")
    # the driver's progress line and closing line (trainer/checkpoint/progress.py); no collective of its own
    times = CheckpointTimes(speaks=roles.driver)
    previous = latest_checkpoint(cfg.trainer.output_dir) if roles.driver else None
    expected = checkpoint_bytes(previous)[0] if previous is not None else None  # the same model: the same size
    label = f"[checkpoint] step {state.step}: writing {final.name}:"
    try:
        if roles.driver:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        with times.writing("actor", tmp, label=label, expected_bytes=expected):
            actor.save(tmp / "actor")
        if cfg.trainer.save_hf:
            with times.writing("hf", tmp, label=label, expected_bytes=expected):
                _save_hf(cfg, actor, roles, tmp / "hf")
        if roles.driver:
            write_state(tmp, replace(state, driver=driver.state_dict()).to_json())
        dist.barrier()
        with times.reading("manifest", label=f"[checkpoint] step {state.step}: checksums of {final.name}:"):
            write_manifest(tmp)  # last: sizes + checksums of everything above (collective)
    except (OSError, RuntimeError) as err:  # a full disk, a quota, a dead mount: say which, keep the last good one
        message = write_failure_message(tmp, err, previous=latest_checkpoint(cfg.trainer.output_dir))
        if roles.driver:
            remove_partial(tmp)  # never used; its space is the user's again
        raise CheckpointWriteError(message) from err
    if roles.driver:
        commit(tmp, final, keep=cfg.trainer.keep_checkpoints, keep_best=cfg.trainer.keep_best_checkpoint)
        times.say(saved_line(state.step, final, times, size=checkpoint_bytes(final)))
    dist.barrier()
