"""The C heap's free pages given back to the OS after every step (glibc's malloc_trim).

Why (docs/LOG.md, 2026-11-27, issue 42 item 7): an actor rank's RSS rose in steps over a long run
while what it had allocated stayed flat. glibc's mallinfo2 in both ranks of a 160-step tiny run: the
bytes in use grew ~8 MiB in the first 20 steps and then < 0.01 MiB a step, the free bytes malloc kept in
its arenas (one per thread that allocates: gloo, the weight sync's and asyncio's worker threads, torch's)
grew from 4 to 62 MiB and kept growing (fragmentation: a freed chunk is reused only by a request it
fits, in the arena of the thread that asks). malloc_trim(0) returns every free page of every arena
(madvise), so the RSS follows what is in use. Its cost is measured beside it in docs/LOG.md.
Elsewhere (no glibc: macOS, musl) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # no C library by that name, or one without malloc_trim
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Give malloc's free pages back to the OS; True where glibc did (returned memory or not)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
