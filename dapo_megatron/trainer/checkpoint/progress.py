"""What a checkpoint's save and load say on the driver: a progress line while megatron-core writes or
reads the shards (trainer/progress_line.py: nothing more for a save or load shorter than its interval),
then one closing line with the step, bytes, files and seconds per part:

    [checkpoint] step 4 saved: 6.2 MB in 15 files, 0.9 s (actor 0.6 s, hf 0.2 s, manifest 0.1 s): <dir>
    [checkpoint] resumed step 4 from <dir> (6.2 MB in 15 files): verified in 0.1 s, actor loaded in 0.3 s

While a save writes: `[checkpoint] step 4: writing step_000004: 1200/4800 MB (80.0/s, 15 s, 45 s left)`,
the bytes below the directory (every rank's shards on the shared file system), of the previous
checkpoint's size when there is one. While a load or a checksum pass reads: the bytes this process has
read (/proc/self/io), the driver's share only. Nothing here is a collective: the driver looks at files and
its own counters; the other ranks make the same calls and print nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from dapo_megatron.trainer.progress_line import ProgressLine, ticking

MB = 1 << 20


def size_text(num_bytes: int) -> str:
    """6.2 MB, 1.4 GB: a checkpoint's size on the console."""
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.1f} GB"
    return f"{num_bytes / MB:.1f} MB"


def tree_bytes(path: Path) -> tuple[int, int]:
    """(bytes, files) below `path`; (0, 0) when it is not there."""
    total = files = 0
    for item in path.rglob("*") if path.is_dir() else ():
        with contextlib.suppress(OSError):  # a file renamed away while it was listed
            if item.is_file():
                total += item.stat().st_size
                files += 1
    return total, files


def read_bytes() -> int | None:
    """Bytes this process has read so far (/proc/self/io rchar), None where the kernel does not say."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class CheckpointTimes:
    """Seconds per part of one save or load, with the progress line of each part (on the driver only)."""

    def __init__(self, *, speaks: bool, out: TextIO | None = None) -> None:
        self.speaks, self.out = speaks, out
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def writing(self, name: str, directory: Path, *, label: str, expected_bytes: int | None) -> Iterator[None]:
        """Time part `name`; the driver's line counts the bytes below `directory` while it runs."""
        line = ProgressLine(label, total=(expected_bytes or 0) // MB or None, unit="MB", out=self.out)
        with self._timed(name), ticking(line, lambda: tree_bytes(directory)[0] // MB) if self.speaks else _nothing():
            yield

    @contextlib.contextmanager
    def reading(self, name: str, *, label: str) -> Iterator[None]:
        """Time part `name`; the driver's line counts the bytes this process reads while it runs."""
        before = read_bytes()
        line = ProgressLine(label, total=None, unit="MB read by rank 0", out=self.out)
        counting = before is not None and self.speaks
        with (
            self._timed(name),
            ticking(line, lambda: ((read_bytes() or 0) - (before or 0)) // MB) if counting else _nothing(),
        ):
            yield

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def total_s(self) -> float:
        return time.perf_counter() - self._start

    def say(self, text: str) -> None:
        if self.speaks:
            print(text, file=self.out, flush=True)


def saved_line(step: int, final_dir: Path, times: CheckpointTimes, *, size: tuple[int, int]) -> str:
    """size: (bytes, files) of the checkpoint (files.checkpoint_bytes)."""
    num_bytes, files = size
    parts = ", ".join(f"{name} {s:.1f} s" for name, s in times.seconds.items())
    return (
        f"[checkpoint] step {step} saved: {size_text(num_bytes)} in {files} files, {times.total_s():.1f} s "
        f"({parts}): {final_dir}"
    )


def resumed_line(step: int, ckpt_dir: Path, times: CheckpointTimes, *, size: tuple[int, int]) -> str:
    num_bytes, files = size
    return (
        f"[checkpoint] resumed step {step} from {ckpt_dir} ({size_text(num_bytes)} in {files} files): "
        f"verified in {times.seconds.get('verify', 0.0):.1f} s, actor loaded in {times.seconds.get('actor', 0.0):.1f} s"
    )


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield
